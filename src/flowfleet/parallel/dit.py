"""A DiT run on one band of the image, per layer kind (DistriFusion, Li et al. 2024, §4).

    patch embedding   local: the band's patches + its slice of the fixed position embedding
    self-attention    local queries against the keys/values of the whole image; the other bands'
                      keys/values come from the ParallelMode's exchange (sync / displaced / naive),
                      or the exact sequence-parallel attention (ulysses / ring: parallel/sequence.py)
    cross-attention   local (text keys/values are the same on every rank)
    MLP, adaLN        local (token-wise; the conditioning vector is computed on every rank)
    final layer       local: the band's velocity, [B, C, R*p, W]

Only self-attention communicates. Each of its layers owns one comm slot of [B, 2, heads, band tokens,
head dim] (its keys and values) and does wait -> compute -> enqueue against the shared CommManager.
The wrappers hold references to the model's own modules (no copies, no parameters of their own), so
a single-band run is the model's forward and an N-band `sync` run equals it up to float rounding.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from flowfleet.errors import FlowfleetError
from flowfleet.models.config import DiTConfig
from flowfleet.models.dit import DiTModel
from flowfleet.models.layers import SelfAttention
from flowfleet.parallel.attention import BandKV
from flowfleet.parallel.bands import BandLayout
from flowfleet.parallel.comm import CommManager
from flowfleet.parallel.mode import ParallelMode
from flowfleet.parallel.sequence import SequenceAttention, SequenceMesh


def attention_slot_shape(cfg: DiTConfig, layout: BandLayout, batch: int) -> tuple[int, ...]:
    """One self-attention layer's keys and values for a band: [B, 2, heads, the largest band's tokens, head dim]."""
    return (batch, 2, cfg.num_heads, max(layout.token_counts), cfg.hidden_size // cfg.num_heads)


def register_dit(comm: CommManager, name: str, cfg: DiTConfig, layout: BandLayout, batch: int) -> None:
    """Reserve one slot per self-attention layer of a DiT (before comm.allocate())."""
    shape = attention_slot_shape(cfg, layout, batch)
    for i in range(cfg.depth):
        comm.register(f"{name}.blocks.{i}.attn", shape, family=name)


# --------------------------------------------------------------------------------------------------
#                                      Layer wrappers
# --------------------------------------------------------------------------------------------------


class PatchEmbedBand:
    """[B, C, R*p, W] band -> [B, band tokens, D]: the model's patch embedding plus its position slice."""

    def __init__(self, model: DiTModel, layout: BandLayout):
        self.x_embedder = model.x_embedder
        self.pos = model.pos_embed[:, layout.token_slice]  # [1, band tokens, D]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.x_embedder(x) + self.pos.to(x.dtype)  # [B, n, D]


class DiTAttentionBand:
    """A DiT block's self-attention on one band: its own projections, every band's keys/values through BandKV
    (the exchange the diffusers attention processors use too)."""

    def __init__(self, attn: SelfAttention, comm: CommManager, slot: str, counts: list[int], mesh: SequenceMesh | None):
        self.attn = attn
        self.kv = BandKV(comm, slot, comm.bands.rank)
        self.comm, self.slot, self.mesh = comm, slot, mesh  # mesh None: SequenceMesh.plain for ulysses / ring
        self._sequence: dict[ParallelMode, SequenceAttention] = {}  # ulysses / ring / usp, built at first use
        self.counts = counts  # every band's tokens

    def __call__(
        self, x: torch.Tensor, *, mode: ParallelMode, rows: torch.Tensor | None, prefetch: bool
    ) -> torch.Tensor:
        q, k, v = self.attn.forward_qkv(x)  # each [B, H, n, Dh]
        if mode.sequence:  # exact: every token's keys/values of this step, no slot
            core = self._sequence.get(mode)
            if core is None:
                mesh = self.mesh or SequenceMesh.plain(self.comm.bands, mode)
                core = self._sequence[mode] = SequenceAttention(self.comm, self.counts, self.slot, mesh)
            return self.attn.project(core(q, k, v))  # [B, n, D]
        kv = torch.stack((k, v), dim=1)  # [B, 2, H, n, Dh]: this band's fresh keys and values
        kv_all = self.kv(kv, mode, self.counts, rows, prefetch)  # [B, 2, H, N (or n for naive), Dh]
        return self.attn.attend(q, kv_all[:, 0], kv_all[:, 1])  # [B, n, D]


# --------------------------------------------------------------------------------------------------
#                                      The band model
# --------------------------------------------------------------------------------------------------


class PatchParallelDiT:
    """DiTModel forward on one band: (x band [B, C, R*p, W], t [B], condition) -> velocity band.

    `name` must match the one passed to register_dit for this model; `rows` maps the batch onto the
    slots' batch rows (which samples these are), so `displaced` reuses each sample's own previous keys
    and values even when routing changes the batch; `mesh`: the bands' Ulysses x ring split, for the
    sequence-parallel modes.
    """

    def __init__(
        self, model: DiTModel, comm: CommManager, name: str, layout: BandLayout, mesh: SequenceMesh | None = None
    ):
        if model.head is not None:
            raise FlowfleetError(f"{name}: a router (classification head) cannot run patch-parallel")
        gh, gw = model.cfg.grid_size
        if (gh, gw, model.cfg.patch_size) != (layout.grid_h, layout.grid_w, layout.patch):
            raise FlowfleetError(
                f"{name}: token grid {gh}x{gw} (patch {model.cfg.patch_size}) differs from the "
                f"band layout's {layout.grid_h}x{layout.grid_w} (patch {layout.patch})"
            )
        self.model = model
        self.name = name
        self.layout = layout
        self.comm = comm
        self.embed = PatchEmbedBand(model, layout)
        self.attn = [
            DiTAttentionBand(b.attn, comm, f"{name}.blocks.{i}.attn", layout.token_counts, mesh)
            for i, b in enumerate(model.dit_blocks)
        ]

    def __call__(
        self,
        x: torch.Tensor,
        t: torch.Tensor,
        *,
        mode: ParallelMode,
        rows: torch.Tensor | None = None,
        prefetch: bool = True,
        drop: torch.Tensor | None = None,
        **cond: Any,
    ) -> torch.Tensor:
        m, lay = self.model, self.layout
        if x.shape[1] != m.cfg.in_channels or tuple(x.shape[-2:]) != (lay.rows * lay.patch, lay.grid_w * lay.patch):
            raise ValueError(
                f"{self.name}: band input {tuple(x.shape[1:])} does not match band "
                f"({m.cfg.in_channels}, {lay.rows * lay.patch}, {lay.grid_w * lay.patch})"
            )
        t = torch.as_tensor(t, device=x.device, dtype=torch.float32).expand(x.shape[0])
        x_in, emb_t = m.network_input(x, t)  # per position: the band's own (a ddpm expert's VP state)
        h = self.embed(x_in)  # [B, n, D]
        c, block_c, ctx, ctx_mask = m.conditioning(emb_t, drop=drop, **cond)  # replicated on every rank
        for block, attn in zip(m.blocks, self.attn):
            h = block(h, block_c, ctx, ctx_mask, attn=partial(attn, mode=mode, rows=rows, prefetch=prefetch))
        if prefetch and mode is ParallelMode.DISPLACED:
            self.comm.flush(self.name)
        assert m.final_layer is not None  # __init__ refused a router
        h = m.final_layer(h, c)  # [B, n, p*p*C]
        return m.output_velocity(m.unpatchify(h, lay.rows), x, t)  # [B, C, R*p, W]
