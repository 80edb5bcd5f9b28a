"""RemoteWatch on a backend that ends jobs: a lost job is resubmitted, and train-all's line says why."""

from __future__ import annotations

import logging

from flowfleet.backends import read_submissions
from flowfleet.backends.watch import RemoteWatch
from flowfleet.storage import RunRoot
from flowfleet.train.specs import JobSpec


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
        "resubmitted 1 times, giving up",
    ]
    assert read_submissions(root)["expert-0"]["id"] == "job-1"


def test_no_output_or_an_unreadable_one_leaves_the_line_as_it_was(tmp_path, caplog):
    for output in ("", RuntimeError("no such job")):
        caplog.clear()
        lines, _ = lost_lines(tmp_path, output, caplog)
        assert lines[0].startswith("expert-0: fake job job-0 lost (fake ended it (FAILED) and it never finished); ")
