"""The torch.distributed world of one process: its rank among the processes of one job (training under
torchrun: DDP) or of one parallel image (patch-parallel inference), its device and its process group.

One code path for CPU and GPU: gloo when the ranks run on CPU, NCCL when each has a CUDA device. Every
process group is created with a timeout, so a rank that dies or stalls makes the others raise a
one-line FlowfleetError instead of hanging. A world never spans two jobs: each expert, the router and
the monolith train in worlds of their own.

    ctx = join_from_env(device)          # training: torchrun's world, or this process alone
    ctx = init_from_env(timeout_s)       # inference under torchrun (must be there)
    ctx = single_process("cpu")          # no process group
    ctx.all_sum(x); ctx.all_ok(flag); ctx.barrier(); ctx.close()
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from flowfleet.device import resolve_device
from flowfleet.errors import FlowfleetError

TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
TRAIN_TIMEOUT_S = 1800.0  # training ranks wait for one another's checkpoint writes (torch's own default)


@dataclass(frozen=True)
class Group:
    """Ranks that communicate: the torch process group (None = the default group), this process's index
    in it and its size. A group of size 1 never calls torch.distributed."""

    pg: Any
    rank: int
    size: int

    @staticmethod
    def solo() -> "Group":
        return Group(None, 0, 1)


def split_group(group: Group, size: int, timeout_s: float = 60.0, strided: bool = False) -> Group:
    """Split `group`'s ranks into groups of `size`; -> the one holding this process. Consecutive ranks by
    default ([0, size), [size, 2 size), ...); `strided`: every (group.size / size)-th rank ({0, G, 2G, ...},
    {1, G + 1, ...}, G = group.size / size), the ranks at the same place in each consecutive group.

    Every rank of `group` creates every subgroup (torch.distributed requires it), in the same order."""
    if size < 1 or group.size % size:
        raise FlowfleetError(f"cannot split {group.size} ranks into groups of {size}")
    if size == group.size:
        return group
    # torch.distributed names subgroup members by their rank in the default group
    ranks = dist.get_process_group_ranks(group.pg) if group.pg is not None else list(range(group.size))
    count = group.size // size  # groups
    mine = Group.solo()
    for g in range(count):
        members = ranks[g::count] if strided else ranks[g * size : (g + 1) * size]
        pg = dist.new_group(members, timeout=datetime.timedelta(seconds=timeout_s)) if size > 1 else None
        if ranks[group.rank] in members:
            mine = Group(pg, members.index(ranks[group.rank]), size)
    return mine


@dataclass(frozen=True)
class DistContext:
    """This process's place among the ranks of one world."""

    rank: int
    world_size: int
    device: torch.device
    backend: str  # "gloo" | "nccl" | "none" (a single process, no process group)
    timeout_s: float
    owns_group: bool = False  # this process created the default group here and destroys it in close()

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def world(self) -> Group:
        return Group(None, self.rank, self.world_size)

    def subgroups(self, size: int) -> Group:
        """Split the ranks into consecutive groups of `size`; -> the group holding this rank."""
        return split_group(self.world, size, self.timeout_s)

    def all_sum(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the world's processes, in place (identity for one process)."""
        if self.distributed:
            dist.all_reduce(x, op=dist.ReduceOp.SUM)
        return x

    def all_ok(self, ok: bool) -> bool:
        """True when every process of the world says ok."""
        if not self.distributed:
            return ok
        flag = torch.tensor([0.0 if ok else 1.0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.SUM)
        return flag.item() == 0.0

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def close(self) -> None:
        """Destroy the default group when this context created it."""
        if self.owns_group and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def single_process(device: torch.device | str = "cpu") -> DistContext:
    return DistContext(0, 1, torch.device(device), "none", 0.0)


def default_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def in_torchrun() -> bool:
    """Whether this process was started by torchrun (or anything setting its environment)."""
    return all(k in os.environ for k in TORCHRUN_ENV)


def init_process_group(
    rank: int,
    world_size: int,
    *,
    init_method: str = "env://",
    timeout_s: float = 60.0,
    device: str | None = None,
    local_rank: int | None = None,
) -> DistContext:
    """Join the default process group (gloo on CPU, NCCL on CUDA) with a collective timeout."""
    dev = resolve_device(device, rank if local_rank is None else local_rank)
    if dev.type == "cuda":
        node_ranks, gpus = int(os.environ.get("LOCAL_WORLD_SIZE", "1")), torch.cuda.device_count()
        if node_ranks > gpus:  # NCCL refuses two ranks on one GPU, after a wait and with a long message
            raise FlowfleetError(
                f"rank {rank}: {node_ranks} ranks on this node share {gpus} GPU(s), and NCCL needs one GPU per "
                f"rank: start at most {gpus} per node, or pass --device cpu"
            )
        torch.cuda.set_device(dev)
    backend = default_backend(dev)
    kwargs: dict[str, Any] = {}
    if backend == "nccl":
        kwargs["device_id"] = dev  # eager NCCL init: a missing peer fails here, within the timeout
    try:
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
            **kwargs,
        )
    except (RuntimeError, ValueError) as err:
        reason = (str(err).strip().splitlines() or ["?"])[0][:200]
        raise FlowfleetError(
            f"rank {rank} of {world_size}: could not join the process group within {timeout_s:g} s ({reason})"
        ) from err
    return DistContext(rank, world_size, dev, backend, timeout_s, owns_group=True)


def init_from_env(timeout_s: float = 60.0, device: str | None = None) -> DistContext:
    """Inside torchrun: join the group described by RANK / WORLD_SIZE / LOCAL_RANK / MASTER_*."""
    if not in_torchrun():
        missing = ", ".join(k for k in TORCHRUN_ENV if k not in os.environ)
        raise FlowfleetError(f"not started by torchrun (missing {missing})")
    return init_process_group(
        int(os.environ["RANK"]),
        int(os.environ["WORLD_SIZE"]),
        timeout_s=timeout_s,
        device=device,
        local_rank=int(os.environ["LOCAL_RANK"]),
    )


def join_from_env(device: str | None = None, timeout_s: float = TRAIN_TIMEOUT_S) -> DistContext:
    """A training job's world: torchrun's when WORLD_SIZE > 1, else this process alone on `device`
    (an already initialised default group is used as it is)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return DistContext(0, 1, resolve_device(device, int(os.environ.get("LOCAL_RANK", "0"))), "none", 0.0)
    if dist.is_initialized():
        dev = resolve_device(device, int(os.environ.get("LOCAL_RANK", "0")))
        return DistContext(dist.get_rank(), dist.get_world_size(), dev, dist.get_backend(), timeout_s)
    return init_from_env(timeout_s, device)


def shutdown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
