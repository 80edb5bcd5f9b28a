"""`flowfleet prepare RUN --parts N`: the source cut into N slices, each encoded by a local process of `flowfleet
prepare RUN --part i/N` (flowfleet.train.fanout: `parallel` at a time, the machine's cores or GPUs shared out among
them), then merged into data/ and eval/ exactly as one prepare writes them (`merge_parts`). The run's autoencoder,
which every part encodes with, is trained once before the parts start. Each part resumes where it stopped, so a run
interrupted at any point is finished by the same command.

On a Slurm cluster (`--backend slurm`, or a run.yaml `backends` entry of kind slurm) the same steps are Slurm jobs:
the autoencoder, an array of the N parts after it, the merge after them (flowfleet.backends.slurm); on a Ray cluster
(`--backend ray`) they are the tasks of one Ray job (flowfleet.backends.ray_parts). Elsewhere the
parts are the same commands, started by hand or by any scheduler: `prepare --part i/N` on each, then `prepare
--merge N`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from flowfleet.config import BackendConfig, load_run_config
from flowfleet.data.shards import ShardSetManifest
from flowfleet.errors import ParameterError
from flowfleet.layout import DATA_PARTS
from flowfleet.stages.parts import run_parts, submit_parts
from flowfleet.stages.prepare import merge_parts, prepare_autoencoder
from flowfleet.storage import RunRoot

log = logging.getLogger(__name__)


@dataclass
class PartsPrepared:
    manifest: ShardSetManifest  # data/'s, merged
    spans: dict[str, tuple[float, float]] = field(default_factory=dict)  # each part's (start, end), perf_counter


def prepare_in_parts(
    run_root: str | RunRoot, n: int, *, parallel: int | None = None, restart: bool = False, progress: bool = True
) -> PartsPrepared:
    """Encode the run's source in `n` parts as local processes, `parallel` at a time (None: one per core, or per GPU
    on a GPU machine), then merge them into data/ (and eval/)."""
    root = run_root if isinstance(run_root, RunRoot) else RunRoot(run_root)
    if n < 1:
        raise ParameterError("parts", f"must be >= 1, got {n}")
    cfg = load_run_config(root)
    if cfg.encoders.latent.name == "autoencoder":
        prepare_autoencoder(root, restart=restart, progress=progress)
    preload = ("flowfleet.cli", "flowfleet.stages.prepare")  # what every part imports: the forkserver does it once
    spans = run_parts(
        root, ["prepare"], n, DATA_PARTS, parallel=parallel, extra=["--restart"] if restart else [], preload=preload
    )
    return PartsPrepared(merge_parts(root, n, progress=progress), spans)


def submit_prepare_parts(run_root: str | RunRoot, n: int, backend: str | BackendConfig) -> dict[str, str]:
    """The n parts as jobs of a Slurm or Ray backend (stages.parts.submit_parts), the run's autoencoder first and the
    merge last -> step name -> job id. Returns once they are submitted."""
    root = run_root if isinstance(run_root, RunRoot) else RunRoot(run_root)
    autoencoder = load_run_config(root).encoders.latent.name == "autoencoder"
    first = ("autoencoder", ["--autoencoder-only"]) if autoencoder else None
    return submit_parts(root, "prepare", n, backend, DATA_PARTS, first)
