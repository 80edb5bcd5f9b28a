"""`train-all`: every job of a run as a separate local OS process, N at a time.

Each job is a command line, `python -m flowfleet.cli train-expert RUN --expert k` (or train-router /
train-monolith; flowfleet.train.specs builds it): the same command a user would run on another machine,
so nothing here is shared between jobs but the run root. Processes get their own session (a terminal
Ctrl-C reaches only this parent, which forwards SIGTERM so each child checkpoints and stops), a thread
budget (OMP_NUM_THREADS; idle threads sleep where jobs share the cores: flowfleet.threads) and, on a GPU
machine, one GPU each.

A job whose command is `python -m MODULE ARGS` (ProcessJob.forkable) starts from Python's
multiprocessing forkserver, which imports `preload` (torch, diffusers, flowfleet: ~5 s of every job's
start) once: each job is a fresh fork of that interpreter that runs `MODULE.main(ARGS)` with its own
environment, session and log, exactly as the command line would. Where there is no forkserver
(Windows), for any other command, or for a job that uses a GPU (a fork cannot initialise CUDA once its parent
has asked torch about GPUs), the job is a plain subprocess. (The module is named by the job's
command line and imported in `_run_module`, the forkserver child, where the server has preloaded it:
this file imports no command-line module, so the fan-out stays below the CLI that uses it.)
"""

from __future__ import annotations

import importlib
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Callable, Protocol

from flowfleet.threads import CEILING, Workload, thread_env


@dataclass
class ProcessJob:
    name: str
    argv: list[str]  # full command line
    log: Path  # stdout + stderr go here (appended)
    forkable: bool = False  # argv is `PYTHON -m MODULE ARGS` and MODULE has main(ARGS): may start from the forkserver


@dataclass
class ProcessOutcome:
    name: str
    returncode: int
    seconds: float
    log: Path
    last_line: str = ""


@dataclass
class Slot:
    """One of the N places a job can run in: a thread budget and maybe a GPU."""

    threads: int
    gpu: int | None = None
    shared: bool = False  # beside other slots on the same cores: idle threads sleep (flowfleet.threads)

    @property
    def workload(self) -> Workload:
        return "shared" if self.shared else "alone"

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.pop(CEILING, None)  # the job's budget below is fixed: no governor follows the load in it
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(self.threads)
        env.update(thread_env(self.workload, env))
        if self.gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = str(self.gpu)
        return env


def plan_slots(num_jobs: int, parallel: int | None, cpus: int, gpus: int) -> list[Slot]:
    """N slots: by default one per GPU on a GPU machine, else one per core (small CPU jobs scale
    better as processes than as threads); the cores are shared out as thread budgets."""
    if parallel is None:
        parallel = gpus if gpus else cpus
    parallel = max(1, min(parallel, max(num_jobs, 1)))
    threads = max(1, cpus // parallel)
    return [Slot(threads, (i % gpus) if gpus else None, shared=parallel > 1) for i in range(parallel)]


def last_line(text: str) -> str:
    """The last non-blank line of a job's output (at most its last 300 characters): what it said as it ended."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return lines[-1][-300:] if lines else ""


def _last_line(path: Path) -> str:
    try:
        return last_line(path.read_text(errors="replace"))
    except OSError:
        return ""


class _Running(Protocol):
    pid: int

    def poll(self) -> int | None: ...  # the exit code once finished

    def send_signal(self, sig: int) -> None: ...


class _Forked:
    """A forkserver child running a flowfleet command (the _Running interface of subprocess.Popen)."""

    def __init__(self, ctx, job: ProcessJob, env: dict[str, str]):
        self.process = ctx.Process(target=_run_module, args=(job.argv, str(job.log), env), name=job.name)
        self.process.start()
        self.pid = self.process.pid

    def poll(self) -> int | None:
        return self.process.exitcode  # None while running; -N when killed by signal N, like Popen

    def send_signal(self, sig: int) -> None:
        if self.process.exitcode is None:
            os.kill(self.pid, sig)


def _run_module(argv: list[str], log: str, env: dict[str, str]) -> None:
    """In a forkserver child: what argv = `python -m MODULE ARGS` with stdout and stderr appended to
    `log`, environment `env` and a new session does."""
    _python, dash_m, module, *args = argv
    assert dash_m == "-m", argv
    os.setsid()
    os.environ.clear()
    os.environ.update(env)
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    import torch

    # OpenMP read the server's environment when torch loaded there: apply this job's thread budget
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", torch.get_num_threads())))
    sys.exit(importlib.import_module(module).main(args))


def _forkserver(preload: tuple[str, ...], workload: Workload):
    """The multiprocessing forkserver context, asked to import `preload` once; None where there is none.
    OpenMP reads its wait policy when the server loads torch, and every fork keeps it: the server starts with
    the thread policy of the jobs' workload (a server already running, in a process that fanned out before,
    keeps the policy it started with)."""
    if not preload or "forkserver" not in multiprocessing.get_all_start_methods():
        return None
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(preload))  # no effect once the server runs: it has imported them already
    added = thread_env(workload)
    os.environ.update(added)  # the server's environment is this process's when it starts
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        for name in added:
            del os.environ[name]
    return ctx


@dataclass
class LocalFanout:
    """Runs ProcessJobs in order, at most len(slots) at a time; SIGTERM/SIGINT stop them cleanly."""

    slots: list[Slot]
    poll_every: float = 0.5
    preload: tuple[str, ...] = ()  # modules a forkserver imports once for every forkable job
    on_start: Callable[[ProcessJob, int], None] | None = None  # (job, pid)
    on_exit: Callable[[ProcessOutcome], None] | None = None
    on_poll: Callable[[], None] | None = None
    _stop: bool = field(default=False, init=False)

    def request_stop(self) -> None:
        self._stop = True

    @property
    def stopped(self) -> bool:
        """A stop was asked for (SIGTERM, SIGINT or request_stop)."""
        return self._stop

    def run(self, jobs: list[ProcessJob]) -> list[ProcessOutcome]:
        if threading.current_thread() is not threading.main_thread():
            return self._run(jobs)
        previous = {s: signal.signal(s, lambda *_: self.request_stop()) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            return self._run(jobs)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _run(self, jobs: list[ProcessJob]) -> list[ProcessOutcome]:
        pending = deque(jobs)
        free = list(range(len(self.slots)))
        running: dict[int, tuple[ProcessJob, _Running, float, IO[bytes] | None]] = {}
        forkable = bool(self.slots) and any(job.forkable for job in jobs)
        forkserver = _forkserver(self.preload, self.slots[0].workload) if forkable else None
        outcomes: list[ProcessOutcome] = []
        forwarded = False
        while pending or running:
            if self._stop and not forwarded:
                for _, proc, _, _ in running.values():
                    proc.send_signal(signal.SIGTERM)
                forwarded = True
            while pending and free and not self._stop:
                slot = free.pop(0)
                job = pending.popleft()
                job.log.parent.mkdir(parents=True, exist_ok=True)
                log: IO[bytes] | None = None
                started: _Running
                if forkserver is not None and job.forkable:
                    started = _Forked(forkserver, job, self.slots[slot].env())
                else:
                    log = open(job.log, "ab")
                    started = subprocess.Popen(
                        job.argv,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        env=self.slots[slot].env(),
                        start_new_session=True,
                    )
                running[slot] = (job, started, time.perf_counter(), log)
                if self.on_start:
                    self.on_start(job, started.pid)
            for slot in list(running):
                job, proc, t0, log = running[slot]
                returncode = proc.poll()
                if returncode is None:
                    continue
                if log is not None:
                    log.close()
                outcome = ProcessOutcome(job.name, returncode, time.perf_counter() - t0, job.log, _last_line(job.log))
                outcomes.append(outcome)
                del running[slot]
                free.append(slot)
                if self.on_exit:
                    self.on_exit(outcome)
            if self.on_poll:
                self.on_poll()
            if self._stop and not running:
                break
            time.sleep(self.poll_every)
        return outcomes
