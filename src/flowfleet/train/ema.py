"""Exponential moving average of the weights; the EMA is what gets sampled and saved as final/."""

from __future__ import annotations

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn


class EMA:
    """EMA of a model's parameters via torch's AveragedModel (a foreach lerp, deterministic on CPU).

    Buffers are copied, not averaged (the DiT's only buffer is its fixed position table).
    """

    def __init__(self, model: nn.Module, decay: float):
        self.decay = decay
        self.averaged = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay))
        self.averaged.requires_grad_(False)

    @property
    def module(self) -> nn.Module:
        """The averaged copy of the model (same class and config as the trained one)."""
        return self.averaged.module

    def update(self, model: nn.Module) -> None:
        self.averaged.update_parameters(model)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.averaged.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.averaged.load_state_dict(state, strict=True)
