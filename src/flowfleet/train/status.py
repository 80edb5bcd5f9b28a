"""status.json of a job, and the lease that a running job holds on it.

While a job runs, its status.json says "running" with the host, pid and a heartbeat (unix time)
refreshed by a background thread, so `flowfleet status` can tell a live job from a dead one and a
second copy of the same job refuses to start while the first one's heartbeat is fresh.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

from flowfleet.errors import FlowfleetError
from flowfleet.layout import FINAL, STATUS_FILE
from flowfleet.storage import RunRoot

STATES = ("pending", "running", "done", "failed", "stopped")
HEARTBEAT_EVERY = 30.0  # seconds between heartbeats of a running job (object store: each one is a PUT)
HEARTBEAT_EVERY_LOCAL = 5.0  # on a local disk a heartbeat is cheap; train-all's progress reads them
STALE_AFTER = 3 * HEARTBEAT_EVERY  # a "running" job silent for this long is presumed dead


class JobBusyError(FlowfleetError):
    """The job is already running elsewhere (fresh heartbeat)."""


@dataclass
class JobStatus:
    """The fields of status.json (docs/contracts.md)."""

    job: str
    state: str = "pending"
    step: int = 0
    total_steps: int = 0
    samples_seen: int = 0
    last_checkpoint: str | None = None
    host: str = ""
    pid: int = 0
    heartbeat: float = 0.0
    last_loss: float | None = None
    message: str = ""
    threads: str = ""  # a CPU job's thread setting as it last changed (flowfleet.threads.ThreadGovernor)
    # the last log line's speed (flowfleet.train.loop._Pace): seconds a step, MFU (None: no peak known), peak memory
    step_s: float | None = None
    model_tflops: float | None = None
    mfu: float | None = None
    peak_memory_gib: float | None = None
    # a DiLoCo worker's rounds: {"round", "rounds", "bytes_written", "bytes_read", "short_rounds": [{"round",
    # "workers", "missing"}]} (flowfleet.train.diloco)
    diloco: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], where: str) -> "JobStatus":
        if not isinstance(raw, dict) or "job" not in raw:
            raise FlowfleetError(f"{where}: not a job status (no 'job' field)")
        known = {f.name for f in dataclasses.fields(cls)}
        status = cls(**{k: v for k, v in raw.items() if k in known})
        if status.state not in STATES:
            raise FlowfleetError(f"{where}: unknown state {status.state!r} (expected one of {', '.join(STATES)})")
        return status

    def heartbeat_age(self, now: float | None = None) -> float | None:
        return None if not self.heartbeat else max(0.0, (now or time.time()) - self.heartbeat)

    def is_live(self, stale_after: float = STALE_AFTER, now: float | None = None) -> bool:
        """Running with a fresh heartbeat, and (on this host) its process still exists."""
        if self.state != "running":
            return False
        age = self.heartbeat_age(now)
        if age is None or age > stale_after:
            return False
        if self.host == socket.gethostname() and self.pid:
            return _pid_alive(self.pid)
        return True


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def read_status(root: RunRoot, job_dir: str) -> JobStatus | None:
    """The job's status, or None when it has never started."""
    raw = root.read_document(job_dir, STATUS_FILE)  # written atomically: only a hand edit fails to parse
    return None if raw is None else JobStatus.from_dict(raw, root.url_of(job_dir, STATUS_FILE))


def job_finished(root: RunRoot, job_dir: str, total_steps: int | None = None) -> tuple[bool, str, JobStatus | None]:
    """(finished, why not, its status): the one test of a finished job, which train-all skips, a
    re-run returns at once and assemble collects. Finished = status.json says done (at `total_steps`,
    when given) and final/ holds a model."""
    where = root.url_of(job_dir)
    try:
        status = read_status(root, job_dir)
    except FlowfleetError as err:  # corrupted JSON or not a job status
        return False, str(err), None
    if status is None:
        if not root.exists(job_dir):
            return False, f"{where}: missing (never started)", None
        return False, f"{root.url_of(job_dir, STATUS_FILE)}: missing", None
    if status.state != "done":
        return False, f"{where}: state {status.state!r} at step {status.step}/{status.total_steps}, not done", status
    if total_steps is not None and status.step < total_steps:
        return False, f"{where}: done at step {status.step}, but run.yaml asks for {total_steps}", status
    if not root.exists(job_dir, FINAL, "config.json"):
        return False, f"{root.url_of(job_dir, FINAL)}: missing although status.json says done", status
    return True, "", status


class JobLease:
    """Holds status.json of one job for the life of a run: claim, heartbeat thread, release.

    update() changes the in-memory status (cheap, every step); the heartbeat thread writes it every
    `interval` seconds; flush() writes it now. All writes happen under one lock.
    """

    def __init__(
        self,
        root: RunRoot,
        job_dir: str,
        status: JobStatus,
        *,
        interval: float = HEARTBEAT_EVERY,
        stale_after: float | None = None,
    ):
        self.root = root
        self.job_dir = job_dir
        self.status = status
        self.interval = interval
        self.stale_after = stale_after if stale_after is not None else max(STALE_AFTER, 3 * interval)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> None:
        """Refuse if another live process runs this job; otherwise mark it running and start beating."""
        current = read_status(self.root, self.job_dir)
        me = (socket.gethostname(), os.getpid())
        if current is not None and current.is_live(self.stale_after) and (current.host, current.pid) != me:
            age = current.heartbeat_age() or 0.0
            raise JobBusyError(
                f"{self.status.job}: already running on {current.host} (pid {current.pid}, heartbeat "
                f"{age:.0f} s ago, {self.root.url_of(self.job_dir, STATUS_FILE)}); stop it first or wait "
                f"{self.stale_after:.0f} s after it dies"
            )
        self.update(state="running", host=me[0], pid=me[1], message="")
        self.flush()
        self._stop.clear()
        self._thread = threading.Thread(target=self._beat, name=f"heartbeat-{self.status.job}", daemon=True)
        self._thread.start()

    def update(self, **fields: Any) -> None:
        with self._lock:
            for key, value in fields.items():
                setattr(self.status, key, value)

    def flush(self) -> None:
        with self._lock:
            self.status.heartbeat = time.time()
            self.root.write_json(self.status.to_dict(), self.job_dir, STATUS_FILE)

    def _beat(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.flush()
            except OSError:  # a missed heartbeat is not fatal; the next one retries
                pass

    def release(self, state: str, message: str = "") -> None:
        """Stop the heartbeat and write the final state."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.update(state=state, message=message)
        self.flush()
