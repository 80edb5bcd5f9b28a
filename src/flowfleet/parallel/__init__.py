"""Patch-parallel inference of DiT experts over torch.distributed (DistriFusion, Li et al. 2024).

mode.py       ParallelMode: sync | displaced | naive, one code path each
bands.py      BandLayout: N contiguous, patch-aligned bands of token rows; band_span/band_counts: the cut
              every layer of every band-parallel model makes
attention.py  BandKV: every band's keys/values by ParallelMode (the DiT's and the diffusers processors'
              self-attention); the diffusers attention processors
comm.py       CommManager: registered slots in one flat buffer, batched async all-gathers, byte counts
dit.py        PatchParallelDiT: a DiT on one band, one wrapper per layer kind
runner.py     PatchParallelRunner / ParallelVelocity: the per-step velocity of a routed fleet on N ranks
fleet.py      ParallelFleet / join_fleet: FleetPipeline and `generate --nproc N` on top of the runner
launch.py     torchrun (re)launch, local ranks for tests (the world they join: flowfleet.distributed)
patched.py    PatchedModel: a diffusers model patched in place (per call: CFG split, warm-up, output
              gather); unet/ for U-Nets, transformers.py for PixArt, SD3 and Flux, vae.py for a decoder
registry.py   parallelize(): which wrapper patches which diffusers class
unet/         the U-Net's band wrappers (halo convolutions, GroupNorm)

Names are imported lazily, so `flowfleet generate --nproc N` can relaunch itself under torchrun
without first importing the model code (diffusers) in the launcher process.
"""

from __future__ import annotations

import importlib
from typing import Any

_WORLD = "flowfleet.distributed"
_EXPORTS = {
    "BandLayout": "bands",
    "CommManager": "comm",
    "Group": _WORLD,
    "ParallelError": "comm",
    "PatchParallelDiT": "dit",
    "register_dit": "dit",
    "DistContext": _WORLD,
    "in_torchrun": _WORLD,
    "init_from_env": _WORLD,
    "init_process_group": _WORLD,
    "relaunch_torchrun": "launch",
    "run_local": "launch",
    "shutdown": _WORLD,
    "single_process": _WORLD,
    "ParallelMode": "mode",
    "ParallelPlan": "runner",
    "ParallelVelocity": "runner",
    "PatchParallelRunner": "runner",
    "ParallelFleet": "fleet",
    "PatchedModel": "patched",
    "parallelize": "registry",
    "join_fleet": "fleet",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'flowfleet.parallel' has no attribute {name!r}")
    module = _EXPORTS[name]
    return getattr(importlib.import_module(module if "." in module else f"flowfleet.parallel.{module}"), name)
