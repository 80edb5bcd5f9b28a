"""`flowfleet distill`: fold a fleet into one model.

A student DiT (by default the size of one expert) regresses onto the assembled fleet's velocity at x_t
from the run's data: the teacher routes with a strategy (top-2 by default) and applies classifier-free
guidance, so the student, sampled without guidance, needs one model call per step where the fleet needs
the router plus k experts on twice the rows. The job is an ordinary training job (student/: checkpoints,
status, resume) and the result an ordinary model folder (model-student/, one expert, no router) that
`generate` and `evaluate` open. run.yaml's `distill` block records the teacher, student and steps.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from flowfleet.config import DistillConfig, RunConfig, load_run_config
from flowfleet.errors import FlowfleetError
from flowfleet.flow import parse_strategy
from flowfleet.layout import MODEL, STUDENT
from flowfleet.sampling.index import read_model_index
from flowfleet.stages.assemble import assemble
from flowfleet.stages.train import train_job
from flowfleet.storage import RunRoot
from flowfleet.train.jobs import JobSpec
from flowfleet.train.loop import TrainOptions

log = logging.getLogger(__name__)


@dataclass
class DistillResult:
    model: str  # model-student/
    distill: DistillConfig


def distill(
    run_root: str | RunRoot,
    *,
    teacher: str = "top2",
    student: dict[str, Any] | None = None,
    steps: int | None = None,
    cfg_scale: float | None = None,
    options: TrainOptions | None = None,
    progress: bool = True,
) -> DistillResult:
    """Train the student on the fleet in RUN_ROOT/model (resuming student/ when it has started with the same
    settings) and assemble RUN_ROOT/model-student."""
    root = run_root if isinstance(run_root, RunRoot) else RunRoot(run_root)
    cfg = load_run_config(root)
    index = read_model_index(RunRoot(root.url_of(MODEL)))  # one-line error when the fleet is not assembled
    try:
        parse_strategy(teacher).resolve_k(len(index.present_experts))
    except ValueError as err:
        raise FlowfleetError(f"--teacher: {err}") from None
    wanted = DistillConfig(teacher=teacher, student=student or {}, steps=steps or cfg.train.steps, cfg=cfg_scale)
    if cfg.distill != wanted:
        if root.exists(STUDENT):
            before = cfg.distill.model_dump() if cfg.distill else {}
            raise FlowfleetError(
                f"{root.url_of(STUDENT)}: trained with run.yaml distill {before}; re-run with those options "
                f"to resume, or delete the folder to distill anew"
            )
        cfg = RunConfig.from_dict({**cfg.to_dict(), "distill": wanted.model_dump(mode="json")}, root.url_of("run.yaml"))
        cfg.save(root)
        log.info(f"distill: run.yaml distill = {wanted.model_dump()}")
    status = train_job(root, JobSpec("student"), options=options or TrainOptions(progress=progress))
    if status.state != "done":
        raise FlowfleetError(
            f"student: {status.state} at step {status.step}/{status.total_steps}; re-run the same command to resume"
        )
    return DistillResult(assemble(root.url, student=True, progress=progress).out, wanted)
