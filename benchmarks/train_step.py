"""Training-step throughput of the DiT and the overhead of flowfleet's full trainer.

For each model (tiny/4 and DiT-S/2 on 4x32x32 latents, unconditional; `demo`: the mnist preset's expert as
`make demo` trains it; `xl`: the paris-xl2 preset's expert, DiT-XL/2 with cross-attention to 77 CLIP tokens, a GPU's
size) it measures, in one run, on the CPU or a GPU (`--device`, `--precision`):

  bare     a bare loop: forward, flow-matching loss, backward, AdamW step on one resident batch
  trainer  flowfleet.train.loop.Trainer on a synthetic run root: data gather, per-step seeded noise,
           EMA, loss sync, metrics.jsonl + TensorBoard, status heartbeat (checkpoints and previews
           are outside the timed window; their cost is reported separately)

samples/s, achieved GFLOP/s (flowfleet.models.flops: analytic, forward + backward = 3 forwards) and
the trainer's overhead over the bare loop, beside a measured fp32 matmul (sgemm) GFLOP/s.

The trainer's step is its real loop body (Trainer._step) on a claimed job, so the heartbeat thread and
the TensorBoard writer run too. Bare and trainer steps alternate one by one: on a shared machine wall
time swings by tens of percent from one minute to the next, and alternating puts those swings on both
alike. Reported: the ratio of median step times and the median of the paired per-step ratios.

    .venv/bin/python benchmarks/train_step.py                      # both models
    .venv/bin/python benchmarks/train_step.py --models tiny --steps-tiny 200 --threads 1
    python benchmarks/train_step.py --device cuda --precision bf16 --batch-S 64   # on a GPU machine
    python benchmarks/train_step.py --device cuda --precision bf16 --models xl --batch-xl 32   # an XL step's speed and
                                                                                              # peak memory, on a GPU
    .venv/bin/python benchmarks/train_step.py --models demo --threads 1 --batch-demo 8 --compiled   # eager against
                                                                                                  # torch.compile
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # previews try the VAE decoder; fail fast, show latents
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the test fixtures

import torch  # noqa: E402
from fixtures.synthetic_run import write_synthetic_run
from tqdm import tqdm  # noqa: E402

from flowfleet.config import RunConfig, load_run_config
from flowfleet.device import compiled, peak_memory, resolve_device
from flowfleet.distributed import join_from_env
from flowfleet.flow import flow_matching_loss, sample_t
from flowfleet.models.dit import DiTModel
from flowfleet.models.flops import train_flops_per_sample
from flowfleet.presets import PRESETS
from flowfleet.storage import RunRoot
from flowfleet.train.loop import Trainer, TrainOptions, autocast_dtype
from flowfleet.train.specs import JobSpec
from flowfleet.train.tasks import build_task

MODELS = {"tiny": "tiny/4", "S": "S/2", "demo": "demo", "xl": "paris-xl2"}


def sgemm_gflops(
    m: int = 1024, k: int | None = None, n: int | None = None, reps: int = 20, device: torch.device | None = None
) -> float:
    """Measured fp32 matmul GFLOP/s of [m, k] x [k, n] (square m^3 by default) on the device (the CPU by
    default; TF32 as torch's defaults set it)."""
    k, n, device = k or m, n or m, device or torch.device("cpu")
    a, b = torch.randn(m, k, device=device), torch.randn(k, n, device=device)
    for _ in range(3):
        a @ b
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return 2 * m * k * n * reps / (time.perf_counter() - t0) / 1e9


def bench_config(size: str, batch: int, steps: int, log_every: int, precision: str = "fp32") -> RunConfig:
    if size in ("demo", "paris-xl2"):  # a preset's expert as it trains: `make demo`'s, or Paris' DiT-XL/2 with CLIP
        raw = PRESETS["mnist" if size == "demo" else size]()
        raw["cluster"]["k"] = raw["router"]["num_outputs"] = 2
    else:
        raw = PRESETS["paris-b2"]()
        raw["encoders"]["text"] = {"name": "none"}
        raw["cluster"]["k"] = 2
        raw["expert"] = dict(size=size, input_size=(32, 32), in_channels=4, conditioning="none")
        raw["router"] = dict(size="tiny/4", input_size=(32, 32), in_channels=4, num_outputs=2)
    raw["name"] = f"bench-{size.replace('/', '-')}"
    raw["train"] = dict(
        steps=steps,
        batch_size=batch,
        lr=1e-4,
        ema_decay=0.9999,
        precision=precision,
        ckpt_every=10**6,
        sample_every=10**6,
        log_every=log_every,
    )
    raw["sampling"]["steps"] = 2
    return RunConfig.from_dict(raw, where="benchmark config")


def block_matrices(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The transformer blocks' weight matrices: what Muon updates (the rest stays with AdamW)."""
    return [p for name, p in model.named_parameters() if p.ndim == 2 and name.startswith("blocks.")]


class MuonSplit(torch.optim.Optimizer):
    """Muon (torch.optim.Muon, its update scaled to AdamW's RMS so that AdamW's rate carries over) on the transformer
    blocks' weight matrices, fused AdamW on everything else (embeddings, biases, the final layer), as Muon's authors
    split a network; one step() runs both. A timing stand-in for the benchmark: no state_dict of its own."""

    def __init__(self, model: torch.nn.Module, lr: float):
        matrices = block_matrices(model)
        chosen = {id(p) for p in matrices}
        rest = [p for p in model.parameters() if id(p) not in chosen]
        self.muon = torch.optim.Muon(matrices, lr=lr, weight_decay=0.0, adjust_lr_fn="match_rms_adamw")
        self.adamw = torch.optim.AdamW(rest, lr=lr, weight_decay=0.0, fused=True)
        super().__init__(self.muon.param_groups + self.adamw.param_groups, {})

    def step(self, closure=None):
        self.muon.step()
        self.adamw.step()


def newton_schulz_flops(model: torch.nn.Module, steps: int = 5) -> int:
    """Multiply-adds x 2 of Muon's Newton-Schulz iterations over the blocks' weight matrices in one optimiser step:
    per iteration, for X of [m, n] with m <= n, X X^T (2 m^2 n), its square (2 m^3) and that times X (2 m^2 n)."""
    total = 0
    for p in block_matrices(model):
        m, n = sorted(p.shape)
        total += steps * (4 * m * m * n + 2 * m**3)
    return total


class BareStep:
    """A bare forward / flow-matching loss / backward / AdamW step on one resident batch."""

    def __init__(self, cfg: RunConfig, device: torch.device, adamw: str = "fused"):
        """adamw: fused (the trainer's), foreach or for-loop (torch's implementations of one update), or muon
        (torch.optim.Muon on the blocks' weight matrices, fused AdamW on the rest: Muon's usual split)."""
        torch.manual_seed(0)
        self.device, self.amp = device, autocast_dtype(cfg.train.precision, device)
        self.model = DiTModel.from_dit_config(cfg.expert).to(device)
        if adamw == "muon":
            self.opt = MuonSplit(self.model, cfg.train.lr)
        else:
            kind = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}[adamw]
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.train.lr, weight_decay=0.0, **kind)
        self.scaler = torch.amp.GradScaler(device.type, enabled=self.amp == torch.float16)
        self.x0 = torch.randn(cfg.train.batch_size, *cfg.latent_shape, device=device)
        e, b = cfg.expert, cfg.train.batch_size
        self.text = {}  # the caption inputs of a text-conditioned expert (the demo's), random
        if e.conditioning in ("pooled", "cross_attn"):
            self.text["text_pooled"] = torch.randn(b, e.text_dim, device=device)
        if e.conditioning == "cross_attn":
            self.text["text_tokens"] = torch.randn(b, e.text_len, e.text_dim, device=device)
            self.text["text_mask"] = torch.ones(b, e.text_len, dtype=torch.bool, device=device)

    def __call__(self) -> None:
        t = sample_t(self.x0.shape[0], device=self.device)
        eps = torch.randn_like(self.x0)
        with torch.autocast(self.device.type, dtype=self.amp) if self.amp else contextlib.nullcontext():
            loss = flow_matching_loss(lambda x, tt: self.model(x, tt, **self.text), self.x0, t, eps)
        self.scaler.scale(loss).backward()
        self.scaler.step(self.opt)
        self.scaler.update()
        self.opt.zero_grad(set_to_none=True)
        loss.item()  # the trainer syncs on the loss every step too


class TrainerStep:
    """The trainer's own loop body (Trainer._step: data, seeded noise, forward/backward, AdamW, EMA, loss
    reduction, status lease, metrics.jsonl + TensorBoard every log_every steps) on a claimed job."""

    def __init__(self, root: RunRoot, device: torch.device):
        root.remove("experts", recursive=True)
        self.trainer = Trainer(
            build_task(root, load_run_config(root), JobSpec("expert", 0)),
            root,
            TrainOptions(progress=False, tensorboard=True),
        )
        self.state = self.trainer._setup(join_from_env(str(device)))
        self.sampler = self.trainer.sampler()
        self.bar = tqdm(disable=True)

    def __call__(self) -> None:
        self.trainer._step(self.state, self.sampler, self.bar)

    def close(self) -> None:
        self.trainer.checkpoints.drain(self.state)  # a background write still running would outlive the run root
        self.state.metrics.close()
        self.state.lease.release("stopped", "benchmark")


def interleaved(a, b, steps: int, warmup: int, sync=lambda: None) -> tuple[list[float], list[float]]:
    """Wall seconds of each step of a and b, run alternately (a, b, a, b, ...) so that whatever else
    the machine does falls on both alike; sync() waits for the device's queued work."""
    ta, tb = [], []
    for i in range(warmup + steps):
        for fn, out in ((a, ta), (b, tb)):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            if i >= warmup:
                out.append(time.perf_counter() - t0)
    return ta, tb


def quantile(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[round(q * 100) - 1]


def checkpoint_write_s(trainer_step: TrainerStep) -> float:
    """One checkpoint, taken and written (the trainer writes it in the background: waited for here)."""
    t0 = time.perf_counter()
    trainer_step.trainer.checkpoints.take(trainer_step.state)
    trainer_step.trainer.checkpoints.drain(trainer_step.state)
    return time.perf_counter() - t0


def compare_adamw(args: argparse.Namespace, device: torch.device, sync) -> int:
    """The bare step of each model under each optimiser (AdamW three ways, Muon), one step of each in turn."""
    for name in args.models.split(","):
        batch, steps = getattr(args, f"batch_{name}"), getattr(args, f"steps_{name}")
        cfg = bench_config(MODELS[name], batch, 10**6, log_every=args.log_every, precision=args.precision)
        kinds = ("fused", "foreach", "for-loop", "muon")
        loops = [BareStep(cfg, device, kind) for kind in kinds]
        times: list[list[float]] = [[] for _ in kinds]
        for i in range(max(2, steps // 10) + steps):
            for loop, out in zip(loops, times):
                sync()
                t0 = time.perf_counter()
                loop()
                sync()
                if i >= max(2, steps // 10):
                    out.append(time.perf_counter() - t0)
        medians = {k: 1e3 * statistics.median(t) for k, t in zip(kinds, times)}
        print(f"{MODELS[name]} batch {batch}: " + ", ".join(f"{k} {ms:.2f} ms" for k, ms in medians.items()))
        ns = newton_schulz_flops(loops[0].model) / 1e9
        step = batch * train_flops_per_sample(cfg.expert) / 1e9
        print(f"a training step {step:.3f} GFLOP; Muon's Newton-Schulz iterations {ns:.3f} GFLOP more")
        row = {"model": MODELS[name], "batch": batch, "steps": steps, "median_step_ms": medians}
        print(json.dumps({**row, "train_step_gflop": step, "newton_schulz_gflop": ns}))
    return 0


def compare_compiled(args: argparse.Namespace, device: torch.device, sync) -> int:
    """The bare step of each model eager and under torch.compile (as train.compile trains it), one step of each in
    turn after the compiled model's first step, whose seconds (the compile, or the compiler's cache read) are
    reported apart."""
    for name in args.models.split(","):
        batch, steps = getattr(args, f"batch_{name}"), getattr(args, f"steps_{name}")
        cfg = bench_config(MODELS[name], batch, 10**6, log_every=args.log_every, precision=args.precision)
        eager, compiled_step = BareStep(cfg, device), BareStep(cfg, device)
        compiled_step.model = compiled(compiled_step.model, device, "benchmark")
        sync()
        t0 = time.perf_counter()
        compiled_step()
        sync()
        first_s = time.perf_counter() - t0
        te, tc = interleaved(eager, compiled_step, steps, warmup=max(2, steps // 10), sync=sync)
        row = {
            "model": MODELS[name],
            "batch": batch,
            "steps": steps,
            "first_compiled_step_s": first_s,
            "eager_step_ms_median": 1e3 * statistics.median(te),
            "compiled_step_ms_median": 1e3 * statistics.median(tc),
            "compiled_over_eager_median_pair": statistics.median(c / e for c, e in zip(tc, te)),
        }
        print(json.dumps(row), flush=True)
    return 0


def bare_only(args: argparse.Namespace, device: torch.device, sync, peak: float) -> int:
    """The bare step of each model alone: the samples a second a training step consumes."""
    for name in args.models.split(","):
        batch, steps = getattr(args, f"batch_{name}"), getattr(args, f"steps_{name}")
        cfg = bench_config(MODELS[name], batch, 10**6, log_every=args.log_every, precision=args.precision)
        step = BareStep(cfg, device)
        times = []
        for i in range(1 + steps):  # one warm-up step
            sync()
            t0 = time.perf_counter()
            step()
            sync()
            if i:
                times.append(time.perf_counter() - t0)
        median = statistics.median(times)
        gflops = batch / median * train_flops_per_sample(cfg.expert) / 1e9
        row = {
            "model": MODELS[name],
            "batch": batch,
            "steps": steps,
            "bare_step_s_median": median,
            "bare_samples_per_s": batch / median,
            "bare_gflops": gflops,
            "sgemm_gflops": peak,
            "peak_memory_gib": peak_memory(device) / 2**30,
        }
        print(json.dumps(row), flush=True)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="tiny,S", help="comma list of tiny, S, demo (the mnist preset's expert)")
    p.add_argument("--batch-demo", type=int, default=32)
    p.add_argument("--steps-demo", type=int, default=60, help="timed steps of each loop")
    p.add_argument("--batch-tiny", type=int, default=64)
    p.add_argument("--batch-S", type=int, default=4)
    p.add_argument("--steps-tiny", type=int, default=60, help="timed steps of each loop")
    p.add_argument("--steps-S", type=int, default=10, help="timed steps of each loop")
    p.add_argument("--batch-xl", type=int, default=32)
    p.add_argument("--steps-xl", type=int, default=10, help="timed steps of each loop")
    p.add_argument("--log-every", type=int, default=10, help="the trainer's metrics interval")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"], help="autocast on CUDA only")
    p.add_argument(
        "--bare",
        action="store_true",
        help="instead: the bare step alone (one model in memory: an XL step on a CPU box, where the trainer's second "
        "copy does not fit)",
    )
    p.add_argument(
        "--adamw",
        action="store_true",
        help="instead: the bare step with each of torch's AdamW implementations (fused, the trainer's; foreach; "
        "for-loop) and with Muon on the blocks' matrices, interleaved step by step",
    )
    p.add_argument(
        "--compiled",
        action="store_true",
        help="instead: the bare step eager and under torch.compile, interleaved step by step, and the compiled model's "
        "first step (the compile) apart",
    )
    args = p.parse_args()
    device = resolve_device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if args.threads:
        torch.set_num_threads(args.threads)
    gpu = f", {torch.cuda.get_device_name(device)}, {args.precision}" if device.type == "cuda" else ""
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads{gpu}, load average {os.getloadavg()}")
    peak = sgemm_gflops(device=device)
    print(f"sgemm 1024^3 fp32: {peak:.1f} GFLOP/s")
    if args.adamw:
        return compare_adamw(args, device, sync)
    if args.compiled:
        return compare_compiled(args, device, sync)
    if args.bare:
        return bare_only(args, device, sync, peak)
    results = {}
    for name in args.models.split(","):
        size = MODELS[name]
        batch, steps = getattr(args, f"batch_{name}"), getattr(args, f"steps_{name}")
        cfg = bench_config(size, batch, 10**6, log_every=args.log_every, precision=args.precision)
        flops = train_flops_per_sample(cfg.expert)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        with tempfile.TemporaryDirectory(prefix="flowfleet-bench-") as tmp:
            root = RunRoot(tmp)
            write_synthetic_run(root, cfg, per_cluster=max(batch, 16), shard_size=256)
            bare, full = BareStep(cfg, device), TrainerStep(root, device)
            try:
                tb, tt = interleaved(bare, full, steps, warmup=max(2, steps // 10), sync=sync)
                ckpt_s = checkpoint_write_s(full)
            finally:
                full.close()
        ratios = [t / b for b, t in zip(tb, tt)]
        mb, mt = statistics.median(tb), statistics.median(tt)
        row = dict(
            size=size,
            device=str(device),
            precision=args.precision,
            tokens=cfg.expert.num_tokens,
            batch=batch,
            steps=steps,
            log_every=args.log_every,
            train_gflop_per_sample=flops / 1e9,
            bare_step_ms_median=1e3 * mb,
            trainer_step_ms_median=1e3 * mt,
            bare_samples_per_s=batch / mb,
            trainer_samples_per_s=batch / mt,
            bare_gflops=batch / mb * flops / 1e9,
            trainer_gflops=batch / mt * flops / 1e9,
            overhead_pct_of_medians=100 * (mt / mb - 1),
            overhead_pct_median_pair=100 * (statistics.median(ratios) - 1),
            overhead_pct_p20_p80_pair=[100 * (quantile(ratios, 0.2) - 1), 100 * (quantile(ratios, 0.8) - 1)],
            checkpoint_write_s=ckpt_s,
            peak_memory_gib=peak_memory(device) / 2**30,  # a GPU's allocator peak (both loops'); a CPU: the process's
        )
        results[name] = row
        print(
            f"{size:7s} {row['tokens']} tokens, batch {batch}, {steps} steps each: "
            f"{row['train_gflop_per_sample']:.3f} GFLOP/sample | bare {row['bare_samples_per_s']:.1f} samples/s = "
            f"{row['bare_gflops']:.1f} GFLOP/s ({100 * row['bare_gflops'] / peak:.0f}% of sgemm) | trainer "
            f"{row['trainer_samples_per_s']:.1f} samples/s = {row['trainer_gflops']:.1f} GFLOP/s | trainer overhead: "
            f"{row['overhead_pct_of_medians']:+.1f}% (medians), {row['overhead_pct_median_pair']:+.1f}% (median of "
            f"paired steps; p20..p80 {row['overhead_pct_p20_p80_pair'][0]:+.1f}.."
            f"{row['overhead_pct_p20_p80_pair'][1]:+.1f}%)"
            f" | checkpoint write {ckpt_s:.2f} s | peak memory {row['peak_memory_gib']:.1f} GiB",
            flush=True,
        )
    print(
        json.dumps(
            {"sgemm_gflops": peak, "threads": torch.get_num_threads(), "load_end": os.getloadavg(), "models": results},
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
