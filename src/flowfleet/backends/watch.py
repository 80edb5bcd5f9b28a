"""Watching jobs submitted to remote backends until they end, resubmitting the ones whose node died.

A job is lost when its status.json says running but its lease has expired (the node or the process died
while the backend still lists the job) or when the backend ended it while it never finished (Slurm
dropped it, Ray's worker node went away). A lost job is cancelled and submitted again, at most
`max_resubmits` times, and resumes from its newest checkpoint. A lost job the backend still lists is let
go of first: its replacement is submitted once the backend has ended it (or after `let_go_s`), so that it is
not placed on the node that died while the backend still counts that node alive (Ray notices a dead node
by missed health checks, seconds after its processes are gone). A job that failed by itself (status
"failed") is not resubmitted: it would fail again.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from flowfleet.backends import RemoteBackend, record_submissions
from flowfleet.storage import RunRoot
from flowfleet.train.fanout import last_line
from flowfleet.train.specs import JobSpec
from flowfleet.train.status import read_status

log = logging.getLogger(__name__)


@dataclass
class _Watched:
    spec: JobSpec
    backend: RemoteBackend
    job_id: str
    submitted: float = field(default_factory=time.time)
    resubmits: int = 0
    max_resubmits: int = 2  # its backend's run.yaml backends.NAME.max_resubmits
    lost: tuple[str, int] | None = None  # the process given up on: its status is not the new job's
    letting_go: tuple[float, str] | None = None  # (when, why) a lost job still listed was cancelled


def last_words(w: _Watched) -> str:
    """': ' and the last line the job printed, as its backend keeps it ('' when there is none to read): why a job
    ended before it finished, in train-all's own line."""
    try:
        said = last_line(w.backend.logs(w.job_id))
    except Exception:  # the backend may have forgotten the job, or never kept its output
        return ""
    return f": {said.strip()}" if said else ""


class RemoteWatch:
    """The submitted jobs of one train-all, on any number of backends; step() looks once."""

    def __init__(self, root: RunRoot, run_name: str, max_resubmits: int = 2, let_go_s: float = 120.0):
        self.root, self.run_name, self.max_resubmits, self.let_go_s = root, run_name, max_resubmits, let_go_s
        self.jobs: dict[str, _Watched] = {}

    def add(
        self, backend: RemoteBackend, specs: list[JobSpec], ids: dict[str, str], max_resubmits: int | None = None
    ) -> None:
        """Watch these jobs of `backend`; max_resubmits: how often each is resubmitted when lost (None: the watch's)."""
        most = self.max_resubmits if max_resubmits is None else max_resubmits
        for spec in specs:
            self.jobs[spec.name] = _Watched(spec, backend, ids[spec.name], max_resubmits=most)

    def ids(self) -> dict[str, str]:
        return {name: w.job_id for name, w in self.jobs.items()}

    def step(self) -> bool:
        """Look at every job once, resubmitting the lost ones -> whether any is still queued or running."""
        states: dict[str, str] = {}
        for backend in {id(w.backend): w.backend for w in self.jobs.values()}.values():
            mine = [w.job_id for w in self.jobs.values() if w.backend is backend]
            states.update(backend.states(mine))
        waiting = False
        for w in self.jobs.values():
            state = states.get(w.job_id)
            active = w.backend.is_active(state)
            if w.letting_go is not None:
                since, why = w.letting_go
                if active and time.time() - since < self.let_go_s:
                    waiting = True  # the backend has not let go of the lost job yet
                else:
                    waiting = self._resubmit(w, why) or waiting
                continue
            status = read_status(self.root, w.spec.dir)
            current = (
                status is not None
                and (status.heartbeat or 0) >= w.submitted - 1
                and (status.host, status.pid) != w.lost
            )
            if status is not None and status.state in ("done", "stopped", "failed") and current:
                waiting = waiting or active  # (the backend has not noticed the end yet)
                continue
            if active:
                if status is None or not current or status.state != "running" or status.is_live():
                    waiting = True
                    continue
                why = f"its lease expired ({status.host}:{status.pid} silent)"
            else:
                why = f"{w.backend.name} ended it ({state or 'gone'}) and it never finished{last_words(w)}"
            if status is not None:
                w.lost = (status.host, status.pid)
            if active and w.resubmits < w.max_resubmits:
                w.backend.cancel([w.job_id])
                w.letting_go = (time.time(), why)
                waiting = True
            else:
                waiting = self._resubmit(w, why) or waiting
        return waiting

    def _resubmit(self, w: _Watched, why: str) -> bool:
        old = w.job_id
        w.letting_go = None
        if w.resubmits >= w.max_resubmits:
            log.warning(
                f"{w.spec.name}: {w.backend.name} job {old} lost ({why}); "
                f"resubmitted {w.max_resubmits} times, giving up (run.yaml backends: max_resubmits)"
            )
            return False
        w.job_id = w.backend.resubmit(self.root, w.spec, self.run_name)
        w.submitted, w.resubmits = time.time(), w.resubmits + 1
        record_submissions(self.root, w.backend, {w.spec.name: w.job_id})
        log.warning(
            f"{w.spec.name}: {w.backend.name} job {old} lost ({why}); resubmitted as {w.job_id}, "
            f"it resumes from its newest checkpoint"
        )
        return True

    def wait(self, poll_every: float = 2.0, on_poll=None) -> None:
        """step() until no job is queued or running."""
        while True:
            if on_poll is not None:
                on_poll()
            if not self.step():
                return
            time.sleep(poll_every)
