"""FleetPipeline on N ranks: `flowfleet generate DIR --nproc N --parallel MODE [--warmup W] [--ulysses-degree U]`.

    pipe = FleetPipeline.from_pretrained(model_dir)          # on every rank
    fleet = ParallelFleet(ctx, plan, configs)
    out = pipe(prompts, n, ..., parallel=fleet)              # every rank returns the same images

The routing stays FleetPipeline's own (RoutedVelocity.select: router, top-k per guidance branch, route_every,
the trace); its decision is broadcast from rank 0 and every selected expert runs patch-parallel
(flowfleet.parallel.runner). One PatchParallelRunner (one CommManager) serves all batches of a run
that fit its batch size; a larger batch or a change of guidance builds a new one.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Mapping

import torch

from flowfleet.distributed import DistContext, in_torchrun, init_from_env, shutdown
from flowfleet.errors import ParameterError
from flowfleet.models.config import DiTConfig
from flowfleet.models.files import read_dit_config
from flowfleet.parallel.mode import DISPLACED_WARMUP, ParallelMode
from flowfleet.parallel.runner import ParallelPlan, ParallelVelocity, PatchParallelRunner, Routing
from flowfleet.sampling.folder import expert_folder, read_model_index
from flowfleet.sampling.pipeline import RoutedVelocity
from flowfleet.storage import RunRoot

log = logging.getLogger(__name__)


def join_fleet(
    model_dir: str,
    nproc: int,
    mode: str,
    warmup: int = DISPLACED_WARMUP,
    *,
    device: str = "auto",
    timeout_s: float = 120.0,
    ulysses_degree: int | None = None,
) -> "ParallelFleet":
    """Inside torchrun: validate the plan, read the experts' configs, join the process group.

    device: "auto" / "cuda" -> this rank's GPU (LOCAL_RANK) when CUDA is available, else CPU; "cpu" -> CPU."""
    plan = ParallelPlan(ParallelMode.parse(mode), warmup, ulysses_degree=ulysses_degree)  # one-line errors first
    if not in_torchrun():
        raise ParameterError(
            f"nproc {nproc}",
            "not running under torchrun (`flowfleet generate` relaunches "
            f"itself; inside your own torchrun pass --nproc-per-node {nproc})",
        )
    world = int(os.environ["WORLD_SIZE"])
    if world != nproc:
        raise ParameterError(f"nproc {nproc}", f"torchrun started {world} ranks")
    root = RunRoot(model_dir)
    index = read_model_index(root)
    configs = {k: read_dit_config(root, expert_folder(k)) for k in index.present_experts}
    if device not in ("auto", "cpu", "cuda"):
        raise ParameterError("device", f"{device!r} with --nproc (expected auto, cpu or cuda: one device per rank)")
    ctx = init_from_env(timeout_s, device="cpu" if device == "cpu" else None)
    return ParallelFleet(ctx, plan, configs, owns_group=True)


class ParallelFleet:
    def __init__(
        self,
        ctx: DistContext,
        plan: ParallelPlan,
        configs: Mapping[int, DiTConfig] | None = None,
        owns_group: bool = False,
    ):
        self.ctx = ctx
        self.owns_group = owns_group
        self.plan = plan
        self.configs = dict(configs) if configs is not None else None
        self.runner: PatchParallelRunner | None = None
        self.last: ParallelVelocity | None = None  # the latest run's velocity (modes per evaluation)

    def _runner(self, pipe: Any, batch: int, guided: bool) -> PatchParallelRunner:
        r = self.runner
        if r is not None and r.batch >= batch and r.guided == guided:
            return r
        if r is not None:
            r.close()
        configs = self.configs or {k: pipe.experts.get(k).cfg for k in pipe.present}
        self.runner = PatchParallelRunner(
            self.ctx, configs, pipe.experts.get, self.plan, batch=batch, guided=guided, dtype=pipe.dtype
        )
        if self.ctx.is_main and (r is None or r.split_text != self.runner.split_text):
            log.info("parallel: %s", self.runner.split_text)
        return self.runner

    def velocity_fn(self, pipe: Any, cond: Any, settings: Any, trace: Any):
        """FleetPipeline's hook: the patch-parallel (x_t, t, step) -> v for one batch."""
        routed = RoutedVelocity(pipe, cond, settings, trace)  # its routing only: the runner runs the experts

        def route(x: torch.Tensor, t: torch.Tensor, step: int) -> Routing:
            selection, uncond = routed.select(x, t, step)
            if uncond is None:  # one choice serves both branches
                return selection.experts, selection.weights, None, None
            return selection.experts, selection.weights, uncond.experts, uncond.weights

        state: dict[str, ParallelVelocity] = {}

        def velocity(x: torch.Tensor, t: torch.Tensor, step: int) -> torch.Tensor:
            if "vf" not in state:  # the batch size is known at the first evaluation
                runner = self._runner(pipe, x.shape[0], routed.guided)
                state["vf"] = self.last = runner.velocity(
                    cond.kwargs(), guidance=settings, route=route, steps=settings.steps, stats=trace.stats
                )
            return state["vf"](x, t, step)

        return velocity

    def close(self) -> None:
        """Wait for in-flight gathers; leave the process group when join_fleet created it."""
        if self.runner is not None:
            self.runner.close()
        if self.owns_group:
            shutdown()
