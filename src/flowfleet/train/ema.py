"""Exponential moving average of the weights; the EMA is what gets sampled and saved as final/."""

from __future__ import annotations

from typing import Generic, TypeVar, cast

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel


def ema_decay_at(decay: float, updates: int, warmup: bool) -> float:
    """The decay of an update that follows `updates` earlier ones (the first copies the weights). With
    warm-up it grows as (1 + n) / (10 + n) up to `decay` (the schedule of diffusers' EMAModel), so a run
    of a few hundred steps is not dominated by its random initialisation."""
    return min(decay, (1 + updates) / (10 + updates)) if warmup else decay


M = TypeVar("M", bound=nn.Module)
_Tensors = tuple[torch.Tensor, ...] | list[torch.Tensor]  # what torch._foreach_* take


class EMA(Generic[M]):
    """EMA of a model's parameters via torch's AveragedModel (a foreach lerp, deterministic on CPU).

    Buffers are copied, not averaged (the DiT's only buffer is its fixed position table). The number
    of updates lives in AveragedModel's `n_averaged` buffer, so it is checkpointed with the weights.
    """

    def __init__(self, model: M, decay: float, warmup: bool = True):
        self.decay = decay
        self.warmup = warmup

        @torch.no_grad()
        def lerp_all(ema_params: _Tensors, params: _Tensors, n: torch.Tensor | int) -> None:
            # AveragedModel calls this from the second update on (the first copies); n counts earlier updates.
            d = ema_decay_at(self.decay, int(n), self.warmup)
            torch._foreach_lerp_(ema_params, params, 1.0 - d)  # what torch's own get_ema_multi_avg_fn runs

        self.averaged = AveragedModel(model, multi_avg_fn=lerp_all)
        self.averaged.requires_grad_(False)

    @property
    def module(self) -> M:
        """The averaged copy of the model (same class and config as the trained one)."""
        return cast(M, self.averaged.module)

    def update(self, model: nn.Module) -> None:
        self.averaged.update_parameters(model)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.averaged.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.averaged.load_state_dict(state, strict=True)
