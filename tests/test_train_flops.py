"""The analytic DiT FLOP count against torch's FlopCounterMode, and the monolith's matched compute."""

from __future__ import annotations

import math

import pytest
import torch
from fixtures.synthetic_run import synthetic_config
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from flowfleet.models.config import DiTConfig
from flowfleet.models.dit import DiTModel
from flowfleet.models.flops import forward_flops, projector_flops, train_flops, train_flops_per_sample
from flowfleet.train.specs import JobSpec, job_steps, monolith_steps

SMALL = dict(hidden_size=64, depth=2, num_heads=2, patch_size=2, in_channels=1)  # overridden per entry
CONFIGS = [
    dict(size="tiny/4", input_size=(16, 16), in_channels=1),
    dict(SMALL, input_size=(8, 8), conditioning="cross_attn", text_dim=24, text_len=5, add_pooled=True),
    dict(SMALL, input_size=(8, 12), in_channels=3, adaln="single", conditioning="pooled", text_dim=24),
    dict(SMALL, hidden_size=32, depth=1, input_size=(8, 8), conditioning="class", num_classes=10, out_channels=2),
    dict(SMALL, hidden_size=32, depth=1, patch_size=4, input_size=(8, 8), num_outputs=3),
]


def _inputs(cfg: DiTConfig, b: int) -> dict:
    kw = {"drop": torch.zeros(b, dtype=torch.bool)}
    if cfg.conditioning == "class":
        kw["labels"] = torch.zeros(b, dtype=torch.long)
    if cfg.uses_text:
        kw["text_pooled"] = torch.randn(b, cfg.text_dim)
    if cfg.conditioning == "cross_attn":
        kw["text_tokens"] = torch.randn(b, cfg.text_len, cfg.text_dim)
        kw["text_mask"] = torch.ones(b, cfg.text_len, dtype=torch.bool)
    return kw


@pytest.mark.parametrize(
    "kw",
    CONFIGS,
    ids=lambda kw: f"{kw.get('conditioning', 'none')}-{kw.get('adaln', 'zero')}-{kw.get('num_outputs', 0)}",
)
def test_forward_flops_equal_flop_counter(kw):
    cfg = DiTConfig(**kw)
    model = DiTModel.from_dit_config(cfg)
    b = 3
    counter = FlopCounterMode(display=False)
    # The math backend decomposes attention into matmuls that the counter sees on CPU.
    with counter, sdpa_kernel(SDPBackend.MATH), torch.no_grad():
        model(torch.randn(b, cfg.in_channels, *cfg.input_size), torch.rand(b), **_inputs(cfg, b))
    assert counter.get_total_flops() == b * forward_flops(cfg)


def test_dit_s2_matches_the_paper():
    # DiT paper Table 4: DiT-S/2 at 256x256 (32x32x4 latents) is 6.06 Gflops, counted as multiply-adds.
    cfg = DiTConfig(size="S/2", input_size=(32, 32), in_channels=4, out_channels=8)
    assert forward_flops(cfg) / 2 / 1e9 == pytest.approx(6.06, abs=0.005)  # the paper's 2 decimals


def test_training_flops_are_about_three_forwards():
    cfg = DiTConfig(**CONFIGS[0])
    model = DiTModel.from_dit_config(cfg)
    counter = FlopCounterMode(display=False)
    with counter, sdpa_kernel(SDPBackend.MATH):
        out = model(torch.randn(2, 1, 16, 16), torch.rand(2), drop=torch.zeros(2, dtype=torch.bool))
        out.square().mean().backward()
    measured = counter.get_total_flops() / 2
    # an estimate, not rounding: 3 forwards (backward ~ 2 forwards) vs torch's count, which skips the input
    # gradient of the first layer (the noisy latent needs none); 2 % is that estimate's stated accuracy
    assert measured == pytest.approx(train_flops_per_sample(cfg), rel=0.02)
    assert train_flops(cfg, steps=10, batch_size=4) == 40 * train_flops_per_sample(cfg)


def test_repas_projector_is_counted_in_training_not_in_sampling():
    """expert.repa_dim: the projector runs on every training forward's tokens (counted, x3 with its backward, in the
    FLOPs the compute matching reads) and never at sampling (the forward's count is unchanged)."""
    plain = DiTConfig(**CONFIGS[0])
    cfg = DiTConfig(**{**CONFIGS[0], "repa_dim": 6})
    model = DiTModel.from_dit_config(cfg)
    tokens = torch.randn(3, cfg.num_tokens, cfg.hidden_size)  # [B, N, D]
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model.repa_projector(tokens)
    assert counter.get_total_flops() == 3 * projector_flops(cfg) and projector_flops(plain) == 0
    assert forward_flops(cfg) == forward_flops(plain)
    assert train_flops_per_sample(cfg) == train_flops_per_sample(plain) + 3 * projector_flops(cfg)


def test_monolith_matches_the_fleets_compute_router_included():
    cfg = synthetic_config(k=3, steps=7, batch=8, monolith=True)
    steps = monolith_steps(cfg, match_compute=True)
    experts = cfg.cluster.k * train_flops(cfg.expert, cfg.train.steps, cfg.train.batch_size)
    router = train_flops(cfg.router, cfg.router_train.steps, cfg.router_train.batch_size)
    per_step = train_flops(cfg.expert, 1, cfg.train.batch_size)
    # the fewest steps that reach the fleet's FLOPs: at least as many, and one step fewer would not
    assert (steps - 1) * per_step < experts + router <= steps * per_step
    assert steps == 21 + math.ceil(router / per_step) and router > 0
    assert monolith_steps(cfg, match_compute=False) == 7
    assert job_steps(cfg, JobSpec("monolith")) == steps  # run.yaml's monolith.match_compute defaults to true


def test_the_parameter_formula_is_the_built_models_count():
    """flowfleet.models.flops.parameter_count (what admit bounds a stranger's config.json by, before building it) is
    the model's own count, for every conditioning, adaLN, head, augmentation and output of a seeded set of configs."""
    import random

    from flowfleet.models.config import DiTConfig
    from flowfleet.models.dit import DiTModel
    from flowfleet.models.flops import parameter_count

    rng = random.Random(0)
    checked = 0
    while checked < 60:
        heads, cond = rng.choice([1, 2, 4]), rng.choice(["none", "class", "pooled", "cross_attn"])
        kw = dict(
            input_size=(8, 8),
            in_channels=rng.choice([1, 3, 4]),
            patch_size=rng.choice([1, 2, 4]),
            hidden_size=heads * rng.choice([8, 16]),
            depth=rng.choice([1, 2, 3]),
            num_heads=heads,
            mlp_ratio=rng.choice([2.0, 3.5, 4.0]),
            adaln=rng.choice(["zero", "single"]),
            conditioning=cond,
            num_outputs=rng.choice([0, 0, 3]),
            augment_dim=rng.choice([0, 5]),
            num_classes=10 if cond == "class" else 0,
            text_dim=12 if cond in ("pooled", "cross_attn") else 0,
            text_len=5 if cond == "cross_attn" else 0,
            add_pooled=cond == "cross_attn" and rng.random() < 0.5,
            cross_norm=rng.random() < 0.5,
        )
        kw["repa_dim"] = rng.choice([0, 7]) if not kw["num_outputs"] else 0  # REPA's projector (experts only)
        cfg = DiTConfig(**kw)
        with torch.device("meta"):
            built = sum(p.numel() for p in DiTModel.from_dit_config(cfg).parameters())
        assert parameter_count(cfg) == built, kw
        checked += 1
    # a depth or width that would never finish building is counted at once
    huge = DiTConfig(input_size=(8, 8), in_channels=1, hidden_size=2**40, num_heads=2**10, depth=1_000_000)
    assert parameter_count(huge) > 10**30
