"""The one training loop, shared by experts, the router and the monolith.

AdamW (constant lr, optional linear warm-up and cosine decay), EMA, gradient accumulation, optional
clipping, autocast on CUDA (fp16 + GradScaler, or bf16; fp32 on CPU), DDP inside one job's island,
checkpoints every N steps and on SIGTERM/SIGINT, resume by default, status.json heartbeat,
metrics.jsonl + TensorBoard, preview PNGs, a stop on a run of non-finite losses.

Determinism: model init is seeded by train.seed; batch b of step s is drawn by the data position
(flowfleet.train.data) and its noise, t and condition dropout by a generator seeded from
(seed, s, chunk), where chunk = rank * grad_accum + micro-step numbers the pieces of the global batch.
No random state therefore carries over between steps, and a resumed job is bit-identical on CPU to
one that never stopped; a 2-process DDP job draws the same samples as a 1-process job with
grad_accum 2.
"""

from __future__ import annotations

import contextlib
import math
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel
from tqdm.auto import tqdm

from flowfleet.config import TrainConfig
from flowfleet.errors import FlowfleetError
from flowfleet.models.files import save_model
from flowfleet.storage import RunRoot
from flowfleet.train.checkpoint import Checkpoint, CheckpointStore, flatten_state, unflatten_state
from flowfleet.train.data import ResumableSampler, derive_seed
from flowfleet.train.ema import EMA
from flowfleet.train.island import Island
from flowfleet.train.jobs import TrainTask
from flowfleet.train.metrics import MetricsLog
from flowfleet.train.status import HEARTBEAT_EVERY, JobLease, JobStatus, read_status

FINAL_DIR = "final"
REPORT_FILE = "report.json"
SAMPLES_DIR = "samples"
_DATA_STREAM = 1  # derive_seed tag of the data order (noise uses the step number instead)


class TrainingDiverged(FlowfleetError):
    """A run of non-finite losses."""


def learning_rate(cfg: TrainConfig, step: int, total_steps: int) -> float:
    """lr for the optimiser step `step` (0-based): linear warm-up, then constant or cosine to 0.
    A pure function of the step, so a resumed job needs no scheduler state."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    span = max(total_steps - cfg.warmup_steps, 1)
    progress = min((step - cfg.warmup_steps) / span, 1.0)
    return cfg.lr * 0.5 * (1.0 + math.cos(math.pi * progress))


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """Mixed precision on CUDA only; CPU trains in fp32 (bf16 is slower on the CPUs we use)."""
    if device.type != "cuda" or precision == "fp32":
        return None
    return {"fp16": torch.float16, "bf16": torch.bfloat16}[precision]


def cpu_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu").contiguous() for k, v in state.items()}


@dataclass
class TrainOptions:
    progress: bool = True  # tqdm bar (shown on a terminal only)
    device: str | None = None  # default: this rank's GPU, else CPU
    heartbeat_every: float = HEARTBEAT_EVERY
    tensorboard: bool = True


class Trainer:
    """Runs one TrainTask to its total steps, resuming from the job's newest checkpoint."""

    def __init__(self, task: TrainTask, root: RunRoot, options: TrainOptions | None = None):
        self.task = task
        self.root = root
        self.options = options or TrainOptions()
        self.store = CheckpointStore(root, task.spec.dir, keep=task.train_cfg.keep_checkpoints)
        self._stop_reason: str | None = None

    # ----------------------------------------------------------------------------------------------
    #                                       Stopping
    # ----------------------------------------------------------------------------------------------

    def request_stop(self, reason: str) -> None:
        """Finish the current step, checkpoint, mark the job stopped (what SIGTERM/SIGINT do)."""
        self._stop_reason = self._stop_reason or reason

    def _on_signal(self, signum: int, _frame: Any) -> None:
        if self._stop_reason is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now, without a checkpoint
        self.request_stop(signal.Signals(signum).name)

    @contextlib.contextmanager
    def _signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    # ----------------------------------------------------------------------------------------------
    #                                        Run
    # ----------------------------------------------------------------------------------------------

    def run(self) -> JobStatus:
        island = Island.from_env(self.options.device)
        try:
            with self._signals():
                return self._run(island)
        finally:
            island.close()

    def _already_done(self) -> JobStatus | None:
        status = read_status(self.root, self.task.spec.dir)
        if (status is not None and status.state == "done" and status.step >= self.task.total_steps
                and self.root.exists(self.task.spec.dir, FINAL_DIR, "config.json")):
            return status
        return None

    def _run(self, island: Island) -> JobStatus:
        task, tc, dev = self.task, self.task.train_cfg, island.device
        done = self._already_done()
        if done is not None:
            return done
        chunks = island.world_size * tc.grad_accum
        if tc.batch_size % chunks:
            raise FlowfleetError(f"{task.name}: batch_size {tc.batch_size} is not divisible by grad_accum x "
                                 f"processes = {tc.grad_accum} x {island.world_size}")
        micro = tc.batch_size // chunks

        torch.manual_seed(tc.seed)
        model = task.build_model().to(dev)
        ema = EMA(model, tc.ema_decay, tc.ema_warmup) if island.is_main else None
        opt = torch.optim.AdamW(model.parameters(), lr=tc.lr, weight_decay=tc.weight_decay)
        amp = autocast_dtype(tc.precision, dev)
        if amp is None and tc.precision != "fp32" and island.is_main:
            print(f"{task.name}: precision {tc.precision} applies on CUDA only; training in fp32 on {dev}",
                  file=sys.stderr)
        scaler = torch.amp.GradScaler(dev.type, enabled=amp == torch.float16)
        step, position, bad = 0, 0, 0
        last_ckpt = self.store.latest()
        if last_ckpt is not None:
            step, position, bad = self._restore(self.store.load(last_ckpt), model, ema, opt, scaler)

        lease = metrics = None
        error: FlowfleetError | None = None
        if island.is_main:
            status = JobStatus(task.name, step=step, total_steps=task.total_steps, samples_seen=position,
                               last_checkpoint=last_ckpt)
            lease = JobLease(self.root, task.spec.dir, status, interval=self.options.heartbeat_every)
            try:
                lease.acquire()
            except FlowfleetError as err:
                error = err
        if not island.all_ok(error is None):
            raise error or FlowfleetError(f"{task.name}: rank 0 could not claim the job")
        if island.is_main:
            metrics = MetricsLog(self.root, task.spec.dir, tensorboard=self.options.tensorboard)
            metrics.truncate_after(step)

        net = model
        if island.distributed:
            net = DistributedDataParallel(model, device_ids=[dev.index] if dev.type == "cuda" else None,
                                          broadcast_buffers=False)
        sampler = ResumableSampler(len(task.data), derive_seed(tc.seed, _DATA_STREAM))
        bar = tqdm(total=task.total_steps, initial=step, desc=task.name, unit="step", dynamic_ncols=True,
                   disable=True if not (island.is_main and self.options.progress) else None)
        window = {"loss": 0.0, "n": 0, "samples": 0, "t0": time.perf_counter(), "extras": {}}
        state, message = "failed", ""
        try:
            while step < task.total_steps:
                lr = learning_rate(tc, step, task.total_steps)
                for group in opt.param_groups:
                    group["lr"] = lr
                items = sampler.take(position, tc.batch_size)
                loss_sum = torch.zeros((), device=dev)
                extra_sums: dict[str, torch.Tensor] = {}
                for m in range(tc.grad_accum):
                    chunk = island.rank * tc.grad_accum + m
                    batch = task.data.gather(items[chunk * micro : (chunk + 1) * micro], dev)
                    gen = torch.Generator(device=dev).manual_seed(derive_seed(tc.seed, step, chunk))
                    sync = net.no_sync() if island.distributed and m < tc.grad_accum - 1 else contextlib.nullcontext()
                    with sync:
                        with torch.autocast(dev.type, dtype=amp) if amp else contextlib.nullcontext():
                            loss, extras = task.loss(net, batch, gen)
                        scaler.scale(loss / tc.grad_accum).backward()
                    loss_sum += loss.detach().float()
                    for key, value in extras.items():
                        extra_sums[key] = extra_sums.get(key, 0) + value.detach().float()
                # one reduction per step: summed losses and extras over chunks, plus the stop flag
                stats = torch.stack([loss_sum, *extra_sums.values(),
                                     torch.tensor(float(self._stop_reason is not None), device=dev)])
                stats = island.all_sum(stats).tolist()
                mean_loss = stats[0] / chunks
                stop = stats[-1] > 0
                step, position = step + 1, position + tc.batch_size

                if math.isfinite(mean_loss):
                    bad = 0
                    if tc.grad_clip is not None:
                        scaler.unscale_(opt)
                        torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
                    scaler.step(opt)
                    scaler.update()
                    if ema is not None:
                        ema.update(model)
                    window["loss"] += mean_loss
                    window["n"] += 1
                    for key, value in zip(extra_sums, stats[1:-1]):
                        window["extras"][key] = window["extras"].get(key, 0.0) + value / chunks
                else:
                    bad += 1
                    if bad >= tc.max_bad_steps:
                        opt.zero_grad(set_to_none=True)
                        raise TrainingDiverged(
                            f"{task.name}: loss was {mean_loss} for {bad} consecutive steps (up to step {step}); "
                            f"stopped without saving. Last good checkpoint: "
                            f"{self.store.url(self.store.latest()) if self.store.latest() else 'none'}. "
                            f"Lower train.lr or set train.grad_clip, check the data, then re-run to resume")
                opt.zero_grad(set_to_none=True)
                window["samples"] += tc.batch_size
                bar.update(1)

                if island.is_main:
                    lease.update(step=step, samples_seen=position)
                    if step % tc.log_every == 0 or step == task.total_steps:
                        self._log(metrics, lease, bar, window, step, lr, position)
                    if step % tc.sample_every == 0 or step == task.total_steps:
                        self._preview(ema.module, metrics, step, dev)
                periodic = (bad == 0 and step % tc.ckpt_every == 0) or step == task.total_steps
                if stop or periodic:
                    self._checkpoint(island, step, position, bad, model, ema, opt, scaler, metrics, lease)
                if stop:
                    reason = self._stop_reason or "a stop on another rank"
                    state = "stopped"
                    message = f"stopped by {reason} at step {step}; re-run the same command to resume"
                    break
            else:
                if island.is_main:
                    self._finish(ema.module, dev)
                state, message = "done", ""
        except KeyboardInterrupt:  # a second Ctrl-C: no checkpoint of this step, the previous one stays
            state, message = "stopped", "interrupted twice, without a checkpoint; re-run to resume from the last one"
            raise
        except Exception as err:
            message = str(err).splitlines()[0][:500] if str(err) else type(err).__name__
            raise
        finally:
            bar.close()
            if island.is_main:
                metrics.close()
                lease.release(state, message)
            if state != "failed":
                island.barrier()
        if island.is_main and state == "stopped":
            print(f"{task.name}: {message}", file=sys.stderr)
        return lease.status if lease is not None else JobStatus(task.name, state=state, step=step,
                                                                total_steps=task.total_steps)

    # ----------------------------------------------------------------------------------------------
    #                                       Pieces
    # ----------------------------------------------------------------------------------------------

    def _restore(self, ckpt: Checkpoint, model, ema: EMA | None, opt, scaler) -> tuple[int, int, int]:
        where = self.store.url(f"step-{ckpt.step:07d}")
        saved_cfg = ckpt.state.get("model_config")
        current = self.task.model_cfg.model_dump(mode="json")
        if saved_cfg != current:
            diff = sorted(k for k in set(saved_cfg or {}) | set(current) if (saved_cfg or {}).get(k) != current.get(k))
            raise FlowfleetError(f"{where}: trained with a different {self.task.name} model config (differs in "
                                 f"{', '.join(diff)}); delete {self.root.url_of(self.task.spec.dir)} to start over")
        model.load_state_dict(ckpt.tensors["model"], strict=True)
        if ema is not None:
            ema.load_state_dict(ckpt.tensors["ema"])
        opt.load_state_dict(unflatten_state(ckpt.state["optimizer"], ckpt.tensors["optimizer"]))
        if ckpt.state.get("scaler"):
            scaler.load_state_dict(ckpt.state["scaler"])
        torch.set_rng_state(ckpt.tensors["rng"]["torch"])
        if torch.cuda.is_available():
            cuda = [ckpt.tensors["rng"][k] for k in sorted(ckpt.tensors["rng"]) if k.startswith("cuda.")]
            if len(cuda) == torch.cuda.device_count():
                torch.cuda.set_rng_state_all(cuda)
        position = int(ckpt.state["data_position"]["samples"])
        if ckpt.state["data_position"].get("num_items") != len(self.task.data):
            print(f"{self.task.name}: the data changed since {where} ({ckpt.state['data_position'].get('num_items')} "
                  f"-> {len(self.task.data)} items); continuing with the new data", file=sys.stderr)
        return ckpt.step, position, int(ckpt.state.get("bad_steps", 0))

    def _checkpoint(self, island: Island, step: int, position: int, bad: int, model, ema: EMA | None, opt, scaler,
                    metrics: MetricsLog | None, lease: JobLease | None) -> None:
        if island.is_main:
            opt_skeleton, opt_tensors = flatten_state(opt.state_dict())
            rng = {"torch": torch.get_rng_state()}
            if torch.cuda.is_available():
                rng.update({f"cuda.{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
            ckpt = Checkpoint(
                step=step,
                tensors={"model": cpu_state(model.state_dict()), "ema": cpu_state(ema.state_dict()),
                         "optimizer": opt_tensors, "rng": rng},
                state={"job": self.task.name, "total_steps": self.task.total_steps, "samples_seen": position,
                       "data_position": {"samples": position, "num_items": len(self.task.data)},
                       "bad_steps": bad, "world_size": island.world_size, "optimizer": opt_skeleton,
                       "scaler": scaler.state_dict(),
                       "model_config": self.task.model_cfg.model_dump(mode="json"),
                       "train_config": self.task.train_cfg.model_dump(mode="json")},
            )
            name = self.store.save(ckpt)
            metrics.flush()
            lease.update(last_checkpoint=name)
            lease.flush()
        island.barrier()

    def _log(self, metrics: MetricsLog, lease: JobLease, bar, window: dict, step: int, lr: float, position: int):
        now = time.perf_counter()
        n = max(window["n"], 1)
        record = {"step": step, "loss": window["loss"] / n if window["n"] else float("nan"), "lr": lr,
                  "samples_per_s": window["samples"] / max(now - window["t0"], 1e-9), "time": time.time(),
                  "epoch": position / len(self.task.data)}
        record.update({k: v / n for k, v in window["extras"].items()})
        metrics.log(record)
        lease.update(last_loss=record["loss"])
        bar.set_postfix(loss=f"{record['loss']:.4f}", samples_s=f"{record['samples_per_s']:.0f}")
        window.update(loss=0.0, n=0, samples=0, t0=now, extras={})

    def _preview(self, model, metrics: MetricsLog, step: int, dev: torch.device) -> None:
        model.eval()
        png = self.task.preview(model, step, dev)
        self.root.write_bytes(png, self.task.spec.dir, SAMPLES_DIR, f"step-{step:07d}.png")
        metrics.add_image_png("samples", png, step)

    def _finish(self, ema_model, dev: torch.device) -> None:
        """final/ (the EMA weights as a model folder), then the task's report."""
        ema_model.eval()
        save_model(ema_model, self.root, self.task.spec.dir, FINAL_DIR)
        report = self.task.report(ema_model, dev)
        if report is not None:
            self.root.write_json(report, self.task.spec.dir, REPORT_FILE)
