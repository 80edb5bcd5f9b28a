"""A machine's speed at an expert's own training step: a few steps of forward, flow-matching loss, backward and
AdamW on random inputs of the expert's shape and batch, timed after a warm-up. What `flowfleet plan` divides the
work by (run.yaml machines.NAME.tflops, where not declared)."""

from __future__ import annotations

import contextlib
import statistics
import time

import torch

from flowfleet.flow import flow_matching_loss, sample_t
from flowfleet.models.config import DiTConfig
from flowfleet.models.dit import DiTModel
from flowfleet.models.flops import train_flops_per_sample
from flowfleet.train.loop import autocast_dtype

WARMUP_STEPS = 2  # the allocator's and the kernels' first calls, not timed


def probe_tflops(
    model_cfg: DiTConfig,
    batch: int,
    latent_shape: tuple[int, int, int],
    device: torch.device,
    precision: str = "fp32",
    steps: int = 10,
) -> tuple[float, float]:
    """-> (model TFLOP/s, seconds a step): the median of `steps` timed training steps of `model_cfg` at `batch`."""
    torch.manual_seed(0)
    model = DiTModel.from_dit_config(model_cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    amp = autocast_dtype(precision, device)
    x0 = torch.randn(batch, *latent_shape, device=device)
    cond = {}
    if model_cfg.conditioning in ("pooled", "cross_attn"):
        cond["text_pooled"] = torch.randn(batch, model_cfg.text_dim, device=device)
    if model_cfg.conditioning == "cross_attn":
        cond["text_tokens"] = torch.randn(batch, model_cfg.text_len, model_cfg.text_dim, device=device)
        cond["text_mask"] = torch.ones(batch, model_cfg.text_len, dtype=torch.bool, device=device)
    times = []
    for i in range(WARMUP_STEPS + steps):
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=amp) if amp else contextlib.nullcontext():
            t = sample_t(batch, device=device)
            loss = flow_matching_loss(lambda x, tt: model(x, tt, **cond), x0, t, torch.randn_like(x0))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()  # waits for the device
        if i >= WARMUP_STEPS:
            times.append(time.perf_counter() - start)
    step_s = statistics.median(times)
    return batch * train_flops_per_sample(model_cfg) / step_s / 1e12, step_s
