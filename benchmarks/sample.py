"""Routed sampling: latency of monolith vs top-1 / top-2 / full, and peak RAM with --offload.

    .venv/bin/python benchmarks/sample.py                # both parts, the figures in BENCHMARKS.md
    .venv/bin/python benchmarks/sample.py --part latency --quick

Part 1 (latency, one process). K random-weight DiT experts of one size, a smaller DiT router, text
cross-attention and CFG (conditional + unconditional rows batched). The monolith is one expert of the
same size sampled through the same FleetPipeline loop (router=None), so every ratio isolates what
routing adds: the router passes, and splitting a batch across the experts its samples selected.
Each configuration runs `--repeats` times, interleaved. The ratios use the minimum CPU time of the
process over the repeats (torch on one thread): on a machine shared with other jobs the CPU time of a
single-threaded process depends less on how often it is descheduled than wall time does. Median
wall times, and the analytic FLOP ratio (flowfleet.models.flops: expert rows run + router rows), are
reported beside them.

Part 2 (peak RAM, one child process per configuration). A K=8 fleet of larger random experts is
written to disk and assembled; each child opens it with FleetPipeline.from_pretrained and samples
top-1 with the batch spread over all 8 experts (SpreadRouter), reporting its peak resident set size
(ru_maxrss) and the RSS after imports. "all resident"
loads all 8 experts before sampling; "lazy" loads what the router selects; "--offload M" keeps at most
M loaded.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the test fixtures


def rss_mib() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


# --------------------------------------------------------------------------------------------------
#                                          Part 1: latency
# --------------------------------------------------------------------------------------------------


class SpreadRouter:
    """The DiT router's cost, but sample b strongly prefers expert b mod K: every expert gets B/K samples.

    Random-weight DiT routers send a whole batch of noise to the same expert (they have learned no
    content), which is the best case for top-1 batching; a trained router splits a varied batch. This
    wrapper gives the worst case for batching: the batch spread evenly over all experts.
    """

    def __init__(self, router, k: int):
        self.router, self.k = router, k

    def __call__(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        logits = self.router(x, t)  # [B, K]
        prefer = torch.nn.functional.one_hot(torch.arange(x.shape[0]) % self.k, self.k)  # [B, K]
        return logits + 20.0 * prefer.to(logits.dtype)


def latency(args: argparse.Namespace) -> list[dict]:
    from fixtures.random_fleet import HashTextEncoder, randomize_, tiny_run_config

    from flowfleet.models.dit import DiTExpert, DiTRouter
    from flowfleet.models.flops import forward_flops
    from flowfleet.sampling import ExpertStore, FleetPipeline

    cfg = tiny_run_config(
        args.k,
        size=args.size,
        channels=3,
        hidden=args.hidden,
        depth=args.depth,
        patch=2,
        text_len=16,
        router_hidden=args.router_hidden,
        router_depth=args.router_depth,
    )
    expert_cfg = cfg.expert.model_copy(update={"num_heads": args.hidden // 64 or 1})
    router_cfg = cfg.router.model_copy(update={"num_heads": max(args.router_hidden // 64, 1)})
    experts = [randomize_(DiTExpert.from_dit_config(expert_cfg), seed=k, std=0.02).eval() for k in range(args.k)]
    router = randomize_(DiTRouter.from_dit_config(router_cfg), seed=99, std=0.02).eval()
    n_params = sum(p.numel() for p in experts[0].parameters())
    r_params = sum(p.numel() for p in router.parameters())
    shape = (3, args.size, args.size)
    text = HashTextEncoder(384, 16)

    def pipeline(experts_, router_):
        return FleetPipeline(
            ExpertStore.from_callables(experts_),
            router_,
            latent_shape=shape,
            conditioning="cross_attn",
            text_encoder=text,
        )

    same = pipeline(experts, router)  # random router: the whole batch goes to one expert
    spread = pipeline(experts, SpreadRouter(router, args.k))  # the batch split over all K experts
    configs = [("monolith", pipeline(experts[:1], None), "top1", 1)]
    for strategy in ("top1", "top2", "full"):
        for label, pipe in (("one expert per batch", same), ("batch spread over K", spread)):
            if strategy == "full" and pipe is spread:
                continue  # full runs every expert on every sample either way
            for every in (1, args.route_every):
                name = f"{strategy}, route-every {every}" + ("" if strategy == "full" else f", {label}")
                configs.append((name, pipe, strategy, every))
    prompts = ["a handwritten digit", "a red square", "a small circle", "two lines"]
    kw = dict(n=args.batch, steps=args.steps, guidance_scale=4.0, sampler="euler")
    print(
        f"expert: hidden {args.hidden}, depth {args.depth}, {expert_cfg.num_tokens} tokens, "
        f"{n_params / 1e6:.2f} M params; router: hidden {args.router_hidden}, depth {args.router_depth}, "
        f"{r_params / 1e6:.2f} M params; K = {args.k}; batch {args.batch} (x2 CFG); {args.steps} Euler steps; "
        f"torch threads {torch.get_num_threads()}",
        flush=True,
    )
    same(prompts, strategy="full", **{**kw, "steps": 1})  # warm-up: allocator, kernels
    times: dict[str, list[float]] = {name: [] for name, *_ in configs}
    cpu: dict[str, list[float]] = {name: [] for name, *_ in configs}
    extra: dict[str, dict] = {}
    for rep in range(args.repeats):
        for name, pipe, strategy, every in configs:
            t0, c0 = time.perf_counter(), time.process_time()
            out = pipe(prompts, strategy=strategy, route_every=every, seed=rep, **kw)
            cpu[name].append(time.process_time() - c0)
            times[name].append(time.perf_counter() - t0)
            tr = out.trace
            n_rows = sum(tr.stats.rows.values())
            flops = n_rows * forward_flops(expert_cfg) + tr.router_calls * args.batch * forward_flops(router_cfg)
            extra[name] = {
                "router_calls": tr.router_calls,
                "expert_calls": sum(tr.stats.calls.values()),
                "expert_rows": n_rows,
                "gflops": flops / 1e9,
            }
        print(f"  repeat {rep + 1}/{args.repeats} done", flush=True)
    base, base_wall = min(cpu["monolith"]), statistics.median(times["monolith"])
    base_flops = extra["monolith"]["gflops"]
    rows = []
    for name, *_ in configs:
        c, w = min(cpu[name]), statistics.median(times[name])
        rows.append(
            {
                "config": name,
                "cpu_s": c,
                "ratio": c / base,
                "wall_s": w,
                "wall_ratio": w / base_wall,
                "flops_ratio": extra[name]["gflops"] / base_flops,
                **extra[name],
            }
        )
    print(
        "\n| configuration | CPU s (min) | x monolith (CPU) | wall s (median) | x monolith (wall) | x monolith "
        "(FLOPs) | router calls | expert calls | expert rows |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['config']} | {r['cpu_s']:.3f} | {r['ratio']:.3f} | {r['wall_s']:.3f} | {r['wall_ratio']:.3f} | "
            f"{r['flops_ratio']:.3f} | {r['router_calls']} | {r['expert_calls']} | {r['expert_rows']} |"
        )
    return rows


# --------------------------------------------------------------------------------------------------
#                                          Part 2: peak RAM
# --------------------------------------------------------------------------------------------------


def ram_child(model_dir: str, mode: str, offload: int | None, steps: int, n: int) -> dict:
    """Run in a fresh process: open the fleet, sample top-1, report memory."""
    from fixtures.random_fleet import HashTextEncoder

    from flowfleet.sampling import FleetPipeline

    torch.set_num_threads(1)
    base = rss_mib()
    pipe = FleetPipeline.from_pretrained(model_dir, offload=offload, text_encoder=HashTextEncoder(384, 16))
    pipe.router = SpreadRouter(pipe.router, pipe.num_experts)  # a varied batch: sample b -> expert b mod 8
    if mode == "all-resident":
        for k in pipe.present:
            pipe.experts.get(k)
    t0 = time.perf_counter()
    out = pipe(["a handwritten digit", "a red square"], n=n, strategy="top1", steps=steps, guidance_scale=4.0)
    wall = time.perf_counter() - t0
    used = sorted({e for s in out.trace.experts for e in s.flatten().tolist()})
    return {
        "mode": mode,
        "offload": offload,
        "rss_after_imports_mib": base,
        "peak_rss_mib": peak_rss_mib(),
        "sampling_s": wall,
        "experts_used": used,
        "loads": sum(pipe.experts.loads.values()),
    }


def ram(args: argparse.Namespace) -> list[dict]:
    from fixtures.random_fleet import tiny_run_config, write_random_fleet

    from flowfleet.stages.assemble import assemble

    with tempfile.TemporaryDirectory(prefix="ff-bench-ram-") as tmp:
        cfg = tiny_run_config(
            8,
            size=args.size,
            channels=3,
            hidden=args.ram_hidden,
            depth=args.ram_depth,
            patch=2,
            text_len=16,
            router_hidden=128,
            router_depth=2,
        )
        cfg = cfg.model_copy(
            update={
                "expert": cfg.expert.model_copy(update={"num_heads": args.ram_hidden // 64}),
                "router": cfg.router.model_copy(update={"num_heads": 2}),
            }
        )
        t0 = time.perf_counter()
        write_random_fleet(os.path.join(tmp, "run"), cfg, std=0.02)
        assemble(os.path.join(tmp, "run"))
        model_dir = os.path.join(tmp, "run", "model")
        size_mib = os.path.getsize(os.path.join(model_dir, "expert_0", "diffusion_pytorch_model.safetensors")) / 2**20
        print(
            f"\nK = 8 experts of {size_mib:.0f} MiB each (hidden {args.ram_hidden}, depth {args.ram_depth}) "
            f"written + assembled in {time.perf_counter() - t0:.0f} s",
            flush=True,
        )
        rows = []
        for mode, offload in (("all-resident", None), ("lazy", None), ("offload", 2)):
            cmd = [
                sys.executable,
                __file__,
                "--ram-child",
                model_dir,
                "--ram-mode",
                mode,
                "--steps",
                str(args.ram_steps),
                "--batch",
                str(args.ram_batch),
            ]
            if offload:
                cmd += ["--offload", str(offload)]
            res = subprocess.run(cmd, capture_output=True, text=True, check=True)
            rows.append(json.loads(res.stdout.strip().splitlines()[-1]))
            print(f"  {mode} done", flush=True)
    print(f"\ntop-1, {args.ram_batch} samples, {args.ram_steps} steps, batch spread over the K = 8 experts\n")
    print(
        "| configuration | peak RSS MiB | RSS after imports MiB | peak - imports MiB | experts used | loads | "
        "sampling s |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        name = {"all-resident": "all 8 resident", "lazy": "lazy, no offload", "offload": "--offload 2"}[r["mode"]]
        print(
            f"| {name} | {r['peak_rss_mib']:.0f} | {r['rss_after_imports_mib']:.0f} | "
            f"{r['peak_rss_mib'] - r['rss_after_imports_mib']:.0f} | {len(r['experts_used'])} | {r['loads']} | "
            f"{r['sampling_s']:.1f} |"
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=("latency", "ram", "all"), default="all")
    p.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    p.add_argument("--k", type=int, default=4, help="experts (latency part)")
    p.add_argument("--size", type=int, default=32, help="image side (3 channels, pixel space, patch 2)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--depth", type=int, default=4)
    # Paris pairs DiT-B/2 experts with a DiT-S/2 router: half the width, same depth (~1/4 of the FLOPs)
    p.add_argument("--router-hidden", type=int, default=128)
    p.add_argument("--router-depth", type=int, default=4)
    p.add_argument("--batch", type=int, default=4, help="samples per generate call (x2 rows with CFG)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--route-every", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)")
    p.add_argument("--ram-hidden", type=int, default=512)
    p.add_argument("--ram-depth", type=int, default=8)
    p.add_argument("--ram-steps", type=int, default=4)
    p.add_argument("--ram-batch", type=int, default=8)
    p.add_argument("--ram-child", metavar="MODEL_DIR", help=argparse.SUPPRESS)
    p.add_argument("--ram-mode", help=argparse.SUPPRESS)
    p.add_argument("--offload", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.ram_child:
        print(json.dumps(ram_child(args.ram_child, args.ram_mode, args.offload, args.steps, args.batch)))
        return
    if args.quick:
        args.size, args.hidden, args.depth, args.router_hidden, args.router_depth = 16, 64, 2, 64, 2
        args.steps, args.repeats = 4, 2
        args.ram_hidden, args.ram_depth, args.ram_steps = 128, 2, 2
    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    print(time.strftime("%Y-%m-%d %H:%M:%S %Z"), "| load average", os.getloadavg(), flush=True)
    if args.part in ("latency", "all"):
        latency(args)
    if args.part in ("ram", "all"):
        ram(args)
    print("\nload average at the end", os.getloadavg())


if __name__ == "__main__":
    main()
