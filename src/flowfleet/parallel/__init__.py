"""Patch-parallel inference of DiT experts over torch.distributed (DistriFusion, Li et al. 2024).

mode.py       ParallelMode: sync | displaced | naive, one code path each
bands.py      BandLayout: N contiguous, patch-aligned bands of token rows
comm.py       CommManager: registered slots in one flat buffer, batched async all-gathers, byte counts
dit.py        PatchParallelDiT: a DiT on one band, one wrapper per layer kind
runner.py     PatchParallelRunner / ParallelVelocity: the per-step velocity of a routed fleet on N ranks
fleet.py      ParallelFleet / join_fleet: FleetPipeline and `generate --nproc N` on top of the runner
launch.py     DistContext, torchrun (re)launch, local ranks for tests; gloo on CPU, NCCL on GPU
synthetic.py  a quickly trained stripes DiT for quality checks (tests, benchmarks)
unet/         the same for diffusers U-Nets

Names are imported lazily, so `flowfleet generate --nproc N` can relaunch itself under torchrun
without first importing the model code (diffusers) in the launcher process.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "BandLayout": "bands", "CommManager": "comm", "Group": "comm", "ParallelError": "comm",
    "PatchParallelDiT": "dit", "register_dit": "dit", "DistContext": "launch", "in_torchrun": "launch",
    "init_from_env": "launch", "init_process_group": "launch", "relaunch_torchrun": "launch",
    "run_local": "launch", "shutdown": "launch", "single_process": "launch", "ParallelMode": "mode",
    "ParallelPlan": "runner", "ParallelVelocity": "runner", "PatchParallelRunner": "runner",
    "ParallelFleet": "fleet", "join_fleet": "fleet",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'flowfleet.parallel' has no attribute {name!r}")
    return getattr(importlib.import_module(f"flowfleet.parallel.{_EXPORTS[name]}"), name)
