"""Per-sample top-k execution (paris §2.7, Eq. 13-15): run each selected expert only on its samples.

Given routing indices [B, k] and renormalised weights [B, k] (flowfleet.flow.routing_weights), the
samples are grouped by expert. With classifier-free guidance each branch has its own selection: the
conditional rows routed by p(k | x_t, t, c), the unconditional ones by p(k | x_t, t, null) (guidance over the
mixture, flowfleet.flow.guided_mixture), or both by the first (guidance inside each expert: the only rule
under a prompt-blind router, where the two posteriors are one). Each expert that some row selected runs
once, on exactly the rows that selected it (conditional and unconditional batched together), and its
velocities are added to each branch's mixture with that branch's weights; the branches are combined
last. No expert ever runs on a row that did not select it, and unselected experts never run.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass, field, fields, replace

import torch

from flowfleet.flow import cfg_combine, routing_weights
from flowfleet.flow.ensemble import dense_weights, draw_experts
from flowfleet.sampling.cache import BlockCache, CacheStats
from flowfleet.sampling.store import ExpertStore

# --------------------------------------------------------------------------------------------------
#                                      Conditioning
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Condition:
    """Per-sample conditioning in the model-call convention of docs/contracts.md (batch-first or None)."""

    text_tokens: torch.Tensor | None = None  # [B, L, T]
    text_mask: torch.Tensor | None = None  # [B, L] bool
    text_pooled: torch.Tensor | None = None  # [B, T]
    labels: torch.Tensor | None = None  # [B] int64

    def _tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def select(self, rows: torch.Tensor) -> "Condition":
        """The conditioning of some samples (rows: index tensor)."""
        return replace(self, **{name: t[rows] for name, t in self._tensors().items()})

    def kwargs(self) -> dict[str, torch.Tensor]:
        return self._tensors()


# --------------------------------------------------------------------------------------------------
#                                        Routing
# --------------------------------------------------------------------------------------------------


def present_probs(logits: torch.Tensor, present: tuple[int, ...]) -> torch.Tensor:
    """Router logits [B, K] -> probabilities [B, P] renormalised over the present experts.

    softmax over the present experts' logits equals p(k) / sum_{j present} p(j): the router's
    distribution conditioned on the expert being available (partial assembly).
    """
    idx = torch.as_tensor(present, device=logits.device)
    return torch.softmax(logits.index_select(1, idx).double(), dim=1).to(logits.dtype)  # [B, P]


@dataclass
class Selection:
    """Which experts each sample uses at one step: global expert ids [B, k] and weights [B, k] (sum 1)."""

    experts: torch.Tensor  # [B, k] int64, global expert ids
    weights: torch.Tensor  # [B, k]
    probs: torch.Tensor  # [B, K] router probabilities over all K (0 for absent experts)


def select_experts(probs_present: torch.Tensor, present: tuple[int, ...], num_experts: int, k: int) -> Selection:
    """Top-k of the present experts per sample, weights renormalised over the top-k (Eq. 13-15)."""
    local, weights = routing_weights(probs_present, k)  # [B, k] indices into `present`, [B, k]
    ids = torch.as_tensor(present, device=local.device)[local]  # [B, k] global ids
    probs = probs_present.new_zeros(probs_present.shape[0], num_experts)
    probs[:, list(present)] = probs_present
    return Selection(ids, weights, probs)


def draw_selection(
    probs_present: torch.Tensor, present: tuple[int, ...], num_experts: int, x1: torch.Tensor
) -> Selection:
    """The trajectory sampler's choice: one expert per sample drawn from the router's posterior [B, P], weight 1.

    Each sample's uniform is read off its own starting noise x1 [B, ...] (the first 8 bytes of the SHA-256 of its
    bytes): a seed's noise fixes its draw in any batch split, alone or batched with other requests, and through
    every door that draws noise from a seed (generate, serve, diffusers' generator), with no second random stream
    to carry beside the noise."""
    rows = x1.detach().cpu().contiguous().reshape(x1.shape[0], -1)
    uniforms = torch.tensor(
        [int.from_bytes(hashlib.sha256(row.numpy().tobytes()).digest()[:8], "big") / 2.0**64 for row in rows],
        dtype=torch.float64,
    )
    local = draw_experts(probs_present, uniforms.to(probs_present.device))  # [B, 1] into `present`
    ids = torch.as_tensor(present, device=local.device)[local]  # [B, 1] global ids
    probs = probs_present.new_zeros(probs_present.shape[0], num_experts)
    probs[:, list(present)] = probs_present
    return Selection(ids, torch.ones_like(ids, dtype=probs_present.dtype), probs)


# --------------------------------------------------------------------------------------------------
#                                   Grouped expert execution
# --------------------------------------------------------------------------------------------------


@dataclass
class ExecutionStats:
    """What ran: forward calls and rows (samples incl. CFG halves) per expert, over a whole sampling run."""

    calls: Counter[int] = field(default_factory=Counter)
    rows: Counter[int] = field(default_factory=Counter)
    batch_sizes: dict[int, list[int]] = field(default_factory=dict)
    cache: CacheStats = field(default_factory=CacheStats)  # block evaluations run / skipped (--cache)

    def record(self, k: int, rows: int) -> None:
        self.calls[k] += 1
        self.rows[k] += rows
        self.batch_sizes.setdefault(k, []).append(rows)


def run_selected(
    store: ExpertStore,
    x: torch.Tensor,
    t: torch.Tensor,
    cond: Condition,
    selection: Selection,
    guidance_scale: float,
    guided: bool,
    stats: ExecutionStats | None = None,
    cache: BlockCache | None = None,
    uncond: Selection | None = None,
) -> torch.Tensor:
    """The fleet's velocity for every sample b, running each expert only on the rows that selected it.

    Unguided: sum_j w[b, j] v_{e[b, j]}(x_b | c). Guided (flowfleet.flow.guided_mixture, computed sparsely):
    sum_k w_u v_k(x | null) + s (sum_k w_c v_k(x | c) - sum_k w_u v_k(x | null)), w_c from `selection`, w_u from
    `uncond` (the unconditional branch's own top-k: guidance over the mixture) or, when None, from `selection` too
    (guidance inside each expert, the same field). Each expert runs once per evaluation, on [the samples that
    selected it under the prompt; those that selected it without] with drop=True on the second rows.
    x [B, C, H, W], t [B]."""
    b = x.shape[0]
    branches = [selection, uncond or selection] if guided else [selection]
    outs = [torch.zeros_like(x) for _ in branches]
    dense = [dense_weights(s.experts, s.weights, store.num_experts) for s in branches]  # [B, K] each
    used = torch.unique(torch.cat([s.experts.flatten() for s in branches])).tolist()
    # Resident experts first, so that an --offload bound does not release one that this step still needs.
    used.sort(key=lambda k: (not store.is_resident(k), k))
    for k in used:
        rows = [(s.experts == k).any(dim=1).nonzero(as_tuple=True)[0] for s in branches]  # [n_k] per branch
        both = torch.cat(rows)  # [n_c + n_u]
        kwargs = cond.select(both).kwargs()
        if guided:
            kwargs["drop"] = torch.arange(both.numel(), device=x.device) >= rows[0].numel()  # the null rows
        expert = store.get(k)
        if cache is not None:  # the first-block rule per sample row ([cond rows; uncond rows] when guided)
            expert = cache.bind(k, expert, torch.cat([r + i * b for i, r in enumerate(rows)]))
        v = expert(x[both], t[both], **kwargs)  # [n_c + n_u, C, H, W]
        if stats is not None:
            stats.record(k, both.numel())
        for out, w, r, vk in zip(outs, dense, rows, v.split([r.numel() for r in rows])):
            out.index_add_(0, r, w[r, k].to(vk.dtype).reshape(-1, *([1] * (x.ndim - 1))) * vk)
    return cfg_combine(outs[0], outs[1], guidance_scale) if guided else outs[0]
