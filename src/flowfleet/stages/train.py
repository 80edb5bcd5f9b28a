"""Stages `train-expert`, `train-router`, `train-monolith`, `train-all` and `status`.

train_expert(run_root, k)        expert k on partitions/k only (an isolated job; DDP under torchrun)
train_router(run_root)           the router on data/ + clusters/assignments.safetensors
train_monolith(run_root)         the baseline on data/ (match_compute: FLOPs = the experts' + the router's)
train_diloco(run_root, w)        DiLoCo worker w of run.yaml diloco (flowfleet.train.diloco)
train_all(run_root, parallel=N)  all of them where run.yaml places them or on `backend` (local processes,
                                 Slurm or Ray jobs), skipping finished jobs and jobs a backend still holds
job_status(run_root)             every job's status.json (pending when never started)
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from flowfleet.backends import (
    MACHINE,
    RemoteBackend,
    backend_of,
    make_backend,
    named_backend,
    place_jobs,
    read_submissions,
    record_submissions,
)
from flowfleet.backends.watch import RemoteWatch
from flowfleet.config import BackendConfig, RunConfig, load_run_config
from flowfleet.data.encoders import latent_decoder_modules
from flowfleet.errors import FlowfleetError, ParameterError
from flowfleet.layout import LOG_FILE, PLAN
from flowfleet.storage import RunRoot
from flowfleet.train.diloco import DiLoCoRounds
from flowfleet.train.fanout import LocalFanout, ProcessJob, plan_slots
from flowfleet.train.loop import Trainer, TrainOptions
from flowfleet.train.plan import current_plan
from flowfleet.train.specs import JobSpec, compute_matching, fleet_jobs, job_cost, launcher, router_spec
from flowfleet.train.status import JobStatus, job_finished, read_status
from flowfleet.train.tasks import build_task, planned_batch, planned_steps

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
    hooks = DiLoCoRounds(task, root) if spec.kind == "diloco" else None  # DiLoCo's outer loop around the steps
    return Trainer(task, root, options, hooks=hooks).run()


def train_expert(run_root: str | RunRoot, k: int, *, options: TrainOptions | None = None) -> JobStatus:
    return train_job(run_root, JobSpec("expert", k), options=options)


def train_router(
    run_root: str | RunRoot, *, paris: bool = False, prompt: bool = False, options: TrainOptions | None = None
) -> JobStatus:
    """The run's router; paris=True: the prompt-blind comparison router in router-paris/; prompt=True: the
    prompt-aware comparison router in router-prompt/. After `remove-expert`, a new router without the
    removed experts' data (flowfleet.layout.router_job)."""
    root, cfg = _open(run_root)
    return train_job(root, router_spec(cfg, paris, prompt=prompt), options=options)


def train_monolith(
    run_root: str | RunRoot, *, match_compute: bool | None = None, options: TrainOptions | None = None
) -> JobStatus:
    return train_job(run_root, JobSpec("monolith"), options=options, match_compute=match_compute)


def train_diloco(run_root: str | RunRoot, w: int, *, options: TrainOptions | None = None) -> JobStatus:
    return train_job(run_root, JobSpec("diloco", worker=w), options=options)


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
        if not status.total_steps:
            with contextlib.suppress(FlowfleetError):  # a by-size expert before `cluster`: not known yet
                status.total_steps = planned_steps(root, cfg, spec)
        rows.append(status)
    return rows


# ------------------------------------------------------------------------------------------------
#                                        train-all
# ------------------------------------------------------------------------------------------------


@dataclass
class FleetOutcome:
    """What train_all did with each job: done | skipped (already done) | busy (live elsewhere) |
    queued (a backend job already holds it) | submitted (--no-wait) | stopped | failed | not started."""

    results: dict[str, str] = field(default_factory=dict)
    messages: dict[str, str] = field(default_factory=dict)  # a line saying why, for the jobs that have one

    @property
    def ok(self) -> bool:
        return all(r in ("done", "skipped", "queued", "submitted") for r in self.results.values())

    def record(self, name: str, result: str, message: str | None = None) -> None:
        self.results[name] = result
        if message is not None:
            self.messages[name] = message

    def in_order(self, names: list[str]) -> "FleetOutcome":
        """The results in the run's order (wherever each job ran)."""
        return FleetOutcome({n: self.results[n] for n in names if n in self.results}, self.messages)


class _StepProgress:
    """One bar over the steps of the jobs being trained, read from their status.json (any backend)."""

    def __init__(self, root: RunRoot, cfg: RunConfig, specs: list[JobSpec], progress: bool):
        self.root, self.specs = root, {s.name: s for s in specs}
        self.totals = {s.name: planned_steps(root, cfg, s) for s in specs}
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
    parallel: int | None = None,
    progress: bool = True,
    backend: str | BackendConfig = "local",
    wait: bool = True,
) -> FleetOutcome:
    """Run every unfinished job of the run where it is placed: run.yaml `placement` maps jobs to backends
    (a `backends` entry, or local | slurm | ray), the others go to `backend`. Local jobs run as processes
    here (`parallel` at a time) while the jobs of Slurm or Ray clusters are watched and resubmitted if
    their node dies (wait=False: return once they are submitted). A job that is done, live elsewhere (its
    status lease) or still held by a backend job submitted earlier is not started again."""
    root, cfg = _open(run_root)
    default = "cli" if isinstance(backend, BackendConfig) else backend
    places = {"cli": backend} if isinstance(backend, BackendConfig) else {}
    plan = current_plan(root, cfg)
    planned = {job: a.machine for job, a in plan.jobs.items()} if plan else None
    placed = place_jobs(cfg, fleet_jobs(cfg), default, planned)
    for name in set(placed.values()) - set(places):
        places[name] = named_backend(cfg, name)
    if not wait:
        kinds = {places[placed[s.name]].kind for s in fleet_jobs(cfg)}
        if "local" in kinds:
            raise ParameterError(
                "wait", "returning before the jobs end is for jobs on Slurm or Ray (local ones end with train-all)"
            )
        if any(p.kind == "ray" and not (p.address or os.environ.get("RAY_ADDRESS")) for p in places.values()):
            raise ParameterError(
                "wait",
                "returning before the jobs end needs a Ray address: a cluster train-all starts for itself ends with it",
            )
    log.info("train-all: %s", describe_matching(root, cfg))  # (after the options' checks: an error is one line)
    remotes: dict[str, RemoteBackend] = {}
    try:
        for name, config in places.items():
            if config.kind != "local":
                remotes[name] = make_backend(config, start_local=wait)
        outcome, todo = _todo(root, cfg)
        if todo:
            # longest first: shortest makespan
            todo.sort(key=lambda s: _planned_cost(root, cfg, s), reverse=True)
            _run_placed(root, cfg, todo, placed, places, remotes, outcome, parallel, progress, wait)
    finally:
        for remote in remotes.values():
            remote.close()
    return outcome.in_order([s.name for s in fleet_jobs(cfg)])


def _planned_cost(root: RunRoot, cfg: RunConfig, spec: JobSpec) -> int:
    """A job's training FLOPs at its planned steps and batch."""
    return job_cost(cfg, spec, planned_steps(root, cfg, spec), planned_batch(root, cfg, spec))


def describe_matching(root: RunRoot, cfg: RunConfig) -> str:
    """The run's compute-matching convention in one line with the FLOPs it gives: the fleet's (each expert's
    planned steps x batch, and the router's) beside the monolith's. A compute-matched monolith whose FLOPs differ
    from the fleet's by a step or more is a bug, refused here before anything trains."""
    line = compute_matching(cfg)
    if current_plan(root, cfg) is not None:
        line += f", as {root.url_of(*PLAN)} plans it for run.yaml machines"
    experts = [JobSpec("expert", k) for k in range(cfg.cluster.k)]
    try:
        fleet = sum(_planned_cost(root, cfg, s) for s in experts)
    except FlowfleetError:  # a by-size split before `cluster`: the shares are not known yet
        return line
    fleet += job_cost(cfg, router_spec(cfg))
    if not (cfg.monolith.enabled and cfg.monolith.match_compute) or cfg.added:
        return f"{line}; the fleet {fleet:.3g} training FLOPs"
    monolith = _planned_cost(root, cfg, JobSpec("monolith"))
    step = job_cost(cfg, JobSpec("monolith"), steps=1)
    if abs(monolith - fleet) >= step:
        raise FlowfleetError(f"monolith: {monolith:.6g} training FLOPs, the fleet's are {fleet:.6g} ({line})")
    return f"{line}; the fleet (experts and router) {fleet:.3g} training FLOPs, the monolith {monolith:.3g}"


def _todo(root: RunRoot, cfg: RunConfig) -> tuple[FleetOutcome, list[JobSpec]]:
    """-> the outcome of the jobs not to start (done, live, held by a backend), and the others."""
    outcome = FleetOutcome()
    todo: list[JobSpec] = []
    submitted = read_submissions(root)
    held = _held(submitted, [s.name for s in fleet_jobs(cfg)])
    for spec in fleet_jobs(cfg):
        done, _, status = job_finished(root, spec.dir, planned_steps(root, cfg, spec))
        if done:
            outcome.record(spec.name, "skipped", "already done")
        elif status is not None and status.state == "running" and status.is_live():
            outcome.record(spec.name, "busy", f"running on {status.host} (pid {status.pid})")
        elif spec.name in held:
            s = submitted[spec.name]
            outcome.record(spec.name, "queued", f"{s['backend']} job {s['id']} is {held[spec.name]}")
        else:
            todo.append(spec)
    for name, why in outcome.messages.items():
        log.info(f"{name}: {why}, skipped")
    return outcome, todo


def _held(submitted: dict[str, dict], names: list[str]) -> dict[str, str]:
    """Jobs whose recorded backend job is still queued or running there -> its state there (a cluster that
    cannot be asked holds nothing: its jobs' leases still keep them from running twice)."""
    groups: dict[tuple[str, str | None], dict[str, str]] = {}
    for name in names:
        if name in submitted:
            s = submitted[name]
            groups.setdefault((s.get("backend", "?"), s.get("address")), {})[name] = str(s["id"])
    held = {}
    for (kind, address), ids in groups.items():
        try:
            remote = backend_of({"backend": kind, "address": address})
            states = remote.states(list(ids.values()))
        except FlowfleetError as err:
            log.warning(f"{', '.join(ids)}: cannot ask {kind} {address or ''} whether still queued ({err})")
            continue
        held.update({n: states[i] for n, i in ids.items() if remote.is_active(states.get(i))})
    return held


def _run_placed(
    root: RunRoot,
    cfg: RunConfig,
    todo: list[JobSpec],
    placed: dict[str, str],
    places: dict[str, BackendConfig],
    remotes: dict[str, RemoteBackend],
    outcome: FleetOutcome,
    parallel: int | None,
    progress: bool,
    wait: bool,
) -> None:
    """Submit the remote jobs, run the local ones here while watching the others, then wait for the rest."""
    watch = RemoteWatch(root, cfg.name)
    whole = len(todo) == len(fleet_jobs(cfg)) and len({placed[s.name] for s in todo}) == 1
    for name, remote in remotes.items():
        mine = [s for s in todo if placed[s.name] == name]
        if not mine:
            continue
        ids = remote.submit(root, mine, cfg.name, then_assemble=whole)
        record_submissions(root, remote, ids)
        for job, job_id in ids.items():
            log.info(
                f"{job}: submitted as {remote.name} job {job_id}"
                + (f" ({name})" if name in cfg.backends or name.startswith(MACHINE) else "")
            )
        watch.add(remote, mine, ids, places[name].max_resubmits)
    if not wait:
        for spec in todo:
            w = watch.jobs[spec.name]
            outcome.record(spec.name, "submitted", f"{w.backend.name} job {w.job_id}")
        return
    local = [s for s in todo if places[placed[s.name]].kind == "local"]
    bar = _StepProgress(root, cfg, todo, progress)
    last_look = [0.0]

    def look() -> None:  # while local jobs run: the remote ones too, every few seconds
        bar.poll()
        if watch.jobs and time.monotonic() - last_look[0] > 2.0:
            last_look[0] = time.monotonic()
            watch.step()

    try:
        if local:
            _train_locally(root, cfg, local, outcome, parallel, bar, look)
        watch.wait(on_poll=bar.poll)
    except KeyboardInterrupt:
        bar.close()
        if watch.jobs:
            log.warning("train-all: stopped watching; the submitted jobs go on (`flowfleet status` shows them)")
        raise
    bar.close()
    for spec in todo:
        if spec.name in watch.jobs:
            w = watch.jobs[spec.name]
            status = read_status(root, spec.dir)
            if status is not None and status.state in ("done", "stopped"):
                outcome.record(spec.name, status.state)
            else:
                why = (status.message if status and status.message else "") or (
                    f"{w.backend.name} job {w.job_id} ended without finishing; see its train.log"
                )
                outcome.record(spec.name, "failed", why)
        if spec.name not in outcome.results:
            outcome.record(spec.name, "not started")


def _train_locally(
    root: RunRoot,
    cfg: RunConfig,
    todo: list[JobSpec],
    outcome: FleetOutcome,
    parallel: int | None,
    bar: _StepProgress,
    on_poll,
) -> None:
    """The jobs as processes on this machine, `parallel` at a time (flowfleet.train.fanout); then DiLoCo's workers,
    all at once (each round waits for every worker), the cores shared out among them."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    cpus = os.cpu_count() or 1
    workers = [s for s in todo if s.kind == "diloco"]
    others = [s for s in todo if s.kind != "diloco"]
    phases = [(others, plan_slots(len(others), parallel, cpus, gpus))] if others else []
    if workers:
        phases.append((workers, plan_slots(len(workers), len(workers), cpus, gpus)))
    logs_tmp = None if root.is_local else tempfile.TemporaryDirectory(prefix="flowfleet-logs-")
    url = root.url_of()

    def log_path(spec: JobSpec) -> Path:
        local = root.local_path(spec.dir, LOG_FILE)
        if local is not None:
            return local
        assert logs_tmp is not None  # a remote run root's logs are written locally, then uploaded
        return Path(logs_tmp.name) / spec.dir / LOG_FILE

    specs = {s.name: s for s in todo}
    threads = {s.name: slots[0].threads for group, slots in phases for s in group}

    def started(job: ProcessJob, pid: int) -> None:
        bar.bar.write(f"{job.name}: started (pid {pid}, {threads[job.name]} threads), log {job.log}")

    def exited(job) -> None:
        status = read_status(root, specs[job.name].dir)
        if job.returncode == 0 and status is not None and status.state in ("done", "stopped"):
            outcome.record(job.name, status.state)
        else:
            why = (status.message if status and status.message else job.last_line) or f"exit code {job.returncode}"
            outcome.record(job.name, "failed", why)
        bar.bar.write(
            f"{job.name}: {outcome.results[job.name]} after {job.seconds:.0f} s"
            + (f" ({outcome.messages[job.name]})" if job.name in outcome.messages else "")
        )
        if logs_tmp is not None:
            root.write_bytes(job.log.read_bytes(), specs[job.name].dir, LOG_FILE)

    try:
        for group, slots in phases:
            log.info(f"train-all: {len(group)} job(s), {len(slots)} at a time")
            # A fork cannot use CUDA once its parent has asked torch about GPUs, which the forkserver's preloaded
            # imports do: on a GPU machine every job starts as a fresh process (measured: "Cannot re-initialize CUDA
            # in forked subprocess" in every job otherwise).
            jobs = [ProcessJob(s.name, s.command(url, launcher()), log_path(s), forkable=not gpus) for s in group]
            # every job imports the same modules, its previews' decoder's too: the forkserver does it once
            # (flowfleet.train.fanout)
            preload = ("flowfleet.cli", "flowfleet.stages.train", *latent_decoder_modules(cfg.encoders.latent))
            fanout = LocalFanout(slots, on_start=started, on_exit=exited, on_poll=on_poll, preload=preload)
            fanout.run(jobs)
            if fanout.stopped:
                break
    finally:
        if logs_tmp is not None:
            logs_tmp.cleanup()
