"""Training objectives: t sampling, the velocity regression loss and its weighting over t; DDPM's noise regression
for a ddpm expert; the regularisers of a block's hidden tokens (dispersive, REPA's alignment)."""

from __future__ import annotations

import math
from typing import Callable, Literal

import torch
import torch.nn.functional as F

from flowfleet.flow.path import interpolate, target_velocity

TimeSampling = Literal["uniform", "logit_normal"]
LossWeighting = Literal["none", "min_snr"]


def sample_t(
    n: int,
    *,
    mode: TimeSampling = "uniform",
    mean: float = 0.0,
    std: float = 1.0,
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """t ~ U[0, 1] or logit-normal(mean, std) (SD3), shape [n]."""
    if mode == "uniform":
        return torch.rand(n, generator=generator, device=device)
    if mode == "logit_normal":
        return torch.sigmoid(mean + std * torch.randn(n, generator=generator, device=device))
    raise ValueError(f"unknown time sampling mode {mode!r} (expected uniform or logit_normal)")


def loss_weight(t: torch.Tensor, weighting: LossWeighting = "none", gamma: float = 5.0) -> torch.Tensor:
    """The weight [B] of each item's velocity error at its time t [B].

    "none": 1, plain flow matching. "min_snr": Min-SNR-gamma (Hang et al. 2023), which weights the error of the
    clean estimate x0 = x_t - t v by min(SNR(t), gamma), SNR(t) = (1 - t)^2 / t^2; since that error is t times the
    velocity's, the velocity's weight is min(SNR, gamma) t^2 = min((1 - t)^2, gamma t^2). It caps the weight of the
    nearly clean steps, where the x0 error is tiny yet the velocity's is not, and of the noisiest, which teach
    little."""
    if weighting == "none":
        return torch.ones_like(t)
    if weighting == "min_snr":
        t = t.double()
        return torch.minimum((1.0 - t) ** 2, gamma * t**2).float()
    raise ValueError(f"unknown loss weighting {weighting!r} (expected none or min_snr)")


def flow_matching_loss(
    velocity_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    x0: torch.Tensor,
    t: torch.Tensor,
    eps: torch.Tensor,
    weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean squared error between velocity_fn(x_t, t) and eps - x0, averaged over all elements; with `weight` [B]
    (loss_weight), each item's squared error scaled by its weight before the mean."""
    x_t = interpolate(x0, eps, t)
    v = velocity_fn(x_t, t)
    err = (v.float() - target_velocity(x0, eps).float()) ** 2  # [B, ...]
    if weight is not None:
        err = err * weight.float().reshape(-1, *([1] * (err.ndim - 1)))
    return torch.mean(err)


def ddpm_loss(
    eps_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    x0: torch.Tensor,
    tau: torch.Tensor,
    eps: torch.Tensor,
    table: torch.Tensor,
) -> torch.Tensor:
    """DDPM's simple loss (DiT's `diffusion/`, without the learned-sigma VLB term): the mean squared error between
    eps_fn(x_tau, tau) and eps, x_tau = sqrt(abar) x0 + sqrt(1 - abar) eps at integer VP steps tau [B] of the
    schedule whose log SNR per step is `table` (flowfleet.flow.path.vp_log_snr)."""
    lam = table.to(x0.device)[tau].reshape(-1, *([1] * (x0.ndim - 1)))  # [B, 1, ...] float64
    x_tau = (torch.sigmoid(lam).sqrt() * x0 + torch.sigmoid(-lam).sqrt() * eps).to(x0.dtype)
    pred = eps_fn(x_tau, tau.to(torch.float32))
    return torch.mean((pred.float() - eps.float()) ** 2)


def dispersive_loss(hidden: torch.Tensor, tau: float = 1.0) -> torch.Tensor:
    """Dispersive loss (Wang & He 2025, "Diffuse and Disperse"), its InfoNCE-L2 form: the log of the mean, over
    every ordered pair (i, j) of the batch (i = j included), of exp(-||z_i - z_j||^2 / (D tau)), with z_i item i's
    hidden tokens [B, ...] flattened to D numbers. Minimising it spreads the batch's representations apart, the
    repulsive half of a contrastive loss with no positive pairs, so it leaves the regression target alone. Its value
    lies in [-log B, 0]: 0 when every item's tokens are the same."""
    z = hidden.float().reshape(hidden.shape[0], -1)  # [B, D]
    b, d = z.shape
    dist = torch.cdist(z, z).pow(2) / d  # [B, B] squared distances per number; the diagonal 0
    return torch.logsumexp(-dist.flatten() / tau, dim=0) - 2.0 * math.log(b)


def alignment_loss(projected: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """REPA's alignment (Yu et al. 2025): minus the mean over items and tokens of the cosine similarity between the
    projected hidden tokens [B, N, C] and a frozen encoder's tokens of the same items [B, N, C]; -1 when every
    token points its target's way."""
    return -F.cosine_similarity(projected.float(), target.float(), dim=-1).mean()
