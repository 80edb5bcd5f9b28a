"""What `cluster` partitions: each item's clustering features (cluster.features, raised to cluster.power), less what
its caption tells (cluster.caption_residual). One home for the rule, so that `cluster`, the evaluation's diagnostics
and held-out items (assigned to the clusters of the training items) compute the same features."""

from __future__ import annotations

import torch

from flowfleet.cluster.kmeans import l2_normalize_

FEATURE_FIELDS = {
    "semantic": ("features",),
    "latent": ("latents",),
    "text": ("text_pooled",),
    "both": ("features", "text_pooled"),
}


def signed_power(x: torch.Tensor, power: float) -> torch.Tensor:
    """x with every entry raised to `power` in magnitude, its sign kept (cluster.power; 1: x itself)."""
    return x if power == 1 else x.sign() * x.abs().pow(power)


def clustering_features(fields: dict[str, torch.Tensor], kind: str, power: float = 1.0) -> torch.Tensor:
    """[N, D] L2-normalised rows of what cluster.features names, each entry first raised to cluster.power (sign
    kept); `both` joins the two normalised halves (each weighted 1/sqrt(2), so neither dominates by its width)."""
    parts = [
        l2_normalize_(signed_power(fields[name].float().flatten(1), power)) for name in FEATURE_FIELDS[kind]
    ]  # latents: [N, C*H*W]
    return l2_normalize_(torch.cat(parts, dim=1)) if len(parts) > 1 else parts[0]


def _caption_design(text: torch.Tensor) -> torch.Tensor:
    """[N, E + 1] float64: the caption embeddings and an intercept column."""
    return torch.cat([text.double().flatten(1), torch.ones(text.shape[0], 1, dtype=torch.float64)], dim=1)


def caption_regression(x: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
    """[E + 1, D] float64: the least-squares prediction of the rows of x [N, D] from the caption embeddings text
    [N, E] with an intercept. The normal equations over the E + 1 columns, in float64 (N x (E + 1)^2 products: a
    minute at Paris' million items), solved by a pseudo-inverse because a few distinct captions span far fewer
    than E + 1 dimensions; its cut, 1e-10 of the largest eigenvalue, keeps captions that differ and merges one
    caption encoded in two batches (embeddings a float32 bit apart give eigenvalues ~1e-14 of it)."""
    design = _caption_design(text)
    return torch.linalg.pinv(design.T @ design, rtol=1e-10, hermitian=True) @ (design.T @ x.double())


def caption_residual(x: torch.Tensor, text: torch.Tensor, coef: torch.Tensor | None = None) -> torch.Tensor:
    """[N, D] rows of x minus their prediction from the caption embeddings text [N, E] (caption_regression,
    fitted on these rows unless `coef` is given: held-out items use the training items' fit), re-normalised:
    what the caption does not tell of an item. Items that share a caption lose exactly their caption's mean."""
    coef = caption_regression(x, text) if coef is None else coef
    return l2_normalize_((x.double() - _caption_design(text) @ coef).to(x.dtype))
