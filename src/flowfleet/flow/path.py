"""The time convention, stated once.

    x_t = (1 - t) * x0 + t * eps,      t in [0, 1],  t = 1 is pure noise
    v   = dx_t/dt = eps - x0           (what every network in flowfleet predicts)

Sampling integrates dx/dt = v from t = 1 down to t = 0. Networks receive t in [0, 1]; the timestep
embedder sees `embedder_timestep(t)`, scaled to [0, 1000] like DiT's discrete timesteps so the
256-frequency sinusoid resolves it. No other module may re-derive any of this.

DDPM experts (ε-prediction on a variance-preserving schedule, DiT's `diffusion/`) speak the same convention to
the rest of flowfleet: an ε-network is queried at the VP time with the same signal-to-noise ratio and its ε turned
into the velocity (docs/heterogeneous-experts.md derives it):

    SNR(t) = (1 - t)^2 / t^2 = abar / (1 - abar)   ->  abar(t), and tau: the VP step with that abar
    x_vp   = x_t / sqrt((1 - t)^2 + t^2)            (= sqrt(abar) x0 + sqrt(1 - abar) eps)
    x0     = (x_vp - sqrt(1 - abar) eps_hat) / sqrt(abar),   v = eps_hat - x0 = (x_t - x0) / t

The schedule's 1000 steps give log-SNR at integer tau; between them it is linear in tau (so `vp_timestep` and
`vp_log_snr_at` are exact inverses), beyond them it is clamped, and never below VP_MIN_LOG_SNR: at t above that
(t > 0.9937) the network sees the step of the clamped SNR, and x0 is recovered at that SNR.
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


# ------------------------------------------------------------------------------------------------
#                         DDPM (epsilon) experts in the same time convention
# ------------------------------------------------------------------------------------------------

VP_STEPS = 1000  # DiT's discrete diffusion steps
VP_SCHEDULES = {"linear": "linear", "cosine": "squaredcos_cap_v2"}  # flowfleet's name -> diffusers' beta_schedule


# The least SNR an epsilon-network is queried at: the last step of DiT's linear schedule (log(abar / (1 - abar)) at
# step 999 of betas 1e-4 .. 0.02), where DDPM's own samplers start. x0 = (x_vp - sigma eps_hat) / alpha multiplies
# the network's error by 1 / alpha: 157x there, but 2e4x at the cosine schedule's last step (log SNR -19.8), where
# epsilon says next to nothing about x0 (Lin et al. 2023, "Common Diffusion Noise Schedules and Sample Steps Are
# Flawed"); a cosine expert's 5 noisiest steps are not used.
VP_MIN_LOG_SNR = -10.1177


def vp_log_snr_bounds(table: torch.Tensor) -> tuple[float, float]:
    """The log SNR range a schedule's epsilon-network is queried in: its steps', and not below VP_MIN_LOG_SNR."""
    return max(float(table[-1]), VP_MIN_LOG_SNR), float(table[0])


def vp_log_snr(schedule: str) -> torch.Tensor:
    """log(abar / (1 - abar)) at VP steps 0 .. 999 of a named schedule (DiT's: linear betas 1e-4 .. 0.02, or the
    cosine schedule), float64 [1000], decreasing. The betas are diffusers' DDPMScheduler's."""
    if schedule not in VP_SCHEDULES:
        raise ValueError(f"schedule: unknown {schedule!r} (expected one of {', '.join(VP_SCHEDULES)})")
    from diffusers import DDPMScheduler  # (the schedule's one implementation; imported where needed)

    scheduler = DDPMScheduler(num_train_timesteps=VP_STEPS, beta_schedule=VP_SCHEDULES[schedule])
    betas = scheduler.betas.double()  # type: ignore[attr-defined]  # set in DDPMScheduler.__init__, undeclared
    abar = torch.cumprod(1.0 - betas, 0)
    return abar.log() - torch.log1p(-abar)


def fm_log_snr(t: torch.Tensor) -> torch.Tensor:
    """log SNR of x_t = (1 - t) x0 + t eps: 2 log((1 - t) / t) (+inf at t = 0, -inf at t = 1)."""
    return 2.0 * (torch.log1p(-t) - torch.log(t))


def vp_log_snr_at(tau: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The schedule's log SNR at fractional VP steps tau in [0, 999] (linear between integer steps)."""
    tau = tau.to(table.dtype).clamp(0, len(table) - 1)
    i = tau.floor().long().clamp(max=len(table) - 2)
    frac = tau - i
    return table[i] + frac * (table[i + 1] - table[i])


def vp_timestep(t: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The fractional VP step whose log SNR (`vp_log_snr_at`) equals that of flowfleet's t, clamped to the
    schedule's steps and to VP_MIN_LOG_SNR: what the timestep embedder of a DDPM expert sees (DiT's 0 .. 999)."""
    lo, hi = vp_log_snr_bounds(table)
    lam = fm_log_snr(t.to(table.dtype)).clamp(min=lo, max=hi)
    rising = -table  # increasing
    i = torch.searchsorted(rising, -lam, right=True).clamp(1, len(table) - 1) - 1  # rising[i] <= -lam
    frac = (lam - table[i]) / (table[i + 1] - table[i])
    return i.to(table.dtype) + frac


def vp_input_scale(t: torch.Tensor) -> torch.Tensor:
    """1 / sqrt((1 - t)^2 + t^2): x_t times this is the VP state of the same SNR."""
    return torch.rsqrt((1.0 - t) ** 2 + t**2)


def velocity_from_eps(eps: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The flow-matching velocity at (x_t, t) implied by an epsilon prediction made at the VP step of t's SNR
    (`vp_timestep`): x0 from the VP state at the (clamped) SNR, then v = eps - x0, or (x_t - x0) / t for t > 1/2
    (the same where both are defined; the second stays finite at t = 1)."""
    dt = torch.promote_types(x_t.dtype, torch.float32)  # bf16 / fp16 activations: the conversion in fp32
    x, e = x_t.to(dt), eps.to(dt)
    tb = _bcast(torch.as_tensor(t, device=x.device).to(dt), x)
    lo, hi = vp_log_snr_bounds(table)
    lam = fm_log_snr(tb).clamp(min=lo, max=hi)
    alpha, sigma = torch.sigmoid(lam).sqrt(), torch.sigmoid(-lam).sqrt()  # sqrt(abar), sqrt(1 - abar)
    x0 = (x * vp_input_scale(tb) - sigma * e) / alpha
    v = torch.where(tb > 0.5, (x - x0) / tb.clamp(min=0.5), e - x0)
    return v.to(x_t.dtype)
