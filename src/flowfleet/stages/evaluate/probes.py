"""The diagnostics an evaluation probes with the run's data: do the experts generalise (each expert and the
monolith on training and held-out items of its cluster), how well the router reads its clusters."""

from __future__ import annotations

from typing import Any, Protocol

import safetensors.torch
import torch

from flowfleet.config import RunConfig
from flowfleet.data.shards import ShardSetUnion
from flowfleet.evaluate.diagnostics import router_accuracy
from flowfleet.evaluate.generalization import clustering_fields, fields_for, generalization, held_out_clusters
from flowfleet.layout import CENTROIDS
from flowfleet.models.dit import DiTModel, DiTRouter
from flowfleet.sampling.pipeline import FleetPipeline
from flowfleet.storage import RunRoot
from flowfleet.train.data import InMemoryData, model_fields
from flowfleet.train.preview import condition_kwargs
from flowfleet.train.tasks import clustered_data


class EvaluationInputs(Protocol):
    """What the probes read of the stage's evaluation (draw.py's EvaluationDraw): the run, its data and the held-out
    reference, the items in the evaluation's order with their latents, the options (seed) and the device."""

    root: RunRoot
    cfg: RunConfig
    data: ShardSetUnion
    ref_data: Any
    order: torch.Tensor
    latents: torch.Tensor
    options: Any
    device: torch.device


def generalization_probe(ev: EvaluationInputs, pipe: FleetPipeline, monolith: FleetPipeline) -> dict[str, Any]:
    """Each expert of the run's own clusters (not an addition's) and the monolith on training and held-out items
    of its cluster (flowfleet.evaluate.generalization)."""
    experts = {k: _dit(pipe.experts.get(k)) for k in pipe.present if k < ev.cfg.cluster.k}
    fields = fields_for(ev.cfg, [m.cfg for m in experts.values()])
    train = ev.data.sets[0].load(fields)  # data/ (additions' items belong to their own experts)
    held = ev.ref_data.load(fields)
    centroids = safetensors.torch.load(ev.root.read_bytes(*CENTROIDS))
    return generalization(
        experts,
        _dit(monolith.experts.get(monolith.present[0])),
        train,
        clustered_data(ev.root, ev.cfg, []).tensors["cluster"][: train["latents"].shape[0]],
        held,
        held_out_clusters(ev.cfg, centroids, train, held),
        seed=ev.options.seed,
        device=ev.device,
    )


def _dit(expert: Any) -> DiTModel:
    """An expert of an opened model folder: a DiT (a store of other callables has no loss to measure)."""
    if not isinstance(expert, DiTModel):
        raise TypeError(f"expected a DiT expert, got {type(expert).__name__}")
    return expert


ROUTER_ITEMS = 512  # items per router accuracy table: each of its 10 t buckets sees every one of them


def _router(pipe: FleetPipeline) -> DiTRouter:
    """The router of an opened model folder: a DiT (a callable of another kind has no accuracy table here)."""
    if not isinstance(pipe.router, DiTRouter):
        raise TypeError(f"expected a DiT router, got {type(pipe.router).__name__}")
    return pipe.router


def _router_fields(pipe: FleetPipeline) -> list[str]:
    """The fields the router reads beside the latents: the prompt's, for a prompt-aware router."""
    return [f for f in model_fields(_router(pipe).cfg) if f != "latents"] if pipe.router_sees_prompt else []


def _prompt(data: Any, pipe: FleetPipeline, pick: torch.Tensor) -> dict[str, torch.Tensor]:
    """The picked items' prompt fields as a batch, for a router that reads them (else none)."""
    if not pipe.router_sees_prompt:
        return {}
    return InMemoryData(data.load(_router_fields(pipe)), [], data.url).gather(pick)


def _router_on(
    ev: EvaluationInputs,
    pipe: FleetPipeline,
    latents: torch.Tensor,
    clusters: torch.Tensor,
    prompt: dict[str, torch.Tensor],
) -> dict[str, Any]:
    """router_accuracy of the fleet's router on these items (their captions, as it was trained, when it reads them)."""
    router = _router(pipe)
    cond = condition_kwargs(prompt, router.cfg) if pipe.router_sees_prompt else None
    return router_accuracy(
        router, latents, clusters, pipe.num_experts, seed=ev.options.seed, device=ev.device, cond=cond
    )


def router_accuracy_probe(ev: EvaluationInputs, pipe: FleetPipeline) -> dict[str, Any]:
    """The fleet's router against the clusters of (up to 512 of) the data items."""
    pick = ev.order[: min(ROUTER_ITEMS, ev.order.numel())]
    clusters = clustered_data(ev.root, ev.cfg, []).tensors["cluster"][pick]
    rep = _router_on(ev, pipe, ev.latents[pick], clusters, _prompt(ev.data, pipe, pick))
    rep["note"] = "the assembled router on a seeded random subset of data/, fresh noise, t uniform per bucket"
    return rep


def router_accuracy_heldout(ev: EvaluationInputs, pipe: FleetPipeline) -> dict[str, Any]:
    """The fleet's router on (up to 512 of) the held-out items, which no job trained on, each in the cluster of
    its nearest fine centroid (the clustering's rule, flowfleet.evaluate.generalization): what it reads of new
    images, where the table of data/ items also shows what it memorised of its training items."""
    rule = clustering_fields(ev.cfg)
    held = ev.ref_data.load(list(dict.fromkeys(["latents", *rule])))
    centroids = safetensors.torch.load(ev.root.read_bytes(*CENTROIDS))
    clusters = held_out_clusters(ev.cfg, centroids, ev.data.sets[0].load(rule), held)  # [M]
    count = clusters.shape[0]
    pick = torch.randperm(count, generator=torch.Generator().manual_seed(ev.options.seed))[:ROUTER_ITEMS]
    rep = _router_on(ev, pipe, held["latents"][pick], clusters[pick], _prompt(ev.ref_data, pipe, pick))
    rep["note"] = (
        "the assembled router on a seeded random subset of the held-out items, each in the cluster of its nearest "
        "fine centroid; fresh noise, t uniform per bucket"
    )
    return rep
