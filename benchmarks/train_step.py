"""Training-step throughput of the DiT and the overhead of flowfleet's full trainer.

For each model (tiny/4 and DiT-S/2 on 4x32x32 latents, unconditional) it measures, in one run:

  bare     a bare loop: forward, flow-matching loss, backward, AdamW step on one resident batch
  trainer  flowfleet.train.loop.Trainer on a synthetic run root: data gather, per-step seeded noise,
           EMA, loss sync, metrics.jsonl + TensorBoard, status heartbeat (checkpoints and previews
           are outside the timed window; their cost is reported separately)

samples/s, achieved GFLOP/s (flowfleet.models.flops: analytic, forward + backward = 3 forwards) and
the trainer's overhead over the bare loop, beside a measured fp32 matmul (sgemm) GFLOP/s.

The trainer's per-step cost is the difference between a long and a short run divided by the
difference in steps (set-up, final checkpoint, preview and final/ cancel). On a shared machine wall
time swings by tens of percent from one minute to the next, so costs are measured as this process's
CPU time too (with --threads 1 that is the work done, whatever else runs); bare and trainer rounds
alternate and the median over rounds is reported.

    .venv/bin/python benchmarks/train_step.py                      # both models
    .venv/bin/python benchmarks/train_step.py --models tiny --rounds 5 --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # previews try the VAE decoder; fail fast, show latents

import torch  # noqa: E402

from flowfleet.config import RunConfig, load_run_config
from flowfleet.flow import flow_matching_loss, sample_t
from flowfleet.models.dit import DiTModel
from flowfleet.models.flops import train_flops_per_sample
from flowfleet.presets import PRESETS
from flowfleet.storage import RunRoot
from flowfleet.train.checkpoint import CheckpointStore
from flowfleet.train.jobs import JobSpec, build_task
from flowfleet.train.loop import Trainer, TrainOptions
from flowfleet.train.synthetic import write_synthetic_run

MODELS = {"tiny": "tiny/4", "S": "S/2"}


def sgemm_gflops(n: int = 1024, reps: int = 20) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(3):
        a @ b
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * n**3 * reps / (time.perf_counter() - t0) / 1e9


def bench_config(size: str, batch: int, steps: int, log_every: int) -> RunConfig:
    raw = PRESETS["paris-b2"]()
    raw["name"] = f"bench-{size}"
    raw["encoders"]["text"] = {"name": "none"}
    raw["cluster"]["k"] = 2
    raw["expert"] = dict(size=size, input_size=(32, 32), in_channels=4, conditioning="none")
    raw["router"] = dict(size="tiny/4", input_size=(32, 32), in_channels=4, num_outputs=2)
    raw["train"] = dict(steps=steps, batch_size=batch, lr=1e-4, ema_decay=0.9999, precision="fp32",
                        ckpt_every=10**6, sample_every=10**6, log_every=log_every)
    raw["sampling"]["steps"] = 2
    return RunConfig.from_dict(raw, where="benchmark config")


def bare_cost(cfg: RunConfig, steps: int, warmup: int) -> tuple[float, float]:
    """(CPU seconds, wall seconds) per step of a bare forward/backward/AdamW loop on one resident batch."""
    torch.manual_seed(0)
    model = DiTModel.from_dit_config(cfg.expert)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, weight_decay=0.0)
    b = cfg.train.batch_size
    x0 = torch.randn(b, *cfg.latent_shape)
    for i in range(warmup + steps):
        if i == warmup:
            cpu0, wall0 = time.process_time(), time.perf_counter()
        t = sample_t(b)
        eps = torch.randn_like(x0)
        loss = flow_matching_loss(lambda x, tt: model(x, tt), x0, t, eps)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()  # the trainer syncs on the loss every step too
    return (time.process_time() - cpu0) / steps, (time.perf_counter() - wall0) / steps


def trainer_run(root: RunRoot, steps: int) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of a whole Trainer.run of `steps` steps on a fresh job folder."""
    root.remove("experts", recursive=True)
    cfg = load_run_config(root)
    cfg.train.steps = steps
    cfg.save(root)
    task = build_task(root, cfg, JobSpec("expert", 0))
    cpu0, wall0 = time.process_time(), time.perf_counter()
    status = Trainer(task, root, TrainOptions(progress=False, tensorboard=True)).run()
    if status.state != "done":  # SIGTERM/SIGINT stop the trainer cleanly; then stop the benchmark too
        sys.exit(f"trainer {status.state}: {status.message}")
    return time.process_time() - cpu0, time.perf_counter() - wall0


def trainer_cost(root: RunRoot, short: int, long: int) -> tuple[float, float]:
    """Per-step (CPU, wall) seconds of the trainer: the difference of a long and a short run over the
    difference in steps, so set-up, the final checkpoint, preview and final/ cancel out."""
    c1, w1 = trainer_run(root, short)
    c2, w2 = trainer_run(root, long)
    return (c2 - c1) / (long - short), (w2 - w1) / (long - short)


def checkpoint_write_s(root: RunRoot) -> float:
    store = CheckpointStore(root, "experts/0")
    ckpt = store.load(store.latest())
    ckpt.step += 1
    t0 = time.perf_counter()
    store.save(ckpt)
    return time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="tiny,S", help="comma list of tiny, S")
    p.add_argument("--batch-tiny", type=int, default=64)
    p.add_argument("--batch-S", type=int, default=4)
    p.add_argument("--steps-tiny", type=int, default=40, help="steps of the long run per round")
    p.add_argument("--steps-S", type=int, default=8, help="steps of the long run per round")
    p.add_argument("--log-every", type=int, default=10, help="the trainer's metrics interval")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average {os.getloadavg()}")
    peak = sgemm_gflops()
    print(f"sgemm 1024^3 fp32: {peak:.1f} GFLOP/s")
    results = {}
    for name in args.models.split(","):
        size = MODELS[name]
        batch, steps = getattr(args, f"batch_{name}"), getattr(args, f"steps_{name}")
        short = max(steps // 4, 2)
        cfg = bench_config(size, batch, steps, log_every=args.log_every)
        flops = train_flops_per_sample(cfg.expert)
        rounds = []
        with tempfile.TemporaryDirectory(prefix="flowfleet-bench-") as tmp:
            root = RunRoot(tmp)
            write_synthetic_run(root, cfg, per_cluster=max(batch, 16), shard_size=256)
            for r in range(args.rounds):  # alternate, so load changes hit both alike
                bare_cpu, bare_wall = bare_cost(cfg, steps - short, warmup=short)
                full_cpu, full_wall = trainer_cost(root, short, steps)
                rounds.append(dict(bare_cpu=bare_cpu, bare_wall=bare_wall, trainer_cpu=full_cpu, trainer_wall=full_wall,
                                   overhead_cpu_pct=100 * (full_cpu / bare_cpu - 1),
                                   overhead_wall_pct=100 * (full_wall / bare_wall - 1)))
                print(f"  {name} round {r}: per step CPU bare {1e3 * bare_cpu:.1f} ms, trainer {1e3 * full_cpu:.1f} ms "
                      f"({rounds[-1]['overhead_cpu_pct']:+.1f}%); wall bare {1e3 * bare_wall:.1f} ms, trainer "
                      f"{1e3 * full_wall:.1f} ms ({rounds[-1]['overhead_wall_pct']:+.1f}%)", flush=True)
            ckpt_s = checkpoint_write_s(root)
        med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
        row = dict(size=size, tokens=cfg.expert.num_tokens, batch=batch, timed_steps_per_round=steps - short,
                   log_every=args.log_every, train_gflop_per_sample=flops / 1e9, checkpoint_write_s=ckpt_s,
                   bare_samples_per_s_cpu=batch / med["bare_cpu"], bare_gflops_cpu=batch / med["bare_cpu"] * flops / 1e9,
                   bare_samples_per_s_wall=batch / med["bare_wall"],
                   trainer_samples_per_s_wall=batch / med["trainer_wall"],
                   overhead_cpu_pct_median=med["overhead_cpu_pct"], overhead_wall_pct_median=med["overhead_wall_pct"],
                   rounds=rounds)
        results[name] = row
        print(f"{size:7s} {row['tokens']} tokens, batch {batch}: {row['train_gflop_per_sample']:.3f} GFLOP/sample | "
              f"bare {row['bare_samples_per_s_cpu']:.1f} samples per CPU-second = {row['bare_gflops_cpu']:.1f} GFLOP/s "
              f"({100 * row['bare_gflops_cpu'] / peak:.0f}% of sgemm) | wall: bare {row['bare_samples_per_s_wall']:.1f}, "
              f"trainer {row['trainer_samples_per_s_wall']:.1f} samples/s | trainer overhead (median of rounds): "
              f"CPU {row['overhead_cpu_pct_median']:+.1f}%, wall {row['overhead_wall_pct_median']:+.1f}% | "
              f"checkpoint write {ckpt_s:.2f} s")
    print(json.dumps({"sgemm_gflops": peak, "threads": torch.get_num_threads(), "load_end": os.getloadavg(),
                      "models": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
