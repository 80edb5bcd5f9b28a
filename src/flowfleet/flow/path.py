"""The time convention, stated once.

    x_t = (1 - t) * x0 + t * eps,      t in [0, 1],  t = 1 is pure noise
    v   = dx_t/dt = eps - x0           (what every network in flowfleet predicts)

Sampling integrates dx/dt = v from t = 1 down to t = 0. Networks receive t in [0, 1]; the timestep
embedder sees `embedder_timestep(t)`, scaled to [0, 1000] like DiT's discrete timesteps so the
256-frequency sinusoid resolves it. No other module may re-derive any of this.
"""

from __future__ import annotations

import torch

# Written into every model config so that experts trained elsewhere can be checked for compatibility.
TIME_CONVENTION = "x_t=(1-t)*x0+t*eps; v=eps-x0; t=1 noise; embed=1000*t"
EMBED_TIME_SCALE = 1000.0


def _bcast(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Reshape per-sample t [B] (or a scalar) so it broadcasts against x [B, ...]."""
    t = torch.as_tensor(t, dtype=x.dtype, device=x.device)
    if t.ndim == 0:
        return t
    return t.reshape(-1, *([1] * (x.ndim - 1)))


def interpolate(x0: torch.Tensor, eps: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """x_t = (1 - t) x0 + t eps."""
    tb = _bcast(t, x0)
    return (1.0 - tb) * x0 + tb * eps


def target_velocity(x0: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """v = eps - x0, the regression target of every expert."""
    return eps - x0


def x0_from_velocity(x_t: torch.Tensor, v: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Clean estimate implied by a velocity: x0 = x_t - t v."""
    return x_t - _bcast(t, x_t) * v


def embedder_timestep(t: torch.Tensor) -> torch.Tensor:
    """The value fed to the sinusoidal timestep embedder for t in [0, 1]."""
    return t * EMBED_TIME_SCALE
