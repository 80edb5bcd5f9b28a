"""Semantic partitioning of the prepared data: two-stage k-means (faiss or torch) and its metrics."""

from flowfleet.cluster.kmeans import (
    KMeansResult,
    TwoStageResult,
    assign_nearest,
    balance_fine_to_coarse,
    faiss_available,
    l2_normalize_,
    lift_to_floor,
    random_partition,
    two_stage_kmeans,
)

__all__ = [
    "KMeansResult",
    "TwoStageResult",
    "assign_nearest",
    "balance_fine_to_coarse",
    "faiss_available",
    "l2_normalize_",
    "lift_to_floor",
    "random_partition",
    "two_stage_kmeans",
]
