"""clusters/assignments.safetensors: the cluster of every item of data/, written by `cluster` and read by
the router's job and `evaluate`.

    "assign"  [N] int64, the cluster (= expert) of each item, indexed by data/'s item index ("index" field)
    "fine"    [N] int64, its fine k-means cluster (the first of the two stages)
"""

from __future__ import annotations

import safetensors.torch
import torch

from flowfleet.errors import FlowfleetError
from flowfleet.layout import ASSIGNMENTS
from flowfleet.storage import RunRoot


def write_assignments(root: RunRoot, assign: torch.Tensor, fine: torch.Tensor) -> None:
    tensors = {"assign": assign.long().contiguous(), "fine": fine.long().contiguous()}
    root.write_bytes(safetensors.torch.save(tensors), *ASSIGNMENTS)


def read_assignments(root: RunRoot, num_clusters: int | None = None) -> torch.Tensor:
    """ "assign" [N] int64; one-line errors when the file is missing, not an assignment, or (given
    num_clusters, run.yaml cluster.k) holds a cluster id outside 0..num_clusters - 1."""
    where = root.url_of(*ASSIGNMENTS)
    if not root.exists(*ASSIGNMENTS):
        raise FlowfleetError(f"{where}: missing; run `flowfleet cluster {root.url}` first")
    try:
        assign = safetensors.torch.load(root.read_bytes(*ASSIGNMENTS))["assign"]
    except KeyError:
        raise FlowfleetError(f"{where}: has no 'assign' tensor") from None
    if assign.ndim != 1:
        raise FlowfleetError(f"{where}: 'assign' has shape {tuple(assign.shape)}, expected [items]")
    assign = assign.long()
    if num_clusters is not None and assign.numel() and (int(assign.min()) < 0 or int(assign.max()) >= num_clusters):
        raise FlowfleetError(
            f"{where}: cluster ids span {int(assign.min())}..{int(assign.max())}, "
            f"but run.yaml cluster.k is {num_clusters}"
        )
    return assign
