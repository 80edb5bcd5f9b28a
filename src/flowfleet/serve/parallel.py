"""`flowfleet serve DIR --nproc N --parallel MODE`: one served model, each image split over N ranks
(DistriFusion's patch parallelism, flowfleet.parallel).

Every rank opens the model folder and joins the patch-parallel fleet; rank 0 alone serves HTTP. For each
request that rank 0 has checked and admitted, it announces the call (prompts, n, labels, settings) on a
control group, then all ranks sample it together (the same collectives as `generate --nproc N`) and
rank 0 answers. The control group's timeout is long because the other ranks wait in it for as long as
the server is idle; the sampling collectives keep the fleet's short timeout, so a rank that dies
mid-request still fails the others within it. Rank 0 announces None when it stops; the others leave.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from flowfleet.parallel.fleet import ParallelFleet
from flowfleet.sampling.pipeline import FleetPipeline, SamplingSettings

IDLE_TIMEOUT = timedelta(days=30)  # how long the other ranks may wait for the next request


@dataclass(frozen=True)
class Call:
    """What every rank needs to run one request's sampling."""

    prompts: list[str] | None
    n: int
    labels: list[int] | None
    settings: SamplingSettings


class ParallelServing:
    def __init__(self, fleet: ParallelFleet):
        self.fleet = fleet
        self.control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)  # collective: every rank calls it

    @property
    def is_main(self) -> bool:
        return self.fleet.ctx.is_main

    def describe(self) -> dict[str, Any]:
        plan = self.fleet.plan
        return {
            "nproc": self.fleet.ctx.world_size,
            "mode": plan.mode.value,
            "warmup": plan.warmup,
            "ulysses_degree": plan.ulysses_degree,
        }

    def announce(self, call: Call | None) -> Call | None:
        """Rank 0: send the next call (None: stop). Other ranks: receive it."""
        box: list[Any] = [call]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def run(self, pipe: FleetPipeline, call: Call, on_step: Any = None) -> Any:
        return pipe(
            call.prompts, call.n, labels=call.labels, settings=call.settings, parallel=self.fleet, on_step=on_step
        )

    def follow(self, pipe: FleetPipeline) -> int:
        """Ranks other than 0: sample every announced call until rank 0 stops; -> calls served."""
        served = 0
        while (call := self.announce(None)) is not None:
            self.run(pipe, call)
            served += 1
        return served

    def stop(self) -> None:
        """Rank 0: tell the other ranks to leave; then leave the fleet's process group."""
        if self.is_main:
            self.announce(None)
        self.fleet.close()
