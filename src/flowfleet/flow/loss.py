"""Training objective: t sampling and the velocity regression loss."""

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
