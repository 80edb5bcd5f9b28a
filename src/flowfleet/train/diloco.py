"""DiLoCo over the run root: one model trained by W isolated workers that exchange nothing but files.

Worker w, round r, from the round's start weights θ_r (the same on every worker; θ_0: train.seed's init):

    1. H = diloco.sync_every inner steps on its random 1/W of data/ (flowfleet.train.tasks.WorkerTask), its inner
       optimiser's state kept from round to round, as DiLoCo keeps it; diloco.pace[w] x H on machines of different
       speeds, so that no worker waits for a slower one
    2. its pseudo-gradient Δ_w = θ_r − θ_w, float32, written atomically to diloco/rounds/<r>/worker-<w>.safetensors
    3. it waits for the other workers' files up to diloco.round_timeout_s. The first worker to find all of them, or
       the first whose wait runs out, creates the round's decision.json naming the workers found (an exclusive
       create: one decision per round, whoever wins, flowfleet.storage.RunRoot.create_bytes); a wait that ran out
       says which workers were missing in one line and in the job's status
    4. every worker reads the decision, averages the Δ it names in worker order, Δ = mean_v Δ_v, and takes the
       outer step θ_{r+1} = θ_r − outer_lr · Nesterov(Δ) (torch's SGD): the same bytes in, the same weights out
    5. its weights become θ_{r+1}; a checkpoint holds θ_{r+1}, the outer optimiser and r + 1

A worker that reaches a round already decided (it was lost, late or resumed) adopts the decision: it skips the
round's inner steps, reads the pseudo-gradients the decision names and goes on from θ_{r+1} with the others. So a
round's update is applied once by every worker, whenever it runs, and no round is lost. final/ holds the EMA of the
outer weights (one update per round at decay ema_decay^H); the workers' final/ folders are equal, and assemble
--diloco makes one of them a model folder as it does the monolith.

Written here rather than with torchft's `local_sgd.DiLoCo`: that averages through a torchft Manager's process group
(a lighthouse server and an allreduce between live replicas); these workers share only a folder or a bucket.
"""

from __future__ import annotations

import copy
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, cast

import safetensors.torch
import torch

from flowfleet.config import DiLoCoConfig
from flowfleet.distributed import DistContext
from flowfleet.errors import FlowfleetError
from flowfleet.layout import DILOCO_DECISION, diloco_round
from flowfleet.models.dit import DiTModel
from flowfleet.storage import RunRoot
from flowfleet.train.checkpoint import Checkpoint, flatten_state, unflatten_state
from flowfleet.train.ema import EMA
from flowfleet.train.loop import StepHooks, TrainState, cpu_state
from flowfleet.train.tasks import TrainTask

POLL_LOCAL_S = 0.1  # how often a waiting worker lists the round's folder: a local disk
POLL_REMOTE_S = 1.0  # an object store (each look is a LIST request)

log = logging.getLogger(__name__)


def pseudo_gradient_name(w: int) -> str:
    return f"worker-{w}.safetensors"


@dataclass
class Traffic:
    """The payload bytes one worker wrote to and read from the run root's rounds (its checkpoints aside)."""

    written: int = 0
    read: int = 0


@dataclass
class Decision:
    """Which workers' pseudo-gradients round `round` averages."""

    round: int
    workers: list[int]
    missing: list[int] = field(default_factory=list)

    def to_bytes(self, by: int) -> bytes:
        body = {"round": self.round, "workers": self.workers, "missing": self.missing, "by": by, "time": time.time()}
        return json.dumps(body).encode()

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> "Decision":
        try:
            raw = json.loads(data)
            return cls(int(raw["round"]), [int(w) for w in raw["workers"]], [int(w) for w in raw.get("missing", [])])
        except (ValueError, KeyError, TypeError) as err:
            raise FlowfleetError(f"{where}: not a DiLoCo round decision ({err})") from None


class Rounds:
    """diloco/rounds/ of a run root as one worker sees it: its writes and reads, counted."""

    def __init__(self, root: RunRoot, workers: int, me: int):
        self.root, self.workers, self.me = root, workers, me
        self.traffic = Traffic()

    def decision(self, r: int) -> Decision | None:
        try:  # (a read, not an exists: an object store's listing cache could still say missing)
            data = self.root.read_bytes(*diloco_round(r), DILOCO_DECISION)
        except FileNotFoundError:
            return None
        self.traffic.read += len(data)
        return Decision.from_bytes(data, self.root.url_of(*diloco_round(r), DILOCO_DECISION))

    def write(self, r: int, delta: dict[str, torch.Tensor]) -> None:
        data = safetensors.torch.save(delta)
        self.root.write_bytes(data, *diloco_round(r), pseudo_gradient_name(self.me))
        self.traffic.written += len(data)

    def read(self, r: int, w: int) -> dict[str, torch.Tensor]:
        data = self.root.read_bytes(*diloco_round(r), pseudo_gradient_name(w))
        self.traffic.read += len(data)
        return safetensors.torch.load(data)

    def present(self, r: int) -> list[int]:
        names = set(self.root.ls(*diloco_round(r)))
        return [w for w in range(self.workers) if pseudo_gradient_name(w) in names]

    def decide(self, r: int, workers: list[int]) -> None:
        """Create round r's decision unless another worker did first."""
        missing = [w for w in range(self.workers) if w not in workers]
        data = Decision(r, workers, missing).to_bytes(by=self.me)
        if self.root.create_bytes(data, *diloco_round(r), DILOCO_DECISION):
            self.traffic.written += len(data)


class OuterLoop:
    """θ_r (a copy of the model whose parameters are the outer weights), its SGD, its EMA and the round count."""

    def __init__(self, model: DiTModel, cfg: DiLoCoConfig, ema_decay: float, ema_warmup: bool):
        self.model: DiTModel = copy.deepcopy(model).requires_grad_(True)
        momentum = cfg.outer_momentum
        self.opt = torch.optim.SGD(
            self.model.parameters(), lr=cfg.outer_lr, momentum=momentum, nesterov=cfg.nesterov and momentum > 0
        )
        self.ema = EMA(self.model, ema_decay**cfg.sync_every, ema_warmup)
        self.round = 0  # rounds applied

    def pseudo_gradient(self, local: torch.nn.Module) -> dict[str, torch.Tensor]:
        """Δ = θ_r − θ_local per parameter, float32 on the CPU."""
        outer = dict(self.model.named_parameters())
        return {
            name: (outer[name].detach() - p.detach()).float().cpu().contiguous() for name, p in local.named_parameters()
        }

    @torch.no_grad()
    def step(self, deltas: list[dict[str, torch.Tensor]], local: torch.nn.Module) -> None:
        """The outer step on the mean of `deltas` (summed in the order given), then the local weights become θ_{r+1}."""
        for name, p in self.model.named_parameters():
            total = deltas[0][name].clone()
            for delta in deltas[1:]:
                total += delta[name]
            p.grad = (total / len(deltas)).to(p.device, p.dtype)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.ema.update(self.model)
        local.load_state_dict(self.model.state_dict())
        self.round += 1

    def state(self) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, Any]]:
        skeleton, tensors = flatten_state(self.opt.state_dict())
        files = {
            "outer": cpu_state(self.model.state_dict()),
            "outer_ema": cpu_state(self.ema.state_dict()),
            "outer_optimizer": tensors,
        }
        return files, {"outer_round": self.round, "outer_optimizer": skeleton}

    def load(self, ckpt: Checkpoint) -> None:
        self.model.load_state_dict(ckpt.tensors["outer"])
        self.ema.load_state_dict(ckpt.tensors["outer_ema"])
        self.opt.load_state_dict(
            unflatten_state(ckpt.state["outer_optimizer"], ckpt.tensors.get("outer_optimizer", {}))
        )
        self.round = int(ckpt.state["outer_round"])


class DiLoCoRounds(StepHooks):
    """DiLoCo's outer loop around the trainer's optimiser steps (see the module's text): the trainer calls it
    (flowfleet.train.loop.StepHooks) at a step's start and end, at checkpoints and at the end.

        Trainer(task, root, options, hooks=DiLoCoRounds(task, root)).run()
    """

    def __init__(self, task: TrainTask, root: RunRoot):
        cfg = task.run.diloco
        if cfg is None or task.spec.worker is None:
            raise FlowfleetError(f"{task.name}: not a DiLoCo worker (run.yaml diloco)")
        self.task, self.cfg, self.me = task, cfg, task.spec.worker
        self.sync_every = cfg.sync_every * cfg.pace_of(self.me)  # this worker's inner steps a round
        self.rounds = Rounds(root, cfg.workers, self.me)
        self.outer: OuterLoop | None = None
        self.short: list[dict[str, Any]] = []  # the rounds decided without every worker, as this worker saw them
        self.poll_s = POLL_LOCAL_S if root.is_local else POLL_REMOTE_S

    @property
    def total_rounds(self) -> int:
        return -(-self.task.total_steps // self.sync_every)

    def check(self, island: DistContext) -> None:
        if island.distributed:
            raise FlowfleetError(f"{self.task.name}: a DiLoCo worker runs as one process (no torchrun)")

    def optimizer(self, model: torch.nn.Module, dev: torch.device) -> torch.optim.Optimizer | None:
        """AdamW (the trainer's, None) or plain SGD (diloco.inner sgd: with outer_lr 1 and no momentum, local SGD)."""
        if self.cfg.inner == "adamw":
            return None
        tc = self.task.train_cfg
        return torch.optim.SGD(model.parameters(), lr=tc.lr, weight_decay=tc.weight_decay)

    def started(self, st: TrainState) -> None:
        if self.outer is None:  # a fresh start: θ_0 is the model as built
            self.outer = self._outer(st)
        self._report(st)

    def _outer(self, st: TrainState) -> OuterLoop:
        tc = self.task.train_cfg
        return OuterLoop(cast(DiTModel, st.model), self.cfg, tc.ema_decay, tc.ema_warmup)  # (the task built it)

    # -- the round -------------------------------------------------------------------------------------

    def skipped(self, st: TrainState) -> int:
        """A round already decided when this worker reaches it is adopted without its inner steps."""
        assert self.outer is not None
        if st.step % self.sync_every or st.step >= self.task.total_steps:
            return 0
        decided = self.rounds.decision(self.outer.round)
        if decided is None:
            return 0
        end = min(st.step + self.sync_every, self.task.total_steps)
        log.info("%s: round %d was decided without waiting for it; adopts it", self.task.name, decided.round)
        moved = end - st.step
        st.position += moved * self.task.train_cfg.batch_size
        st.step = end
        self._apply(st, decided, own=None)
        return moved

    def after_update(self, st: TrainState) -> bool:
        """At a round's end: write Δ, wait for the decision, apply it (-> a checkpoint is due)."""
        if st.step % self.sync_every and st.step < self.task.total_steps:
            return False
        assert self.outer is not None
        r = self.outer.round
        decided = self.rounds.decision(r)
        own = None
        if decided is None:
            own = self.outer.pseudo_gradient(st.model)
            self.rounds.write(r, own)
            decided = self._wait(r)
        elif self.me not in decided.workers:
            log.warning("%s: round %d was decided without it (late); adopts it", self.task.name, r)
        self._apply(st, decided, own)
        return True

    def _wait(self, r: int) -> Decision:
        """Until round r is decided: by this worker once every file is there or its wait runs out."""
        t0 = time.monotonic()
        while True:
            decided = self.rounds.decision(r)
            if decided is not None:
                return decided
            present = self.rounds.present(r)
            waited = time.monotonic() - t0
            if len(present) == self.cfg.workers or waited >= self.cfg.round_timeout_s:
                self.rounds.decide(r, present)
                continue
            time.sleep(self.poll_s)

    def _apply(self, st: TrainState, decided: Decision, own: dict[str, torch.Tensor] | None) -> None:
        """The outer step of round `decided.round` from the pseudo-gradients it names (this worker's own, where
        given, from memory: the bytes it wrote)."""
        assert self.outer is not None
        if decided.round != self.outer.round:
            raise FlowfleetError(
                f"{self.task.name}: round {decided.round} decided, but this worker is at round {self.outer.round}"
            )
        if not decided.workers:
            raise FlowfleetError(f"{self.rounds.root.url_of(*diloco_round(decided.round))}: decided with no worker")
        deltas = [
            own if w == self.me and own is not None else self.rounds.read(decided.round, w) for w in decided.workers
        ]
        if decided.missing:
            short = {"round": decided.round, "workers": decided.workers, "missing": decided.missing}
            self.short.append(short)
            log.warning(
                "%s: round %d went on with workers %s; %s missing (diloco.round_timeout_s %g s)",
                self.task.name,
                decided.round,
                ", ".join(map(str, decided.workers)),
                ", ".join(map(str, decided.missing)),
                self.cfg.round_timeout_s,
            )
        self.outer.step(deltas, st.model)
        self._report(st)

    def _report(self, st: TrainState) -> None:
        """The rounds and the traffic in the job's status.json."""
        if st.lease is None or self.outer is None:
            return
        st.lease.update(diloco=self.report())

    def report(self) -> dict[str, Any]:
        assert self.outer is not None
        return {
            "round": self.outer.round,
            "rounds": self.total_rounds,
            "workers": self.cfg.workers,
            "sync_every": self.sync_every,
            "bytes_written": self.rounds.traffic.written,
            "bytes_read": self.rounds.traffic.read,
            "short_rounds": list(self.short),
        }

    # -- checkpoints and final/ -------------------------------------------------------------------------

    def checkpoint_extras(self, st: TrainState) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, Any]]:
        assert self.outer is not None
        files, state = self.outer.state()
        traffic = {"written": self.rounds.traffic.written, "read": self.rounds.traffic.read}
        return files, {**state, "diloco_traffic": traffic, "diloco_short_rounds": self.short}

    def restore(self, st: TrainState, ckpt: Checkpoint) -> None:
        self.outer = self._outer(st)
        self.outer.load(ckpt)
        traffic = ckpt.state.get("diloco_traffic", {})
        self.rounds.traffic = Traffic(int(traffic.get("written", 0)), int(traffic.get("read", 0)))
        self.short = list(ckpt.state.get("diloco_short_rounds", []))

    def final_model(self, st: TrainState) -> DiTModel | None:
        assert self.outer is not None
        if self.outer.round != self.total_rounds:
            raise FlowfleetError(f"{self.task.name}: {self.outer.round} of {self.total_rounds} rounds applied")
        return self.outer.ema.module.eval()
