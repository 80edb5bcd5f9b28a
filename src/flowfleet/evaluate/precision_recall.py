"""Precision and recall of a generated set in a feature space (Kynkäänniemi et al. 2019), with density
and coverage (Naeem et al. 2020), computed by the `prdc` package.

    precision_recall(real [N, D], fake [M, D], k=3) -> {"precision", "recall", "density", "coverage", "k"}

Precision: the share of generated samples that fall inside the real manifold (the union of balls
around each real feature reaching its k-th nearest real neighbour): fidelity. Recall: the share of
real samples inside the generated manifold: diversity. A Fréchet distance mixes the two; a guidance
scale moves one against the other, so the report plots both.
"""

from __future__ import annotations

import contextlib
import io
import warnings
from typing import Any

import torch

from flowfleet.errors import FlowfleetError

NEAREST_K = 3  # Kynkäänniemi et al. use k = 3 for precision and recall


def precision_recall(real: torch.Tensor, fake: torch.Tensor, k: int = NEAREST_K) -> dict[str, Any]:
    """Precision, recall, density and coverage of `fake` [M, D] against `real` [N, D]."""
    try:
        from prdc import compute_prdc
    except ImportError:
        raise FlowfleetError("precision/recall: needs the prdc package (pip install 'flowfleet[eval]')") from None
    if real.ndim != 2 or fake.ndim != 2 or real.shape[1] != fake.shape[1]:
        raise FlowfleetError(
            f"precision/recall: expected features [N, D] and [M, D], got {tuple(real.shape)} and {tuple(fake.shape)}"
        )
    if min(real.shape[0], fake.shape[0]) <= k:
        raise FlowfleetError(f"precision/recall: needs more than k = {k} samples per set")
    # prdc prints the set sizes, and its sklearn call warns about joblib's configuration
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        scores = compute_prdc(real.double().cpu().numpy(), fake.double().cpu().numpy(), nearest_k=k)
    return {name: float(value) for name, value in scores.items()} | {"k": k}
