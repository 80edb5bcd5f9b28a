"""Why a fleet samples well or badly ("expert-data alignment", after Villagra et al. 2026).

router accuracy per t     does argmax p(k | x_t, t) recover the cluster of x0? (near t = 0 it should;
                          near t = 1 nothing can). The computation is the training report's
                          (flowfleet.train.preview.router_accuracy), run here on the data of the run.
centroid alignment        does a generated sample land in the semantic cluster of the expert that
                          generated it? Its semantic features (the run's clustering encoder), L2-normalised
                          like the clustering's, against the K coarse centroids: the distance to the
                          dominant expert's centroid vs. the mean distance to the others, and the share
                          of samples whose cluster (nearest fine centroid -> its coarse cluster, the
                          clustering's own rule) is the dominant expert's.
expert disagreement       the spread of the K experts' velocities at the states a trajectory visits: where
                          experts disagree, routing decides what is drawn; where they agree it does not.
expert usage              the share of the ensemble weight each expert received, per strategy.

SemanticFeatures holds the run's clustering encoder and centroids for centroid alignment; disagreement()
samples trajectories with the probe.

The dominant expert of a sample is the one with the largest ensemble weight summed over all steps.

train.preview (matplotlib behind it) is imported only when router accuracy is measured.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import safetensors.torch
import torch

from flowfleet.cluster.features import signed_power
from flowfleet.config import RunConfig, SamplingConfig
from flowfleet.evaluate.reference import semantic_is_fid_extractor
from flowfleet.flow.ensemble import dense_weights
from flowfleet.layout import CENTROIDS
from flowfleet.sampling.routing import Condition, Selection, run_selected
from flowfleet.sampling.store import ExpertStore
from flowfleet.sampling.trace import RoutingTrace
from flowfleet.storage import RunRoot

if TYPE_CHECKING:  # the encoders module loads transformers; only its type is needed here
    from flowfleet.data.encoders import SemanticEncoder

# --------------------------------------------------------------------------------------------------
#                                      Router accuracy
# --------------------------------------------------------------------------------------------------


def router_accuracy(
    router: torch.nn.Module,
    latents: torch.Tensor,
    clusters: torch.Tensor,
    num_clusters: int,
    *,
    seed: int = 0,
    device: torch.device | str = "cpu",
    cond: dict[str, torch.Tensor] | None = None,
) -> dict[str, Any]:
    """Accuracy of the router against the cluster of x0 per t-bucket (t uniform inside each bucket,
    fresh noise), the largest cluster's share as chance level, and the confusion matrix."""
    from flowfleet.train.preview import router_accuracy as _accuracy

    with torch.inference_mode():
        report = _accuracy(router, latents, clusters, num_clusters, seed=seed, device=torch.device(device), cond=cond)
    return report


# --------------------------------------------------------------------------------------------------
#                                     Trajectory weights
# --------------------------------------------------------------------------------------------------


def weight_per_expert(trace: RoutingTrace) -> torch.Tensor:
    """[B, K]: each sample's ensemble weight per expert summed over the recorded steps."""
    total = torch.zeros(trace.num_samples, trace.num_experts, dtype=torch.float64)
    for experts, weights in zip(trace.experts, trace.weights):
        total += dense_weights(experts, weights.double(), trace.num_experts)
    return total


def dominant_experts(trace: RoutingTrace) -> torch.Tensor:
    """[B] int64: the expert with the largest summed weight over the trajectory (lowest id on ties)."""
    return weight_per_expert(trace).argmax(dim=1)


def usage_shares(trace: RoutingTrace) -> list[float]:
    """Share of the total ensemble weight per expert (sums to 1), over all samples and steps."""
    w = weight_per_expert(trace).sum(dim=0)
    return (w / w.sum().clamp_min(1e-12)).tolist()


# --------------------------------------------------------------------------------------------------
#                                    Centroid alignment
# --------------------------------------------------------------------------------------------------


def centroid_alignment(
    features: torch.Tensor,
    dominant: torch.Tensor,
    coarse: torch.Tensor,
    fine: torch.Tensor,
    fine_to_coarse: torch.Tensor,
) -> dict[str, Any]:
    """features [N, D] (raw semantic features of generated images), dominant [N] expert ids,
    coarse [K, D], fine [F, D], fine_to_coarse [F] from clusters/centroids.safetensors."""
    n, k = features.shape[0], coarse.shape[0]
    if features.shape[1] != coarse.shape[1]:
        raise ValueError(f"features have {features.shape[1]} dimensions, the centroids {coarse.shape[1]}")
    f = torch.nn.functional.normalize(features.double(), dim=1)  # [N, D], as the clustering normalised
    d = torch.cdist(f, coarse.double())  # [N, K]
    mine = d.gather(1, dominant.view(-1, 1))[:, 0]  # [N]
    others = (d.sum(dim=1) - mine) / max(k - 1, 1)  # [N] mean distance to the other centroids
    assigned = fine_to_coarse.long()[torch.cdist(f, fine.double()).argmin(dim=1)]  # [N] the clustering's rule
    return {
        "dominant_distance": float(mine.mean()),
        "other_distance": float(others.mean()) if k > 1 else None,
        "assigned_is_dominant": float((assigned == dominant).double().mean()),
        "chance": float(torch.bincount(assigned, minlength=k).max() / n),
        "assigned_share": (torch.bincount(assigned, minlength=k).double() / n).tolist(),
        "n": n,
    }


# --------------------------------------------------------------------------------------------------
#                                    Expert disagreement
# --------------------------------------------------------------------------------------------------


def velocity_spread(velocities: torch.Tensor) -> float:
    """velocities [K, B, ...] -> RMS deviation of the experts from their mean, relative to the RMS of
    the mean velocity: 0 when all experts agree, ~1 when their differences are as large as the flow."""
    v = velocities.double().flatten(2)  # [K, B, F]
    mean = v.mean(dim=0)  # [B, F]
    dev = (v - mean).pow(2).sum(dim=2).mean()  # mean over experts and samples of |v_k - v_mean|^2
    ref = mean.pow(2).sum(dim=1).mean().clamp_min(1e-24)
    return float((dev / ref).sqrt())


class DisagreementProbe:
    """A velocity function wrapper: at the first evaluation of every step it also runs every present
    expert on the current states (guided like the fleet) and records their spread; then returns the
    wrapped velocity unchanged. Costs K expert passes per step: run it on a small diagnostic batch."""

    def __init__(self, inner, experts: ExpertStore, cond: Condition, guidance: SamplingConfig, guided):
        """guidance: the fleet's scale and the steps it applies to; guided(scale) -> whether a step at that scale
        runs the unconditional rows (FleetPipeline's rule)."""
        self.inner, self.experts, self.cond, self.guidance, self.guided = inner, experts, cond, guidance, guided
        self.t: list[float] = []
        self.spread: list[float] = []
        self._last_step = -1

    def expert_velocities(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """[P, B, C, H, W]: each present expert's (guided) velocity for every sample."""
        b = x.shape[0]
        scale = self.guidance.guidance_at(float(t[0]))
        out = []
        for k in self.experts.present:
            only_k = Selection(
                torch.full((b, 1), k, dtype=torch.long, device=x.device),
                torch.ones(b, 1, dtype=x.dtype, device=x.device),
                torch.zeros(b, self.experts.num_experts, dtype=x.dtype, device=x.device),
            )
            out.append(run_selected(self.experts, x, t, self.cond, only_k, scale, self.guided(scale)))
        return torch.stack(out)

    def __call__(self, x: torch.Tensor, t: torch.Tensor, step: int) -> torch.Tensor:
        if step != self._last_step:
            self._last_step = step
            self.t.append(float(t[0]))
            self.spread.append(velocity_spread(self.expert_velocities(x, t)))
        return self.inner(x, t, step)

    def to_json(self) -> dict[str, list[float]]:
        return {"t": [round(v, 6) for v in self.t], "spread": self.spread}


# --------------------------------------------------------------------------------------------------
#                         The evaluation's probes: clustering features, disagreement
# --------------------------------------------------------------------------------------------------


class SemanticFeatures:
    """The run's clustering encoder and centroids, for the centroid-alignment diagnostic."""

    def __init__(self, root: RunRoot, cfg: RunConfig, fid_key: str, device: torch.device):
        # Images can be placed among the centroids only when the clusters were made from image features.
        self.available = cfg.cluster.features == "semantic" and root.exists(*CENTROIDS)
        # The clustering features of an image ARE its FID features when both are default_1 at one input size.
        self.same_as_fid = semantic_is_fid_extractor(cfg, fid_key)
        self.cfg, self.device = cfg, device
        self._encoder: SemanticEncoder | None = None
        if self.available:
            c = safetensors.torch.load(root.read_bytes(*CENTROIDS))
            self.coarse, self.fine, self.fine_to_coarse = c["coarse"], c["fine"], c["fine_to_coarse"]

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        from flowfleet.data.encoders import build_semantic_encoder

        if self._encoder is None:
            self._encoder = build_semantic_encoder(self.cfg.encoders.semantic, self.device)
        return torch.cat([self._encoder.encode(images[i : i + 64]).cpu() for i in range(0, images.shape[0], 64)])

    def alignment(self, features: torch.Tensor, dominant: torch.Tensor) -> dict[str, Any]:
        features = signed_power(features, self.cfg.cluster.power)  # as the clustering saw them
        return centroid_alignment(features, dominant, self.coarse, self.fine, self.fine_to_coarse)


def disagreement(pipe, prompts, labels, settings, n: int, seed: int) -> dict[str, list[float]]:
    """Sample n trajectories with the strategy of `settings`, probing all experts at every step."""
    cond, _ = pipe.encode_condition(prompts[:n] if prompts else None, labels[:n] if labels else None, n)
    noise = torch.randn(n, *pipe.latent_shape, generator=torch.Generator().manual_seed(seed), dtype=pipe.dtype).to(
        pipe.device
    )
    trace = RoutingTrace(pipe.num_experts)
    inner = pipe.velocity_fn(cond, settings, trace)
    probe = DisagreementProbe(inner, pipe.experts, cond, settings, pipe.guidance_applies)
    pipe.sample(noise, cond, settings, velocity_fn=probe)
    return probe.to_json()
