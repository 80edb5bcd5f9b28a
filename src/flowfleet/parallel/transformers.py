"""Patch parallelism for the diffusers transformers people run: PixArt (PixArtTransformer2DModel),
Stable Diffusion 3 (SD3Transformer2DModel, joint attention over image + text tokens) and Flux
(FluxTransformer2DModel: packed tokens, RoPE, double- and single-stream blocks).

    from flowfleet.parallel import parallelize
    with parallelize(pipe.transformer, mode="displaced", cfg_split=True):   # on every rank
        images = pipe(prompt).images                                         # the pipeline is unchanged

A transformer's image tokens are the (H/p) x (W/p) patch grid in row-major order, so a band of latent
rows is a contiguous slice of the token sequence. Any number of ranks up to the number of token rows
works: band sizes differ by at most one row (parallel.bands.band_sizes); keys/values and output bands
travel padded to the largest band and are trimmed on arrival. Per call (parallel.patched.PatchedModel):
the model's own forward runs on this rank's band of latent rows, and

    pos_embed        patch embedding + positional embedding of the whole grid, then this band's tokens
                     (PatchEmbedBand: exact; it embeds the full latent, which every rank holds)
    self-attention   this band's queries against every band's image keys/values (fresh in sync, the
                     previous step's in displaced mode): the U-Net's SelfAttentionBand processor
    cross-attention  local queries against the text, which every rank holds whole (CrossAttentionBand)
    joint attention  (SD3) this band's image tokens and the whole text: queries [band; text] against
                     keys/values [every band's image tokens; text] (JointAttentionBand). In sync every
                     rank's text stream is identical; in displaced each rank's text sees its own band
                     fresh and the others stale, as in xDiT's SD3 support
    norms, MLPs, AdaLN, the output projection and unpatchify   per token: the band alone

so the model's unpatchify yields this band's rows of the prediction, which PatchedModel gathers.

Flux takes the latent already packed into tokens [B, (H/2)(W/2), 4C] with their positions as img_ids
[(H/2)(W/2), 3]: a band is a contiguous slice of both (RoPE is then computed for this band's positions by
the model itself), and FluxJointBand exchanges the rotated image keys/values of every block, double- and
single-stream (where the sequence is [text; this band's image tokens]).
A transformer has no GroupNorm: the U-Net's GN variants (sync-gn, stale-gn, separate-gn) are displaced.

mode="ulysses" | "ring" replace the key/value exchange of every self- and joint attention with exact
sequence parallelism (flowfleet.parallel.sequence): no slots, no warm-up. The joint attentions' text
tokens, held by every rank, are passed as `text` and join locally; Ulysses needs every attention layer's
heads divisible by the bands (checked up front, one line naming the layer).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from diffusers.models.attention_processor import Attention, AttnProcessor, AttnProcessor2_0, JointAttnProcessor2_0
from diffusers.models.embeddings import PatchEmbed, apply_rotary_emb
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from diffusers.models.transformers.pixart_transformer_2d import PixArtTransformer2DModel
from diffusers.models.transformers.transformer_flux import FluxAttention, FluxAttnProcessor, FluxTransformer2DModel
from diffusers.models.transformers.transformer_sd3 import SD3Transformer2DModel

from flowfleet.distributed import Group
from flowfleet.errors import FlowfleetError
from flowfleet.parallel.attention import CrossAttentionBand, SelfAttentionBand, _heads
from flowfleet.parallel.bands import band_sizes
from flowfleet.parallel.mode import UNetMode
from flowfleet.parallel.patched import PatchedModel
from flowfleet.parallel.sequence import check_heads
from flowfleet.parallel.step import BandStep


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
        return self.step.cut(self._class_forward(self.embed, full))  # [B, (H/p)(W/p), D] -> this band's tokens


class JointAttentionBand(SelfAttentionBand):
    """Processor for SD3's joint attention (mirrors diffusers' JointAttnProcessor2_0 step by step):
    queries [this band's image tokens; text] against keys/values [every band's image tokens; text].
    Without text (SD3.5's second, image-only attention) it is self-attention over the image."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, *args, **kwargs):
        if attention_mask is not None:
            raise FlowfleetError(f"layer {self.name}: patch-parallel joint attention takes no attention mask")
        b, n = hidden_states.shape[:2]  # [B, n, D]: this band's image tokens
        q, k, v = (_heads(attn, proj(hidden_states)) for proj in (attn.to_q, attn.to_k, attn.to_v))  # [B, H, n, Dh]
        if attn.norm_q is not None:
            q = attn.norm_q(q)
        if attn.norm_k is not None:
            k = attn.norm_k(k)
        text = None
        if encoder_hidden_states is not None:
            cq, ck, cv = (
                _heads(attn, proj(encoder_hidden_states))
                for proj in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)
            )
            if attn.norm_added_q is not None:
                cq = attn.norm_added_q(cq)
            if attn.norm_added_k is not None:
                ck = attn.norm_added_k(ck)
            text = (cq, ck, cv)  # [B, H, L, Dh] each
        if self.step.exchange.sequence:  # ulysses, ring: exact, the text's rows last
            out = self.sequence(q, k, v, text)  # [B, H, n + L, Dh]
        else:
            kv = self.all_bands(torch.stack((k, v), dim=1))  # [B, 2, H, N*n, Dh]: the whole image
            k, v = kv[:, 0], kv[:, 1]
            if text is not None:
                q, k, v = (torch.cat([image, words], dim=2) for image, words in zip((q, k, v), text))
            out = F.scaled_dot_product_attention(q, k, v)  # [B, H, n + L, Dh]
        out = out.transpose(1, 2).reshape(b, -1, attn.heads * q.shape[-1]).to(q.dtype)  # [B, n + L, D]
        image, text = out[:, :n], out[:, n:]
        image = attn.to_out[1](attn.to_out[0](image))
        if encoder_hidden_states is None:
            return image
        return image, (text if attn.context_pre_only else attn.to_add_out(text))


def _check_attention_heads(model: Any, kind: type[Any], mode: UNetMode, bands: int, what: str) -> None:
    """mode=ulysses splits every attention layer's heads over the bands: a one-line error naming the first
    layer whose head count the band count does not divide (ring and the other modes take any; usp's degree
    is checked against every layer's heads by parallel.sequence.ulysses_degree)."""
    for name, m in model.named_modules():
        if isinstance(m, kind):
            check_heads(mode.exchange, m.heads, bands, f"{what} layer {name}", parameter="mode")


def _heads_of(model: Any, kind: type[Any]) -> list[int]:
    return [m.heads for m in model.modules() if isinstance(m, kind)]


class ParallelTransformer(PatchedModel):
    """A diffusers image transformer (patch embedding, blocks on tokens, unpatchify) patched to run on this
    rank's band of latent rows (module docstring). Subclasses name the model class and its
    unsupported arguments."""

    SAMPLE = "hidden_states"
    MODEL: type[Any] = object

    def __init__(self, model, group: Group, **options):
        self._check_model(model)
        self.patch = int(model.config["patch_size"])
        super().__init__(model, group, **options)

    def _check_model(self, model: Any) -> None:
        """Raise a one-line FlowfleetError naming what patch parallelism cannot run exactly."""
        if not isinstance(model, self.MODEL):
            raise FlowfleetError(
                f"patch-parallel {self.what}: expected a {self.MODEL.__name__}, got {type(model).__name__}"
            )
        if not isinstance(model.pos_embed, PatchEmbed):
            raise FlowfleetError(f"{self.what} pos_embed: {type(model.pos_embed).__name__} is not supported")
        for name, m in model.named_modules():
            if isinstance(m, Attention) and not isinstance(
                m.processor, (AttnProcessor2_0, AttnProcessor, JointAttnProcessor2_0)
            ):
                raise FlowfleetError(
                    f"{self.what} layer {name}: attention processor {type(m.processor).__name__} is not supported "
                    f"by patch parallelism (use diffusers' default processor)"
                )

    def _check_mode(self, model: Any, mode: UNetMode, bands: int) -> None:
        _check_attention_heads(model, Attention, mode, bands, self.what)

    def _attention_heads(self, model: Any) -> list[int]:
        return _heads_of(model, Attention)

    def _install(self) -> None:
        self._patch(self.model.pos_embed, PatchEmbedBand(self.model.pos_embed, self.step))
        for name, m in self.model.named_modules():
            if not isinstance(m, Attention):
                continue
            if isinstance(m.processor, JointAttnProcessor2_0):
                self._set_processor(m, JointAttentionBand(name, self.step))
            elif m.is_cross_attention:
                self._set_processor(m, CrossAttentionBand(name))
            else:
                self._set_processor(m, SelfAttentionBand(name, self.step))

    def _check_input(self, sample: torch.Tensor) -> int:
        if sample.ndim != 4:
            raise FlowfleetError(
                f"patch-parallel {self.what}: expected a latent [B, C, H, W], got {tuple(sample.shape)}"
            )
        n, h = self.step.bands, sample.shape[-2]
        if h % self.patch or h // self.patch < n:
            raise FlowfleetError(
                f"patch-parallel {self.what}: a latent of height {h} cannot be split into {n} bands of whole "
                f"token rows (the height must be a multiple of patch {self.patch} and at least {n * self.patch})"
            )
        return sample.shape[0]

    def _band_inputs(self, call: dict[str, Any]) -> dict[str, Any]:
        sample = self.step.full = call[self.SAMPLE]  # the full latent, for PatchEmbedBand
        p = self.patch
        rows = band_sizes(sample.shape[-2] // p, self.step.bands)  # token rows per band, differing by <= 1
        self.step.sizes = tuple(r * (sample.shape[-1] // p) for r in rows)  # tokens per band
        band = self.step.cut(sample)  # [B, C, rows * p, W]
        return self._my_bands({**call, self.SAMPLE: band}, self.RESIDUALS)

    def _output(self, full: torch.Tensor) -> Transformer2DModelOutput:
        return Transformer2DModelOutput(sample=full)


class ParallelPixArt(ParallelTransformer):
    MODEL = PixArtTransformer2DModel
    UNSUPPORTED = ("attention_mask",)  # a mask over image tokens would have to be split too
    what = "PixArt"


class ParallelSD3(ParallelTransformer):
    MODEL = SD3Transformer2DModel
    RESIDUALS = ("block_controlnet_hidden_states",)  # ControlNet: [B, image tokens, D] per block
    what = "SD3"


class FluxJointBand(SelfAttentionBand):
    """Processor for Flux's attention (mirrors diffusers' FluxAttnProcessor step by step): the local
    sequence is [text; this band's image tokens] (double-stream: the text from encoder_hidden_states;
    single-stream: the first step.text_tokens tokens of hidden_states); after RoPE, its queries attend
    to [text; every band's image tokens]."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        if attention_mask is not None:
            raise FlowfleetError(f"layer {self.name}: patch-parallel Flux attention takes no attention mask")

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.unflatten(-1, (-1, attn.head_dim))  # [B, S, D] -> [B, S, H, Dh]

        q, k, v = heads(attn.to_q(hidden_states)), heads(attn.to_k(hidden_states)), heads(attn.to_v(hidden_states))
        q, k = attn.norm_q(q), attn.norm_k(k)
        if encoder_hidden_states is not None:  # double-stream: the text stream's own projections, ahead
            eq, ek, ev = (
                heads(proj(encoder_hidden_states)) for proj in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)
            )
            eq, ek = attn.norm_added_q(eq), attn.norm_added_k(ek)
            q, k, v = torch.cat([eq, q], dim=1), torch.cat([ek, k], dim=1), torch.cat([ev, v], dim=1)
            text = encoder_hidden_states.shape[1]
        else:  # single-stream: hidden_states is already [text; image band]
            text = self.step.text_tokens
        if image_rotary_emb is not None:
            q = apply_rotary_emb(q, image_rotary_emb, sequence_dim=1)
            k = apply_rotary_emb(k, image_rotary_emb, sequence_dim=1)
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # [B, H, L + n, Dh]: the text first
        if self.step.exchange.sequence:  # ulysses, ring: exact; they return the text's rows last
            words = tuple(x[:, :, :text] for x in (q, k, v)) if text else None
            out = self.sequence(q[:, :, text:], k[:, :, text:], v[:, :, text:], words)  # [B, H, n + L, Dh]
            out = torch.cat([out[:, :, out.shape[2] - text :], out[:, :, : out.shape[2] - text]], dim=2)
        else:
            kv = self.all_bands(torch.stack((k[:, :, text:], v[:, :, text:]), dim=1))  # [B, 2, H, N*n, Dh]
            keys = torch.cat([k[:, :, :text], kv[:, 0]], dim=2)  # [B, H, L + N*n, Dh]
            values = torch.cat([v[:, :, :text], kv[:, 1]], dim=2)
            out = F.scaled_dot_product_attention(q, keys, values)  # [B, H, L + n, Dh]
        out = out.transpose(1, 2).flatten(2, 3).to(q.dtype)  # [B, L + n, D]
        if encoder_hidden_states is None:
            return out
        text_out, image = out[:, :text], out[:, text:]
        image = attn.to_out[1](attn.to_out[0](image.contiguous()))
        return image, attn.to_add_out(text_out.contiguous())


class ParallelFlux(PatchedModel):
    """A FluxTransformer2DModel patched to run on this rank's band of image tokens (module docstring)."""

    SAMPLE = "hidden_states"
    RESIDUALS = ("controlnet_block_samples", "controlnet_single_block_samples")  # [B, image tokens, D] each
    SHARED = ("img_ids", "txt_ids")
    MODEL = FluxTransformer2DModel
    what = "Flux"

    def __init__(self, model: FluxTransformer2DModel, group: Group, **options):
        if not isinstance(model, FluxTransformer2DModel):
            raise FlowfleetError(f"patch-parallel Flux: expected a FluxTransformer2DModel, got {type(model).__name__}")
        for name, m in model.named_modules():
            if isinstance(m, FluxAttention) and type(m.processor) is not FluxAttnProcessor:
                raise FlowfleetError(
                    f"Flux layer {name}: attention processor {type(m.processor).__name__} is not supported "
                    f"by patch parallelism (use diffusers' default FluxAttnProcessor)"
                )
        super().__init__(model, group, **options)

    def _check_mode(self, model: Any, mode: UNetMode, bands: int) -> None:
        _check_attention_heads(model, FluxAttention, mode, bands, self.what)

    def _attention_heads(self, model: Any) -> list[int]:
        return _heads_of(model, FluxAttention)

    def _install(self) -> None:
        for name, m in self.model.named_modules():
            if isinstance(m, FluxAttention):
                self._set_processor(m, FluxJointBand(name, self.step))

    def _check_input(self, sample: torch.Tensor) -> int:
        if sample.ndim != 3:
            raise FlowfleetError(
                f"patch-parallel Flux: expected packed latent tokens [B, S, C], got {tuple(sample.shape)}"
            )
        if sample.shape[1] < self.step.bands:
            raise FlowfleetError(
                f"patch-parallel Flux: {sample.shape[1]} image tokens cannot be split into {self.step.bands} bands"
            )
        return sample.shape[0]

    def _band_inputs(self, call: dict[str, Any]) -> dict[str, Any]:
        tokens, ids = call[self.SAMPLE], call["img_ids"]  # [B, S, C], [S, 3]
        self.step.sizes = band_sizes(tokens.shape[1], self.step.bands)
        self.step.text_tokens = call["txt_ids"].shape[-2]
        band = {self.SAMPLE: self.step.cut(tokens), "img_ids": self.step.cut(ids)}  # [B, n, C], [n, 3]
        return self._my_bands({**call, **band}, self.RESIDUALS)

    def _output(self, full: torch.Tensor) -> Transformer2DModelOutput:
        return Transformer2DModelOutput(sample=full)
