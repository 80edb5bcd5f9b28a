"""Flow matching: the one home of flowfleet's time convention.

path.py      interpolant x_t, target velocity, timestep scaling for the embedder; a ddpm expert's VP time and
             its noise as the velocity
loss.py      training-time sampling of t, the velocity regression loss and its weighting over t; DDPM's noise
             regression
sampler.py   t-grids, Euler/Heun ODE integration from t=1 (noise) to t=0 (data), the guided velocity (CFG) of a
             model and of a mixture of experts
ensemble.py  combining expert velocities with router weights (top-k renormalised, full, one drawn expert)
"""

from flowfleet.flow.ensemble import Strategy, combine, routing_weights, same_as_earlier
from flowfleet.flow.loss import alignment_loss, ddpm_loss, dispersive_loss, flow_matching_loss, loss_weight, sample_t
from flowfleet.flow.path import (
    TIME_CONVENTION,
    embedder_timestep,
    interpolate,
    target_velocity,
    x0_from_velocity,
)
from flowfleet.flow.sampler import (
    cfg_combine,
    guidance_scale_at,
    guided_mixture,
    guided_velocity,
    integrate,
    time_grid,
)

__all__ = [
    "TIME_CONVENTION",
    "embedder_timestep",
    "interpolate",
    "target_velocity",
    "x0_from_velocity",
    "alignment_loss",
    "dispersive_loss",
    "flow_matching_loss",
    "loss_weight",
    "ddpm_loss",
    "sample_t",
    "time_grid",
    "integrate",
    "cfg_combine",
    "guidance_scale_at",
    "guided_velocity",
    "guided_mixture",
    "combine",
    "routing_weights",
    "same_as_earlier",
    "Strategy",
]
