"""DistriFusion patch parallelism for diffusers UNet2DConditionModel (DistriFusion, Li et al. 2024, §4).

mode.py       UNetMode (sync | displaced | sync-gn | stale-gn | separate-gn | naive) -> ParallelMode + NormStats
step.py       BandStep: this rank's band and the current evaluation's mode, shared by the wrappers
conv.py       FirstConvBand (exact from the full latent), HaloConvBand (halo rows from neighbouring bands)
attention.py  SelfAttentionBand (whole-image keys/values), CrossAttentionBand (cached text keys/values)
norm.py       GroupNormBand: exact / corrected asynchronous / stale / separate statistics (biased variance)
model.py      ParallelUNet / parallelize(): patch a U-Net in place, full latent in, full prediction out

All communication goes through flowfleet.parallel.comm.CommManager (one per parallel U-Net).
"""

from __future__ import annotations

import importlib
from typing import Any

# Imported lazily: flowfleet.parallel.patched (which model.py builds on) reads mode.py and step.py of this
# package, so importing model.py here eagerly would be circular.
_EXPORTS = {"NormStats": "mode", "UNetMode": "mode", "ParallelUNet": "model", "check_supported": "model"}
_EXPORTS["parallelize"] = "model"

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'flowfleet.parallel.unet' has no attribute {name!r}")
    return getattr(importlib.import_module(f"flowfleet.parallel.unet.{_EXPORTS[name]}"), name)
