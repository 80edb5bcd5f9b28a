"""Training objectives: t sampling and the velocity regression loss; DDPM's noise regression for a ddpm expert."""

from __future__ import annotations

from typing import Callable, Literal

import torch

from flowfleet.flow.path import interpolate, target_velocity

TimeSampling = Literal["uniform", "logit_normal"]


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


def flow_matching_loss(
    velocity_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    x0: torch.Tensor,
    t: torch.Tensor,
    eps: torch.Tensor,
) -> torch.Tensor:
    """Mean squared error between velocity_fn(x_t, t) and eps - x0, averaged over all elements."""
    x_t = interpolate(x0, eps, t)
    v = velocity_fn(x_t, t)
    return torch.mean((v.float() - target_velocity(x0, eps).float()) ** 2)


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
