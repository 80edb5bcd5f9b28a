"""Patch-parallel VAE decoding: one large image's decode split into row bands over N ranks.

    with parallelize(vae) as handle:         # an AutoencoderKL (its decoder is patched) or a Decoder
        image = vae.decode(latents).sample   # full latent in, the full image out, on every rank

A VAE decoder is a U-Net's second half without time or text: convolutions, GroupNorm, one self-attention
in the middle block and nearest-neighbour upsamplings (each doubles a band's rows, so bands stay aligned).
It runs on the U-Net's band wrappers (flowfleet.parallel.unet: the first convolution cut from the full
latent, halo convolutions, GroupNorm with statistics pooled over every band, attention over every band's
keys/values) in `sync` mode only: a decode is one call, with no previous step whose activations could
stand in, so it equals the single-device decode up to float rounding. What it saves is each rank's
activation memory and compute (1/N of every feature map), which is what limits a large image's decode.
The first call also runs the decoder once without communication to discover its comm slots
(PatchedModel), which doubles that call's compute; later calls with the same shape do not.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from diffusers.models.attention_processor import Attention
from diffusers.models.autoencoders.vae import Decoder

from flowfleet.distributed import Group
from flowfleet.errors import FlowfleetError
from flowfleet.parallel.attention import SelfAttentionBand
from flowfleet.parallel.bands import band_sizes
from flowfleet.parallel.mode import UNetMode
from flowfleet.parallel.patched import PatchedModel
from flowfleet.parallel.unet.conv import FirstConvBand, HaloConvBand, RowHalo
from flowfleet.parallel.unet.model import check_layers
from flowfleet.parallel.unet.norm import GroupNormBand


def check_decoder(decoder: Any) -> None:
    """Raise a one-line FlowfleetError naming the first layer patch parallelism cannot decode exactly: the
    U-Net's layer limits, and no transposed convolution at all (a decoder upsamples by interpolation)."""
    if not isinstance(decoder, Decoder):
        raise FlowfleetError(f"patch-parallel VAE: expected a diffusers VAE Decoder, got {type(decoder).__name__}")
    check_layers(decoder, "VAE")
    for name, m in decoder.named_modules():
        if isinstance(m, nn.ConvTranspose2d):
            raise FlowfleetError(f"VAE layer {name}: transposed convolutions are not supported by patch parallelism")


class ParallelVAEDecoder(PatchedModel):
    """A diffusers VAE Decoder patched to decode this rank's band of latent rows (module docstring)."""

    SAMPLE = "sample"
    UNSUPPORTED = ("latent_embeds",)  # MoVQ-style spatial conditioning
    RETURNS_TUPLE = False  # Decoder.forward(sample, latent_embeds) -> the image tensor
    what = "VAE decoder"

    def __init__(self, decoder: Decoder, group: Group, **options):
        check_decoder(decoder)
        super().__init__(decoder, group, **{**options, "mode": UNetMode.SYNC, "warmup": 0})

    def _install(self) -> None:
        for name, m in self.model.named_modules():
            if isinstance(m, nn.GroupNorm):
                self._patch(m, GroupNormBand(m, name, self.step))
            elif isinstance(m, nn.Conv2d) and m is self.model.conv_in:
                self._patch(m, FirstConvBand(m, self.step))
            elif isinstance(m, nn.Conv2d) and RowHalo.of(m).rows > 0:
                self._patch(m, HaloConvBand(m, name, self.step))
            elif isinstance(m, Attention):
                self._set_processor(m, SelfAttentionBand(name, self.step))

    def _check_input(self, sample: torch.Tensor) -> int:
        n, h = self.step.bands, sample.shape[-2] if sample.ndim == 4 else 0
        if sample.ndim != 4 or h < n:
            raise FlowfleetError(
                f"patch-parallel VAE decoder: a latent {tuple(sample.shape)} cannot be split into {n} bands of "
                f"whole rows (at least {n} rows)"
            )
        return sample.shape[0]

    def _band_inputs(self, call: dict[str, Any]) -> dict[str, Any]:
        self.step.sizes = band_sizes(call[self.SAMPLE].shape[-2], self.step.bands)  # rows, differing by <= 1
        return call

    def _output(self, full: torch.Tensor) -> torch.Tensor:
        return full  # Decoder.forward returns the image tensor itself
