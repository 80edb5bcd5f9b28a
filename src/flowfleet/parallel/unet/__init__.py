"""DistriFusion patch parallelism for diffusers UNet2DConditionModel (DistriFusion, Li et al. 2024, §4).

mode.py       UNetMode (sync | displaced | sync-gn | stale-gn | separate-gn | naive) -> ParallelMode + NormStats
step.py       BandStep: this rank's band and the current evaluation's mode, shared by the wrappers
conv.py       FirstConvBand (exact from the full latent), HaloConvBand (halo rows from neighbouring bands)
attention.py  SelfAttentionBand (whole-image keys/values), CrossAttentionBand (cached text keys/values)
norm.py       GroupNormBand: exact / corrected asynchronous / stale / separate statistics (biased variance)
model.py      ParallelUNet / parallelize(): patch a U-Net in place, full latent in, full prediction out

All communication goes through flowfleet.parallel.comm.CommManager (one per parallel U-Net).
"""

from flowfleet.parallel.unet.mode import NormStats, UNetMode
from flowfleet.parallel.unet.model import ParallelUNet, check_supported, parallelize

__all__ = ["NormStats", "UNetMode", "ParallelUNet", "check_supported", "parallelize"]
