"""Post-hoc EMA (Karras et al. 2024, "Analyzing and Improving the Training Dynamics of Diffusion Models", EDM2):
train once with a few power-function EMAs, keep their snapshots, and choose the averaging length afterwards.

A power-function EMA of exponent gamma averages the weights seen up to update t with weights proportional to
tau^gamma (tau = 1..t): its decay at update t is (1 - 1/t)^(gamma + 1), so its length grows with training and is
given relative to it, sigma_rel (the standard deviation of the averaging profile over the training so far, as a
share of it). Any profile of another sigma_rel, at any snapshot's step, is close to a linear combination of the
stored snapshots' profiles; the coefficients that fit it best in L2 over tau give its weights as the same combination
of the snapshots' weights (`posthoc_coefficients`, `reconstruct`).

Written here rather than taken from a library: no maintained package on PyPI offers the reconstruction for arbitrary
modules (EDM2's own phema.py is research code that is not packaged).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import safetensors.torch
import torch
from torch import nn

from flowfleet.layout import EMA_SNAPSHOTS
from flowfleet.storage import RunRoot

Snapshot = tuple[int, float, Mapping[str, torch.Tensor]]  # (step, gamma, weights)


def gamma_of(sigma_rel: float) -> float:
    """The power-function exponent gamma of relative length sigma_rel: the real root above -1 of
    sigma_rel^2 (gamma + 2)^2 (gamma + 3) = gamma + 1, i.e. gamma^3 + 7 gamma^2 + (16 - s) gamma + (12 - s) = 0
    with s = sigma_rel^-2."""
    if not 0 < sigma_rel < 12**-0.5:  # gamma -> -1 as sigma_rel -> 1 / sqrt(12), the uniform average's length
        raise ValueError(f"sigma_rel: {sigma_rel} is not in (0, {12**-0.5:.4f})")
    s = sigma_rel**-2
    roots = np.roots([1.0, 7.0, 16.0 - s, 12.0 - s])
    real = [r.real for r in roots if abs(r.imag) < 1e-9 and r.real > -1]
    return float(max(real))


def sigma_rel_of(gamma: float) -> float:
    """The relative length of a power-function EMA of exponent gamma (> -1)."""
    return float(np.sqrt((gamma + 1) / ((gamma + 2) ** 2 * (gamma + 3))))


class PowerEMA:
    """A power-function EMA of a module's parameters (buffers copied): after t updates it holds
    sum_tau tau^gamma theta_tau / sum_tau tau^gamma, up to the discrete decay's rounding."""

    def __init__(self, model: nn.Module, sigma_rel: float):
        self.sigma_rel, self.gamma = sigma_rel, gamma_of(sigma_rel)
        self.updates = 0
        self.params = {n: p.detach().clone().float() for n, p in model.state_dict().items()}

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        self.updates += 1
        beta = (1.0 - 1.0 / self.updates) ** (self.gamma + 1)  # 0 at the first update: a copy
        for name, value in model.state_dict().items():
            mine = self.params[name]
            if value.is_floating_point():
                mine.lerp_(value.detach().float(), 1.0 - beta)
            else:
                mine.copy_(value)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {**self.params, "__updates__": torch.tensor(self.updates)}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        self.updates = int(state["__updates__"])
        for name, value in state.items():
            if name != "__updates__":
                self.params[name].copy_(value)


class TrackedEMAs:
    """A job's power-function EMAs of the lengths train.posthoc_ema names (rank 0's), checkpointed with the job, and
    their snapshots, one file a step under the job's ema/ folder."""

    def __init__(self, model: nn.Module, lengths: Sequence[float]):
        self.emas = [PowerEMA(model, s) for s in lengths]

    def update(self, model: nn.Module) -> None:
        for ema in self.emas:
            ema.update(model)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {f"{e.sigma_rel!r}/{name}": v for e in self.emas for name, v in e.state_dict().items()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        for e in self.emas:
            prefix = f"{e.sigma_rel!r}/"
            e.load_state_dict({k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)})

    def write_snapshot(self, root: RunRoot, job_dir: str, step: int) -> None:
        """ema/step-<step>.safetensors: every tracked EMA's weights, keyed '<sigma_rel>/<name>' (atomic write)."""
        tensors = {f"{e.sigma_rel!r}/{n}": v.contiguous() for e in self.emas for n, v in e.params.items()}
        root.write_bytes(safetensors.torch.save(tensors), job_dir, EMA_SNAPSHOTS, f"step-{step:07d}.safetensors")


def read_snapshots(root: RunRoot, job_dir: str) -> list[Snapshot]:
    """Every snapshot a job's ema/ folder holds, one (step, gamma, weights) per tracked length and step: the step
    from the file's name, the length from each key's prefix."""
    out: list[Snapshot] = []
    for name in root.ls(job_dir, EMA_SNAPSHOTS):
        if not (name.startswith("step-") and name.endswith(".safetensors")):
            continue
        step = int(name.removeprefix("step-").removesuffix(".safetensors"))
        by_length: dict[str, dict[str, torch.Tensor]] = {}
        for key, value in safetensors.torch.load(root.read_bytes(job_dir, EMA_SNAPSHOTS, name)).items():
            length, _, param = key.partition("/")
            by_length.setdefault(length, {})[param] = value
        out += [(step, gamma_of(float(length)), weights) for length, weights in sorted(by_length.items())]
    return out


def _overlaps(t_a: np.ndarray, g_a: np.ndarray, t_b: np.ndarray, g_b: np.ndarray) -> np.ndarray:
    """The L2 inner products over tau in [0, inf) of the normalised power profiles
    p(tau) = (gamma + 1) tau^gamma / t^(gamma + 1) on [0, t], every a against every b: [len(a), len(b)]."""
    ta, ga = t_a[:, None], g_a[:, None]
    tb, gb = t_b[None, :], g_b[None, :]
    t_min = np.minimum(ta, tb)
    # int_0^m (ga + 1)(gb + 1) tau^(ga + gb) dtau / (ta^(ga + 1) tb^(gb + 1)), in logs: the powers of large steps
    log = (
        np.log(ga + 1)
        + np.log(gb + 1)
        + (ga + gb + 1) * np.log(t_min)
        - np.log(ga + gb + 1)
        - (ga + 1) * np.log(ta)
        - (gb + 1) * np.log(tb)
    )
    return np.exp(log)


def posthoc_coefficients(snapshots: Sequence[tuple[int, float]], target: tuple[int, float]) -> np.ndarray:
    """The coefficients x [len(snapshots)] whose combination of the snapshots' averaging profiles (each a (step,
    gamma)) is nearest in L2 to the target's (step, gamma): the least-squares solution of A x = b."""
    steps = np.array([s for s, _ in snapshots], dtype=np.float64)
    gammas = np.array([g for _, g in snapshots], dtype=np.float64)
    a = _overlaps(steps, gammas, steps, gammas)
    b = _overlaps(steps, gammas, np.array([float(target[0])]), np.array([float(target[1])]))[:, 0]
    x, *_ = np.linalg.lstsq(a, b, rcond=None)
    return x


def reconstruct(
    snapshots: Iterable[tuple[int, float, Mapping[str, torch.Tensor]]], sigma_rel: float, step: int | None = None
) -> dict[str, torch.Tensor]:
    """The weights of a power-function EMA of relative length sigma_rel at `step` (default: the last snapshot's),
    from snapshots (step, gamma, weights) of other lengths: the same combination of their weights as of their
    profiles (posthoc_coefficients). Snapshots after `step` take no part."""
    taken = list(snapshots)
    if not taken:
        raise ValueError("reconstruct: no snapshots")
    step = max(s for s, _, _ in taken) if step is None else step
    taken = [snap for snap in taken if snap[0] <= step]
    x = posthoc_coefficients([(s, g) for s, g, _ in taken], (step, gamma_of(sigma_rel)))
    latest = max(taken, key=lambda snap: snap[0])[2]
    out: dict[str, torch.Tensor] = {}
    for name, value in latest.items():
        if not value.is_floating_point():  # a counter or an index, not averaged: the newest snapshot's
            out[name] = value.clone()
            continue
        total = sum(float(c) * weights[name].double() for c, (_, _, weights) in zip(x, taken))
        out[name] = torch.as_tensor(total).to(value.dtype)
    return out
