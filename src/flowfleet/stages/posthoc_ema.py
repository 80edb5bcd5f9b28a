"""`flowfleet ema RUN --sigma-rel S`: the EMA length chosen after training (EDM2's post-hoc EMA).

Every finished job that tracked power-function EMAs (run.yaml train.posthoc_ema, router_train.posthoc_ema) gets a
final/ reconstructed from its snapshots at relative length S and its last step (flowfleet.train.phema). The first
time, final/ as training wrote it (train.ema_decay's EMA) is kept in final-ema/; `--sigma-rel trained` puts it back.
Each changed job records what its final/ is in posthoc_ema.json. `assemble` then builds model/ from the new finals.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from flowfleet.config import load_run_config
from flowfleet.errors import ParameterError
from flowfleet.layout import FINAL, FINAL_TRAINED, POSTHOC_RECORD, ROUTERS
from flowfleet.models.dit import DiTExpert, DiTModel, DiTRouter
from flowfleet.models.files import WEIGHTS_NAME, load_model, save_model
from flowfleet.storage import RunRoot
from flowfleet.train.phema import gamma_of, read_snapshots, reconstruct
from flowfleet.train.specs import fleet_jobs
from flowfleet.train.status import job_finished

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Changed:
    job: str
    step: int
    snapshots: int  # the snapshots the reconstruction combined


def apply_posthoc_ema(run_root: str, sigma_rel: float | None) -> list[Changed]:
    """final/ of every finished job with snapshots from its EMA of relative length `sigma_rel` (None: the EMA it
    trained with, as kept in final-ema/). A length outside (0, 1/sqrt(12)) is a one-line error before any job is
    touched; a job without snapshots is left as it is."""
    if sigma_rel is not None:
        try:
            gamma_of(sigma_rel)
        except ValueError as err:
            raise ParameterError("sigma_rel", str(err).removeprefix("sigma_rel: ")) from None
    root = RunRoot(run_root)
    changed = []
    for spec in fleet_jobs(load_run_config(root)):
        finished, _, _ = job_finished(root, spec.dir)
        snapshots = read_snapshots(root, spec.dir) if finished else []
        if not snapshots:
            continue
        _keep_trained(root, spec.dir)
        cls: type[DiTModel] = DiTRouter if spec.kind in ROUTERS else DiTExpert
        model = load_model(cls, root, spec.dir, FINAL_TRAINED)
        step = max(s for s, _, _ in snapshots)
        used = [snap for snap in snapshots if snap[0] <= step]
        if sigma_rel is not None:
            model.load_state_dict(reconstruct(used, sigma_rel, step), strict=True)
        save_model(model, root, spec.dir, FINAL)
        record = {"sigma_rel": sigma_rel, "step": step, "snapshots": sorted({s for s, _, _ in used})}
        root.write_json(record if sigma_rel is not None else {"sigma_rel": None}, spec.dir, POSTHOC_RECORD)
        changed.append(Changed(spec.name, step, len(used)))
        log.info("%s: final/ is %s", spec.name, f"the EMA of sigma_rel {sigma_rel}" if sigma_rel else "as trained")
    return changed


def _keep_trained(root: RunRoot, job_dir: str) -> None:
    """final/ into final-ema/, once: later calls find it there and keep it."""
    if root.exists(job_dir, FINAL_TRAINED, WEIGHTS_NAME):
        return
    for name in (WEIGHTS_NAME, "config.json"):  # the weights first, as save_model writes them
        root.write_bytes(root.read_bytes(job_dir, FINAL, name), job_dir, FINAL_TRAINED, name)
