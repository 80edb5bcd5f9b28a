"""DistriFusion for diffusers transformers (flowfleet.parallel.parallelize on PixArt, SD3, Flux): time,
blocked time per step (proof of overlap) and bytes per step against analytic tensor parallelism.

    .venv/bin/python benchmarks/parallel_transformers.py                       # the figures in BENCHMARKS.md
    .venv/bin/python benchmarks/parallel_transformers.py --models pixart --steps 4 --repeats 1   # quick

Each model at width 256 (4 heads of 64), random weights, a 32 x 32 latent (256 image tokens at patch 2),
16 text tokens, one image with classifier-free guidance (the pipeline's batch of 2: [unconditional;
conditional]); depth: PixArt and SD3 4 blocks, Flux 2 double-stream + 2 single-stream blocks. A
FlowMatchEulerDiscreteScheduler loop of --steps steps; every configuration is a fresh set of processes
(one thread each): "1 rank" on the plain model, "2 ranks" with the model patched by parallelize() in sync
and displaced mode (warm-up 1: steps 0-1 synchronous). One untimed loop first (slot discovery); the
wall time is the slower rank's; the busiest rank's process CPU time (gloo's threads included) shows how
the work splits. Blocked time per step: CommManager.blocked_by_step (seconds waiting inside band
exchanges) averaged over the displaced steps. Bytes per step: one rank's, in a steady step, against
Megatron-style tensor parallelism on 2 ranks, which all-reduces the [B, S, D] fp32 activations after
every attention output projection and every MLP (ring all-reduce: 2 (n-1)/n of the tensor per rank):
PixArt 3 per block (self-attention, cross-attention, MLP) over the image tokens; SD3 and Flux's
double-stream blocks 2 per block over image + text tokens; Flux's single-stream blocks 1 (one output
projection for attention and MLP together). Configurations run --repeats times, interleaved; the
minimum is reported.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.models.transformers.pixart_transformer_2d import PixArtTransformer2DModel
from diffusers.models.transformers.transformer_flux import FluxTransformer2DModel
from diffusers.models.transformers.transformer_sd3 import SD3Transformer2DModel

from flowfleet.parallel import parallelize, run_local

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the test fixtures
from fixtures.transformers import TEXT_DIM, predict  # noqa: E402

SIZE, TEXT_TOKENS, WIDTH, HEADS = 32, 16, 256, 4


def build(kind: str):
    torch.manual_seed(0)
    if kind == "pixart":
        return PixArtTransformer2DModel(
            sample_size=SIZE,
            patch_size=2,
            in_channels=4,
            out_channels=4,
            num_layers=4,
            num_attention_heads=HEADS,
            attention_head_dim=WIDTH // HEADS,
            cross_attention_dim=WIDTH,
            caption_channels=TEXT_DIM,
            use_additional_conditions=False,
        ).eval()
    if kind == "sd3":
        return SD3Transformer2DModel(
            sample_size=SIZE,
            patch_size=2,
            in_channels=4,
            out_channels=4,
            num_layers=4,
            attention_head_dim=WIDTH // HEADS,
            num_attention_heads=HEADS,
            joint_attention_dim=TEXT_DIM,
            caption_projection_dim=WIDTH,
            pooled_projection_dim=TEXT_DIM,
            pos_embed_max_size=SIZE,
        ).eval()
    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=WIDTH // HEADS,
        num_attention_heads=HEADS,
        joint_attention_dim=TEXT_DIM,
        pooled_projection_dim=TEXT_DIM,
        guidance_embeds=False,
        axes_dims_rope=(16, 24, 24),
    ).eval()


def tensor_parallel_bytes(kind: str, ranks: int = 2, batch: int = 2) -> int:
    """One rank's all-reduce bytes per step under Megatron-style tensor parallelism (module docstring)."""
    image = (SIZE // 2) ** 2
    reduces = {"pixart": [(3, image)] * 4, "sd3": [(2, image + TEXT_TOKENS)] * 4}.get(
        kind, [(2, image + TEXT_TOKENS)] * 2 + [(1, image + TEXT_TOKENS)] * 2
    )
    per_rank = 2 * (ranks - 1) / ranks
    return int(sum(n * batch * tokens * WIDTH * 4 * per_rank for n, tokens in reduces))


def loop(model, x, text, steps):
    scheduler = FlowMatchEulerDiscreteScheduler()
    scheduler.set_timesteps(steps)
    both = torch.cat([torch.zeros_like(text), text])
    with torch.no_grad():
        for t in scheduler.timesteps:
            uncond, cond = predict(model, torch.cat([x, x]), both, t.expand(2)).chunk(2)
            x = scheduler.step(uncond + 4.0 * (cond - uncond), t, x).prev_sample
    return x


def _rank(ctx, kind: str, mode: str | None, steps: int) -> dict:
    torch.set_num_threads(1)
    model = build(kind)
    g = torch.Generator().manual_seed(1)
    x, text = torch.randn(1, 4, SIZE, SIZE, generator=g), torch.randn(1, TEXT_TOKENS, TEXT_DIM, generator=g)
    if mode is None:
        loop(model, x, text, 1)  # untimed
        cpu0, t0 = time.process_time(), time.perf_counter()
        loop(model, x, text, steps)
        return {"wall": time.perf_counter() - t0, "cpu": time.process_time() - cpu0}
    with parallelize(model, ctx.world, mode=mode, warmup=1) as handle:
        loop(model, x, text, 1)  # untimed: slot discovery
        handle.reset()  # the timed loop's evaluations are comm steps 0..steps-1 (step 0 also holds the untimed one)
        cpu0, t0 = time.process_time(), time.perf_counter()
        loop(model, x, text, steps)
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        calls = range(steps)
        blocked = [handle.comm.blocked_by_step.get(s, 0.0) for s in calls]
        sent = [handle.comm.bytes_by_step.get(s, 0) for s in calls]
    return {"wall": wall, "cpu": cpu, "blocked": blocked, "bytes": sent}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["pixart", "sd3", "flux"])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default="runs/bench-parallel-transformers")
    a = p.parse_args()
    configs = [(None, 1), ("sync", 2), ("displaced", 2)]
    runs: dict[str, list[dict]] = {}
    load0 = os.getloadavg()
    for _ in range(a.repeats):
        for kind in a.models:
            for mode, n in configs:
                ranks = run_local(_rank, n, (kind, mode, a.steps), start_method="fork", timeout_s=300.0)
                slow = max(ranks, key=lambda r: r["wall"])
                busy = max(r["cpu"] for r in ranks)
                runs.setdefault(f"{kind}/{mode or 'one'}", []).append({**slow, "busiest_cpu": busy})
    table = {}
    for kind in a.models:
        one = min(runs[f"{kind}/one"], key=lambda r: r["wall"])
        row = {"one_rank_wall_s": round(one["wall"], 2), "one_rank_cpu_s": round(one["cpu"], 2)}
        for mode in ("sync", "displaced"):
            best = min(runs[f"{kind}/{mode}"], key=lambda r: r["wall"])
            steady = best["blocked"][2:]  # after warm-up (steps 0-1 synchronous)
            row[mode] = {
                "wall_s": round(best["wall"], 2),
                "busiest_cpu_s": round(best["busiest_cpu"], 2),
                "blocked_ms_per_step": round(1e3 * statistics.mean(steady), 1),
                "blocked_ms_max": round(1e3 * max(steady), 1),
                "bytes_per_step": best["bytes"][-1],
            }
        row["tensor_parallel_bytes_per_step"] = tensor_parallel_bytes(kind)
        table[kind] = row
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "steps": a.steps,
        "load_before_after": [load0, os.getloadavg()],
        "models": table,
    }
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
