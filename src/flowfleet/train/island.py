"""The compute island of one job: the processes torchrun started for it on one node, or just this one.

Under `torchrun --nproc_per_node N flowfleet train-expert ...` the job uses DDP over the node's
devices (NCCL on GPUs, gloo on CPU, env:// rendezvous). A process group never spans two jobs: each
expert, the router and the monolith are islands of their own (paris §2.2).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from flowfleet.device import resolve_device


@dataclass
class Island:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    owns_group: bool = False  # this object initialised the process group and must destroy it

    @classmethod
    def from_env(cls, device: str | None = None) -> "Island":
        """Read torchrun's RANK / WORLD_SIZE / LOCAL_RANK; join the process group when WORLD_SIZE > 1."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        local = int(os.environ.get("LOCAL_RANK", "0"))
        dev = resolve_device(device, local)
        island = cls(rank, world, local, dev)
        if world > 1 and not dist.is_initialized():
            if dev.type == "cuda":
                torch.cuda.set_device(dev)
            dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", init_method="env://")
            island.owns_group = True
        return island

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def all_sum(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the island's processes (identity for one process)."""
        if self.distributed:
            dist.all_reduce(x, op=dist.ReduceOp.SUM)
        return x

    def all_ok(self, ok: bool) -> bool:
        """True when every process of the island says ok."""
        if not self.distributed:
            return ok
        flag = torch.tensor([0.0 if ok else 1.0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.SUM)
        return flag.item() == 0.0

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def close(self) -> None:
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self.owns_group = False
