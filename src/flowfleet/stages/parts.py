"""A stage cut into N parts: `prepare --parts N` and `cluster --parts N` start their `--part i/N` commands here as
local processes at once (flowfleet.train.fanout: `parallel` at a time, the machine's cores or GPUs shared out among
them), each part's output in a log of the run root's parts folder; or, with `--backend` a Slurm or Ray backend, submit
the stage's first step, its parts and its merge as Slurm jobs (flowfleet.backends.slurm) or one Ray job of tasks
(flowfleet.backends.ray_parts)."""

from __future__ import annotations

import logging
import os
import tempfile
import time
from pathlib import Path

import torch

from flowfleet.config import BackendConfig, load_run_config
from flowfleet.errors import FlowfleetError, ParameterError
from flowfleet.storage import RunRoot
from flowfleet.train.fanout import LocalFanout, ProcessJob, ProcessOutcome, plan_slots
from flowfleet.train.specs import cli_command, launcher

log = logging.getLogger(__name__)


def run_parts(
    root: RunRoot,
    stage: list[str],
    n: int,
    folder: str,
    *,
    parallel: int | None = None,
    extra: list[str] | None = None,
    preload: tuple[str, ...] = ("flowfleet.cli",),
) -> dict[str, tuple[float, float]]:
    """`flowfleet STAGE... RUN --quiet --part i/N EXTRA...` for i < n as local processes, `parallel` at a time (None:
    one per core, or per GPU on a GPU machine), each one's output in FOLDER/<i>-of-<N>.log of the run root
    -> each part's (start, end) perf_counter. A part that fails raises with its last line and its log."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    slots = plan_slots(n, parallel, os.cpu_count() or 1, gpus)
    logs_tmp = None if root.is_local else tempfile.TemporaryDirectory(prefix="flowfleet-parts-logs-")
    spans: dict[str, tuple[float, float]] = {}
    started: dict[str, float] = {}

    def log_path(i: int) -> Path:
        name = f"{i}-of-{n}.log"  # beside the part folders: a part's own `--restart` empties its folder
        local = root.local_path(folder, name)
        return local if local is not None else Path(logs_tmp.name) / name  # type: ignore[union-attr]

    def on_start(job: ProcessJob, pid: int) -> None:
        started[job.name] = time.perf_counter()
        log.info("%s: started (pid %d), log %s", job.name, pid, job.log)

    def on_exit(done: ProcessOutcome) -> None:
        spans[done.name] = (started[done.name], time.perf_counter())
        log.info("%s: exit code %d after %.0f s", done.name, done.returncode, done.seconds)
        if logs_tmp is not None:
            root.write_bytes(done.log.read_bytes(), folder, done.log.name)

    command = cli_command([*stage, root.url_of(), "--quiet"], launcher())  # as train-all starts its jobs
    jobs = []
    for i in range(n):
        log_path(i).parent.mkdir(parents=True, exist_ok=True)
        argv = [*command, "--part", f"{i}/{n}", *(extra or [])]
        jobs.append(ProcessJob(f"part {i}/{n}", argv, log_path(i), forkable=not gpus))
    fanout = LocalFanout(slots, on_start=on_start, on_exit=on_exit, preload=preload)
    try:
        outcomes = fanout.run(jobs)
    finally:
        if logs_tmp is not None:
            logs_tmp.cleanup()
    what = " ".join(stage)
    if fanout.stopped:
        raise FlowfleetError(f"{what} --parts {n}: stopped; run the same command to finish the parts")
    for done in outcomes:
        if done.returncode != 0:
            why = done.last_line or f"exit code {done.returncode}"
            raise FlowfleetError(f"{what} {done.name} failed: {why} (its log: {root.url_of(folder, done.log.name)})")
    return spans


def submit_parts(
    root: RunRoot, stage: str, n: int, backend: str | BackendConfig, folder: str, first: tuple[str, list[str]] | None
) -> dict[str, str]:
    """`flowfleet STAGE` in n parts as jobs of a Slurm or Ray backend (a run.yaml `backends` name, `slurm`, `ray`, or a
    BackendConfig): `first` (a step's name and the STAGE arguments that make it) once, the parts after it, the merge
    last -> step name -> job id. Returns once they are submitted."""
    from flowfleet.backends import named_backend
    from flowfleet.backends.ray import RayBackend
    from flowfleet.backends.slurm import SlurmBackend

    if n < 1:
        raise ParameterError("parts", f"must be >= 1, got {n}")
    cfg = load_run_config(root)
    config = backend if isinstance(backend, BackendConfig) else named_backend(cfg, backend)
    if config.kind == "ray":
        return RayBackend(config).submit_parts(root, stage, n, cfg.name, folder, first)
    if config.kind != "slurm":
        raise ParameterError(
            "backend",
            f"{stage} --parts runs as local processes, Slurm jobs or a Ray job, not on {config.kind!r}: start "
            f"`flowfleet {stage} {root.url} --part i/{n}` there, then `--merge {n}`",
        )
    return SlurmBackend(config).submit_parts(root, stage, n, cfg.name, folder, first)
