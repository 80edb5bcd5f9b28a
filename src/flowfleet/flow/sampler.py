"""ODE samplers over a t-grid from 1 (noise) to 0 (data), and classifier-free guidance (the one home of
the guided velocity: `guided_velocity` runs a model once on [conditional; unconditional] rows; `guided_mixture`
is the guided velocity of a mixture of experts, each branch mixed by its own posterior)."""

from __future__ import annotations

import struct
from typing import Callable, Literal

import torch

from flowfleet.flow.ensemble import combine

VelocityFn = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]  # (x_t, t[B], step index) -> v
SamplerName = Literal["euler", "heun"]


def time_grid(steps: int, shift: float = 1.0, device: torch.device | str = "cpu") -> torch.Tensor:
    """steps + 1 decreasing times from 1 to 0. shift > 1 spends more steps at high noise
    (SD3's t' = s t / (1 + (s - 1) t))."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if shift <= 0:
        raise ValueError(f"shift must be > 0, got {shift}")
    t = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64)
    t = shift * t / (1.0 + (shift - 1.0) * t)
    return t.to(device=device, dtype=torch.float32)


def integrate(
    velocity_fn: VelocityFn,
    x1: torch.Tensor,
    grid: torch.Tensor,
    sampler: SamplerName = "euler",
    callback: Callable[[int, torch.Tensor], object] | None = None,  # its return value is ignored
) -> torch.Tensor:
    """Integrate dx/dt = v(x, t) along `grid` (decreasing) starting from noise x1.

    Heun uses the trapezoid correction on every step except the last one into t = 0, which is a
    plain Euler step (as in EDM), so the network is never asked for the velocity at t = 0 exactly.
    velocity_fn receives the step index so callers can cache per-step work (routing, comm).
    """
    if sampler not in ("euler", "heun"):
        raise ValueError(f"unknown sampler {sampler!r} (expected euler or heun)")
    x = x1
    n = x.shape[0]
    for i in range(len(grid) - 1):
        t_cur, t_next = grid[i], grid[i + 1]
        dt = (t_next - t_cur).to(x.dtype)
        v = velocity_fn(x, t_cur.expand(n), i)
        x_next = x + dt * v
        if sampler == "heun" and float(t_next) > 0.0:
            v_next = velocity_fn(x_next, t_next.expand(n), i)
            x_next = x + dt * 0.5 * (v + v_next)
        x = x_next
        if callback is not None:
            callback(i, x)
    return x


def guidance_scale_at(guidance_scale: float, t: float, max_t: float = 1.0) -> float:
    """The guidance scale at time t: `guidance_scale` while t <= max_t, 1 (no guidance) at the noisier steps above it
    (the sampling settings' guided interval, config.SamplingConfig.guidance_at; max_t = 1 guides every step).
    Compared in float32, the time grid's precision: a grid time that is max_t (0.8 is 0.800000012 in float32) is
    guided.
    """
    return guidance_scale if t <= _float32(max_t) else 1.0


def _float32(value: float) -> float:
    return struct.unpack("f", struct.pack("f", value))[0]


def cfg_combine(v_cond: torch.Tensor, v_uncond: torch.Tensor, guidance_scale: float) -> torch.Tensor:
    """Classifier-free guidance on all channels: v_u + s (v_c - v_u), s = guidance_scale; 1 is no guidance."""
    return v_uncond + guidance_scale * (v_cond - v_uncond)


def guided_mixture(
    v_cond: torch.Tensor,
    v_uncond: torch.Tensor,
    w_cond: torch.Tensor,
    w_uncond: torch.Tensor,
    guidance_scale: float,
) -> torch.Tensor:
    """The classifier-free guided velocity of a mixture of experts, [B, ...]:

        v = sum_k w_u[b, k] v_u[k, b] + s * (sum_k w_c[b, k] v_c[k, b] - sum_k w_u[b, k] v_u[k, b])

    v_cond / v_uncond [K, B, ...]: each expert's velocity with the condition and with the null condition; w_cond /
    w_uncond [B, K]: dense mixture weights of each branch, p(k | x_t, t, c) and p(k | x_t, t, null). With exact
    experts and posteriors this is the guided velocity of one model trained on all the data, since DDM's
    decomposition (paris Eq. 3) holds for the conditional and the unconditional flow separately. Guiding inside
    each expert and mixing with one posterior is the special case w_uncond = w_cond, another vector field."""
    return cfg_combine(combine(v_cond, w_cond), combine(v_uncond, w_uncond), guidance_scale)


def guided_velocity(
    model: Callable[..., torch.Tensor],
    x: torch.Tensor,
    t: torch.Tensor,
    cond: dict[str, torch.Tensor],
    guidance_scale: float,
    **model_kwargs,
) -> torch.Tensor:
    """Classifier-free guided velocity [B, ...] from ONE model call on 2B rows: the B samples with their
    condition, then the same samples with drop=True (the null condition); cfg_combine of the halves.
    `model_kwargs` go to the call unchanged (e.g. a patch-parallel expert's mode and row slots, which the
    caller gives for all 2B rows)."""
    n = x.shape[0]
    drop = torch.arange(2 * n, device=x.device) >= n  # [2B]: first half conditioned, second half null
    both = {name: torch.cat([c, c]) for name, c in cond.items()}
    v = model(torch.cat([x, x]), torch.cat([t, t]), drop=drop, **both, **model_kwargs)
    v_cond, v_uncond = v.chunk(2)  # each [B, ...]
    return cfg_combine(v_cond, v_uncond, guidance_scale)
