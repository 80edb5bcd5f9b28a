"""Patch-parallel inference of DiT experts over torch.distributed (DistriFusion, papers/distrifusion).

mode.py     ParallelMode: sync | displaced | naive, one code path each
bands.py    BandLayout: N contiguous, patch-aligned bands of token rows
comm.py     CommManager: registered slots in one flat buffer, batched async all-gathers, byte counts
dit.py      PatchParallelDiT: a DiT on one band, one wrapper per layer kind
runner.py   PatchParallelRunner / ParallelVelocity: the per-step velocity of a routed fleet on N ranks
launch.py   DistContext, torchrun (re)launch, local ranks for tests; gloo on CPU, NCCL on GPU
"""

from flowfleet.parallel.bands import BandLayout
from flowfleet.parallel.comm import CommManager, Group, ParallelError
from flowfleet.parallel.dit import PatchParallelDiT, register_dit
from flowfleet.parallel.launch import (
    DistContext,
    in_torchrun,
    init_from_env,
    init_process_group,
    relaunch_torchrun,
    run_local,
    shutdown,
    single_process,
)
from flowfleet.parallel.mode import ParallelMode
from flowfleet.parallel.runner import ParallelPlan, ParallelVelocity, PatchParallelRunner

__all__ = [
    "BandLayout", "CommManager", "Group", "ParallelError", "PatchParallelDiT", "register_dit", "DistContext",
    "in_torchrun", "init_from_env", "init_process_group", "relaunch_torchrun", "run_local", "shutdown",
    "single_process", "ParallelMode", "ParallelPlan", "ParallelVelocity", "PatchParallelRunner",
]
