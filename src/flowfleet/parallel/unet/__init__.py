"""DistriFusion patch parallelism for diffusers UNet2DConditionModel (DistriFusion, Li et al. 2024, §4).

conv.py       FirstConvBand (exact from the full latent), HaloConvBand (halo rows from neighbouring bands)
norm.py       GroupNormBand: exact / corrected asynchronous / stale / separate statistics (biased variance)
model.py      ParallelUNet: a U-Net patched in place (flowfleet.parallel.registry picks it for a U-Net)

Its attention processors (SelfAttentionBand, CrossAttentionBand) live in flowfleet.parallel.attention, the
modes (UNetMode: sync | displaced | sync-gn | stale-gn | separate-gn | naive) in flowfleet.parallel.mode and
the per-evaluation BandStep in flowfleet.parallel.step: the transformers and the VAE decoder use them too.
All communication goes through flowfleet.parallel.comm.CommManager (one per parallel U-Net).
"""

from __future__ import annotations

import importlib
from typing import Any

# Imported lazily, so that importing the package does not import diffusers.
_EXPORTS = {
    "NormStats": "flowfleet.parallel.mode",
    "UNetMode": "flowfleet.parallel.mode",
    "ParallelUNet": "flowfleet.parallel.unet.model",
    "check_supported": "flowfleet.parallel.unet.model",
    "parallelize": "flowfleet.parallel.registry",  # any supported diffusers model, a U-Net among them
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'flowfleet.parallel.unet' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
