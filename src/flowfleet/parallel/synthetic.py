"""A quickly trained DiT whose images have global structure, for patch-parallel quality checks.

Oriented sinusoidal stripes (random angle, frequency and phase) continue across the whole image, so
a band that never sees the others (the naive baseline) cannot know where its neighbour's stripes are
and leaves seams, while displaced patch parallelism keeps them continuous. Used by
tests/test_parallel_dit.py and benchmarks/parallel.py; a few hundred CPU steps suffice.
"""

from __future__ import annotations

import math
import time

import torch

from flowfleet.flow import flow_matching_loss, sample_t
from flowfleet.models.config import DiTConfig
from flowfleet.models.dit import DiTModel


def stripes(n: int, size: int, generator: torch.Generator) -> torch.Tensor:
    """n images [n, 1, size, size] in [-1, 1]: sin(2 pi f (u cos a + v sin a) + phase)."""
    angle = torch.rand(n, 1, 1, generator=generator) * math.pi
    freq = (1.5 + 1.5 * torch.rand(n, 1, 1, generator=generator)) / size  # 1.5..3 periods per image
    phase = torch.rand(n, 1, 1, generator=generator) * 2 * math.pi
    v, u = torch.meshgrid(torch.arange(size).float(), torch.arange(size).float(), indexing="ij")
    return torch.sin(2 * math.pi * freq * (u * angle.cos() + v * angle.sin()) + phase)[:, None]


def train_stripes_dit(cfg: DiTConfig, iters: int, *, batch: int = 32, lr: float = 3e-3, seed: int = 0,
                      log: bool = False) -> DiTModel:
    """Flow-matching training of an unconditional DiT on stripes for a fixed number of steps (eval mode)."""
    if cfg.in_channels != 1 or cfg.input_size[0] != cfg.input_size[1] or cfg.conditioning != "none":
        raise ValueError("stripes are square, single-channel and unconditional")
    torch.manual_seed(seed)
    model = DiTModel.from_dit_config(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed)
    t0 = time.monotonic()
    for it in range(iters):
        x0 = stripes(batch, cfg.input_size[0], gen)
        t = sample_t(batch, generator=gen)
        eps = torch.randn(x0.shape, generator=gen)
        loss = flow_matching_loss(lambda x, tt: model(x, tt), x0, t, eps)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if log and (it % 100 == 0 or it == iters - 1):
            print(f"  train {it:5d}/{iters}  loss {loss.item():.4f}  {time.monotonic() - t0:.1f} s", flush=True)
    return model.eval()
