"""`flowfleet prepare RUN --parts N`: the source cut into N slices, each encoded by a local process of `flowfleet
prepare RUN --part i/N` (flowfleet.train.fanout: `parallel` at a time, the machine's cores or GPUs shared out among
them), then merged into data/ and eval/ exactly as one prepare writes them (`merge_parts`). The run's autoencoder,
which every part encodes with, is trained once before the parts start. Each part resumes where it stopped, so a run
interrupted at any point is finished by the same command.

On a Slurm cluster (`--backend slurm`, or a run.yaml `backends` entry of kind slurm) the same steps are Slurm jobs:
the autoencoder, an array of the N parts after it, the merge after them (flowfleet.backends.slurm). Elsewhere the
parts are the same commands, started by hand or by any scheduler: `prepare --part i/N` on each, then `prepare
--merge N`.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from flowfleet.config import BackendConfig, load_run_config
from flowfleet.data.shards import ShardSetManifest
from flowfleet.errors import FlowfleetError, ParameterError
from flowfleet.layout import DATA_PARTS
from flowfleet.stages.prepare import merge_parts, prepare_autoencoder
from flowfleet.storage import RunRoot
from flowfleet.train.fanout import LocalFanout, ProcessJob, ProcessOutcome, plan_slots
from flowfleet.train.specs import cli_command, launcher

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
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    slots = plan_slots(n, parallel, os.cpu_count() or 1, gpus)
    logs_tmp = None if root.is_local else tempfile.TemporaryDirectory(prefix="flowfleet-prepare-logs-")
    spans: dict[str, tuple[float, float]] = {}
    started: dict[str, float] = {}

    def log_path(i: int) -> Path:
        name = f"{i}-of-{n}.log"  # beside the part folders: `--restart` empties a part's own
        local = root.local_path(DATA_PARTS, name)
        return local if local is not None else Path(logs_tmp.name) / name  # type: ignore[union-attr]

    def on_start(job: ProcessJob, pid: int) -> None:
        started[job.name] = time.perf_counter()
        log.info("%s: started (pid %d), log %s", job.name, pid, job.log)

    def on_exit(done: ProcessOutcome) -> None:
        spans[done.name] = (started[done.name], time.perf_counter())
        log.info("%s: exit code %d after %.0f s", done.name, done.returncode, done.seconds)
        if logs_tmp is not None:
            root.write_bytes(done.log.read_bytes(), DATA_PARTS, done.log.name)

    command = cli_command(["prepare", root.url_of(), "--quiet"], launcher())  # as train-all starts its jobs
    jobs = []
    for i in range(n):
        log_path(i).parent.mkdir(parents=True, exist_ok=True)
        argv = [*command, "--part", f"{i}/{n}", *(["--restart"] if restart else [])]
        jobs.append(ProcessJob(f"part {i}/{n}", argv, log_path(i), forkable=not gpus))
    preload = ("flowfleet.cli", "flowfleet.stages.prepare")  # what every part imports: the forkserver does it once
    fanout = LocalFanout(slots, on_start=on_start, on_exit=on_exit, preload=preload)
    try:
        outcomes = fanout.run(jobs)
    finally:
        if logs_tmp is not None:
            logs_tmp.cleanup()
    if fanout.stopped:
        raise FlowfleetError(f"prepare --parts {n}: stopped; run the same command to finish the parts")
    for done in outcomes:
        if done.returncode != 0:
            why = done.last_line or f"exit code {done.returncode}"
            raise FlowfleetError(f"{done.name} failed: {why} (its log: {root.url_of(DATA_PARTS, done.log.name)})")
    return PartsPrepared(merge_parts(root, n, progress=progress), spans)


def submit_prepare_parts(run_root: str | RunRoot, n: int, backend: str | BackendConfig) -> dict[str, str]:
    """The n parts as jobs of a Slurm backend (a run.yaml `backends` name, `slurm`, or a BackendConfig), the
    autoencoder first and the merge last -> step name -> job id. Returns once they are submitted."""
    from flowfleet.backends import named_backend
    from flowfleet.backends.slurm import SlurmBackend

    root = run_root if isinstance(run_root, RunRoot) else RunRoot(run_root)
    if n < 1:
        raise ParameterError("parts", f"must be >= 1, got {n}")
    cfg = load_run_config(root)
    config = backend if isinstance(backend, BackendConfig) else named_backend(cfg, backend)
    if config.kind != "slurm":
        raise ParameterError(
            "backend",
            f"prepare --parts runs as local processes or Slurm jobs, not on {config.kind!r}: start "
            f"`flowfleet prepare {root.url} --part i/{n}` there, then `--merge {n}`",
        )
    autoencoder = cfg.encoders.latent.name == "autoencoder"
    return SlurmBackend(config).submit_prepare(root, n, cfg.name, autoencoder)
