"""Exponential moving average of the weights; the EMA is what gets sampled and saved as final/."""

from __future__ import annotations

from dataclasses import dataclass
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


@dataclass(frozen=True)
class _Lists:
    """The averaged copy's parameters beside the trained model's, in module order, and where each buffer of both
    lives. Parameter objects stay a module's own through `.to()` and an in-place load_state_dict (detached views
    would not); `.to()` replaces buffers, so those are looked up by owner and name at every update."""

    model: nn.Module  # the trained model these were made for
    ours: list[torch.Tensor]
    theirs: list[torch.Tensor]
    buffers: list[tuple[nn.Module, nn.Module, str]]  # (our owner, theirs, name)

    @classmethod
    def of(cls, averaged: nn.Module, model: nn.Module) -> "_Lists":
        ours: list[torch.Tensor] = list(averaged.parameters())
        theirs: list[torch.Tensor] = list(model.parameters())
        if [p.shape for p in ours] != [p.shape for p in theirs]:
            raise ValueError("EMA.update: the model's parameters are not those of the averaged copy")
        owners = [
            (a, b, name)
            for a, b in zip(averaged.modules(), model.modules())
            for name, _ in a.named_buffers(recurse=False)
        ]
        return cls(model, ours, theirs, owners)

    def buffer_tensors(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return [getattr(a, n) for a, _, n in self.buffers], [getattr(b, n) for _, b, n in self.buffers]


class EMA(Generic[M]):
    """EMA of a model's parameters, kept in torch's AveragedModel (its state dict and `n_averaged` count).

    Buffers are copied, not averaged (the DiT's only buffer is its fixed position table). The number
    of updates lives in AveragedModel's `n_averaged` buffer, so it is checkpointed with the weights.

    The update is AveragedModel.update_parameters' own arithmetic (a copy first, then one foreach lerp, as torch's
    get_ema_multi_avg_fn) on tensor lists made once per trained model: update_parameters walks both modules, detaches
    and groups every tensor again each step, a visible share of a small expert's step on a CPU.
    """

    def __init__(self, model: M, decay: float, warmup: bool = True):
        self.decay = decay
        self.warmup = warmup
        self.averaged = AveragedModel(model)
        self.averaged.requires_grad_(False)
        self._lists: _Lists | None = None  # made at the first update, for the model updated from

    @property
    def module(self) -> M:
        """The averaged copy of the model (same class and config as the trained one)."""
        return cast(M, self.averaged.module)

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        if self._lists is None or self._lists.model is not model:
            self._lists = _Lists.of(self.averaged.module, model)
        lists = self._lists
        n = int(self.averaged.n_averaged)  # earlier updates
        if n == 0:
            torch._foreach_copy_(lists.ours, lists.theirs)
        else:
            torch._foreach_lerp_(lists.ours, lists.theirs, 1.0 - ema_decay_at(self.decay, n, self.warmup))
        if lists.buffers:
            torch._foreach_copy_(*lists.buffer_tensors())
        self.averaged.n_averaged += 1

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.averaged.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.averaged.load_state_dict(state, strict=True)  # in place: the lists of update stay the module's
