"""Checkpoints of one job: safetensors + JSON only (no pickles, no torch.load).

    JOB/checkpoints/step-0000500/
        model.safetensors  ema.safetensors  optimizer.safetensors  rng.safetensors
        state.json         written LAST: step, data position, scaler, optimizer skeleton, file sizes
    JOB/checkpoints/latest.json   {"step", "dir"}: updated after state.json

Each file is written atomically (RunRoot.write_bytes). A checkpoint counts only once its state.json
exists and every file it lists has the recorded size, so a crash in the middle of a write leaves the
previous checkpoint the one that loads. If latest.json is missing or names an incomplete checkpoint,
the newest complete one is found by listing the folder.
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import safetensors.torch
import torch

from flowfleet.errors import FlowfleetError
from flowfleet.layout import CHECKPOINTS
from flowfleet.storage import RunRoot

LATEST = "latest.json"
STATE = "state.json"
FORMAT = 1
_STEP_DIR = re.compile(r"^step-(\d{7,})$")


class CheckpointError(FlowfleetError):
    """A checkpoint that cannot be read."""


def step_dir(step: int) -> str:
    return f"step-{step:07d}"


def step_of(name: str) -> int:
    """The step of a checkpoint folder's name (step_dir's inverse)."""
    m = _STEP_DIR.match(name)
    if m is None:
        raise CheckpointError(f"{name!r}: not a checkpoint folder's name (step-NNNNNNN)")
    return int(m.group(1))


# ------------------------------------------------------------------------------------------------
#           Nested state (optimizer, scaler) <-> JSON skeleton + flat tensors
# ------------------------------------------------------------------------------------------------
# Written by hand: safetensors stores only a flat str -> tensor map, and torch's own nested
# state_dict formats are otherwise only serialisable with pickle. Dicts with non-string keys (the
# optimizer's per-parameter state is keyed by int) and tuples (Adam's betas) keep their types.


def flatten_state(obj: Any, prefix: str = "") -> tuple[Any, dict[str, torch.Tensor]]:
    """-> (JSON-able skeleton, tensors); each tensor is replaced by {"__tensor__": key}."""
    tensors: dict[str, torch.Tensor] = {}

    def walk(x: Any, path: str) -> Any:
        if isinstance(x, torch.Tensor):
            tensors[path] = x.detach().to("cpu").contiguous().clone()
            return {"__tensor__": path}
        if isinstance(x, dict):
            if all(isinstance(k, str) for k in x):
                return {k: walk(v, f"{path}.{k}" if path else k) for k, v in x.items()}
            return {"__items__": [[k, walk(v, f"{path}.{k}" if path else str(k))] for k, v in x.items()]}
        if isinstance(x, tuple):
            return {"__tuple__": [walk(v, f"{path}.{i}") for i, v in enumerate(x)]}
        if isinstance(x, list):
            return [walk(v, f"{path}.{i}") for i, v in enumerate(x)]
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        raise TypeError(f"cannot store {type(x).__name__} at {path!r} in a checkpoint")

    return walk(obj, prefix), tensors


def unflatten_state(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of flatten_state."""
    if isinstance(skeleton, dict):
        if set(skeleton) == {"__tensor__"}:
            return tensors[skeleton["__tensor__"]]
        if set(skeleton) == {"__items__"}:
            return {k: unflatten_state(v, tensors) for k, v in skeleton["__items__"]}
        if set(skeleton) == {"__tuple__"}:
            return tuple(unflatten_state(v, tensors) for v in skeleton["__tuple__"])
        return {k: unflatten_state(v, tensors) for k, v in skeleton.items()}
    if isinstance(skeleton, list):
        return [unflatten_state(v, tensors) for v in skeleton]
    return skeleton


# ------------------------------------------------------------------------------------------------
#                                      The store
# ------------------------------------------------------------------------------------------------


@dataclass
class Checkpoint:
    """What a checkpoint holds: flat tensor files by name and the JSON state."""

    step: int
    tensors: dict[str, dict[str, torch.Tensor]]  # "model", "ema", "optimizer", "rng" -> flat tensors
    state: dict[str, Any] = field(default_factory=dict)


class CheckpointStore:
    """Reads and writes the checkpoints of one job folder of a run root."""

    def __init__(self, root: RunRoot, job_dir: str, keep: int = 2):
        self.root = root
        self.job_dir = job_dir
        self.keep = keep

    def _parts(self, *rest: str) -> tuple[str, ...]:
        return (self.job_dir, CHECKPOINTS, *rest)

    def url(self, name: str | None = None) -> str:
        return self.root.url_of(*self._parts(*([name] if name else [])))

    # -- writing -------------------------------------------------------------------------------------

    def save(self, ckpt: Checkpoint) -> str:
        """Write every tensor file, then state.json, then latest.json; prune old ones. -> dir name."""
        name = step_dir(ckpt.step)
        sizes = {}
        for file_name, tensors in ckpt.tensors.items():
            data = safetensors.torch.save(tensors)
            self.root.write_bytes(data, *self._parts(name, f"{file_name}.safetensors"))
            sizes[f"{file_name}.safetensors"] = len(data)
        state = {"format": FORMAT, "step": ckpt.step, "time": time.time(), "files": sizes, **ckpt.state}
        self.root.write_json(state, *self._parts(name, STATE))
        self.root.write_json({"step": ckpt.step, "dir": name}, *self._parts(LATEST))
        self.prune()
        return name

    def prune(self) -> None:
        """Keep the newest `keep` complete checkpoints; drop older ones and incomplete leftovers."""
        steps = self._step_dirs()
        complete = [s for s in steps if self._is_complete(step_dir(s))]
        kept = set(complete[-self.keep :])
        newest = complete[-1] if complete else -1
        for s in steps:
            if s not in kept and s < newest:
                self.root.remove(*self._parts(step_dir(s)), recursive=True)

    # -- reading -------------------------------------------------------------------------------------

    def _step_dirs(self) -> list[int]:
        steps = []
        for entry in self.root.ls(*self._parts()):
            if _STEP_DIR.match(entry):
                steps.append(step_of(entry))
        return sorted(steps)

    def _is_complete(self, name: str) -> bool:
        if not self.root.exists(*self._parts(name, STATE)):
            return False
        try:
            state = self.root.read_json(*self._parts(name, STATE))
        except ValueError:
            return False
        for file_name, size in state.get("files", {}).items():
            parts = self._parts(name, file_name)
            if not self.root.exists(*parts) or self.root.fs.size(self.root.path(*parts)) != size:
                return False
        return True

    def latest(self) -> str | None:
        """Name of the newest complete checkpoint, or None."""
        if self.root.exists(*self._parts(LATEST)):
            try:
                pointed = self.root.read_json(*self._parts(LATEST)).get("dir")
            except (ValueError, AttributeError):
                pointed = None
            if pointed and self._is_complete(pointed):
                newer = [s for s in self._step_dirs() if step_dir(s) > pointed and self._is_complete(step_dir(s))]
                return step_dir(newer[-1]) if newer else pointed
        for s in reversed(self._step_dirs()):
            if self._is_complete(step_dir(s)):
                return step_dir(s)
        return None

    def load(self, name: str) -> Checkpoint:
        where = self.url(name)
        if not self._is_complete(name):
            raise CheckpointError(f"{where}: incomplete checkpoint (state.json missing or a file truncated)")
        state = self.root.read_json(*self._parts(name, STATE))
        if state.get("format") != FORMAT:
            raise CheckpointError(f"{where}/{STATE}: format {state.get('format')!r}, expected {FORMAT}")
        tensors = {}
        for file_name in state["files"]:
            raw = self.root.read_bytes(*self._parts(name, file_name))
            try:
                tensors[file_name.removesuffix(".safetensors")] = safetensors.torch.load(raw)
            except Exception as err:  # safetensors has its own error type for a bad header
                raise CheckpointError(f"{where}/{file_name}: unreadable ({str(err).splitlines()[0][:200]})") from None
        return Checkpoint(step=int(state["step"]), tensors=tensors, state=state)


class BackgroundWriter:
    """Writes one checkpoint at a time in a thread of its own (CheckpointStore.save: state.json last), so that the
    training loop goes on while it is written; a process killed mid-write leaves the previous checkpoint the newest
    complete one. The checkpoint handed over must own its tensors (a copy taken at its step).

        writer = BackgroundWriter(store)
        writer.start(ckpt)          # waits for the previous write first; -> its name, if one ended
        writer.finished()           # -> the name of a write that ended since, else None (its error raised here)
        writer.wait()               # joins the running write -> its name
        writer.save(ckpt)           # or written in the caller's thread -> its name"""

    def __init__(self, store: CheckpointStore):
        self.store = store
        self._thread: threading.Thread | None = None
        self._name: str | None = None
        self._error: BaseException | None = None
        self.last_s: float | None = None  # how long the last ended write took
        self._started = 0.0  # when the write in flight started (time.perf_counter)

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def write_s(self) -> float | None:
        """How long a write takes as far as this writer knows: the last ended write's time, or the one in flight's
        so far where that is longer (a first write that has not ended yet); None before any write started."""
        known = [self.last_s] if self.last_s is not None else []
        if self.busy:
            known.append(time.perf_counter() - self._started)
        return max(known) if known else None

    def start(self, ckpt: Checkpoint) -> str | None:
        ended = self.wait()
        self._started = time.perf_counter()
        self._thread = threading.Thread(target=self._write, args=(ckpt,), name="flowfleet-checkpoint", daemon=True)
        self._thread.start()
        return ended

    def save(self, ckpt: Checkpoint) -> str:
        """Write a checkpoint in the caller's thread (train.async_checkpoint false), timed as a background write is;
        -> its name."""
        self.wait()
        return self._timed_save(ckpt)

    def _write(self, ckpt: Checkpoint) -> None:
        try:
            self._name = self._timed_save(ckpt)
        except BaseException as err:  # raised in the loop's thread, at its next look
            self._error = err

    def _timed_save(self, ckpt: Checkpoint) -> str:
        t0 = time.perf_counter()
        try:
            return self.store.save(ckpt)
        finally:
            self.last_s = time.perf_counter() - t0

    def finished(self) -> str | None:
        return None if self.busy else self.wait()

    def wait(self) -> str | None:
        if self._thread is None:
            return None
        self._thread.join()
        self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error
        name, self._name = self._name, None
        return name
