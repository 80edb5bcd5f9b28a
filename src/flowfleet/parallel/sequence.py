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

    usp      (xDiT's Unified Sequence Parallelism, Fang & Zhao 2024) both at once on a U x R mesh of bands:
             Ulysses inside each group of U consecutive bands (a contiguous chunk of the sequence, H/U
             heads per rank), then ring attention across the R = N / U groups, among the ranks that hold
             the same heads. Needs H and N divisible by U. Per layer: 4 (U-1)/U n D + 2 (R-1) n D.

All equal the single-device attention up to float reordering (no stale activations, unlike displaced).
Uneven bands travel at their own sizes: every rank knows every band's token count. One code path serves
the three: a SequenceMesh whose Ulysses group is every band (ulysses) or one (ring), or a U x R split.

Written by hand, not taken from yunchang 0.6.4 or torch 2.13's context_parallel: both compute attention
with the CUDA SDPA kernels (aten::_scaled_dot_product_flash_attention / efficient / cudnn), which have no
CPU implementation (yunchang's Ulysses and Ring both raise NotImplementedError on CPU; torch's ring
handles only those three ops), and yunchang's exchanges assume equal shards. What is left is two
collectives and the log-sum-exp merge.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flowfleet.distributed import Group, split_group
from flowfleet.errors import ParameterError
from flowfleet.parallel.comm import CommManager
from flowfleet.parallel.mode import ParallelMode


def check_heads(mode: ParallelMode, heads: int, ranks: int, what: str, parameter: str = "parallel") -> None:
    """One-line error when `mode` cannot split `heads` over `ranks` (Ulysses splits heads); `parameter` names the
    setting as the caller has it ("parallel" for the sampler, "mode" for parallelize())."""
    if mode is ParallelMode.ULYSSES and heads % ranks:
        raise ParameterError(
            f"{parameter} ulysses",
            f"{what} has {heads} attention heads, not divisible by the {ranks} ranks of an image (use {parameter} "
            f"ring, or a rank count that divides {heads})",
        )


def ulysses_degree(mode: ParallelMode, bands: int, heads: list[int], requested: int | None, option: str) -> int:
    """The Ulysses degree U of `mode` on `bands` bands of models with these head counts: every band (ulysses),
    1 (ring), or for usp the requested U (None: the largest that divides the bands and every model's heads,
    so that as much as possible goes through the all-to-all, which sends the fewest bytes); one-line errors
    for a degree that does not divide them. `option` names the setting ("ulysses_degree")."""
    if requested is not None and mode is not ParallelMode.USP:
        raise ParameterError(option, f"only with usp (got {mode.value})")
    if mode is ParallelMode.ULYSSES:
        return bands
    if mode is not ParallelMode.USP:
        return 1
    if requested is None:
        return math.gcd(bands, *heads)
    if requested < 1 or bands % requested:
        raise ParameterError(f"{option} {requested}", f"must divide the {bands} bands of an image")
    bad = sorted({h for h in heads if h % requested})
    if bad:
        raise ParameterError(f"{option} {requested}", f"must divide every attention layer's heads (some have {bad[0]})")
    return requested


@dataclass(frozen=True)
class SequenceMesh:
    """How the bands of one image share the sequence: `ulysses`, this rank's group of U consecutive bands
    (an all-to-all over heads inside it), and `ring`, its group of the R = N / U bands at the same place in
    every Ulysses group (they hold the same heads of different chunks: keys/values travel around it)."""

    ulysses: Group
    ring: Group

    @classmethod
    def build(cls, bands: Group, degree: int, timeout_s: float = 60.0) -> "SequenceMesh":
        """Collective: every rank of `bands` calls it with the same degree U (1 = ring, N = ulysses)."""
        ring_size = bands.size // degree
        ulysses = split_group(bands, degree, timeout_s)
        ring = split_group(bands, ring_size, timeout_s, strided=True)
        return cls(ulysses, ring)

    @classmethod
    def plain(cls, bands: Group, mode: ParallelMode) -> "SequenceMesh":
        """ulysses or ring, which need no process group of their own: every band in the one Ulysses group, or
        in the one ring (a single band: neither). usp splits the bands: SequenceMesh.build."""
        if bands.size == 1:
            return cls(Group.solo(), Group.solo())
        if mode is ParallelMode.ULYSSES:
            return cls(bands, Group.solo())
        if mode is ParallelMode.RING:
            return cls(Group.solo(), bands)
        raise ValueError(f"{mode.value} on {bands.size} bands needs SequenceMesh.build (its subgroups)")

    def describe(self) -> str:
        return f"ulysses degree {self.ulysses.size} x ring degree {self.ring.size}"


class SequenceAttention:
    """One self-attention layer's exact sequence-parallel core: this band's q, k, v [B, H, n, Dh] -> this
    band's attention output of every head [B, H, n, Dh] (before the output projection).

    Joint attention (SD3, Flux) adds `text`: the prompt's q, k, v [B, H, L, Dh], which every rank holds
    whole. Its queries attend to every image token and the text, and every query attends to the text's
    keys/values; the output is then [B, H, n + L, Dh], the text's rows last, identical on every rank
    (Ulysses: each rank's heads come back from the rank that computed them; ring: the text's blocks are
    merged in chunk order, not in the order they arrived), so a replicated text stream stays replicated."""

    def __init__(self, comm: CommManager, counts: list[int], name: str, mesh: SequenceMesh):
        self.comm = comm
        self.counts = counts  # every band's tokens, in band order
        self.name = name
        self.mesh = mesh
        u = mesh.ulysses.size
        first = comm.bands.rank - mesh.ulysses.rank  # this Ulysses group's first band
        self.group_counts = counts[first : first + u]  # its bands' tokens
        self.chunks = [sum(counts[g * u : (g + 1) * u]) for g in range(mesh.ring.size)]  # tokens per group

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        text: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        b, heads, n, dh = q.shape
        length = 0 if text is None else text[0].shape[2]
        u = self.mesh.ulysses
        if u.size > 1:  # this group's chunk of the sequence, for H / U heads
            q, k, v = self._scatter_heads(torch.stack((q, k, v)))
            if text is not None:
                h = heads // u.size
                mine = slice(u.rank * h, (u.rank + 1) * h)
                text = (text[0][:, mine], text[1][:, mine], text[2][:, mine])
        if self.mesh.ring.size > 1:
            out = self._ring(q, k, v, text)  # [B, h, chunk + L, Dh]
        else:
            if text is not None:
                q, k, v = (torch.cat([mine, words], dim=2) for mine, words in zip((q, k, v), text))
            out = F.scaled_dot_product_attention(q, k, v)  # [B, h, chunk + L, Dh]
        if u.size > 1:
            out = self._gather_heads(out, n, length)
        return out  # [B, H, n + L, Dh]

    def _scatter_heads(self, qkv: torch.Tensor) -> torch.Tensor:
        """[3, B, H, n, Dh] of this band -> [3, B, H/U, chunk, Dh]: its Ulysses group's tokens of its heads."""
        _, b, heads, _, dh = qkv.shape
        group = self.mesh.ulysses
        h = heads // group.size  # heads per rank (check_heads / ulysses_degree made it exact)
        sent = [qkv[:, :, j * h : (j + 1) * h] for j in range(group.size)]  # member j gets heads [j h, (j+1) h)
        shapes: list[tuple[int, ...]] = [(3, b, h, c, dh) for c in self.group_counts]
        got = self.comm.all_to_all_bands(sent, shapes, f"{self.name} q/k/v", group=group)
        return torch.cat(got, dim=3)

    def _gather_heads(self, out: torch.Tensor, n: int, length: int) -> torch.Tensor:
        """[B, H/U, chunk + L, Dh] of these heads -> [B, H, n + L, Dh]: this band's tokens and the text, of
        every head (the text's rows of each head come from the member that computed them)."""
        b, h, _, dh = out.shape
        group = self.mesh.ulysses
        image, words = out.split([sum(self.group_counts), length], dim=2)
        back = [torch.cat([part, words], dim=2) for part in image.split(self.group_counts, dim=2)]
        got = self.comm.all_to_all_bands(
            back, [(b, h, n + length, dh)] * group.size, f"{self.name} output", group=group
        )
        return torch.cat(got, dim=1)

    def _ring(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, text=None) -> torch.Tensor:
        """Queries of this rank's chunk (and the text's) against every chunk's keys/values, which travel once
        around the ring group -> [B, h, chunk + L, Dh]."""
        ring = self.mesh.ring
        b, heads, n, dh = q.shape
        if text is not None:
            q = torch.cat([q, text[0]], dim=2)  # [B, h, n + L, Dh]: the text's queries ride along
        kv = torch.stack((k, v))  # [2, B, h, m, Dh]: the chunk at hand (this rank's first)
        out = lse = None  # this chunk's rows, merged as the blocks arrive
        words = {}  # source chunk -> the text rows' (block, lse), merged in chunk order at the end
        for hop in range(ring.size):
            source = (ring.rank - hop) % ring.size
            shift = None
            if hop + 1 < ring.size:  # the next block travels while this one computes
                shape = (2, b, heads, self.chunks[(source - 1) % ring.size], dh)
                shift = self.comm.ring_shift(kv, shape, f"{self.name} keys/values", group=ring)
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
            for source in range(ring.size):
                merged = _merge(*merged, *words[source])
            out = torch.cat([out, merged[0]], dim=2)  # [B, h, n + L, Dh]
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
