"""Per-sample top-k execution (paris §2.7, Eq. 13-15): run each selected expert only on its samples.

Given routing indices [B, k] and renormalised weights [B, k] (flowfleet.flow.routing_weights), the
samples are grouped by expert. Each expert that at least one sample selected runs once, on exactly
the samples that selected it (with their conditional and unconditional rows batched together when
classifier-free guidance is on), and its guided velocity is added to those samples' output with their
weights. No expert ever runs on a sample that did not select it, and unselected experts never run.
Because the ensemble and CFG are both linear, guiding per expert then combining equals combining then
guiding, which is what paris Eq. 14 with CFG on all channels asks for.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, fields, replace

import torch

from flowfleet.flow import guided_velocity, routing_weights
from flowfleet.flow.ensemble import dense_weights
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
    cfg_scale: float,
    guided: bool,
    stats: ExecutionStats | None = None,
    cache: BlockCache | None = None,
) -> torch.Tensor:
    """sum_j w[b, j] * v_{e[b, j]}(x_b, t_b) for every sample b, running each expert only on its samples.

    x [B, C, H, W], t [B]. With `guided`, each expert sees [its samples; the same samples with
    drop=True] in one batch (flowfleet.flow.guided_velocity).
    """
    b = x.shape[0]
    out = torch.zeros_like(x)
    chosen = selection.experts  # [B, k]
    dense = dense_weights(chosen, selection.weights, store.num_experts)  # [B, K], zeros where not selected
    used = torch.unique(chosen).tolist()
    # Resident experts first, so that an --offload bound does not release one that this step still needs.
    used.sort(key=lambda k: (not store.is_resident(k), k))
    for k in used:
        rows = (chosen == k).any(dim=1).nonzero(as_tuple=True)[0]  # [n_k]
        n = rows.numel()
        xk, tk, ck = x[rows], t[rows], cond.select(rows)
        expert = store.get(k)
        if cache is not None:  # the first-block rule per sample row ([cond rows; uncond rows] when guided)
            expert = cache.bind(k, expert, torch.cat([rows, rows + b]) if guided else rows)
        if guided:
            vk = guided_velocity(expert, xk, tk, ck.kwargs(), cfg_scale)  # [n_k, C, H, W]
        else:
            vk = expert(xk, tk, **ck.kwargs())  # [n_k, C, H, W]
        if stats is not None:
            stats.record(k, (2 if guided else 1) * n)
        w = dense[rows, k].to(vk.dtype).reshape(n, *([1] * (x.ndim - 1)))  # [n_k, 1, 1, 1]
        out.index_add_(0, rows, w * vk)
    return out
