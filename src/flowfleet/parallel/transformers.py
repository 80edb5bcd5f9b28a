"""Patch parallelism for the diffusers transformers people run: PixArt (PixArtTransformer2DModel).

    from flowfleet.parallel import parallelize
    with parallelize(pipe.transformer, mode="displaced", cfg_split=True):   # on every rank
        images = pipe(prompt).images                                         # the pipeline is unchanged

A transformer's image tokens are the (H/p) x (W/p) patch grid in row-major order, so a band of latent
rows is a contiguous slice of the token sequence. Per call (flowfleet.parallel.patched.PatchedModel):
the model's own forward runs on this rank's band of latent rows, and

    pos_embed        patch embedding + positional embedding of the whole grid, then this band's tokens
                     (PatchEmbedBand: exact; it embeds the full latent, which every rank holds)
    self-attention   this band's queries against every band's image keys/values (fresh in sync, the
                     previous step's in displaced mode): the U-Net's SelfAttentionBand processor
    cross-attention  local queries against the text, which every rank holds whole (CrossAttentionBand)
    norms, MLPs, AdaLN, the output projection and unpatchify   per token: the band alone

so the model's unpatchify yields this band's rows of the prediction, which PatchedModel gathers.
A transformer has no GroupNorm: the U-Net's GN variants (sync-gn, stale-gn, separate-gn) are displaced.
"""

from __future__ import annotations

import torch
from diffusers.models.attention_processor import Attention, AttnProcessor, AttnProcessor2_0
from diffusers.models.embeddings import PatchEmbed
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from diffusers.models.transformers.pixart_transformer_2d import PixArtTransformer2DModel

from flowfleet.distributed import Group
from flowfleet.errors import FlowfleetError
from flowfleet.parallel.patched import PatchedModel
from flowfleet.parallel.unet.attention import CrossAttentionBand, SelfAttentionBand
from flowfleet.parallel.unet.step import BandStep


class PatchEmbedBand:
    """Replaces a PatchEmbed's forward: (this band's latent rows) -> this band's tokens [B, n, D], embedded
    with the whole grid's positions. Runs the layer on the full latent (held by every rank, in
    step.full) and keeps this band's tokens: exact, and cheap next to the transformer blocks."""

    def __init__(self, embed: PatchEmbed, step: BandStep):
        self.embed, self.step = embed, step
        self._class_forward = type(embed).forward

    def __call__(self, band: torch.Tensor) -> torch.Tensor:
        full = self.step.full  # [B, C, H, W]
        assert full is not None and full.shape[0] == band.shape[0]
        tokens = self._class_forward(self.embed, full)  # [B, (H/p)(W/p), D]
        n = tokens.shape[1] // self.step.bands  # tokens per band (whole token rows)
        return tokens[:, self.step.index * n : (self.step.index + 1) * n]


def check_pixart(model) -> None:
    """Raise a one-line FlowfleetError naming what patch parallelism cannot run exactly."""
    if not isinstance(model, PixArtTransformer2DModel):
        raise FlowfleetError(f"patch-parallel PixArt: expected a PixArtTransformer2DModel, got {type(model).__name__}")
    if not isinstance(model.pos_embed, PatchEmbed):
        raise FlowfleetError(f"PixArt pos_embed: {type(model.pos_embed).__name__} is not supported")
    for name, m in model.named_modules():
        if isinstance(m, Attention) and not isinstance(m.processor, (AttnProcessor2_0, AttnProcessor)):
            raise FlowfleetError(
                f"PixArt layer {name}: attention processor {type(m.processor).__name__} is not supported "
                f"by patch parallelism (use the default AttnProcessor2_0)"
            )


class ParallelPixArt(PatchedModel):
    """A PixArtTransformer2DModel patched to run on this rank's band of latent rows (module docstring)."""

    SAMPLE = "hidden_states"
    UNSUPPORTED = ("attention_mask",)  # a mask over image tokens would have to be split too
    what = "PixArt"

    def __init__(self, model: PixArtTransformer2DModel, group: Group, **options):
        check_pixart(model)
        self.patch = int(model.config["patch_size"])
        super().__init__(model, group, **options)

    def _install(self) -> None:
        self._patch(self.model.pos_embed, PatchEmbedBand(self.model.pos_embed, self.step))
        for name, m in self.model.named_modules():
            if isinstance(m, Attention):
                band = CrossAttentionBand(name) if m.is_cross_attention else SelfAttentionBand(name, self.step)
                self._set_processor(m, band)

    def _check_input(self, sample: torch.Tensor) -> int:
        if sample.ndim != 4:
            raise FlowfleetError(f"patch-parallel PixArt: expected a latent [B, C, H, W], got {tuple(sample.shape)}")
        n, h = self.step.bands, sample.shape[-2]
        if h % (n * self.patch):
            raise FlowfleetError(
                f"patch-parallel PixArt: a latent of height {h} cannot be split into {n} bands of whole token rows "
                f"(the height must be a multiple of {n} x patch {self.patch} = {n * self.patch})"
            )
        return sample.shape[0]

    def _model_input(self, sample: torch.Tensor) -> torch.Tensor:
        self.step.full = sample  # for PatchEmbedBand
        rows = sample.shape[-2] // self.step.bands
        return sample[..., self.step.index * rows : (self.step.index + 1) * rows, :]  # [B, C, H/n, W]

    def _output(self, full: torch.Tensor) -> Transformer2DModelOutput:
        return Transformer2DModelOutput(sample=full)
