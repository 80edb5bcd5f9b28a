"""DistriFusion patch parallelism for diffusers UNet2DConditionModel (DistriFusion, Li et al. 2024, §4).

mode.py       UNetMode (sync | displaced | sync-gn | stale-gn | separate-gn | naive) -> ParallelMode + NormStats
step.py       BandStep: this rank's band and the current evaluation's mode, shared by the wrappers
conv.py       FirstConvBand (exact from the full latent), HaloConvBand (halo rows from neighbouring bands)
attention.py  SelfAttentionBand (whole-image keys/values), CrossAttentionBand (cached text keys/values)
norm.py       GroupNormBand: exact / corrected asynchronous / stale / separate statistics (biased variance)
model.py      ParallelUNet: a U-Net patched in place (flowfleet.parallel.parallelize picks it for a U-Net)

All communication goes through flowfleet.parallel.comm.CommManager (one per parallel U-Net).
"""

from __future__ import annotations

import importlib
from typing import Any

# Imported lazily: flowfleet.parallel.patched (which model.py builds on) reads mode.py and step.py of this
# package, so importing model.py here eagerly would be circular.
_EXPORTS = {
    "NormStats": "flowfleet.parallel.unet.mode",
    "UNetMode": "flowfleet.parallel.unet.mode",
    "ParallelUNet": "flowfleet.parallel.unet.model",
    "check_supported": "flowfleet.parallel.unet.model",
    "parallelize": "flowfleet.parallel.patched",  # any supported diffusers model, a U-Net among them
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'flowfleet.parallel.unet' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
