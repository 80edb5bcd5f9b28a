"""The one loss every comparison of the gate uses: the papers' training objective (velocity MSE, the condition on) at
fixed t bins and seeded noise, the same for every model compared on the same items; guidance off (scale 1)."""

from __future__ import annotations

from typing import Callable, Iterator

import torch

from flowfleet.flow.path import interpolate, target_velocity
from flowfleet.models.dit import DiTExpert
from flowfleet.sampling.pipeline import FleetPipeline
from flowfleet.sampling.routing import Condition
from flowfleet.sampling.trace import RoutingTrace
from flowfleet.stages.admit.settings import GateSettings
from flowfleet.train.data import derive_seed
from flowfleet.train.preview import condition_kwargs

CONDITION_FIELDS = ("text_tokens", "text_mask", "text_pooled", "labels")


@torch.no_grad()
def flow_loss(
    velocity: Callable[[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]], torch.Tensor],
    items: dict[str, torch.Tensor],
    settings: GateSettings,
    device: torch.device,
    reverse: bool = False,
) -> float:
    """Mean velocity MSE over t bins' midpoints, noise seeded per bin (the same for every model on the same items).
    reverse: as if t = 0 were noise (x_t = t x0 + (1 - t) eps, target x0 - eps), the convention flowfleet's is not."""
    total = 0.0
    for x_t, t, target, cond in noised(items, settings, device, reverse):
        total += float(((velocity(x_t, t, cond) - target) ** 2).mean())
    return total / settings.t_bins


def noised(
    items: dict[str, torch.Tensor], settings: GateSettings, device: torch.device, reverse: bool = False
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]]:
    """Per t bin: (x_t [N, C, H, W], t [N] at the bin's midpoint, the target velocity, the condition) of the items,
    the noise seeded per bin. reverse: x_t and the target as t = 0 as noise would make them (see flow_loss)."""
    x0 = items["latents"].float().to(device)  # [N, C, H, W]
    cond = {k: v.to(device) for k, v in items.items() if k in CONDITION_FIELDS}
    for b in range(settings.t_bins):
        eps = torch.randn(x0.shape, generator=torch.Generator().manual_seed(derive_seed(settings.seed, b))).to(device)
        t = torch.full((x0.shape[0],), (b + 0.5) / settings.t_bins, device=device)  # [N]
        if reverse:
            yield interpolate(x0, eps, 1 - t), t, -target_velocity(x0, eps), cond
        else:
            yield interpolate(x0, eps, t), t, target_velocity(x0, eps), cond


def expert_velocity(model: DiTExpert) -> Callable[..., torch.Tensor]:
    def v(x: torch.Tensor, t: torch.Tensor, cond: dict[str, torch.Tensor]) -> torch.Tensor:
        return model(x, t, **condition_kwargs(cond, model.cfg))

    return v


def fleet_velocity(pipe: FleetPipeline) -> Callable[..., torch.Tensor]:
    """The routed fleet's velocity (its strategy, router on every call, no guidance)."""
    settings = pipe.settings(guidance_scale=1.0, route_every=1)

    def v(x: torch.Tensor, t: torch.Tensor, cond: dict[str, torch.Tensor]) -> torch.Tensor:
        given = {k: cond[k] for k in CONDITION_FIELDS if k in cond}
        if "text_mask" in given:
            given["text_mask"] = given["text_mask"].bool()
        condition = Condition(**given)
        return pipe.velocity_fn(condition, settings, RoutingTrace(pipe.num_experts))(x, t, 0)

    return v


def subset(items: dict[str, torch.Tensor], n: int, seed: int) -> dict[str, torch.Tensor]:
    count = items["latents"].shape[0]
    pick = torch.randperm(count, generator=torch.Generator().manual_seed(seed))[:n].sort().values
    return {k: v[pick] for k, v in items.items()}
