"""RemoteWatch on backends that end jobs or are slow to let go of them: a lost job is resubmitted (once the
backend has let go of it), and train-all's line says why."""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import time

from flowfleet.backends import read_submissions
from flowfleet.backends.watch import RemoteWatch
from flowfleet.layout import STATUS_FILE
from flowfleet.storage import RunRoot
from flowfleet.train.specs import JobSpec
from flowfleet.train.status import JobStatus, read_status


class EndingBackend:
    """Ends every job it is given (FAILED) before it writes a status; keeps `output` as each job's log."""

    name = "fake"
    config = None

    def __init__(self, output: str | Exception):
        self.output, self.submitted = output, 0

    def resubmit(self, root, spec, run_name):
        self.submitted += 1
        return f"job-{self.submitted}"

    def states(self, ids):
        return {i: "FAILED" for i in ids}

    def is_active(self, state):
        return state == "RUNNING"

    def cancel(self, ids):
        raise AssertionError("a job the backend has ended is not cancelled")

    def logs(self, job_id):
        if isinstance(self.output, Exception):
            raise self.output
        return self.output

    def record(self):
        return {}


def lost_lines(tmp_path, output, caplog) -> tuple[list[str], RunRoot]:
    root = RunRoot(tmp_path)
    watch = RemoteWatch(root, "run", max_resubmits=1)
    watch.add(EndingBackend(output), [JobSpec("expert", 0)], {"expert-0": "job-0"})
    with caplog.at_level(logging.WARNING, logger="flowfleet.backends.watch"):
        assert watch.step() is True  # resubmitted: waiting on the new job
        assert watch.step() is False  # lost again: max_resubmits reached, given up
    return [r.getMessage() for r in caplog.records], root


def test_a_job_the_backend_ended_is_resubmitted_with_its_last_words(tmp_path, caplog):
    lines, root = lost_lines(tmp_path, "flowfleet: expert-0: 1200 steps\nValueError: boom\n\n", caplog)
    assert lines == [
        "expert-0: fake job job-0 lost (fake ended it (FAILED) and it never finished: ValueError: boom); "
        "resubmitted as job-1, it resumes from its newest checkpoint",
        "expert-0: fake job job-1 lost (fake ended it (FAILED) and it never finished: ValueError: boom); "
        "resubmitted 1 times, giving up (run.yaml backends: max_resubmits)",
    ]
    assert read_submissions(root)["expert-0"]["id"] == "job-1"


def test_no_output_or_an_unreadable_one_leaves_the_line_as_it_was(tmp_path, caplog):
    for output in ("", RuntimeError("no such job")):
        caplog.clear()
        lines, _ = lost_lines(tmp_path, output, caplog)
        assert lines[0].startswith("expert-0: fake job job-0 lost (fake ended it (FAILED) and it never finished); ")


class SlowToLetGoBackend(EndingBackend):
    """Lists a cancelled job RUNNING for `lingers` more looks (Ray, until it notices the node died), then
    STOPPED; every job it is given runs."""

    def __init__(self, lingers: int):
        super().__init__("")
        self.lingers, self.cancelled = lingers, []

    def states(self, ids):
        out = {}
        for i in ids:
            if i in self.cancelled and self.lingers <= 0:
                out[i] = "STOPPED"
            else:
                out[i] = "RUNNING"
        self.lingers -= any(i in self.cancelled for i in ids)
        return out

    def cancel(self, ids):
        self.cancelled.extend(ids)


def dead_lease(root: RunRoot) -> None:
    """expert-0's status: running, a fresh heartbeat, on this host, from a process that has exited."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    status = JobStatus("expert-0", state="running", host=socket.gethostname(), pid=gone.pid, heartbeat=time.time() + 5)
    root.write_json(status.to_dict(), "experts/0", STATUS_FILE)


def test_a_lost_job_the_backend_still_lists_is_resubmitted_once_the_backend_lets_go(tmp_path, caplog):
    root = RunRoot(tmp_path)
    backend = SlowToLetGoBackend(lingers=2)
    watch = RemoteWatch(root, "run", max_resubmits=1)
    watch.add(backend, [JobSpec("expert", 0)], {"expert-0": "job-0"})
    dead_lease(root)
    with caplog.at_level(logging.WARNING, logger="flowfleet.backends.watch"):
        for _ in range(3):  # cancelled, then listed twice more: nothing resubmitted yet
            assert watch.step() is True
            assert backend.cancelled == ["job-0"] and backend.submitted == 0
        assert watch.step() is True  # let go of: the replacement is submitted
    assert backend.submitted == 1 and watch.ids() == {"expert-0": "job-1"}
    assert [r.getMessage() for r in caplog.records] == [
        f"expert-0: fake job job-0 lost (its lease expired ({socket.gethostname()}:{backend_pid(root)} silent)); "
        "resubmitted as job-1, it resumes from its newest checkpoint"
    ]


def test_a_backend_that_never_lets_go_is_given_up_on_after_let_go_s(tmp_path):
    root = RunRoot(tmp_path)
    backend = SlowToLetGoBackend(lingers=10**6)
    watch = RemoteWatch(root, "run", max_resubmits=1, let_go_s=0.0)
    watch.add(backend, [JobSpec("expert", 0)], {"expert-0": "job-0"})
    dead_lease(root)
    assert watch.step() is True and backend.submitted == 0  # cancelled
    assert watch.step() is True and backend.submitted == 1  # still listed, but let_go_s has passed


def backend_pid(root: RunRoot) -> int:
    status = read_status(root, "experts/0")
    assert status is not None
    return status.pid


def test_each_backend_resubmits_as_often_as_its_run_yaml_says(tmp_path, caplog):
    """backends.NAME.max_resubmits: a preemptible partition's jobs come back more often than the watch's default,
    another backend's not at all; each job gives up after its own backend's count."""
    from flowfleet.config import BackendConfig

    assert BackendConfig(kind="slurm").max_resubmits == 2
    root = RunRoot(tmp_path)
    watch = RemoteWatch(root, "run")  # the default: 2
    preemptible, strict = EndingBackend("preempted"), EndingBackend("")
    watch.add(preemptible, [JobSpec("expert", 0)], {"expert-0": "job-0"}, max_resubmits=4)
    watch.add(strict, [JobSpec("expert", 1)], {"expert-1": "job-0"}, max_resubmits=0)
    steps = [watch.step() for _ in range(6)]
    assert steps == [True] * 4 + [False] * 2
    assert (preemptible.submitted, strict.submitted) == (4, 0)
