"""A diffusers UNet2DConditionModel split into row bands over N ranks, used from a normal scheduler loop.

    with parallelize(unet, group, mode="displaced", warmup=4) as punet:   # on every rank
        for t in scheduler.timesteps:                                     # the loop is unchanged
            eps = unet(latents, t, encoder_hidden_states=text).sample     # full in, full out, every rank
            latents = scheduler.step(eps, t, latents).prev_sample

What every patched diffusers model does per call (binding, CFG split, warm-up counted in sampler steps,
slot discovery, output gather) is flowfleet.parallel.patched.PatchedModel. The U-Net part: its GroupNorm
and Conv2d layers' forwards become band wrappers and its attention layers get band processors; its own
forward is given the full latent, whose band of rows its first convolution cuts (exact, from the full
input), and every later layer runs on the band (flowfleet.parallel.unet.conv, .attention, .norm).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from diffusers.models.attention_processor import Attention, AttnProcessor, AttnProcessor2_0
from diffusers.models.unets.unet_2d_condition import UNet2DConditionModel, UNet2DConditionOutput

from flowfleet.distributed import Group
from flowfleet.errors import FlowfleetError
from flowfleet.parallel.attention import CrossAttentionBand, SelfAttentionBand
from flowfleet.parallel.bands import band_sizes
from flowfleet.parallel.patched import PatchedModel
from flowfleet.parallel.unet.conv import FirstConvBand, HaloConvBand, RowHalo
from flowfleet.parallel.unet.norm import GroupNormBand

# Layers whose forward mixes rows in ways the band wrappers do not model (functional group norms,
# FIR/kernel resamplers with their own padding). Matched by class name so that the check works across
# diffusers releases that move or drop these classes.
_UNSUPPORTED = frozenset(
    {"AdaGroupNorm", "SpatialNorm", "FirDownsample2D", "FirUpsample2D", "KDownsample2D", "KUpsample2D"}
)


def check_supported(unet: nn.Module) -> None:
    """Raise a one-line FlowfleetError naming the first layer that patch parallelism cannot run exactly."""
    if not isinstance(unet, UNet2DConditionModel):
        raise FlowfleetError(
            f"patch-parallel U-Net: expected a diffusers UNet2DConditionModel, got {type(unet).__name__}"
        )
    check_layers(unet, "U-Net")


def check_layers(model: nn.Module, what: str) -> None:
    """The band wrappers' limits, for any model made of them (a U-Net, a VAE decoder): a one-line
    FlowfleetError naming the first layer `what` has that they cannot run exactly."""
    for name, m in model.named_modules():
        kind = type(m).__name__
        if kind in _UNSUPPORTED:
            raise FlowfleetError(f"{what} layer {name} ({kind}) is not supported by patch parallelism")
        if isinstance(m, nn.ConvTranspose2d) and (m.kernel_size[0] > 1 or m.stride[0] > 1):
            raise FlowfleetError(f"{what} layer {name}: transposed convolutions are not supported by patch parallelism")
        if isinstance(m, nn.Conv2d) and (isinstance(m.padding, str) or m.padding_mode != "zeros"):
            raise FlowfleetError(
                f"{what} layer {name}: only explicit zero padding is supported "
                f"(padding={m.padding!r}, padding_mode={m.padding_mode!r})"
            )
        if kind == "Downsample2D" and getattr(m, "use_conv", False) and getattr(m, "padding", 1) == 0:
            raise FlowfleetError(f"{what} layer {name}: asymmetric-padding downsampling (padding=0) is not supported")
        if isinstance(m, Attention):
            if not isinstance(m.processor, (AttnProcessor2_0, AttnProcessor)):
                raise FlowfleetError(
                    f"{what} layer {name}: attention processor {type(m.processor).__name__} is not "
                    f"supported by patch parallelism (use the default AttnProcessor2_0)"
                )
            if m.spatial_norm is not None:
                raise FlowfleetError(f"{what} layer {name}: attention with a spatial norm is not supported")


def down_factor(unet: UNet2DConditionModel) -> int:
    """How many latent rows make one row at the U-Net's coarsest level (2 ** number of resamplings)."""
    downs = sum(1 for m in unet.modules() if type(m).__name__ == "Downsample2D")
    return 2 ** max(downs, int(getattr(unet, "num_upsamplers", 0)))


class ParallelUNet(PatchedModel):
    """A UNet2DConditionModel patched to run on this rank's band of rows; see the module docstring."""

    SAMPLE = "sample"
    UNSUPPORTED = ("attention_mask",)
    # ControlNet / T2I-Adapter residuals: whole feature maps of every level, cut into this band's rows
    RESIDUALS = (
        "down_block_additional_residuals",
        "mid_block_additional_residual",
        "down_intrablock_additional_residuals",
    )
    what = "U-Net"

    def __init__(self, unet: UNet2DConditionModel, group: Group, **options):
        check_supported(unet)
        self.factor = down_factor(unet)
        super().__init__(unet, group, **options)

    def _install(self) -> None:
        unet, step = self.model, self.step
        for name, m in unet.named_modules():
            if isinstance(m, nn.GroupNorm):
                self._patch(m, GroupNormBand(m, name, step))
            elif isinstance(m, nn.Conv2d) and m is unet.conv_in:
                self._patch(m, FirstConvBand(m, step))
            elif isinstance(m, nn.Conv2d) and RowHalo.of(m).rows > 0:
                self._patch(m, HaloConvBand(m, name, step))  # (1x1 convolutions are row-local: left alone)
            elif isinstance(m, Attention):
                band = CrossAttentionBand(name) if m.is_cross_attention else SelfAttentionBand(name, step)
                self._set_processor(m, band)

    def _output(self, full: torch.Tensor) -> UNet2DConditionOutput:
        return UNet2DConditionOutput(sample=full)

    def _check_input(self, sample: torch.Tensor) -> int:
        if sample.ndim != 4:
            raise FlowfleetError(f"patch-parallel U-Net: expected a latent [B, C, H, W], got {tuple(sample.shape)}")
        b, h = sample.shape[0], sample.shape[-2]
        n, f = self.step.bands, self.factor
        if h % f or h // f < n:
            raise FlowfleetError(
                f"patch-parallel U-Net: a latent of height {h} cannot be split into {n} bands of whole rows at every "
                f"U-Net level (the height must be a multiple of {f} and at least {n} x {f} = {n * f})"
            )
        return b

    def _band_inputs(self, call: dict[str, Any]) -> dict[str, Any]:
        # bands of whole groups of `factor` rows (whole rows at the coarsest level), sizes differing by <= 1
        self.step.sizes = band_sizes(call[self.SAMPLE].shape[-2] // self.factor, self.step.bands)
        return self._my_bands(call, self.RESIDUALS)
