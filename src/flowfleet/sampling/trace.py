"""What the router decided during one sampling run: per step and per sample, for routing.json and the views."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from flowfleet.sampling.routing import ExecutionStats, Selection


@dataclass
class RoutingTrace:
    """One record per sampling step (the first velocity evaluation of a Heun step).

    probs[i]   [B, K] router probabilities over all K experts (renormalised over the present ones,
               0 for absent experts) that the selection of step i used
    experts[i] [B, k] global ids of the experts each sample used at step i
    weights[i] [B, k] their weights (sum to 1 per sample)
    routed[i]  whether the router ran at step i (False: weights reused, --route-every)
    uncond_experts[i], uncond_weights[i]  [B, k] the unconditional branch's own choice under guidance over the
               mixture (its posterior without the prompt); None where the conditional choice served both
    """

    num_experts: int
    times: list[float] = field(default_factory=list)
    probs: list[torch.Tensor] = field(default_factory=list)
    experts: list[torch.Tensor] = field(default_factory=list)
    weights: list[torch.Tensor] = field(default_factory=list)
    routed: list[bool] = field(default_factory=list)
    uncond_experts: list[torch.Tensor | None] = field(default_factory=list)
    uncond_weights: list[torch.Tensor | None] = field(default_factory=list)
    router_calls: int = 0
    stats: ExecutionStats = field(default_factory=ExecutionStats)

    def record(self, t: float, selection: Selection, routed: bool, uncond: Selection | None = None) -> None:
        self.times.append(float(t))
        self.probs.append(selection.probs.detach().float().cpu())
        self.experts.append(selection.experts.detach().cpu())
        self.weights.append(selection.weights.detach().float().cpu())
        self.routed.append(routed)
        self.uncond_experts.append(None if uncond is None else uncond.experts.detach().cpu())
        self.uncond_weights.append(None if uncond is None else uncond.weights.detach().float().cpu())

    @property
    def num_steps(self) -> int:
        return len(self.times)

    @property
    def num_samples(self) -> int:
        return self.experts[0].shape[0] if self.experts else 0

    def prob_matrix(self) -> torch.Tensor:
        """[steps, B, K] router probabilities."""
        return torch.stack(self.probs) if self.probs else torch.zeros(0, 0, self.num_experts)

    def top1_matrix(self) -> torch.Tensor:
        """[steps, B] the highest-weighted expert of each sample at each step."""
        if not self.experts:
            return torch.zeros(0, 0, dtype=torch.long)
        return torch.stack([e.gather(1, w.argmax(1, keepdim=True))[:, 0] for e, w in zip(self.experts, self.weights)])

    def selections(self) -> Counter[int]:
        """How many (sample, step) pairs selected each expert."""
        counts: Counter[int] = Counter()
        for e in self.experts:
            counts.update(e.flatten().tolist())
        return counts

    def select(self, rows: slice) -> "RoutingTrace":
        """The trace of some samples (a batch shared by several requests, split back per request); the
        execution counts stay with the whole batch."""
        return RoutingTrace(
            self.num_experts,
            times=list(self.times),
            probs=[p[rows] for p in self.probs],
            experts=[e[rows] for e in self.experts],
            weights=[w[rows] for w in self.weights],
            routed=list(self.routed),
            uncond_experts=[None if e is None else e[rows] for e in self.uncond_experts],
            uncond_weights=[None if w is None else w[rows] for w in self.uncond_weights],
            router_calls=self.router_calls,
        )

    @staticmethod
    def concat(traces: Sequence["RoutingTrace"]) -> "RoutingTrace":
        """Join the traces of consecutive batches of one generate call (same steps) along the samples."""
        first = traces[0]
        out = RoutingTrace(first.num_experts, times=list(first.times), routed=list(first.routed))
        for i in range(first.num_steps):
            out.probs.append(torch.cat([tr.probs[i] for tr in traces]))
            out.experts.append(torch.cat([tr.experts[i] for tr in traces]))
            out.weights.append(torch.cat([tr.weights[i] for tr in traces]))
            for mine, theirs in ((out.uncond_experts, "uncond_experts"), (out.uncond_weights, "uncond_weights")):
                parts = [getattr(tr, theirs)[i] for tr in traces]
                mine.append(None if any(p is None for p in parts) else torch.cat(parts))
        for tr in traces:
            out.router_calls += tr.router_calls
            out.stats.calls.update(tr.stats.calls)
            out.stats.rows.update(tr.stats.rows)
            out.stats.cache.blocks_run += tr.stats.cache.blocks_run
            out.stats.cache.blocks_skipped += tr.stats.cache.blocks_skipped
            for k, sizes in tr.stats.batch_sizes.items():
                out.stats.batch_sizes.setdefault(k, []).extend(sizes)
        return out

    def image_step(self, s: int, i: int) -> dict[str, Any]:
        """Step s of image i: {step, t, router_ran, experts, weights, probs[, uncond_experts, uncond_weights]}."""
        record = {
            "step": s,
            "t": round(self.times[s], 6),
            "router_ran": self.routed[s],
            "experts": self.experts[s][i].tolist(),
            "weights": [round(w, 6) for w in self.weights[s][i].tolist()],
            "probs": [round(p, 6) for p in self.probs[s][i].tolist()],
        }
        experts, weights = self.uncond_experts[s], self.uncond_weights[s]
        if experts is not None and weights is not None:
            record.update(uncond_experts=experts[i].tolist(), uncond_weights=[round(w, 6) for w in weights[i].tolist()])
        return record

    def _uncond_json(self, i: int) -> dict[str, Any]:
        """Step i's unconditional choice where it was routed apart (guidance over the mixture), else nothing."""
        experts, weights = self.uncond_experts[i], self.uncond_weights[i]
        if experts is None or weights is None:
            return {}
        return {
            "uncond_experts": experts.tolist(),
            "uncond_weights": [[round(w, 6) for w in row] for row in weights.tolist()],
        }

    def to_json(self, loads: Counter[int] | None = None) -> dict[str, Any]:
        """routing.json: per-step, per-sample choices and a usage summary per expert."""
        sel = self.selections()
        k_range = range(self.num_experts)
        usage = {
            str(k): {
                "selections": sel.get(k, 0),
                "share": sel.get(k, 0) / max(sum(sel.values()), 1),
                "forward_calls": self.stats.calls.get(k, 0),
                "forward_rows": self.stats.rows.get(k, 0),
                **({"loads": loads.get(k, 0)} if loads is not None else {}),
            }
            for k in k_range
        }
        steps = [
            {
                "step": i,
                "t": round(self.times[i], 6),
                "router_ran": self.routed[i],
                "experts": self.experts[i].tolist(),
                "weights": [[round(w, 6) for w in row] for row in self.weights[i].tolist()],
                "probs": [[round(p, 6) for p in row] for row in self.probs[i].tolist()],
                **self._uncond_json(i),
            }
            for i in range(self.num_steps)
        ]
        return {
            "num_experts": self.num_experts,
            "num_samples": self.num_samples,
            "num_steps": self.num_steps,
            "router_calls": self.router_calls,
            "cache": self.stats.cache.to_json(),
            "usage": usage,
            "steps": steps,
        }
