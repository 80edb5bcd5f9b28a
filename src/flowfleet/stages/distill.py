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

import safetensors.torch
import torch
from tqdm.auto import tqdm

from flowfleet.config import DistillConfig, RunConfig, load_run_config
from flowfleet.errors import FlowfleetError, ParameterError
from flowfleet.flow import Strategy
from flowfleet.layout import MODEL, REFLOW_PAIRS, RUN_FILE, STUDENT
from flowfleet.sampling.folder import read_model_index
from flowfleet.sampling.pipeline import FleetPipeline
from flowfleet.sampling.routing import Condition
from flowfleet.stages.assemble import assemble
from flowfleet.stages.train import train_job
from flowfleet.storage import RunRoot
from flowfleet.train.data import model_fields
from flowfleet.train.loop import TrainOptions
from flowfleet.train.preview import condition_kwargs
from flowfleet.train.specs import JobSpec
from flowfleet.train.tasks import clustered_data

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
    guidance_scale: float | None = None,
    method: str = "velocity",
    pairs: int = 2000,
    options: TrainOptions | None = None,
    progress: bool = True,
) -> DistillResult:
    """Train the student on the fleet in RUN_ROOT/model (resuming student/ when it has started with the same
    settings) and assemble RUN_ROOT/model-student."""
    root = run_root if isinstance(run_root, RunRoot) else RunRoot(run_root)
    cfg = load_run_config(root)
    index = read_model_index(RunRoot(root.url_of(MODEL)))  # one-line error when the fleet is not assembled
    try:
        chosen = Strategy.parse(teacher)
        chosen.resolve_k(len(index.present_experts))
    except ValueError as err:
        raise ParameterError("teacher", f"{err}") from None
    wanted = DistillConfig.model_validate(
        dict(
            teacher=chosen,
            student=student or {},
            steps=steps or cfg.train.steps,
            guidance_scale=guidance_scale,
            method=method,
            pairs=pairs,
        )
    )
    if cfg.distill != wanted:
        if root.exists(STUDENT):
            before = cfg.distill.model_dump() if cfg.distill else {}
            raise FlowfleetError(
                f"{root.url_of(STUDENT)}: trained with run.yaml distill {before}; re-run with those options "
                f"to resume, or delete the folder to distill anew"
            )
        cfg = RunConfig.from_dict({**cfg.to_dict(), "distill": wanted.model_dump(mode="json")}, root.url_of(RUN_FILE))
        cfg.save(root)
        log.info(f"distill: run.yaml distill = {wanted.model_dump()}")
    if wanted.method == "reflow":
        _reflow_pairs(root, cfg, progress)
    status = train_job(root, JobSpec("student"), options=options or TrainOptions(progress=progress))
    if status.state != "done":
        raise FlowfleetError(
            f"student: {status.state} at step {status.step}/{status.total_steps}; re-run the same command to resume"
        )
    return DistillResult(assemble(root.url, student=True, progress=progress).out, wanted)


def _reflow_pairs(root: RunRoot, cfg: RunConfig, progress: bool) -> None:
    """student/reflow-pairs.safetensors: `pairs` items of the data (seeded), fixed noise, and the teacher's
    sample from that noise with the items' conditions; written once (a re-run reuses it)."""
    if root.exists(*REFLOW_PAIRS):
        return
    assert cfg.distill is not None
    d = cfg.distill
    pipe = FleetPipeline.from_pretrained(root.url_of(MODEL), load_encoders=False)
    settings = pipe.settings(
        d.teacher,
        steps=d.teacher_steps,
        guidance_scale=d.teacher_guidance(cfg.sampling),
    )
    fields = [f for f in model_fields(cfg.expert) if f != "latents"]
    data = clustered_data(root, cfg, fields)
    gen = torch.Generator().manual_seed(cfg.train.seed)
    pick = torch.randperm(len(data), generator=gen)[: d.pairs]
    if pick.numel() < d.pairs:  # fewer items than pairs: cycle through them
        pick = pick.repeat(-(-d.pairs // pick.numel()))[: d.pairs]
    chunks: dict[str, list[torch.Tensor]] = {}
    bar = tqdm(total=d.pairs, desc="reflow pairs (teacher)", unit="pair", disable=not progress, dynamic_ncols=True)
    for start in range(0, d.pairs, 250):
        batch = data.gather(pick[start : start + 250])
        cond = condition_kwargs(batch, cfg.expert)
        noise = torch.randn(len(batch["cluster"]), *cfg.latent_shape, generator=gen)
        x0, _ = pipe.sample(noise, Condition(**cond), settings)
        for name, tensor in {"latents": x0, "noise": noise, **cond}.items():
            chunks.setdefault(name, []).append(tensor.cpu())
        bar.update(noise.shape[0])
    bar.close()
    tensors = {name: torch.cat(parts).contiguous() for name, parts in chunks.items()}
    root.write_bytes(safetensors.torch.save(tensors), *REFLOW_PAIRS)
    log.info(f"distill: {d.pairs} teacher pairs ({d.teacher}, {d.teacher_steps} steps) in {root.url_of(*REFLOW_PAIRS)}")
