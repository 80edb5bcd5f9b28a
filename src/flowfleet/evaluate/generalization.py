"""Do the experts generalise? Each expert's flow-matching loss on its own training items and on the held-out
items of its cluster, beside the monolith's on the same items.

An expert trains on about 1/K of the data. When its loss on held-out items of its own cluster sits well above
its loss on its training items, and above the monolith's on the same held-out items, it is short of data: the
regime in which a fleet trails a monolith of the same training FLOPs. Held-out items (eval/, which no training job
reads) join a cluster by the clustering's own rule: the cluster of their nearest fine centroid, in the features
`cluster` used, with the caption residual fitted on the training items. The loss is the training objective with the
condition on, at the midpoints of `t_bins` equal t bins and `draws` noise draws per item and bin: the same noise for
every model scored on an item, so the expert and the monolith differ by their weights only.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from flowfleet.cluster.features import FEATURE_FIELDS, caption_regression, caption_residual, clustering_features
from flowfleet.config import RunConfig
from flowfleet.flow.loss import flow_matching_loss
from flowfleet.models.dit import DiTModel
from flowfleet.train.data import derive_seed, model_fields
from flowfleet.train.preview import condition_kwargs

Fields = Mapping[str, torch.Tensor]


def clustering_fields(cfg: RunConfig) -> list[str]:
    """The shard fields the clustering rule reads."""
    return [*FEATURE_FIELDS[cfg.cluster.features], *(["text_pooled"] if cfg.cluster.caption_residual else [])]


def held_out_clusters(
    cfg: RunConfig, centroids: Mapping[str, torch.Tensor], train: Fields, held: Fields
) -> torch.Tensor:
    """[M] the cluster of each held-out item: its nearest fine centroid's (the rule `cluster` assigned the
    training items by), in the clustering features, less the training items' caption fit when
    cluster.caption_residual."""
    c = cfg.cluster
    x = clustering_features(dict(held), c.features, c.power)  # [M, D] normalised
    if c.caption_residual:
        coef = caption_regression(clustering_features(dict(train), c.features, c.power), train["text_pooled"])
        x = caption_residual(x, held["text_pooled"], coef)
    nearest = torch.cdist(x.double(), centroids["fine"].double()).argmin(dim=1)  # [M]
    return centroids["fine_to_coarse"].long()[nearest]


@torch.no_grad()
def velocity_loss(
    model: DiTModel,
    fields: Fields,
    *,
    t_bins: int,
    draws: int,
    seed: int,
    device: torch.device,
    batch: int = 256,
) -> list[float]:
    """The mean velocity MSE at each t bin's midpoint over the items of `fields`, condition on. Item i's noise
    in bin b, draw d comes from a generator seeded by (seed, b, d) over the whole set, so two models scored on
    the same fields see the same noise."""
    cfg = model.cfg
    x0_all = fields["latents"].float()  # [N, C, H, W]
    n = x0_all.shape[0]
    totals = [0.0] * t_bins
    for b in range(t_bins):
        for d in range(draws):
            gen = torch.Generator().manual_seed(derive_seed(seed, b, d))
            eps_all = torch.randn(x0_all.shape, generator=gen)  # [N, C, H, W]
            for lo in range(0, n, batch):
                x0, eps = x0_all[lo : lo + batch].to(device), eps_all[lo : lo + batch].to(device)
                part = {k: v[lo : lo + batch].to(device) for k, v in fields.items()}
                cond = condition_kwargs(part, cfg)
                t = torch.full((x0.shape[0],), (b + 0.5) / t_bins, device=device)  # [B]
                loss = flow_matching_loss(lambda x_t, tt, kw=cond: model(x_t, tt, **kw), x0, t, eps)  # type: ignore[misc]  # kw's default binds cond
                totals[b] += float(loss) * x0.shape[0] / (n * draws)
    return totals


def _subset(fields: Fields, rows: torch.Tensor) -> dict[str, torch.Tensor]:
    return {k: v[rows] for k, v in fields.items()}


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def generalization(
    experts: Mapping[int, DiTModel],
    monolith: DiTModel,
    train: Fields,
    train_clusters: torch.Tensor,
    held: Fields,
    held_clusters: torch.Tensor,
    *,
    max_items: int = 256,
    t_bins: int = 10,
    draws: int = 1,
    seed: int = 0,
    device: torch.device | str = "cpu",
) -> dict[str, Any]:
    """Per expert k: its loss and the monolith's on (up to max_items, seeded) training items of cluster k and
    on the held-out items of cluster k, by t bin and on average; then the item-weighted means over the clusters."""
    gen = torch.Generator().manual_seed(seed)
    rows: list[dict[str, Any]] = []
    for k, expert in sorted(experts.items()):
        sets = {}
        for split, clusters in (("train", train_clusters), ("heldout", held_clusters)):
            members = (clusters == k).nonzero().flatten()
            sets[split] = members[torch.randperm(len(members), generator=gen)[:max_items]].sort().values
        row: dict[str, Any] = {"expert": k, "items": {s: int(len(r)) for s, r in sets.items()}}
        models: tuple[tuple[str, DiTModel], ...] = (("expert", expert), ("monolith", monolith))
        for name, model in models:
            for split, fields in (("train", train), ("heldout", held)):
                if len(sets[split]) == 0:
                    continue
                by_t = velocity_loss(
                    model,
                    _subset(fields, sets[split]),
                    t_bins=t_bins,
                    draws=draws,
                    seed=seed,
                    device=torch.device(device),
                )
                row[f"{name}_{split}_by_t"] = by_t
                row[f"{name}_{split}"] = _mean(by_t)
        rows.append(row)

    def weighted(key: str, split: str) -> float | None:
        have = [r for r in rows if key in r]
        total = sum(r["items"][split] for r in have)
        return sum(r[key] * r["items"][split] for r in have) / total if total else None

    summary = {
        name: {split: weighted(f"{name}_{split}", split) for split in ("train", "heldout")}
        for name in ("expert", "monolith")
    }
    return {
        "t": [(b + 0.5) / t_bins for b in range(t_bins)],
        "draws": draws,
        "max_items": max_items,
        "clusters": rows,
        "summary": summary,
        "note": "velocity MSE, condition on, at each t bin's midpoint; held-out items join the cluster of their "
        "nearest fine centroid; the same items and noise for an expert and the monolith",
    }


def fields_for(cfg: RunConfig, expert_cfgs: list[Any]) -> list[str]:
    """Every field the generalisation diagnostic reads: latents, the experts' condition, the clustering's."""
    wanted = ["latents", *clustering_fields(cfg)]
    for c in expert_cfgs:
        wanted += model_fields(c)
    return list(dict.fromkeys(wanted))
