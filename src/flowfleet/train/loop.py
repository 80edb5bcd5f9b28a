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
import logging
import math
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch.nn.parallel import DistributedDataParallel
from tqdm.auto import tqdm

from flowfleet.config import TrainConfig
from flowfleet.device import compiled, peak_flops, peak_memory
from flowfleet.distributed import DistContext, join_from_env
from flowfleet.errors import FlowfleetError
from flowfleet.layout import FINAL, JOB_REPORT, SAMPLES
from flowfleet.models.dit import DiTModel
from flowfleet.models.files import save_model
from flowfleet.models.flops import train_flops_per_sample
from flowfleet.storage import RunRoot
from flowfleet.threads import ThreadGovernor
from flowfleet.train.checkpoint import BackgroundWriter, Checkpoint, CheckpointStore, flatten_state, unflatten_state
from flowfleet.train.data import ResumableSampler, derive_seed
from flowfleet.train.ema import EMA
from flowfleet.train.feed import BatchFeed
from flowfleet.train.metrics import MetricsLog
from flowfleet.train.phema import TrackedEMAs
from flowfleet.train.status import HEARTBEAT_EVERY, HEARTBEAT_EVERY_LOCAL, JobLease, JobStatus, job_finished
from flowfleet.train.tasks import TrainTask

_DATA_STREAM = 1  # derive_seed tag of the data order (noise uses the step number instead)

log = logging.getLogger(__name__)


class TrainingDiverged(FlowfleetError):
    """A run of non-finite losses."""


def learning_rate(cfg: TrainConfig, step: int, total_steps: int) -> float:
    """lr for the optimiser step `step` (0-based): linear warm-up, then constant, cosine to 0, or constant
    and a linear cool-down over the last steps (wsd). A pure function of the step, so a resumed job needs no
    scheduler state."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    span = max(total_steps - cfg.warmup_steps, 1)
    if cfg.schedule == "wsd":
        cooldown = max(round(cfg.cooldown * span), 1)  # steps; the last one runs at lr / cooldown
        return cfg.lr * min(1.0, (total_steps - step) / cooldown)
    progress = min((step - cfg.warmup_steps) / span, 1.0)
    return cfg.lr * 0.5 * (1.0 + math.cos(math.pi * progress))


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """Mixed precision on CUDA only; CPU trains in fp32 (bf16 is slower on the CPUs we use)."""
    if device.type != "cuda" or precision == "fp32":
        return None
    return {"fp16": torch.float16, "bf16": torch.bfloat16}[precision]


def adamw(model: torch.nn.Module, dev: torch.device, tc: TrainConfig) -> torch.optim.Optimizer:
    """A job's optimiser: AdamW. fused: one kernel over every parameter instead of a dozen small ops per parameter
    tensor (a small expert's step is faster for it on a CPU core too)."""
    return torch.optim.AdamW(
        model.parameters(), lr=tc.lr, weight_decay=tc.weight_decay, fused=dev.type in ("cpu", "cuda")
    )


def cpu_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A copy in host memory (also of a CPU tensor: a checkpoint written in the background must own its tensors)."""
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in state.items()}


@dataclass
class TrainOptions:
    progress: bool = True  # tqdm bar (shown on a terminal only)
    device: str | None = None  # default: this rank's GPU, else CPU
    heartbeat_every: float | None = None  # default: 5 s on a local run root, 30 s on an object store
    tensorboard: bool = True


@dataclass
class _Window:
    """Metrics accumulated between two log lines."""

    loss: float = 0.0
    finite_steps: int = 0
    steps: int = 0
    samples: int = 0
    t0: float = field(default_factory=time.perf_counter)
    extras: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class _Pace:
    """A job's speed as a GPU user reads it: seconds a step, model TFLOP/s (the DiT's analytic FLOPs of the samples
    trained, flowfleet.models.flops), MFU (those over the devices' peak: flowfleet.device.peak_flops; None where no
    peak is known) and the most memory the process has held on its device."""

    sample_flops: int  # training FLOPs of one sample
    peak: float | None  # FLOP/s of every rank's device together
    device: torch.device

    @classmethod
    def of(cls, task: TrainTask, island: DistContext, precision: str) -> "_Pace":
        peak = peak_flops(island.device, precision)
        return cls(
            train_flops_per_sample(task.model_cfg), None if peak is None else peak * island.world_size, island.device
        )

    def measure(self, samples_per_s: float, step_s: float) -> dict[str, float | None]:
        """step_s, model_tflops, mfu, peak_memory_gib of a log window (every rank's samples a second, seconds a
        step)."""
        achieved = samples_per_s * self.sample_flops
        return {
            "step_s": step_s,
            "model_tflops": achieved / 1e12,
            "mfu": None if self.peak is None else achieved / self.peak,
            "peak_memory_gib": peak_memory(self.device) / 2**30,
        }


@dataclass
class TrainState:
    """Everything one run of a job holds; only rank 0 has ema, lease and metrics. A StepHooks object reads and moves
    model, step, position and lease (its own status fields) here; the rest is the trainer's."""

    island: DistContext
    model: torch.nn.Module  # the bare model (what gets saved)
    net: torch.nn.Module  # what the loss calls: the model, or its DDP wrapper
    opt: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    amp: torch.dtype | None
    micro: int  # samples per micro-batch per process
    feed: BatchFeed  # this process's batches, read ahead (train.prefetch)
    ema: EMA | None = None
    tracked: TrackedEMAs | None = None  # rank 0's post-hoc EMAs (train.posthoc_ema), where tracked
    lease: JobLease | None = None
    metrics: MetricsLog | None = None
    step: int = 0
    position: int = 0  # samples drawn so far (the data position)
    bad: int = 0  # consecutive non-finite steps
    window: _Window = field(default_factory=_Window)
    pace: "_Pace | None" = None  # rank 0's: what its log lines say of the job's speed

    def rank0(self) -> _Rank0:
        """Rank 0's EMA, lease and metrics log; an error on any other rank."""
        if self.ema is None or self.lease is None or self.metrics is None:
            raise RuntimeError("only rank 0 holds the EMA, the job lease and the metrics log")
        return _Rank0(self.ema, self.lease, self.metrics)


class _Rank0(NamedTuple):
    ema: EMA
    lease: JobLease
    metrics: MetricsLog


class StopRequest:
    """A job's stop, asked for by SIGTERM or SIGINT (the handlers installed while the job runs) or request(): the step
    in progress finishes, a checkpoint is taken, the job is marked stopped; a second Ctrl-C stops at once."""

    def __init__(self) -> None:
        self.reason: str | None = None
        self.time = 0.0  # when it was asked for (time.monotonic)

    def request(self, reason: str) -> None:
        if self.reason is None:
            self.reason, self.time = reason, time.monotonic()

    def _on_signal(self, signum: int, _frame: Any) -> None:
        if self.reason is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now, without a checkpoint
        self.request(signal.Signals(signum).name)

    @contextlib.contextmanager
    def handlers(self):
        """SIGTERM and SIGINT ask for the stop while inside (on the main thread; the previous handlers after)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)


class StepHooks:
    """What a loop around the trainer's optimiser steps adds (DiLoCo's outer loop: flowfleet.train.diloco), at the
    points where the trainer calls it; the defaults add nothing, as a plain job's."""

    def check(self, island: DistContext) -> None:
        """Before anything is built or claimed: a one-line error where the loop cannot run on this world."""

    def optimizer(self, model: torch.nn.Module, dev: torch.device) -> torch.optim.Optimizer | None:
        """The inner optimiser (None: the trainer's AdamW)."""
        return None

    def started(self, st: TrainState) -> None:
        """After set-up, a restored checkpoint included."""

    def skipped(self, st: TrainState) -> int:
        """Before a step: steps it moved the state on without training them (DiLoCo: a round decided elsewhere,
        adopted), after which the trainer checkpoints; 0: the trainer takes the step."""
        return 0

    def after_update(self, st: TrainState) -> bool:
        """After each optimiser step, before its bookkeeping: -> a checkpoint is due now."""
        return False

    def checkpoint_extras(self, st: TrainState) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, Any]]:
        """More tensor files and state.json fields of a checkpoint."""
        return {}, {}

    def restore(self, st: TrainState, ckpt: Checkpoint) -> None:
        """Restore what checkpoint_extras saved."""

    def final_model(self, st: TrainState) -> DiTModel | None:
        """What final/ holds (None: the trainer's EMA weights)."""
        return None


class JobCheckpoints:
    """A job's checkpoints: the newest restored into a TrainState, a step's state taken (rank 0 writes it, in the
    background under train.async_checkpoint), and the job's status told when a write has ended."""

    def __init__(self, task: TrainTask, root: RunRoot, hooks: "StepHooks", stop: StopRequest):
        self.task, self.root, self.hooks, self.stop = task, root, hooks, stop
        self.store = CheckpointStore(root, task.spec.dir, keep=task.train_cfg.keep_checkpoints)
        self.writer = BackgroundWriter(self.store)  # train.async_checkpoint

    def restore(self, st: TrainState, ckpt: Checkpoint) -> None:
        """The job's state at `ckpt` into `st`; a checkpoint of another model config is refused in one line."""
        where = self.store.url(f"step-{ckpt.step:07d}")
        saved_cfg = ckpt.state.get("model_config") or {}
        current = self.task.model_cfg.model_dump(mode="json")
        if saved_cfg != current:
            diff = sorted(k for k in set(saved_cfg) | set(current) if saved_cfg.get(k) != current.get(k))
            raise FlowfleetError(
                f"{where}: trained with a different {self.task.name} model config (differs in "
                f"{', '.join(diff)}); delete {self.root.url_of(self.task.spec.dir)} to start over"
            )
        st.model.load_state_dict(ckpt.tensors["model"], strict=True)
        if st.ema is not None:
            st.ema.load_state_dict(ckpt.tensors["ema"])
        if st.tracked is not None and "posthoc_ema" in ckpt.tensors:
            st.tracked.load_state_dict(ckpt.tensors["posthoc_ema"])
        st.opt.load_state_dict(unflatten_state(ckpt.state["optimizer"], ckpt.tensors["optimizer"]))
        if ckpt.state.get("scaler"):
            st.scaler.load_state_dict(ckpt.state["scaler"])
        torch.set_rng_state(ckpt.tensors["rng"]["torch"])
        if torch.cuda.is_available():
            cuda = [ckpt.tensors["rng"][k] for k in sorted(ckpt.tensors["rng"]) if k.startswith("cuda.")]
            if len(cuda) == torch.cuda.device_count():
                torch.cuda.set_rng_state_all(cuda)
        st.step, st.bad = ckpt.step, int(ckpt.state.get("bad_steps", 0))
        st.position = int(ckpt.state["data_position"]["samples"])
        self.hooks.restore(st, ckpt)
        if ckpt.state["data_position"].get("num_items") != len(self.task.data):
            log.warning(
                "%s: the data changed since %s (%s -> %d items); continuing with the new data",
                self.task.name,
                where,
                ckpt.state["data_position"].get("num_items"),
                len(self.task.data),
            )

    def take(self, st: TrainState, stop: bool = False) -> None:
        """Rank 0 takes a copy of the job's state at this step and writes it (train.async_checkpoint: in the
        background); every rank waits for it to be taken. A stop by SIGTERM too late for a write (stop_grace_s)
        takes none: the job ends on its newest complete checkpoint."""
        if st.island.is_main and not (stop and self.past_grace()):
            opt_skeleton, opt_tensors = flatten_state(st.opt.state_dict())
            rng = {"torch": torch.get_rng_state()}
            if torch.cuda.is_available():
                rng.update({f"cuda.{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
            extra_tensors, extra_state = self.hooks.checkpoint_extras(st)
            ckpt = Checkpoint(
                step=st.step,
                tensors={
                    "model": cpu_state(st.model.state_dict()),
                    "ema": cpu_state(st.rank0().ema.state_dict()),
                    "optimizer": opt_tensors,
                    "rng": rng,
                    **({"posthoc_ema": cpu_state(st.tracked.state_dict())} if st.tracked is not None else {}),
                    **extra_tensors,
                },
                state={
                    **extra_state,
                    "job": self.task.name,
                    "total_steps": self.task.total_steps,
                    "samples_seen": st.position,
                    "data_position": {"samples": st.position, "num_items": len(self.task.data)},
                    "bad_steps": st.bad,
                    "world_size": st.island.world_size,
                    "optimizer": opt_skeleton,
                    "scaler": st.scaler.state_dict(),
                    "model_config": self.task.model_cfg.model_dump(mode="json"),
                    "train_config": self.task.train_cfg.model_dump(mode="json"),
                },
            )
            ended = self.writer.start(ckpt) if self.task.train_cfg.async_checkpoint else self.writer.save(ckpt)
            if ended:
                self.ended(st, ended)
        st.island.barrier()

    def ended(self, st: TrainState, name: str) -> None:
        """A checkpoint's write has ended: the metrics so far and the job's status name it."""
        main = st.rank0()
        main.metrics.flush()
        main.lease.update(last_checkpoint=name)
        main.lease.flush()

    def drain(self, st: TrainState) -> None:
        """Wait for the checkpoint being written (its error raised here)."""
        ended = self.writer.wait()
        if ended:
            self.ended(st, ended)

    def past_grace(self) -> bool:
        """A SIGTERM whose grace (train.stop_grace_s) the write in flight and one more, each as long as a write takes
        (the writer's write_s), would outlast."""
        write_s = self.writer.write_s
        if self.stop.reason != "SIGTERM" or write_s is None:
            return False
        needed = write_s * (2 if self.writer.busy else 1)
        late = time.monotonic() - self.stop.time + needed > self.task.train_cfg.stop_grace_s
        if late:
            log.warning(
                "%s: SIGTERM: no checkpoint of this step (a write takes %.1f s, train.stop_grace_s is %g); "
                "the job resumes from its newest complete one",
                self.task.name,
                write_s,
                self.task.train_cfg.stop_grace_s,
            )
        return late


class JobOutputs:
    """What a job leaves besides its checkpoints (rank 0): metrics lines, preview grids, final/ and its report."""

    def __init__(self, task: TrainTask, root: RunRoot):
        self.task, self.root = task, root

    def log(self, st: TrainState, bar, lr: float) -> None:
        """A metrics line of the steps since the last: loss, rate, samples a second, speed; the status too."""
        w, now = st.window, time.perf_counter()
        seconds = max(now - w.t0, 1e-9)
        record: dict[str, Any] = {
            "step": st.step,
            "loss": w.loss / w.finite_steps if w.finite_steps else float("nan"),
            "lr": lr,
            "samples_per_s": w.samples / seconds,
            "time": time.time(),
            "epoch": st.position / len(self.task.data),
        }
        record.update({k: v / max(w.finite_steps, 1) for k, v in w.extras.items()})
        speed = st.pace.measure(record["samples_per_s"], seconds / max(w.steps, 1)) if st.pace is not None else {}
        record.update(speed)
        st.rank0().metrics.log(record)
        st.rank0().lease.update(last_loss=record["loss"], **speed)
        bar.set_postfix(loss=f"{record['loss']:.4f}", samples_s=f"{record['samples_per_s']:.0f}")
        st.window = _Window(t0=now)

    def after_step(self, st: TrainState, lr: float, bar) -> None:
        """Rank 0 after each step: a metrics line every log_every steps, a preview every sample_every, the post-hoc
        EMAs' snapshot every posthoc_every, each at the last step too."""
        tc, total = self.task.train_cfg, self.task.total_steps
        st.rank0().lease.update(step=st.step, samples_seen=st.position)
        if st.step % tc.log_every == 0 or st.step == total:
            self.log(st, bar, lr)
        if st.step % tc.sample_every == 0 or st.step == total:
            self.preview(st)
        if st.tracked is not None and (st.step % tc.posthoc_every == 0 or st.step == total):
            st.tracked.write_snapshot(self.root, self.task.spec.dir, st.step)

    def preview(self, st: TrainState) -> None:
        """A grid of the EMA model's samples at this step (samples/, TensorBoard)."""
        main = st.rank0()
        png = self.task.preview(main.ema.module.eval(), st.step, st.island.device)
        self.root.write_bytes(png, self.task.spec.dir, SAMPLES, f"step-{st.step:07d}.png")
        main.metrics.add_image_png("samples", png, st.step)

    def finish(self, st: TrainState, final: DiTModel | None) -> None:
        """final/ (`final`, else the EMA weights, as a model folder), then the task's report."""
        model = final or st.rank0().ema.module.eval()
        save_model(model, self.root, self.task.spec.dir, FINAL)
        report = self.task.report(model, st.island.device)
        if report is not None:
            self.root.write_json(report, self.task.spec.dir, JOB_REPORT)


class Trainer:
    """Runs one TrainTask to its total steps, resuming from the job's newest checkpoint; `hooks`: a loop around its
    optimiser steps (DiLoCo's)."""

    def __init__(
        self, task: TrainTask, root: RunRoot, options: TrainOptions | None = None, hooks: StepHooks | None = None
    ):
        self.task = task
        self.root = root
        self.options = options or TrainOptions()
        self.hooks = hooks or StepHooks()
        self.stop = StopRequest()
        self.checkpoints = JobCheckpoints(task, root, self.hooks, self.stop)
        self.outputs = JobOutputs(task, root)

    # ----------------------------------------------------------------------------------------------
    #                                       Stopping
    # ----------------------------------------------------------------------------------------------

    # ----------------------------------------------------------------------------------------------
    #                                          Run
    # ----------------------------------------------------------------------------------------------

    def run(self) -> JobStatus:
        island = join_from_env(self.options.device)
        try:
            with self.stop.handlers():
                return self._run(island)
        finally:
            island.close()

    def _already_done(self) -> JobStatus | None:
        done, _, status = job_finished(self.root, self.task.spec.dir, self.task.total_steps)
        return status if done else None

    def _run(self, island: DistContext) -> JobStatus:
        task = self.task
        done = self._already_done()
        if done is not None:
            return done
        st = self._setup(island)
        sampler = self.sampler()
        bar = tqdm(
            total=task.total_steps,
            initial=st.step,
            desc=task.name,
            unit="step",
            dynamic_ncols=True,
            disable=True if not (island.is_main and self.options.progress) else None,
        )
        state, message = "failed", ""
        # a CPU job's threads: fixed (the same seed, the same weights), or following the machine's load
        governor = ThreadGovernor(follow=task.train_cfg.follow_load) if island.device.type == "cpu" else None
        if governor is not None and island.is_main:
            st.rank0().lease.update(threads=governor.setting)
        try:
            while st.step < task.total_steps:
                if governor is not None and (changed := governor.step()) and island.is_main:
                    st.rank0().lease.update(threads=changed)
                if self._step(st, sampler, bar):
                    if island.is_main:
                        self.checkpoints.drain(st)
                    state = "stopped"
                    message = (
                        f"stopped by {self.stop.reason or 'a stop on another rank'} at step {st.step}; "
                        f"re-run the same command to resume"
                    )
                    break
            else:
                if island.is_main:
                    self.outputs.finish(st, self.hooks.final_model(st))
                    self.checkpoints.drain(st)
                state = "done"
        except KeyboardInterrupt:  # a second Ctrl-C: no checkpoint of this step, the previous one stays
            state, message = "stopped", "interrupted twice, without a checkpoint; re-run to resume from the last one"
            raise
        except Exception as err:
            message = str(err).splitlines()[0][:500] if str(err) else type(err).__name__
            raise
        finally:
            bar.close()
            st.feed.close()
            if island.is_main:
                with contextlib.suppress(Exception):  # (a failed job: its own error is the one to see)
                    self.checkpoints.drain(st)
                st.rank0().metrics.close()
                st.rank0().lease.release(state, message)
            if state != "failed":
                island.barrier()
        if st.lease is None:
            return JobStatus(task.name, state=state, step=st.step, total_steps=task.total_steps)
        if state == "stopped":
            log.warning("%s: %s", task.name, message)
        return st.lease.status

    # ----------------------------------------------------------------------------------------------
    #                                      Set-up, steps
    # ----------------------------------------------------------------------------------------------

    def _setup(self, island: DistContext) -> TrainState:
        """Model, EMA, optimiser, scaler; restore the newest checkpoint; claim the job (rank 0)."""
        task, tc, dev = self.task, self.task.train_cfg, island.device
        self.hooks.check(island)
        chunks = island.world_size * tc.grad_accum
        if tc.batch_size % chunks:
            raise FlowfleetError(
                f"{task.name}: batch_size {tc.batch_size} is not divisible by grad_accum x "
                f"processes = {tc.grad_accum} x {island.world_size}"
            )
        torch.manual_seed(tc.seed)
        model = task.build_model().to(dev)  # type: ignore[arg-type]  # diffusers' functools.wraps hides .to's binding
        amp = autocast_dtype(tc.precision, dev)
        if amp is None and tc.precision != "fp32" and island.is_main:
            log.warning("%s: precision %s applies on CUDA only; training in fp32 on %s", task.name, tc.precision, dev)
        st = TrainState(
            island=island,
            model=model,
            net=model,
            amp=amp,
            micro=tc.batch_size // chunks,
            feed=BatchFeed(task.data, tc.read_ahead, pin=dev.type == "cuda"),
            opt=self.hooks.optimizer(model, dev) or adamw(model, dev, tc),
            scaler=torch.amp.GradScaler(dev.type, enabled=amp == torch.float16),
            ema=EMA(model, tc.ema_decay, tc.ema_warmup) if island.is_main else None,
            tracked=TrackedEMAs(model, tc.posthoc_ema) if island.is_main and tc.posthoc_ema else None,
        )
        last = self.checkpoints.store.latest()
        if last is not None:
            self.checkpoints.restore(st, self.checkpoints.store.load(last))
            if island.is_main:
                log.info("%s: resuming from its checkpoint at step %d", task.name, st.step)

        error: FlowfleetError | None = None
        if island.is_main:
            status = JobStatus(
                task.name, step=st.step, total_steps=task.total_steps, samples_seen=st.position, last_checkpoint=last
            )
            every = self.options.heartbeat_every or (HEARTBEAT_EVERY_LOCAL if self.root.is_local else HEARTBEAT_EVERY)
            st.lease = JobLease(self.root, task.spec.dir, status, interval=every)
            try:
                st.lease.acquire()
            except FlowfleetError as err:
                error = err
        if not island.all_ok(error is None):  # every rank stops when rank 0 cannot claim the job
            raise error or FlowfleetError(f"{task.name}: rank 0 could not claim the job")
        if island.is_main:
            st.metrics = MetricsLog(self.root, task.spec.dir, tensorboard=self.options.tensorboard)
            st.metrics.truncate_after(st.step)
            ranks = f" x {island.world_size} ranks ({island.backend})" if island.distributed else ""
            precision = f"{tc.precision} autocast" if amp else "fp32"
            log.info("%s: %d steps on %s%s in %s", task.name, task.total_steps, dev, ranks, precision)
            st.pace = _Pace.of(task, island, tc.precision if amp else "fp32")
        if island.distributed:
            st.net = DistributedDataParallel(
                model, device_ids=[dev.index] if dev.type == "cuda" else None, broadcast_buffers=False
            )
        if tc.compile:
            st.net = compiled(st.net, dev, task.name)  # around DDP: compile splits its graph at DDP's buckets
        self.hooks.started(st)
        return st

    def sampler(self) -> ResumableSampler:
        return ResumableSampler(len(self.task.data), derive_seed(self.task.train_cfg.seed, _DATA_STREAM))

    def _step(self, st: TrainState, sampler: ResumableSampler, bar) -> bool:
        """One optimiser step and its bookkeeping (log, preview, checkpoint), or the steps the hooks moved on
        without it; -> stop now."""
        if moved := self.hooks.skipped(st):
            bar.update(moved)
            if st.lease is not None:
                st.lease.update(step=st.step, samples_seen=st.position)
            self.checkpoints.take(st)
            return self.stop.reason is not None
        tc, total = self.task.train_cfg, self.task.total_steps
        lr = learning_rate(tc, st.step, total)
        for ahead in range(1, min(tc.read_ahead, total - st.step - 1) + 1):  # the next steps' batches, meanwhile
            position = st.position + ahead * tc.batch_size
            for m, chunk in enumerate(self._chunks(st, sampler.take(position, tc.batch_size))):
                st.feed.ahead((position, m), chunk)
        loss, extras, stop = self._forward_backward(st, sampler.take(st.position, tc.batch_size), lr)
        st.step, st.position = st.step + 1, st.position + tc.batch_size
        self._update(st, loss, extras)
        due = self.hooks.after_update(st)
        bar.update(1)
        if st.island.is_main:
            self.outputs.after_step(st, lr, bar)
        if st.island.is_main and (ended := self.checkpoints.writer.finished()):
            self.checkpoints.ended(st, ended)
        if stop or due or (st.bad == 0 and st.step % tc.ckpt_every == 0) or st.step == total:
            self.checkpoints.take(st, stop)
        return stop

    def _forward_backward(self, st: TrainState, items: torch.Tensor, lr: float) -> tuple[float, dict[str, float], bool]:
        """Gradients of one global batch (this process's chunks, accumulated) -> mean loss and extras
        over the whole batch, and whether any process was asked to stop. One reduction per step."""
        tc, island, dev = self.task.train_cfg, st.island, st.island.device
        for group in st.opt.param_groups:
            group["lr"] = lr
        loss_sum = torch.zeros((), device=dev)
        extra_sums: dict[str, torch.Tensor] = {}
        for m, mine in enumerate(self._chunks(st, items)):
            chunk = island.rank * tc.grad_accum + m  # which piece of the global batch
            batch = st.feed.take((st.position, m), mine, dev)
            gen = torch.Generator(device=dev).manual_seed(derive_seed(tc.seed, st.step, chunk))
            sync: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
            if isinstance(st.net, DistributedDataParallel) and m < tc.grad_accum - 1:
                sync = st.net.no_sync()  # gradients all-reduced on the last micro-batch only
            with sync:
                with torch.autocast(dev.type, dtype=st.amp) if st.amp else contextlib.nullcontext():
                    loss, extras = self.task.loss(st.net, batch, gen)
                st.scaler.scale(loss / tc.grad_accum).backward()
            loss_sum += loss.detach().float()
            for key, value in extras.items():
                extra_sums[key] = extra_sums.get(key, 0) + value.detach().float()
        stop = torch.tensor(float(self.stop.reason is not None), device=dev)
        stats = island.all_sum(torch.stack([loss_sum, *extra_sums.values(), stop])).tolist()
        chunks = island.world_size * tc.grad_accum
        means = {key: value / chunks for key, value in zip(extra_sums, stats[1:-1])}
        return stats[0] / chunks, means, stats[-1] > 0

    def _chunks(self, st: TrainState, items: torch.Tensor) -> list[torch.Tensor]:
        """This process's micro-batches of a global batch's items: pieces rank * grad_accum + m, m < grad_accum."""
        first = st.island.rank * self.task.train_cfg.grad_accum
        return [items[c * st.micro : (c + 1) * st.micro] for c in range(first, first + self.task.train_cfg.grad_accum)]

    def _update(self, st: TrainState, loss: float, extras: dict[str, float]) -> None:
        """Optimiser step + EMA for a finite loss; skip a non-finite one, and stop after a run of them."""
        tc = self.task.train_cfg
        if math.isfinite(loss):
            st.bad = 0
            if tc.grad_clip is not None:
                st.scaler.unscale_(st.opt)
                # the optimiser's own list: walking the module tree for its parameters costs more than the clip
                torch.nn.utils.clip_grad_norm_([p for g in st.opt.param_groups for p in g["params"]], tc.grad_clip)
            st.scaler.step(st.opt)
            st.scaler.update()
            if st.ema is not None:
                st.ema.update(st.model)
            if st.tracked is not None:
                st.tracked.update(st.model)
            st.window.loss += loss
            st.window.finite_steps += 1
            for key, value in extras.items():
                st.window.extras[key] = st.window.extras.get(key, 0.0) + value
        else:
            st.bad += 1
        st.opt.zero_grad(set_to_none=True)
        st.window.samples += tc.batch_size
        st.window.steps += 1
        if st.bad >= tc.max_bad_steps:
            if st.island.is_main:
                self.checkpoints.drain(st)  # (the newest checkpoint may still be being written)
            last = self.checkpoints.store.latest()
            raise TrainingDiverged(
                f"{self.task.name}: loss was {loss} for {st.bad} consecutive steps (up to step {st.step}); stopped "
                f"without saving. Last good checkpoint: {self.checkpoints.store.url(last) if last else 'none'}. Lower "
                f"train.lr or set train.grad_clip, check the data, then re-run to resume"
            )

    # ----------------------------------------------------------------------------------------------
    #                                 Checkpoints, logs, outputs
    # ----------------------------------------------------------------------------------------------
