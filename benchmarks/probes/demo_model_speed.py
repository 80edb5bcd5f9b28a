"""Training-step speed of the demo's expert (the `mnist` preset's DiT) and what changes it.

For the model the demo trains (the `mnist` preset's expert: 8 x 8 x 4 latent, 2 x 2 patches, depth 4, pooled MiniLM
text conditioning, batch 64), measured in one run, variant after variant, each on the same resident
batch: samples/s and achieved GFLOP/s (flowfleet.models.flops; forward + backward = 3 forwards), as a
share of a measured fp32 matmul of the model's own largest shape and of a 1024^3 sgemm.

    eager           the model as train-all runs it
    gelu-tanh       the same with DiT's tanh-approximated GELU (the preset runs the exact one: mlp_act gelu)
    compile         torch.compile(model) (inductor; compile time reported apart)
    math-attention  scaled_dot_product_attention restricted to the math kernel
    threads         the same at 1 and 2 torch threads

    .venv/bin/python benchmarks/probes/demo_model_speed.py --threads 1,2 --steps 40
    .venv/bin/python benchmarks/probes/demo_model_speed.py --threads 1 --no-compile --hidden 128   # another width
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the helpers the probes share


def step_times(model, batch: int, steps: int, cfg, attention=None) -> list[float]:
    from flowfleet.flow import flow_matching_loss, sample_t

    gen = torch.Generator().manual_seed(0)
    x0 = torch.randn(batch, cfg.in_channels, *cfg.input_size, generator=gen)
    pooled = torch.randn(batch, cfg.text_dim, generator=gen)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ctx = attention if attention is not None else contextlib.nullcontext
    times = []
    with ctx():
        for i in range(steps + 3):
            t0 = time.perf_counter()
            t = sample_t(batch, mode="logit_normal", generator=gen)
            eps = torch.randn(x0.shape, generator=gen)
            drop = torch.rand(batch, generator=gen) < 0.1

            def velocity(xt, tt, drop=drop):
                return model(xt, tt, drop=drop, text_pooled=pooled)

            loss = flow_matching_loss(velocity, x0, t, eps)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if i >= 3:  # warm-up steps (and compilation) excluded
                times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", default="1,2")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--hidden", type=int, default=None, help="the expert's width (default: the preset's)")
    args = p.parse_args()

    from torch.nn.attention import SDPBackend, sdpa_kernel
    from train_step import sgemm_gflops  # the same measured matmul as benchmarks/train_step.py

    from flowfleet.models.dit import DiTExpert
    from flowfleet.models.flops import train_flops_per_sample
    from flowfleet.presets import preset

    cfg = preset("mnist").expert
    if args.hidden:
        cfg = cfg.model_copy(update={"hidden_size": args.hidden})
    tanh = cfg.model_copy(update={"mlp_act": "gelu_tanh"})
    per_sample = train_flops_per_sample(cfg)
    print(f"expert: hidden {cfg.hidden_size}, depth {cfg.depth}, mlp_act {cfg.mlp_act}, batch {args.batch}")
    rows = []
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        tokens = args.batch * cfg.num_tokens
        peak_model = sgemm_gflops(tokens, cfg.hidden_size, 4 * cfg.hidden_size, reps=50)  # the MLP's first matmul
        peak = sgemm_gflops(1024, 1024, 1024, reps=20)
        variants = {
            "eager": (lambda: DiTExpert.from_dit_config(cfg), None),
            "gelu-tanh": (lambda: DiTExpert.from_dit_config(tanh), None),
            "math-attention": (lambda: DiTExpert.from_dit_config(cfg), lambda: sdpa_kernel(SDPBackend.MATH)),
        }
        if not args.no_compile:
            variants["compile"] = (lambda: torch.compile(DiTExpert.from_dit_config(cfg)), None)
        for name, (build, attention) in variants.items():
            torch.manual_seed(0)
            model = build()
            t0 = time.perf_counter()
            times = step_times(model, args.batch, args.steps, cfg, attention)
            wall = time.perf_counter() - t0
            med = statistics.median(times)
            gflops = per_sample * args.batch / med / 1e9
            rows.append(
                {
                    "threads": threads,
                    "variant": name,
                    "step_ms": round(1000 * med, 1),
                    "samples_per_s": round(args.batch / med, 1),
                    "gflops": round(gflops, 2),
                    "share_of_model_sgemm": round(gflops / peak_model, 3),
                    "share_of_sgemm_1024": round(gflops / peak, 3),
                    "sgemm_model_shape_gflops": round(peak_model, 1),
                    "sgemm_1024_gflops": round(peak, 1),
                    "setup_and_warmup_s": round(wall - sum(times), 1),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    print(
        "\n| threads | variant | step ms | samples/s | GFLOP/s | share of sgemm (model shape) | share of sgemm 1024³ |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['threads']} | {r['variant']} | {r['step_ms']} | {r['samples_per_s']} | {r['gflops']} | "
            f"{r['share_of_model_sgemm']:.2f} ({r['sgemm_model_shape_gflops']}) | "
            f"{r['share_of_sgemm_1024']:.2f} ({r['sgemm_1024_gflops']}) |"
        )


if __name__ == "__main__":
    main()
