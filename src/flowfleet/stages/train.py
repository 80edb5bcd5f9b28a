"""Stages `train-expert`, `train-router`, `train-monolith`, `train-all` and `status`.

train_expert(run_root, k)        expert k on partitions/k only (an isolated job; DDP under torchrun)
train_router(run_root)           the router on data/ + clusters/assignments.safetensors
train_monolith(run_root)         the baseline on data/ (match_compute: FLOPs = sum over the experts)
train_all(run_root, parallel=N)  all of them as local processes (or backend="slurm": sbatch jobs),
                                 skipping finished jobs and jobs a backend still holds
job_status(run_root)             every job's status.json (pending when never started)
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from flowfleet.backends import BACKEND_NAMES, read_submissions, record_submissions
from flowfleet.backends.slurm import SlurmBackend, SlurmOptions
from flowfleet.backends.slurm import active as slurm_active
from flowfleet.config import RunConfig, load_run_config
from flowfleet.errors import FlowfleetError
from flowfleet.layout import LOG_FILE
from flowfleet.storage import RunRoot
from flowfleet.train.fanout import LocalFanout, ProcessJob, flowfleet_job, plan_slots
from flowfleet.train.jobs import JobSpec, build_task, fleet_jobs, job_cost, job_steps, router_spec
from flowfleet.train.loop import Trainer, TrainOptions
from flowfleet.train.status import JobStatus, job_finished, read_status

log = logging.getLogger(__name__)


def _open(run_root: str | RunRoot) -> tuple[RunRoot, RunConfig]:
    root = run_root if isinstance(run_root, RunRoot) else RunRoot(run_root)
    return root, load_run_config(root)


def train_job(
    run_root: str | RunRoot, spec: JobSpec, *, options: TrainOptions | None = None, match_compute: bool | None = None
) -> JobStatus:
    """Train one job to its total steps (resuming from its newest checkpoint); -> final status."""
    root, cfg = _open(run_root)
    task = build_task(root, cfg, spec, match_compute=match_compute)
    return Trainer(task, root, options).run()


def train_expert(run_root: str | RunRoot, k: int, *, options: TrainOptions | None = None) -> JobStatus:
    return train_job(run_root, JobSpec("expert", k), options=options)


def train_router(run_root: str | RunRoot, *, paris: bool = False, options: TrainOptions | None = None) -> JobStatus:
    """The run's router; paris=True: the prompt-blind comparison router in router-paris/. After
    `remove-expert`, a new router without the removed experts' data (flowfleet.layout.router_job)."""
    root, cfg = _open(run_root)
    return train_job(root, router_spec(cfg, paris), options=options)


def train_monolith(
    run_root: str | RunRoot, *, match_compute: bool | None = None, options: TrainOptions | None = None
) -> JobStatus:
    return train_job(run_root, JobSpec("monolith"), options=options, match_compute=match_compute)


# ------------------------------------------------------------------------------------------------
#                                         Status
# ------------------------------------------------------------------------------------------------


def job_status(run_root: str | RunRoot) -> list[JobStatus]:
    """One status per job of the run, in order experts, router, monolith; never-started jobs pending."""
    root, cfg = _open(run_root)
    rows = []
    specs = fleet_jobs(cfg) + ([JobSpec("student")] if cfg.distill is not None else [])  # (distill trains it)
    for spec in specs:
        try:
            status = read_status(root, spec.dir) or JobStatus(spec.name)
        except FlowfleetError as err:  # one unreadable file must not hide the other jobs
            status = JobStatus(spec.name, state="failed", message=str(err))
        status.total_steps = status.total_steps or job_steps(cfg, spec)
        rows.append(status)
    return rows


# ------------------------------------------------------------------------------------------------
#                                        train-all
# ------------------------------------------------------------------------------------------------


@dataclass
class FleetOutcome:
    """What train_all did with each job: done | skipped (already done) | busy (live elsewhere) |
    queued (a backend job already holds it) | submitted (--no-wait) | stopped | failed | not started."""

    results: dict[str, str]
    messages: dict[str, str]

    @property
    def ok(self) -> bool:
        return all(r in ("done", "skipped", "queued", "submitted") for r in self.results.values())


class _StepProgress:
    """One bar over the steps of the jobs being trained, read from their status.json (any backend)."""

    def __init__(self, root: RunRoot, cfg: RunConfig, specs: list[JobSpec], progress: bool):
        self.root, self.specs = root, {s.name: s for s in specs}
        self.totals = {s.name: job_steps(cfg, s) for s in specs}
        self.seen = dict.fromkeys(self.totals, 0)
        self.bar = tqdm(
            total=sum(self.totals.values()),
            desc="train-all",
            unit="step",
            dynamic_ncols=True,
            disable=None if progress else True,
        )
        self.last = 0.0

    def poll(self, force: bool = False) -> None:
        if not force and time.monotonic() - self.last < 2.0:
            return
        self.last = time.monotonic()
        for name, total in self.totals.items():
            status = read_status(self.root, self.specs[name].dir)
            step = min(status.step, total) if status else 0
            if step > self.seen[name]:
                self.bar.update(step - self.seen[name])
                self.seen[name] = step

    def close(self) -> None:
        self.poll(force=True)
        self.bar.close()


def train_all(
    run_root: str,
    *,
    parallel: int | None = None,
    progress: bool = True,
    backend: str = "local",
    slurm: SlurmOptions | None = None,
    wait: bool = True,
) -> FleetOutcome:
    """Run every unfinished job of the run: as local processes (`--parallel` at a time), or as jobs of a
    Slurm cluster (backend "slurm"; wait=False returns once they are submitted). A job that is done, live
    elsewhere (its status lease) or still held by a backend job submitted earlier is not started again."""
    if backend not in BACKEND_NAMES:
        raise FlowfleetError(f"--backend: unknown {backend!r} (expected {' or '.join(BACKEND_NAMES)})")
    root, cfg = _open(run_root)
    results: dict[str, str] = {}
    messages: dict[str, str] = {}
    todo: list[JobSpec] = []
    submitted = read_submissions(root)
    held = _held_by_slurm(submitted, [s.name for s in fleet_jobs(cfg)]) if backend == "slurm" else {}
    for spec in fleet_jobs(cfg):
        done, _, status = job_finished(root, spec.dir, job_steps(cfg, spec))
        if done:
            results[spec.name] = "skipped"
            messages[spec.name] = "already done"
        elif status is not None and status.is_live():
            results[spec.name] = "busy"
            messages[spec.name] = f"running on {status.host} (pid {status.pid})"
        elif spec.name in held:
            results[spec.name] = "queued"
            messages[spec.name] = f"slurm job {submitted[spec.name]['id']} is {held[spec.name]}"
        else:
            todo.append(spec)
    for name, why in messages.items():
        log.info(f"{name}: {why}, skipped")
    if not todo:
        return FleetOutcome(results, messages)
    todo.sort(key=lambda s: job_cost(cfg, s), reverse=True)  # longest first: shortest makespan
    if backend == "slurm":
        _train_on_slurm(root, cfg, todo, results, messages, slurm or SlurmOptions(), progress, wait)
    else:
        _train_locally(root, cfg, todo, results, messages, parallel, progress)
    for spec in todo:
        results.setdefault(spec.name, "not started")
    if any(r == "not started" for r in results.values()):
        log.warning("train-all: stopped; re-run to resume")
    return FleetOutcome(results, messages)


def _held_by_slurm(submitted: dict[str, dict], names: list[str]) -> dict[str, str]:
    """Jobs whose recorded Slurm job is still pending or running -> its squeue state."""
    ids = {n: str(submitted[n]["id"]) for n in names if submitted.get(n, {}).get("backend") == "slurm"}
    if not ids:
        return {}
    states = SlurmBackend().states(list(ids.values()))
    return {n: states[i] for n, i in ids.items() if slurm_active(states.get(i))}


def _train_on_slurm(
    root: RunRoot,
    cfg: RunConfig,
    todo: list[JobSpec],
    results: dict[str, str],
    messages: dict[str, str],
    options: SlurmOptions,
    progress: bool,
    wait: bool,
) -> None:
    backend = SlurmBackend(options)
    ids = backend.submit(root, todo, cfg.name)
    record_submissions(root, "slurm", ids)
    for name, job_id in ids.items():
        log.info(f"{name}: submitted as slurm job {job_id}")
    if not wait:
        for spec in todo:
            results[spec.name], messages[spec.name] = "submitted", f"slurm job {ids[spec.name]}"
        return
    bar = _StepProgress(root, cfg, todo, progress)
    try:
        _watch_slurm(root, cfg, backend, todo, ids, bar)
    except KeyboardInterrupt:
        bar.close()
        log.warning("train-all: stopped watching; the slurm jobs go on (`flowfleet status` shows them)")
        raise
    bar.close()
    for spec in todo:
        status = read_status(root, spec.dir)
        if status is not None and status.state in ("done", "stopped"):
            results[spec.name] = status.state
        else:
            results[spec.name] = "failed"
            messages[spec.name] = (status.message if status and status.message else "") or (
                f"slurm job {ids[spec.name]} ended without finishing; its log is beside train.log"
            )


def _watch_slurm(
    root: RunRoot,
    cfg: RunConfig,
    backend: SlurmBackend,
    todo: list[JobSpec],
    ids: dict[str, str],
    bar: _StepProgress,
    poll_every: float = 2.0,
    max_resubmits: int = 2,
) -> None:
    """Until every job has ended. A job is lost when its status says running but its lease has expired
    (the node or the process died) or Slurm no longer lists it while it never finished: it is cancelled
    and submitted again (at most max_resubmits times), and resumes from its newest checkpoint. A job
    that failed by itself (status "failed") is not resubmitted: it would fail again."""
    submitted = {name: time.time() for name in ids}
    resubmits = dict.fromkeys(ids, 0)
    while True:
        bar.poll()
        states = backend.states([ids[s.name] for s in todo])
        waiting = False
        for spec in todo:
            job_id, state = ids[spec.name], states.get(ids[spec.name])
            status = read_status(root, spec.dir)
            current = status is not None and (status.heartbeat or 0) >= submitted[spec.name] - 1
            if status is not None and status.state in ("done", "stopped", "failed") and current:
                if slurm_active(state):
                    waiting = True  # (Slurm has not noticed the end yet)
                continue
            if slurm_active(state):
                if status is None or not current or status.state != "running" or status.is_live():
                    waiting = True
                    continue
                why = f"its lease expired ({status.host}:{status.pid} silent)"
            else:
                why = "Slurm no longer lists it and it never finished"
            if resubmits[spec.name] >= max_resubmits:
                log.warning(
                    f"{spec.name}: slurm job {job_id} lost ({why}); resubmitted {max_resubmits} times, giving up"
                )
                continue
            if slurm_active(state):
                backend.cancel([job_id])
            ids[spec.name] = backend.resubmit(root, spec, cfg.name)
            submitted[spec.name], resubmits[spec.name] = time.time(), resubmits[spec.name] + 1
            record_submissions(root, "slurm", {spec.name: ids[spec.name]})
            log.warning(
                f"{spec.name}: slurm job {job_id} lost ({why}); resubmitted as {ids[spec.name]}, "
                f"it resumes from its newest checkpoint"
            )
            waiting = True
        if not waiting:
            return
        time.sleep(poll_every)


def _train_locally(
    root: RunRoot,
    cfg: RunConfig,
    todo: list[JobSpec],
    results: dict[str, str],
    messages: dict[str, str],
    parallel: int | None,
    progress: bool,
) -> None:
    slots = plan_slots(
        len(todo), parallel, os.cpu_count() or 1, torch.cuda.device_count() if torch.cuda.is_available() else 0
    )
    logs_tmp = None if root.is_local else tempfile.TemporaryDirectory(prefix="flowfleet-logs-")
    url = root.url_of()

    def log_path(spec: JobSpec) -> Path:
        local = root.local_path(spec.dir, LOG_FILE)
        if local is not None:
            return local
        assert logs_tmp is not None  # a remote run root's logs are written locally, then uploaded
        return Path(logs_tmp.name) / spec.dir / LOG_FILE

    jobs = [flowfleet_job(s.name, s.cli_args(url), log_path(s)) for s in todo]
    specs = {s.name: s for s in todo}
    bar = _StepProgress(root, cfg, todo, progress)

    def started(job: ProcessJob, pid: int) -> None:
        bar.bar.write(f"{job.name}: started (pid {pid}, {slots[0].threads} threads), log {job.log}")

    def exited(outcome) -> None:
        status = read_status(root, specs[outcome.name].dir)
        if outcome.returncode == 0 and status is not None and status.state in ("done", "stopped"):
            results[outcome.name] = status.state
        else:
            results[outcome.name] = "failed"
            messages[outcome.name] = (
                status.message if status and status.message else outcome.last_line
            ) or f"exit code {outcome.returncode}"
        bar.bar.write(
            f"{outcome.name}: {results[outcome.name]} after {outcome.seconds:.0f} s"
            + (f" ({messages[outcome.name]})" if outcome.name in messages else "")
        )
        if logs_tmp is not None:
            root.write_bytes(outcome.log.read_bytes(), specs[outcome.name].dir, LOG_FILE)

    log.info(f"train-all: {len(todo)} job(s), {len(slots)} at a time")
    # every job imports the same modules: the forkserver does it once (flowfleet.train.fanout)
    fanout = LocalFanout(
        slots, on_start=started, on_exit=exited, on_poll=bar.poll, preload=("flowfleet.cli", "flowfleet.stages.train")
    )
    try:
        fanout.run(jobs)
    finally:
        bar.close()
        if logs_tmp is not None:
            logs_tmp.cleanup()
