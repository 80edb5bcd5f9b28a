"""Attention on one band of rows (DistriFusion, Li et al. 2024, §4): the exchange of keys/values that every
band-parallel self-attention shares (BandKV: the DiT experts' and the diffusers processors'), and the
diffusers attention processors.

    self-attention   this band's queries against the keys/values of the whole image: this band's fresh
                     ones plus the other bands', which the ParallelMode supplies (this step's, blocking;
                     the previous step's, gathered asynchronously; or none for the naive baseline).
                     One comm slot of [B, 2, heads, band tokens, head dim] per layer. In the exact
                     sequence-parallel modes (ulysses, ring) flowfleet.parallel.sequence computes it
                     instead, with collectives of its own and no slot.
    cross-attention  local: this band's queries against the text. The text keys/values are the same on
                     every rank and every step of a run, so they are computed once per prompt tensor and
                     reused (the cache is keyed on that tensor object and its in-place version counter).

The processors mirror diffusers' AttnProcessor2_0 step by step (token reshape, optional group norm, q/k/v
projections, head split, q/k norms, scaled-dot-product attention with the default scale, output
projection, residual, rescale) so that with every band's fresh keys/values the result equals the
single-device layer up to float rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flowfleet.errors import FlowfleetError
from flowfleet.parallel.comm import CommManager
from flowfleet.parallel.mode import ParallelMode
from flowfleet.parallel.sequence import SequenceAttention
from flowfleet.parallel.step import BandStep

# --------------------------------------------------------------------------------------------------
#                               Keys and values of every band
# --------------------------------------------------------------------------------------------------


class BandKV:
    """One self-attention layer's comm slot: this band's fresh keys/values [B, 2, H, n, Dh] -> every band's,
    [B, 2, H, sum of n, Dh] in row order, as the ParallelMode supplies them (this step's, blocking; the
    previous step's, with this step's sent while later layers compute; this band's alone for naive).
    Uneven bands travel padded to the largest band's n and are trimmed on arrival.

    rows: which of the slot's batch rows these samples are (None: the leading ones), so that displaced
    reuses each sample's own previous keys/values when routing changes the batch; prefetch=False skips
    sending this step's (the last step: nobody will read them)."""

    def __init__(self, comm: CommManager, slot: str, index: int):
        self.comm = comm
        self.slot = slot
        self.index = index  # this band
        self._paths = {
            ParallelMode.SYNC: self._sync,
            ParallelMode.DISPLACED: self._displaced,
            ParallelMode.NAIVE: self._naive,
        }

    def __call__(
        self,
        kv: torch.Tensor,
        mode: ParallelMode,
        counts: list[int],
        rows: torch.Tensor | None = None,
        prefetch: bool = True,
    ) -> torch.Tensor:
        return self._paths[mode](kv, counts, rows, prefetch)

    def _merge(self, kv: torch.Tensor, bands: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """This band's fresh K/V + every band's [N, B, 2, H, n, Dh] -> [B, 2, H, sum of n, Dh] (copies)."""
        parts = [kv if r == self.index else bands[r, :, :, :, : counts[r]] for r in range(bands.shape[0])]
        return torch.cat([part.to(kv.dtype) for part in parts], dim=3)

    @staticmethod
    def _padded(kv: torch.Tensor, counts: list[int]) -> torch.Tensor:
        missing = max(counts) - kv.shape[3]
        return F.pad(kv, (0, 0, 0, missing)) if missing else kv  # [B, 2, H, largest n, Dh]

    def _sync(self, kv, counts, rows, prefetch):
        return self._merge(kv, self.comm.gather(self.slot, self._padded(kv, counts), rows), counts)  # blocks

    def _displaced(self, kv, counts, rows, prefetch):
        stale = self.comm.wait(self.slot)  # [N, B_slot, 2, H, n, Dh]: the previous step's K/V
        stale = stale[:, : kv.shape[0]] if rows is None else stale[:, rows]  # a view, or copies (index)
        full = self._merge(kv, stale, counts)  # copies: the receive buffer may be refilled from here on
        if prefetch:
            self.comm.enqueue(self.slot, self._padded(kv, counts), rows)  # gathered while later layers compute
        return full

    def _naive(self, kv, counts, rows, prefetch):
        return kv  # this band only: no interaction between bands


# --------------------------------------------------------------------------------------------------
#                        Shared pieces of diffusers' AttnProcessor2_0
# --------------------------------------------------------------------------------------------------


def _tokens(attn, hidden_states: torch.Tensor) -> torch.Tensor:
    """[B, C, h, W] or [B, n, C] -> [B, n, C], after the layer's optional group norm."""
    if hidden_states.ndim == 4:
        b, c, h, w = hidden_states.shape
        hidden_states = hidden_states.view(b, c, h * w).transpose(1, 2)  # [B, n, C]
    if attn.group_norm is not None:
        hidden_states = attn.group_norm(hidden_states.transpose(1, 2)).transpose(1, 2)
    return hidden_states


def _heads(attn, t: torch.Tensor) -> torch.Tensor:
    """[B, n, heads * Dh] -> [B, heads, n, Dh]."""
    b, n, inner = t.shape
    return t.view(b, n, attn.heads, inner // attn.heads).transpose(1, 2)


def _finish(attn, out: torch.Tensor, residual: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Attention output [B, heads, n, Dh] -> the layer's output, shaped like its input `residual`."""
    b, heads, n, dh = out.shape
    out = out.transpose(1, 2).reshape(b, n, heads * dh).to(dtype)  # [B, n, inner]
    out = attn.to_out[1](attn.to_out[0](out))  # projection, dropout
    if residual.ndim == 4:
        out = out.transpose(-1, -2).reshape(residual.shape)  # [B, C, h, W]
    if attn.residual_connection:
        out = out + residual
    return out / attn.rescale_output_factor


# --------------------------------------------------------------------------------------------------
#                                        Self-attention
# --------------------------------------------------------------------------------------------------


class SelfAttentionBand:
    """Processor for a self-attention layer: local queries, every band's keys/values (BandKV)."""

    def __init__(self, name: str, step: BandStep):
        self.name = name
        self.slot = f"{name}.kv"
        self.step = step
        self.kv = BandKV(step.comm, self.slot, step.index)

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, **kwargs):
        if encoder_hidden_states is not None or attention_mask is not None:
            raise FlowfleetError(
                f"layer {self.name}: patch-parallel self-attention takes no encoder states or attention mask"
            )
        residual = hidden_states
        x = _tokens(attn, hidden_states)  # [B, n, C]: this band's tokens
        q = _heads(attn, attn.to_q(x))  # [B, H, n, Dh]
        k = _heads(attn, attn.to_k(x))
        v = _heads(attn, attn.to_v(x))
        if attn.norm_q is not None:
            q = attn.norm_q(q)
        if attn.norm_k is not None:
            k = attn.norm_k(k)
        if self.step.exchange.sequence:  # ulysses, ring (transformers): exact, no slot
            return _finish(attn, self.sequence(q, k, v), residual, q.dtype)
        kv_all = self.all_bands(torch.stack((k, v), dim=1))  # [B, 2, H, N*n (n for naive), Dh]
        out = F.scaled_dot_product_attention(q, kv_all[:, 0], kv_all[:, 1])  # [B, H, n, Dh]
        return _finish(attn, out, residual, q.dtype)

    def sequence(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, text=None) -> torch.Tensor:
        """Exact sequence-parallel attention (the step's mode: ulysses, ring or usp) of this band's q, k, v
        [B, H, n, Dh], with a joint attention's text q, k, v [B, H, L, Dh] (held by every rank) ->
        [B, H, n (+ L), Dh], the text's rows last (flowfleet.parallel.sequence)."""
        assert self.step.mesh is not None, "a sequence-parallel mode needs the model's SequenceMesh"
        return SequenceAttention(self.step.comm, self.step.counts(q.shape[2]), self.name, self.step.mesh)(q, k, v, text)

    def all_bands(self, kv: torch.Tensor) -> torch.Tensor:
        """This band's fresh keys/values [B, 2, H, n, Dh] -> every band's, [B, 2, H, sum of n, Dh]; the slot is
        declared while the model records its slots."""
        counts = self.step.counts(kv.shape[3])
        self.step.declare(self.slot, (kv.shape[1], kv.shape[2], max(counts), kv.shape[4]))
        return self.kv(kv, self.step.exchange, counts)


# --------------------------------------------------------------------------------------------------
#                                       Cross-attention
# --------------------------------------------------------------------------------------------------


class CrossAttentionBand:
    """Processor for a cross-attention layer: local queries against cached text keys/values."""

    def __init__(self, name: str):
        self.name = name
        self._text: torch.Tensor | None = None  # the encoder states the cache was computed from (kept alive)
        self._key: tuple[int, ...] = ()
        self._kv: tuple[torch.Tensor, torch.Tensor] | None = None

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, **kwargs):
        if encoder_hidden_states is None:
            raise FlowfleetError(f"layer {self.name}: cross-attention called without encoder hidden states")
        residual = hidden_states
        x = _tokens(attn, hidden_states)  # [B, n, C]
        b, length = encoder_hidden_states.shape[0], encoder_hidden_states.shape[1]
        if attention_mask is not None:  # a text mask, as AttnProcessor2_0 shapes it
            attention_mask = attn.prepare_attention_mask(attention_mask, length, b)
            attention_mask = attention_mask.view(b, attn.heads, -1, attention_mask.shape[-1])
        q = _heads(attn, attn.to_q(x))  # [B, H, n, Dh]
        if attn.norm_q is not None:
            q = attn.norm_q(q)
        k, v = self._text_kv(attn, encoder_hidden_states)  # [B, H, L, Dh] each
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)  # [B, H, n, Dh]
        return _finish(attn, out, residual, q.dtype)

    def _text_kv(self, attn, text: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Same tensor object, not modified in place since, same projection weights -> same keys/values.
        key = (text._version, attn.to_k.weight._version, attn.to_v.weight._version)
        if self._kv is None or self._text is not text or self._key != key:
            states = attn.norm_encoder_hidden_states(text) if attn.norm_cross else text
            k = _heads(attn, attn.to_k(states))  # [B, H, L, Dh]
            v = _heads(attn, attn.to_v(states))
            if attn.norm_k is not None:
                k = attn.norm_k(k)
            self._text, self._key, self._kv = text, key, (k, v)
        return self._kv

    def clear(self) -> None:
        self._text, self._key, self._kv = None, (), None
