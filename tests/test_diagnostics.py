"""Diagnostics on small tensors: velocity spread, trajectory weights, centroid alignment, router accuracy."""

from __future__ import annotations

import pytest
import torch
from fixtures.tolerances import gamma, unit_roundoff

from flowfleet.config import SamplingConfig
from flowfleet.evaluate.diagnostics import (
    DisagreementProbe,
    centroid_alignment,
    dominant_experts,
    router_accuracy,
    usage_shares,
    velocity_spread,
    weight_per_expert,
)
from flowfleet.flow import integrate, time_grid
from flowfleet.sampling.routing import Condition, Selection
from flowfleet.sampling.store import ExpertStore
from flowfleet.sampling.trace import RoutingTrace

U32 = unit_roundoff(torch.float32)


def test_velocity_spread():
    u = torch.randn(5, 2, 3, 3)
    # the float64 mean of three equal values is within gamma_3 of each: a spread of that order
    assert velocity_spread(torch.stack([u, u, u])) == pytest.approx(0.0, abs=gamma(4))
    # v1 = u, v2 = 3u: mean 2u, deviation |u| each -> sqrt(|u|^2 / |2u|^2) = 0.5; 3u is rounded once in
    # float32 (u32 relative), which moves the mean and the deviation by at most that each
    assert velocity_spread(torch.stack([u, 3 * u])) == pytest.approx(0.5, rel=4 * U32)


def trace_of(steps: list[tuple[list[list[int]], list[list[float]]]], k: int) -> RoutingTrace:
    tr = RoutingTrace(k)
    for i, (experts, weights) in enumerate(steps):
        e, w = torch.tensor(experts), torch.tensor(weights)
        tr.record(1.0 - i / len(steps), Selection(e, w, torch.zeros(e.shape[0], k)), routed=True)
    return tr


def test_trajectory_weights_dominant_expert_and_usage():
    # 3 samples, K = 3, top-2 for two steps.
    tr = trace_of(
        [
            ([[0, 1], [2, 1], [1, 0]], [[0.6, 0.4], [0.5, 0.5], [0.9, 0.1]]),
            ([[1, 0], [2, 0], [1, 2]], [[0.7, 0.3], [0.8, 0.2], [0.6, 0.4]]),
        ],
        k=3,
    )
    w = weight_per_expert(tr)
    # sums of two float32 weights (each decimal rounded once, u32 relative) against exact decimals
    want = torch.tensor([[0.9, 1.1, 0.0], [0.2, 0.5, 1.3], [0.1, 1.5, 0.4]], dtype=torch.float64)
    assert torch.allclose(w, want, atol=3 * U32 * 1.5, rtol=0)
    assert dominant_experts(tr).tolist() == [1, 2, 1]
    shares = usage_shares(tr)
    # ratios of sums of 6 such weights
    assert sum(shares) == pytest.approx(1.0, rel=gamma(8, torch.float32))
    assert shares == pytest.approx([1.2 / 6, 3.1 / 6, 1.7 / 6], rel=gamma(8, torch.float32))


def test_centroid_alignment():
    coarse = torch.eye(3, 4)  # three unit centroids on the axes, D = 4
    fine = torch.eye(4)[:3].repeat_interleave(2, dim=0) * 1.0  # two fine centroids per coarse one
    fine_to_coarse = torch.tensor([0, 0, 1, 1, 2, 2])
    features = torch.tensor([[5.0, 0, 0, 0], [0, 2.0, 0, 0], [0, 0, 3.0, 0], [0, 0, 7.0, 0]])
    dominant = torch.tensor([0, 1, 2, 0])  # the last sample landed in cluster 2, not in its expert's
    out = centroid_alignment(features, dominant, coarse, fine, fine_to_coarse)
    assert out["assigned_is_dominant"] == 0.75  # counts: exact
    root2 = 2**0.5
    # float32 distances between unit vectors in 4-d (normalise, 4 squares, a sqrt), averaged over 4 samples
    rel = gamma(12, torch.float32)
    assert out["dominant_distance"] == pytest.approx(root2 / 4, rel=rel)  # three exact hits, one at sqrt 2
    # others: aligned samples are sqrt 2 from both others; the misaligned one: 0 and sqrt 2 -> mean sqrt2/2
    assert out["other_distance"] == pytest.approx((3 * root2 + root2 / 2) / 4, rel=rel)
    assert out["chance"] == 0.5 and out["assigned_share"] == [0.25, 0.25, 0.5]  # counts: exact
    with pytest.raises(ValueError, match="dimensions"):
        centroid_alignment(features[:, :3], dominant, coarse, fine, fine_to_coarse)


class OracleRouter(torch.nn.Module):
    """Knows the two clusters sit at means -2 and +2: logits from the mean of x_t."""

    def forward(self, x, t):
        m = x.flatten(1).mean(dim=1)
        return torch.stack([-m, m], dim=1) * 20


def test_router_accuracy_per_t_bucket_falls_towards_noise():
    g = torch.Generator().manual_seed(0)
    clusters = torch.randint(0, 2, (200,), generator=g)
    latents = (clusters.float() * 4 - 2).view(-1, 1, 1, 1) + 0.1 * torch.randn(200, 1, 4, 4, generator=g)
    rep = router_accuracy(OracleRouter(), latents, clusters, 2, seed=1)
    acc = rep["accuracy"]
    assert len(acc) == len(rep["t_buckets"]) == 10
    assert acc[0] == 1.0 and acc[-1] < 0.85 and acc[0] > acc[-1]
    assert 0.4 < rep["chance"] < 0.6


def test_disagreement_probe_records_each_step_and_passes_the_velocity_through():
    scales = [1.0, 3.0]
    store = ExpertStore.from_callables([lambda x, t, c=c, **kw: c * x for c in scales])

    def inner(x, t, step):
        return -x

    probe = DisagreementProbe(inner, store, Condition(), SamplingConfig(guidance_scale=1.0), guided=lambda scale: False)
    x1 = torch.randn(4, 1, 2, 2)
    grid = time_grid(3)
    out = integrate(probe, x1, grid, "heun")
    ref = integrate(inner, x1, grid, "heun")
    assert torch.equal(out, ref)  # the wrapped velocity passes through untouched
    assert probe.t == grid[:-1].tolist()  # once per step, also under Heun's second evaluation
    assert probe.spread == pytest.approx([0.5, 0.5, 0.5], rel=4 * U32)  # v_k = c_k x: std(c) / mean(c)
    assert probe.to_json()["t"][0] == 1.0
    assert probe.expert_velocities(x1, torch.ones(4)).shape == (2, 4, 1, 2, 2)
