"""`flowfleet ema RUN --sigma-rel S`: the EMA length chosen after training (EDM2's post-hoc EMA).

Every finished job that tracked power-function EMAs (run.yaml train.posthoc_ema, router_train.posthoc_ema) gets a
final/ reconstructed from its snapshots at relative length S and its last step (flowfleet.train.phema). The first
time, final/ as training wrote it (train.ema_decay's EMA) is kept in final-ema/; `--sigma-rel trained` puts it back.
Each changed job records what its final/ is in posthoc_ema.json. `assemble` then builds model/ from the new finals.

`flowfleet ema RUN --choose S1,S2,...` makes the choice as EDM2 does, on held-out images: each length is sampled on
the validation split's draw, the fleet and the monolith each take their best (choose_posthoc_ema).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import torch

from flowfleet.config import load_run_config
from flowfleet.errors import ParameterError
from flowfleet.layout import (
    FINAL,
    FINAL_TRAINED,
    MODEL,
    MONOLITH,
    MONOLITH_MODEL,
    POSTHOC_CHOICE,
    POSTHOC_RECORD,
    ROUTERS,
)
from flowfleet.models.dit import DiTExpert, DiTModel, DiTRouter
from flowfleet.models.files import WEIGHTS_NAME, load_model, save_model
from flowfleet.storage import RunRoot
from flowfleet.train.phema import gamma_of, read_snapshots, reconstruct
from flowfleet.train.specs import JobSpec, fleet_jobs
from flowfleet.train.status import job_finished

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Changed:
    job: str
    step: int
    snapshots: int  # the snapshots the reconstruction combined


def _check_length(sigma_rel: float, parameter: str = "sigma_rel") -> None:
    try:
        gamma_of(sigma_rel)
    except ValueError as err:
        raise ParameterError(parameter, str(err).removeprefix("sigma_rel: ")) from None


def apply_posthoc_ema(
    run_root: str, sigma_rel: float | None, jobs: Callable[[JobSpec], bool] = lambda spec: True
) -> list[Changed]:
    """final/ of every finished job (of those `jobs` takes) with snapshots from its EMA of relative length
    `sigma_rel` (None: the EMA it trained with, as kept in final-ema/). A length outside (0, 1/sqrt(12)) is a
    one-line error before any job is touched; a job without snapshots is left as it is."""
    if sigma_rel is not None:
        _check_length(sigma_rel)
    root = RunRoot(run_root)
    changed = []
    for spec in filter(jobs, fleet_jobs(load_run_config(root))):
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


def _in_fleet(spec: JobSpec) -> bool:
    return spec.kind != MONOLITH


def _is_monolith(spec: JobSpec) -> bool:
    return spec.kind == MONOLITH


def choose_posthoc_ema(
    run_root: str, lengths: Sequence[float], options: Any, extractor: torch.nn.Module | None = None
) -> dict[str, Any]:
    """EDM2's choice of the EMA's length, on the validation split. For each length, every job's final/ is its
    reconstruction at that length, the fleet and the monolith are assembled and sampled on the validation split's
    draw (ValidationDraw: the test split is never read), and scored; each model takes the length its scores choose
    (choose_scale's rule: the lowest classifier FD, FID without a judge, among the prompt-accurate lengths). Then the
    fleet's jobs (experts and routers) keep the fleet's length, the monolith its own, both assembled again.
    options: EvaluateOptions of the draw (n, seed, sampling, judge). -> the record, also reports/posthoc_ema.json:
    {"split", "n", "lengths": [{"sigma_rel", "fleet": scores, "monolith": scores}], "chosen": {"fleet", "monolith"}}."""
    from flowfleet.stages.assemble import assemble
    from flowfleet.stages.evaluate import ValidationDraw, choose_scale
    from flowfleet.stages.evaluate.pieces import distance

    if len(lengths) < 2:
        raise ParameterError("lengths", f"a choice needs two lengths or more, got {list(lengths)}")
    for length in lengths:
        _check_length(length, "lengths")
    root = RunRoot(run_root)
    cfg = load_run_config(root)
    mono = cfg.monolith.enabled and job_finished(root, MONOLITH)[0]
    drawn = replace(options, monolith=mono, strategies=options.strategies[:1], guidance_sweep=())
    rows: list[dict[str, Any]] = []
    draw = None
    for length in lengths:
        if not apply_posthoc_ema(run_root, length):
            raise ParameterError("run_root", f"{root.url}: no finished job kept post-hoc EMA snapshots")
        assemble(root.url)
        if mono:
            assemble(root.url, monolith=True)
        # its prompts, noise and references do not depend on the weights: one draw scores every length
        draw = draw or ValidationDraw.open(root.url_of(MODEL), drawn, extractor)
        row: dict[str, Any] = {"sigma_rel": length, "fleet": draw.score("fleet", _pipe(root.url_of(MODEL), draw))}
        if mono:
            row["monolith"] = draw.score(MONOLITH, _pipe(root.url_of(MONOLITH_MODEL), draw))
        rows.append(row)
        log.info("sigma_rel %g: %s", length, {name: distance(row[name]) for name in ("fleet", MONOLITH) if name in row})
    min_accuracy = options.min_accuracy
    chosen = {"fleet": rows[choose_scale([r["fleet"] for r in rows], min_accuracy)]["sigma_rel"]}
    if mono:
        chosen[MONOLITH] = rows[choose_scale([r[MONOLITH] for r in rows], min_accuracy)]["sigma_rel"]
    apply_posthoc_ema(run_root, chosen["fleet"], _in_fleet)
    assemble(root.url)
    if mono:
        apply_posthoc_ema(run_root, chosen[MONOLITH], _is_monolith)
        assemble(root.url, monolith=True)
    record = {"split": "validation", "n": options.n, "seed": options.seed, "lengths": rows, "chosen": chosen}
    root.write_json(record, *POSTHOC_CHOICE)
    return record


def _pipe(folder: str, draw: Any) -> Any:
    from flowfleet.sampling.pipeline import FleetPipeline

    return FleetPipeline.from_pretrained(folder, device=draw.ev.device)
