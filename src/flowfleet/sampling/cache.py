"""First-block cache for the fleet's sampler (`--cache T`): skip an expert's blocks after the first for a
sample when the first block's residual has changed by less than T since the last evaluation that ran them
all; that evaluation's residual of the skipped blocks stands in.

    change = mean |r1 - r1_full| / mean |r1_full|      r1 = block_1(h) - h, per sample, over tokens x width
    change < T  ->  h_out = block_1(h) + (h_out_full - block_1(h)_full)      (blocks 2..depth not run)

This is the First-Block Cache rule (ParaAttention; diffusers' FirstBlockCacheConfig) kept per expert and per
sample row (the CFG halves are rows of their own): routing gives each expert a different subset of the
samples at each evaluation, so a sample's state is valid only where the same expert ran it in full
before. T = 0 never skips. Written here because diffusers' cache hooks attach to diffusers models'
blocks, and the fleet's experts are flowfleet's own DiTModel.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from flowfleet.errors import ParameterError
from flowfleet.models.dit import DiTModel


@dataclass
class CacheStats:
    """Block evaluations of one sampling run: run in full vs skipped (per sample row)."""

    blocks_run: int = 0
    blocks_skipped: int = 0

    @property
    def saved(self) -> float:
        total = self.blocks_run + self.blocks_skipped
        return self.blocks_skipped / total if total else 0.0

    def to_json(self) -> dict[str, float]:
        return {"blocks_run": self.blocks_run, "blocks_skipped": self.blocks_skipped, "saved": round(self.saved, 4)}


@dataclass
class _ExpertState:
    first: torch.Tensor  # [rows, N, D] the first block's residual at each row's last full evaluation
    rest: torch.Tensor  # [rows, N, D] the other blocks' residual then
    valid: torch.Tensor  # [rows] bool: this expert ran the row in full before


@dataclass
class BlockCache:
    """One sampling run's cache. rows: the run's sample rows (2 x batch with guidance: [cond; uncond]);
    stats: where the block counts go (the run's ExecutionStats.cache)."""

    threshold: float
    rows: int
    stats: CacheStats = field(default_factory=CacheStats)
    _state: dict[int, _ExpertState] = field(default_factory=dict)

    def bind(self, k: int, model: Any, rows: torch.Tensor) -> Callable[..., torch.Tensor]:
        """Expert k as a model callable (x, t, **cond) on these sample rows (the cache's row ids of x)."""
        if not isinstance(model, DiTModel):
            raise ParameterError("cache", f"expert {k} is a {type(model).__name__}, not a DiT with blocks to skip")
        return lambda x, t, **cond: self.forward(k, model, rows, x, t, **cond)

    def forward(self, k: int, model: DiTModel, rows: torch.Tensor, x: torch.Tensor, t: torch.Tensor, **cond):
        """DiTModel.forward with the first-block rule, per row: [n, C, H, W] -> velocity [n, C, H, W]."""
        drop = cond.pop("drop", None)
        t = torch.as_tensor(t, device=x.device, dtype=torch.float32).expand(x.shape[0])
        x_in, emb_t = model.network_input(x, t)  # a ddpm expert's VP state and step
        h = model.x_embedder(x_in) + model.pos_embed.to(x.dtype)  # [n, N, D]
        c, block_c, ctx, ctx_mask = model.conditioning(emb_t, drop=drop, **cond)
        first, *rest = model.dit_blocks
        h1 = first(h, block_c, ctx, ctx_mask)  # [n, N, D]
        r1 = h1 - h
        state = self._state.get(k)
        if state is None:
            shape = (self.rows, *r1.shape[1:])
            zeros = torch.zeros(shape, dtype=r1.dtype, device=r1.device)
            state = self._state[k] = _ExpertState(zeros, zeros.clone(), torch.zeros(self.rows, dtype=torch.bool))
        prev = state.first[rows]
        change = (r1 - prev).abs().mean(dim=(1, 2)) / prev.abs().mean(dim=(1, 2)).clamp_min(1e-12)  # [n]
        skip = state.valid[rows.cpu()].to(x.device) & (change < self.threshold)
        out = h1 + state.rest[rows]  # the skipped rows' answer; the others are overwritten below
        run = (~skip).nonzero(as_tuple=True)[0]
        if run.numel():
            hr = h1[run]
            pick = lambda v: None if v is None else v[run]  # noqa: E731 - the conditioning of the rows run
            for block in rest:
                hr = block(hr, block_c[run], pick(ctx), pick(ctx_mask))
            out[run] = hr
            state.first[rows[run]] = r1[run]
            state.rest[rows[run]] = hr - h1[run]
            state.valid[rows[run].cpu()] = True
        self.stats.blocks_run += x.shape[0] + run.numel() * len(rest)
        self.stats.blocks_skipped += int(skip.sum()) * len(rest)
        assert model.final_layer is not None  # experts have one (a router has a head instead)
        raw = model.unpatchify(model.final_layer(out, c), model.cfg.grid_size[0])  # [n, out_ch, H, W]
        return model.output_velocity(raw, x, t)  # [n, C, H, W]
