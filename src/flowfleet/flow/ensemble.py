"""Combining expert velocities (paris Eq. 13-15).

routing_weights turns router probabilities [B, K] into a per-sample selection: the indices of the
experts that must run for each sample and their weights (renormalised over the selection, so they
sum to 1). combine() applies them. The routed pipeline groups samples by expert so that only the
selected experts ever run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class Strategy:
    """top-k routing; k == K (or `full`) is the full ensemble; `trajectory`: one expert per image, drawn once from
    the router's posterior under the prompt at the first step and kept to the end (DDM's oracle sampler, the expert
    chosen by the router instead of the image's cluster label). A name is parsed into one where it enters
    (Strategy.parse: the sampling settings' and the distillation's field type, evaluate's options) and travels as
    this value; its text is `name`."""

    k: int | None  # None = all experts ("full")
    name: str
    kept: bool = False  # trajectory: the first step's choice is kept, never routed again

    def __str__(self) -> str:
        return self.name

    @classmethod
    def parse(cls, text: "str | Strategy") -> "Strategy":
        """'top1' | 'top2' | 'topk:K' | 'full' | 'trajectory' -> Strategy (a Strategy as it is); anything else is a
        one-line ValueError."""
        if isinstance(text, Strategy):
            return text
        s = str(text).strip().lower()
        if s == "full":
            return cls(None, "full")
        if s == "trajectory":
            return cls(1, "trajectory", kept=True)
        k_text = None
        if s.startswith("topk:"):
            k_text = s[5:]
        elif s.startswith("top") and s[3:].isdigit():
            k_text = s[3:]
        if k_text is None or not k_text.isdigit() or int(k_text) < 1:
            raise ValueError(f"unknown strategy {text!r} (expected top1, top2, topk:K, full or trajectory)")
        return cls(int(k_text), s)

    def resolve_k(self, num_experts: int) -> int:
        if self.k is None:
            return num_experts
        if self.k > num_experts:
            raise ValueError(f"strategy {self.name!r}: k={self.k} exceeds the {num_experts} experts present")
        return self.k


def same_as_earlier(strategies: Sequence[Strategy], num_experts: int) -> dict[str, str]:
    """Each strategy that selects the same experts with the same weights as an earlier one in the list
    -> that earlier one (top-k with k >= K is the full ensemble: with K = 2, top2 and full are one model).
    Strategies that are a model of their own are not keys."""
    first: dict[tuple[int, bool], str] = {}  # (experts per sample, kept) -> the first strategy of that kind
    same = {}
    for strategy in strategies:
        kind = (strategy.resolve_k(num_experts), strategy.kept)
        if kind in first:
            same[strategy.name] = first[kind]
        else:
            first[kind] = strategy.name
    return same


def routing_weights(probs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """probs [B, K] -> (indices [B, k], weights [B, k]); weights renormalised to sum to 1 per sample.
    With k = 1 the weight is exactly 1 on the argmax expert."""
    if not 1 <= k <= probs.shape[1]:
        raise ValueError(f"k={k} outside 1..{probs.shape[1]}")
    top_p, top_i = probs.topk(k, dim=1)
    weights = top_p / top_p.sum(dim=1, keepdim=True).clamp_min(torch.finfo(probs.dtype).tiny)
    return top_i, weights


def draw_experts(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One expert per sample drawn from probs [B, K] by inverse CDF with uniforms [B] in [0, 1) -> indices [B, 1]."""
    cdf = probs.double().cumsum(dim=1)  # [B, K]
    cdf = cdf / cdf[:, -1:].clamp_min(torch.finfo(torch.float64).tiny)
    picked = torch.searchsorted(cdf, uniforms.to(cdf)[:, None], right=True)  # [B, 1]
    return picked.clamp_max(probs.shape[1] - 1)


def dense_weights(indices: torch.Tensor, weights: torch.Tensor, num_experts: int) -> torch.Tensor:
    """(indices [B, k], weights [B, k]) -> dense [B, K] with zeros for unselected experts."""
    dense = torch.zeros(indices.shape[0], num_experts, dtype=weights.dtype, device=weights.device)
    return dense.scatter(1, indices, weights)


def combine(velocities: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """velocities [K, B, ...] and dense weights [B, K] -> sum_k w[b, k] v[k, b]  ([B, ...])."""
    w = weights.transpose(0, 1).reshape(*weights.shape[::-1], *([1] * (velocities.ndim - 2)))
    return (w.to(velocities.dtype) * velocities).sum(dim=0)
