"""Small pieces of the stage: the samples file, the guidance scale a model is compared at, a score line, FID
statistics of generated images."""

from __future__ import annotations

import io
from typing import Any, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from flowfleet.data.images import to_uint8
from flowfleet.evaluate.fid import FID, FeatureStats


def samples_npz(images: torch.Tensor, prompts: Sequence[str], seed: int) -> bytes:
    """Every scored sample as a compressed npz: images uint8 [n, H, W, C], prompts [n], seed."""
    buf = io.BytesIO()
    np.savez_compressed(
        buf,
        images=to_uint8(images).permute(0, 2, 3, 1).numpy(),
        prompts=np.array(list(prompts), dtype=str),
        seed=np.array(seed),
    )
    return buf.getvalue()


def distance(scores: dict[str, Any]) -> float:
    """The distance a choice reads from a draw's scores: the classifier FD, or FID where there is none."""
    return scores["classifier_fd"] if scores.get("classifier_fd") is not None else scores["fid"]


def choose_scale(records: Sequence[dict[str, Any]], min_accuracy: float) -> int:
    """The index of the guidance scale a model is compared at: the lowest classifier FD (FID when there is
    none) among the scales whose prompt accuracy reaches min_accuracy; when none does, the most accurate
    (ties: the lower distance). Without prompt accuracy (no judge), the lowest distance."""
    accurate = [i for i, r in enumerate(records) if r.get("prompt_accuracy", 1.0) >= min_accuracy]
    if accurate:
        return min(accurate, key=lambda i: distance(records[i]))
    return min(range(len(records)), key=lambda i: (-records[i]["prompt_accuracy"], distance(records[i])))


def extend_sweep(
    scales: Sequence[float], chosen: float, bounds: tuple[float, float], added: int, most: int
) -> tuple[float | None, str | None]:
    """The next scale to sample when the chosen one sits at an edge of the sorted `scales`, one step past it as far
    again (by ratio) as its neighbour lies inside, clipped to `bounds`: (scale, None). (None, why) when it cannot go
    on: the edge is the bound, or `most` scales were added already; (None, None) when the choice lies inside."""
    if len(scales) < 2 or scales[0] < chosen < scales[-1]:
        return None, None
    lo, hi = bounds
    upper = chosen == scales[-1]
    if (upper and chosen >= hi) or (not upper and chosen <= lo):
        return None, f"the best scale is the bound {hi if upper else lo}"
    if added >= most:
        return None, f"the best scale is the sweep's {'highest' if upper else 'lowest'} after {most} added scales"
    inside = scales[-2] if upper else scales[1]
    if upper:
        return (min(hi, chosen * chosen / inside) if inside > 0 else hi), None
    return max(lo, chosen * chosen / inside), None


def describe_scores(scores: dict[str, Any]) -> str:
    parts = [f"FID {scores['fid']:.2f}"] if "fid" in scores else []
    if "prompt_accuracy" in scores:
        parts.append(f"prompt accuracy {scores['prompt_accuracy']:.3f}")
    if "classifier_fd" in scores:
        parts.append(f"classifier FD {scores['classifier_fd']:.2f}")
        parts.append(f"precision {scores['precision']:.3f} recall {scores['recall']:.3f}")
    return ", ".join(parts)


def stats_of(features: torch.Tensor, key: str) -> FeatureStats:
    stats = FeatureStats.empty(features.shape[1], {"extractor": key})
    stats.update(features)
    return stats


def generated_features(fid: FID, images: torch.Tensor, name: str) -> tuple[FeatureStats, torch.Tensor]:
    """FID statistics of the generated images, keeping the per-image features (for the diagnostics)."""
    stats = FeatureStats.empty(fid.dim, {"extractor": fid.key, "name": name})
    parts = []
    bs = fid.settings.batch_size
    for i in tqdm(range(0, images.shape[0], bs), desc=f"fid features ({name})", unit="batch", leave=False):
        f = fid.features(images[i : i + bs])
        stats.update(f)
        parts.append(f)
    return stats, torch.cat(parts)
