"""Transformer pieces of the DiT: attention, MLP, adaLN-Zero / adaLN-single blocks, output layers.

Self-attention keeps q/k/v in one `qkv` projection like the DiT reference; `forward_qkv` and
`attend` are split so that patch-parallel wrappers (flowfleet.parallel) can substitute the keys
and values of other image bands without copying this code.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """adaLN: x * (1 + scale) + shift, with per-sample shift/scale [B, D] broadcast over tokens."""
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


def linear_at(seq: nn.Sequential, index: int) -> nn.Linear:
    """The nn.Linear at `index` of `seq` (indexing a Sequential is typed as returning any Module)."""
    layer = seq[index]
    assert isinstance(layer, nn.Linear), f"{type(layer).__name__} at {index} is not nn.Linear"
    return layer


def zero_(layer: nn.Linear | nn.Conv2d) -> None:
    """Zero a layer's weight and bias (adaLN-Zero's modulation, the final layer)."""
    nn.init.zeros_(layer.weight)
    if layer.bias is not None:
        nn.init.zeros_(layer.bias)


class SelfAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=True)
        self.proj = nn.Linear(dim, dim, bias=True)

    def forward_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, n, d = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.num_heads, d // self.num_heads)  # [B, N, 3, H, Dh]
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [B, H, N, Dh]
        return q, k, v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.project(F.scaled_dot_product_attention(q, k, v))  # [B, Nq, D]

    def project(self, out: torch.Tensor) -> torch.Tensor:
        """Every head's attention output [B, H, Nq, Dh] -> [B, Nq, D]."""
        b, h, n, dh = out.shape
        return self.proj(out.transpose(1, 2).reshape(b, n, h * dh))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attend(*self.forward_qkv(x))


class CrossAttention(nn.Module):
    """Queries from image tokens, keys/values from (projected) text tokens; key padding mask."""

    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.q = nn.Linear(dim, dim, bias=True)
        self.kv = nn.Linear(dim, dim * 2, bias=True)
        self.proj = nn.Linear(dim, dim, bias=True)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        b, n, d = x.shape
        h, dh = self.num_heads, d // self.num_heads
        q = self.q(x).reshape(b, n, h, dh).transpose(1, 2)  # [B, H, N, Dh]
        kv = self.kv(ctx).reshape(b, ctx.shape[1], 2, h, dh).permute(2, 0, 3, 1, 4)  # [2, B, H, L, Dh]
        attn_mask = None if mask is None else mask[:, None, None, :]  # [B, 1, 1, L] True = attend
        out = F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=attn_mask)
        return self.proj(out.transpose(1, 2).reshape(b, n, d))


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str = "gelu_tanh"):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU(approximate="tanh" if act == "gelu_tanh" else "none")
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class DiTBlock(nn.Module):
    """adaLN-Zero block: x + g1 * MSA(mod(LN x)) [+ CrossAttn(LN x, text)] + g2 * MLP(mod(LN x)), with
    dropout on the MSA and MLP outputs while training (`dropout`, 0 by default as in DiT).

    adaln="zero": a per-block SiLU+Linear maps the conditioning vector c [B, D] to 6 chunks.
    adaln="single" (PixArt-alpha): the caller passes one global modulation [B, 6D] and the block adds
    its learned table [6, D].
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        mlp_ratio: float,
        adaln: str,
        cross_attn: bool,
        cross_norm: bool = True,
        mlp_act: str = "gelu_tanh",
        dropout: float = 0.0,
    ):
        super().__init__()
        self.adaln = adaln
        # on the attention and MLP outputs; identity in eval(). At p = 0 none at all: a training-mode Dropout(0) still
        # copies its input (two clones a block) to the same values
        self.drop = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.attn = SelfAttention(dim, num_heads)
        self.cross_attn = CrossAttention(dim, num_heads) if cross_attn else None
        self.norm_cross = nn.LayerNorm(dim, eps=1e-6) if cross_attn and cross_norm else None
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), mlp_act)
        if adaln == "zero":
            self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim, bias=True))
        else:
            self.scale_shift_table = nn.Parameter(torch.zeros(6, dim))

    def modulation(self, c: torch.Tensor) -> list[torch.Tensor]:
        """c [B, D] (zero) or [B, 6D] (single) -> six [B, D] chunks."""
        if self.adaln == "zero":
            return list(self.adaLN_modulation(c).chunk(6, dim=1))
        mod = self.scale_shift_table[None] + c.reshape(c.shape[0], 6, -1)  # [B, 6, D]
        return list(mod.unbind(1))

    def forward(self, x: torch.Tensor, c: torch.Tensor, ctx=None, ctx_mask=None, attn=None) -> torch.Tensor:
        """`attn` (default self.attn) is the self-attention callable [B, N, D] -> [B, N, D]; patch-parallel
        wrappers (flowfleet.parallel.dit) pass one whose keys/values also cover the other image bands."""
        attn = self.attn if attn is None else attn
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.modulation(c)
        x = x + gate_msa.unsqueeze(1) * self.drop(attn(modulate(self.norm1(x), shift_msa, scale_msa)))  # [B, N, D]
        if self.cross_attn is not None:
            queries = self.norm_cross(x) if self.norm_cross is not None else x  # [B, N, D]
            x = x + self.cross_attn(queries, ctx, ctx_mask)  # [B, N, D]
        x = x + gate_mlp.unsqueeze(1) * self.drop(self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp)))  # [B, N, D]
        return x


class FinalLayer(nn.Module):
    """adaLN-modulated LayerNorm then a linear map of each token to a p*p*C patch."""

    def __init__(self, dim: int, patch_size: int, out_channels: int, adaln: str):
        super().__init__()
        self.adaln = adaln
        self.norm_final = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(dim, patch_size * patch_size * out_channels, bias=True)
        if adaln == "zero":
            self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 2 * dim, bias=True))
        else:
            self.scale_shift_table = nn.Parameter(torch.randn(2, dim) / dim**0.5)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        if self.adaln == "zero":
            shift, scale = self.adaLN_modulation(c).chunk(2, dim=1)
        else:
            shift, scale = (self.scale_shift_table[None] + c[:, None]).unbind(1)
        return self.linear(modulate(self.norm_final(x), shift, scale))  # [B, N, p*p*C]


class ClassifierHead(nn.Module):
    """Router output: adaLN-modulated LayerNorm, mean over tokens, linear to K logits."""

    def __init__(self, dim: int, num_outputs: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 2 * dim, bias=True))
        self.head = nn.Linear(dim, num_outputs, bias=True)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=1)
        pooled = modulate(self.norm(x), shift, scale).mean(dim=1)  # [B, D]
        return self.head(pooled)  # [B, K]


def projector(width: int, hidden: int, out: int) -> nn.Sequential:
    """REPA's projector: a three-layer MLP with SiLU from the model's hidden tokens to an encoder's token width."""
    return nn.Sequential(
        nn.Linear(width, hidden), nn.SiLU(), nn.Linear(hidden, hidden), nn.SiLU(), nn.Linear(hidden, out)
    )
