"""Exact sequence parallelism for self-attention over the bands of an image (xDiT's USP building blocks):
the other layers of a DiT block are token-wise and stay on their band; only attention needs every token.

    ulysses  (DeepSpeed-Ulysses, Jacobs et al. 2023) an all-to-all turns each band's tokens of all H heads
             into every token of H/N heads; attention runs on the whole sequence for those heads; a second
             all-to-all turns the result back into this band's tokens of all heads. Needs H divisible by N.
             Per layer each rank sends (N-1)/N of its q, k, v and of the attention output: 4 (N-1)/N n D.
    ring     (Ring attention, Liu et al. 2023) queries stay on their band; the keys/values of every band
             travel once around the ring (N-1 hops), the next hop in flight while this block's attention
             computes; the blocks are merged by their log-sum-exp (online softmax). Any split.
             Per layer each rank sends its keys/values N-1 times: 2 (N-1) n D.

Both equal the single-device attention up to float reordering (no stale activations, unlike displaced).
Uneven bands travel at their own sizes: every rank knows every band's token count.

Written by hand, not taken from yunchang 0.6.4 or torch 2.13's context_parallel: both compute attention
with the CUDA SDPA kernels (aten::_scaled_dot_product_flash_attention / efficient / cudnn), which have no
CPU implementation (yunchang's Ulysses and Ring both raise NotImplementedError on CPU; torch's ring
handles only those three ops), and yunchang's exchanges assume equal shards. What is left is two
collectives and the log-sum-exp merge.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flowfleet.errors import FlowfleetError
from flowfleet.parallel.comm import CommManager
from flowfleet.parallel.mode import ParallelMode


def check_heads(mode: ParallelMode, heads: int, ranks: int, what: str, option: str = "--parallel ") -> None:
    """One-line error when `mode` cannot split `heads` over `ranks` (Ulysses splits heads); `option` spells
    the setting as the caller's user gave it ("--parallel " on the CLI, "mode=" for parallelize())."""
    if mode is ParallelMode.ULYSSES and heads % ranks:
        raise FlowfleetError(
            f"{option}ulysses: {what} has {heads} attention heads, not divisible by the {ranks} ranks of an "
            f"image (use {option}ring, or a rank count that divides {heads})"
        )


class SequenceAttention:
    """One self-attention layer's exact sequence-parallel core: this band's q, k, v [B, H, n, Dh] -> this
    band's attention output of every head [B, H, n, Dh] (before the output projection).

    Joint attention (SD3, Flux) adds `text`: the prompt's q, k, v [B, H, L, Dh], which every rank holds
    whole. Its queries attend to every image token and the text, and every query attends to the text's
    keys/values; the output is then [B, H, n + L, Dh], the text's rows last, identical on every rank
    (ulysses: each rank's heads come back from the rank that computed them; ring: the text's blocks are
    merged in band order, not in the order they arrived), so a replicated text stream stays replicated."""

    def __init__(self, comm: CommManager, counts: list[int], name: str):
        self.comm = comm
        self.counts = counts  # every band's tokens, in band order
        self.index = comm.bands.rank  # this band
        self.name = name

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mode: ParallelMode,
        text: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        if self.comm.bands.size == 1:  # one band holds every token: the model's own attention
            if text is not None:
                q, k, v = (torch.cat([band, whole], dim=2) for band, whole in zip((q, k, v), text))
            return F.scaled_dot_product_attention(q, k, v)
        if mode is ParallelMode.ULYSSES:
            return self.ulysses(q, k, v, text)
        if mode is ParallelMode.RING:
            return self.ring(q, k, v, text)
        raise ValueError(f"{self.name}: {mode.value} is not a sequence-parallel mode")

    def ulysses(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, text=None) -> torch.Tensor:
        b, heads, n, dh = q.shape
        size = self.comm.bands.size
        h = heads // size  # heads per rank (check_heads made it exact)
        mine = slice(self.index * h, (self.index + 1) * h)
        qkv = torch.stack((q, k, v))  # [3, B, H, n, Dh]
        sent = [qkv[:, :, j * h : (j + 1) * h] for j in range(size)]  # band j gets heads [j h, (j+1) h)
        got = self.comm.all_to_all_bands(sent, [(3, b, h, c, dh) for c in self.counts], f"{self.name} q/k/v")
        full = torch.cat(got, dim=3)  # [3, B, h, N, Dh]: every token of this rank's heads
        length = 0
        if text is not None:  # the text's tokens of these heads: local, every rank holds them
            full = torch.cat([full, torch.stack(text)[:, :, mine]], dim=3)  # [3, B, h, N + L, Dh]
            length = text[0].shape[2]
        out = F.scaled_dot_product_attention(full[0], full[1], full[2])  # [B, h, N + L, Dh]
        image, words = out.split([sum(self.counts), length], dim=2)
        back = [torch.cat([part, words], dim=2) for part in image.split(self.counts, dim=2)]  # band j's + text
        got = self.comm.all_to_all_bands(back, [(b, h, n + length, dh)] * size, f"{self.name} output")
        return torch.cat(got, dim=1)  # [B, H, n + L, Dh]: this band's tokens (and the text), heads in order

    def ring(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, text=None) -> torch.Tensor:
        size = self.comm.bands.size
        b, heads, n, dh = q.shape
        if text is not None:
            q = torch.cat([q, text[0]], dim=2)  # [B, H, n + L, Dh]: the text's queries ride along
        kv = torch.stack((k, v))  # [2, B, H, m, Dh]: the block at hand (this band's first)
        out = lse = None  # this band's rows, merged as the blocks arrive
        words = {}  # source band -> the text rows' (block, lse), merged in band order at the end
        for hop in range(size):
            source = (self.index - hop) % size
            shift = None
            if hop + 1 < size:  # the next block travels while this one computes
                shape = (2, b, heads, self.counts[(source - 1) % size], dh)
                shift = self.comm.ring_shift(kv, shape, f"{self.name} keys/values")
            block, block_lse = _attention_with_lse(q, kv[0], kv[1])
            out, lse = _merge(out, lse, block[:, :, :n], block_lse[:, :, :n])
            words[source] = (block[:, :, n:], block_lse[:, :, n:])
            if shift is not None:
                kv = shift.wait()
        assert out is not None
        if text is not None:
            text_out, text_lse = _attention_with_lse(q, text[1], text[2])  # the text's own keys/values
            out, lse = _merge(out, lse, text_out[:, :, :n], text_lse[:, :, :n])
            merged = (text_out[:, :, n:], text_lse[:, :, n:])
            for source in range(size):
                merged = _merge(*merged, *words[source])
            out = torch.cat([out, merged[0]], dim=2)  # [B, H, n + L, Dh]
        return out.to(q.dtype)


def _merge(out, lse, block: torch.Tensor, block_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial softmax attentions over disjoint key sets, each with its log-sum-exp [.., 1] -> the
    attention over both (online softmax); `out` None: the block alone."""
    if out is None or lse is None:
        return block, block_lse
    merged = torch.logaddexp(lse, block_lse)
    return out * torch.exp(lse - merged) + block * torch.exp(block_lse - merged), merged


def _attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of q [B, H, n, Dh] over one block of keys/values [B, H, m, Dh], in float32, with
    the log-sum-exp of each query's scores [B, H, n, 1] (SDPA's default scale)."""
    scores = (q.float() @ k.float().transpose(-2, -1)) * q.shape[-1] ** -0.5  # [B, H, n, m]
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    return torch.exp(scores - lse) @ v.float(), lse
