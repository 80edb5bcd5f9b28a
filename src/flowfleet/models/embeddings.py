"""Input embeddings of the DiT: patches, fixed 2-D sin-cos positions, timesteps, labels, text.

Follows the DiT reference model (facebookresearch/DiT models.py): timestep sinusoid is [cos, sin]
over 256 frequencies; position sinusoid is [sin, cos] per axis, the first half of the channels
encoding the column (x) coordinate and the second half the row (y) coordinate.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from flowfleet.models.layers import linear_at

# --------------------------------------------------------------------------------------------------
#                                   Sinusoidal helpers
# --------------------------------------------------------------------------------------------------


def sincos_1d(dim: int, pos: torch.Tensor) -> torch.Tensor:
    """pos [M] -> [M, dim] as [sin(pos w), cos(pos w)], w_i = 1 / 10000^(i / (dim/2))."""
    omega = torch.arange(dim // 2, dtype=torch.float64) / (dim / 2.0)
    omega = 1.0 / 10000**omega  # [dim/2]
    out = pos.double().reshape(-1)[:, None] * omega[None]  # [M, dim/2]
    return torch.cat([torch.sin(out), torch.cos(out)], dim=1)


def sincos_2d(dim: int, grid_h: int, grid_w: int) -> torch.Tensor:
    """[grid_h * grid_w, dim] fixed position embedding, row-major token order (row, then column)."""
    ys, xs = torch.meshgrid(torch.arange(grid_h), torch.arange(grid_w), indexing="ij")
    emb_x = sincos_1d(dim // 2, xs)  # [H*W, dim/2]  column coordinate
    emb_y = sincos_1d(dim // 2, ys)  # [H*W, dim/2]  row coordinate
    return torch.cat([emb_x, emb_y], dim=1).float()


def timestep_sinusoid(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """t [B] (any real values) -> [B, dim] as [cos(t f), sin(t f)], f_i = max_period^(-i/half)."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t.float()[:, None] * freqs[None]
    emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    if dim % 2:
        emb = torch.cat([emb, torch.zeros_like(emb[:, :1])], dim=-1)
    return emb


# --------------------------------------------------------------------------------------------------
#                                   Embedding layers
# --------------------------------------------------------------------------------------------------


class PatchEmbed(nn.Module):
    """[B, C, H, W] -> [B, (H/p)(W/p), D] with a strided convolution (timm's PatchEmbed)."""

    def __init__(self, in_channels: int, hidden_size: int, patch_size: int):
        super().__init__()
        self.patch_size = patch_size
        self.proj = nn.Conv2d(in_channels, hidden_size, kernel_size=patch_size, stride=patch_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)  # [B, N, D]


class TimestepEmbedder(nn.Module):
    """Scalar timesteps -> [B, D] through a 256-frequency sinusoid and a two-layer MLP."""

    def __init__(self, hidden_size: int, frequency_embedding_size: int = 256):
        super().__init__()
        self.frequency_embedding_size = frequency_embedding_size
        self.mlp = nn.Sequential(
            nn.Linear(frequency_embedding_size, hidden_size, bias=True),
            nn.SiLU(),
            nn.Linear(hidden_size, hidden_size, bias=True),
        )

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        t_freq = timestep_sinusoid(t, self.frequency_embedding_size)  # [B, 256]
        return self.mlp(t_freq.to(linear_at(self.mlp, 0).weight.dtype))  # [B, D]


class LabelEmbedder(nn.Module):
    """Class labels -> [B, D]; row `num_classes` is the null class used for CFG."""

    def __init__(self, num_classes: int, hidden_size: int):
        super().__init__()
        self.num_classes = num_classes
        self.embedding_table = nn.Embedding(num_classes + 1, hidden_size)

    def forward(self, labels: torch.Tensor, drop: torch.Tensor | None) -> torch.Tensor:
        if drop is not None:
            labels = torch.where(drop, torch.full_like(labels, self.num_classes), labels)
        return self.embedding_table(labels)


class PooledTextEmbedder(nn.Module):
    """Pooled text vector [B, T] -> [B, D]; a learned null vector replaces dropped conditions."""

    def __init__(self, text_dim: int, hidden_size: int):
        super().__init__()
        self.null = nn.Parameter(torch.zeros(text_dim))
        self.mlp = nn.Sequential(nn.Linear(text_dim, hidden_size), nn.SiLU(), nn.Linear(hidden_size, hidden_size))

    def forward(self, pooled: torch.Tensor, drop: torch.Tensor | None) -> torch.Tensor:
        if drop is not None:
            pooled = torch.where(drop[:, None], self.null.to(pooled.dtype).expand_as(pooled), pooled)
        return self.mlp(pooled)


class TextTokenProjector(nn.Module):
    """Text tokens [B, L, T] -> [B, L, D] for cross-attention; a learned null sequence replaces
    dropped conditions (PixArt-alpha's y_embedding), with its mask all ones."""

    def __init__(self, text_dim: int, text_len: int, hidden_size: int):
        super().__init__()
        self.text_len = text_len
        self.null = nn.Parameter(torch.randn(text_len, text_dim) / text_dim**0.5)
        self.proj = nn.Sequential(
            nn.Linear(text_dim, hidden_size), nn.GELU(approximate="tanh"), nn.Linear(hidden_size, hidden_size)
        )

    def forward(
        self, tokens: torch.Tensor, mask: torch.Tensor | None, drop: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        b, length, _ = tokens.shape
        if length != self.text_len:
            raise ValueError(f"text tokens have length {length}, model expects text_len={self.text_len}")
        if mask is None:
            mask = torch.ones(b, length, dtype=torch.bool, device=tokens.device)
        mask = mask.bool()
        if drop is not None:
            tokens = torch.where(drop[:, None, None], self.null.to(tokens.dtype).expand_as(tokens), tokens)
            mask = mask | drop[:, None]
        return self.proj(tokens), mask  # [B, L, D], [B, L]
