"""Where `train-all` runs the jobs of a run: `local` (processes on this machine, flowfleet.train.fanout),
`slurm` (sbatch jobs on an existing cluster, flowfleet.backends.slurm) or `ray` (Ray jobs on an existing
cluster, flowfleet.backends.ray); run.yaml `backends` + `placement` may spread one run over several.

Whatever the backend, a job is the same flowfleet command writing the same files into the run root;
status.json's lease says whether a job is alive, RUN_ROOT/backends/submissions.json which backend job
runs it, and flowfleet.backends.watch resubmits a job whose node died.
"""

from __future__ import annotations

import fnmatch
import time
from typing import Any, Protocol, Sequence

from flowfleet.config import BACKEND_KINDS, BackendConfig, RunConfig
from flowfleet.errors import FlowfleetError, ParameterError
from flowfleet.layout import SUBMISSIONS
from flowfleet.storage import RunRoot
from flowfleet.train.specs import JobSpec


class RemoteBackend(Protocol):
    """A cluster flowfleet hands jobs to; it never schedules them itself."""

    name: str  # "slurm" | "ray": submissions.json's `backend`
    config: BackendConfig

    def submit(self, root: RunRoot, specs: list[JobSpec], run_name: str, then_assemble: bool) -> dict[str, str]:
        """Submit the jobs -> job name -> backend job id (then_assemble: also `assemble` once all succeed,
        where the backend can chain jobs)."""
        ...

    def resubmit(self, root: RunRoot, spec: JobSpec, run_name: str) -> str: ...

    def states(self, ids: Sequence[str]) -> dict[str, str]:
        """Backend job id -> the backend's state of it; ids it no longer knows are absent."""
        ...

    def is_active(self, state: str | None) -> bool:
        """Whether the job is queued or running there."""
        ...

    def cancel(self, ids: Sequence[str]) -> None: ...

    def logs(self, job_id: str) -> str:
        """The job's output as the backend keeps it."""
        ...

    def record(self) -> dict[str, Any]:
        """What submissions.json keeps beside each id to find the job again (a Ray cluster's address)."""
        ...

    def close(self) -> None:
        """Release what the backend started itself (a local Ray cluster)."""
        ...


def make_backend(config: BackendConfig, start_local: bool = False) -> RemoteBackend:
    """The backend `config` names; start_local: a Ray backend without an address starts a local cluster
    (for the jobs of one train-all, which waits for them) instead of refusing."""
    if config.kind == "slurm":
        from flowfleet.backends.slurm import SlurmBackend

        return SlurmBackend(config)
    if config.kind == "ray":
        from flowfleet.backends.ray import RayBackend

        return RayBackend(config, start_local=start_local)
    raise FlowfleetError(f"backend kind {config.kind!r} runs on this machine, not as a remote backend")


MACHINE = "machine:"  # place_jobs' prefix of a planned job's place: the run.yaml machine that trains it


def named_backend(cfg: RunConfig, name: str) -> BackendConfig:
    """A run.yaml `backends` entry, or local | slurm | ray with default options, or (machine:NAME) a run.yaml
    machine's backend narrowed to its nodes."""
    if name.startswith(MACHINE):
        return machine_backend(cfg, name.removeprefix(MACHINE))
    if name in cfg.backends:
        return cfg.backends[name]
    if name in BACKEND_KINDS:
        return BackendConfig.model_validate({"kind": name})
    known = ", ".join([*cfg.backends, *BACKEND_KINDS])
    raise ParameterError("backend", f"unknown {name!r} (known: {known})")


def machine_backend(cfg: RunConfig, machine: str) -> BackendConfig:
    """The backend of run.yaml machine `machine`, its jobs sent to its nodes only (slurm: --nodelist and
    --partition; ray: its custom resource)."""
    m = cfg.machines[machine]
    base = named_backend(cfg, m.backend)
    changes: dict[str, Any] = {}
    if m.nodelist:
        changes["nodelist"] = m.nodelist
    if m.partition:
        changes["partition"] = m.partition
    if m.resource:
        changes["resources"] = {**base.resources, m.resource: RESOURCE_SHARE}
    return base.model_copy(update=changes)


# What of a machine's custom resource one job asks for: a token share, so that the resource picks the nodes and
# the CPUs and GPUs the job asks for decide how many run there at once.
RESOURCE_SHARE = 0.001


def place_jobs(
    cfg: RunConfig, specs: list[JobSpec], default: str, planned: dict[str, str] | None = None
) -> dict[str, str]:
    """job name -> backend name: the machine the run's plan gives it (`planned`: job -> machine; machine:NAME),
    else run.yaml `placement` (the first pattern that matches), else `default`."""
    placed = {}
    for spec in specs:
        if planned and spec.name in planned:
            placed[spec.name] = MACHINE + planned[spec.name]
            continue
        where = next((b for pattern, b in cfg.placement.items() if fnmatch.fnmatchcase(spec.name, pattern)), default)
        placed[spec.name] = where
    return placed


def read_submissions(root: RunRoot) -> dict[str, dict[str, Any]]:
    """job name -> {backend, id, submitted, ...}: the newest submission of each job (empty when none)."""
    return dict(root.read_json(*SUBMISSIONS)) if root.exists(*SUBMISSIONS) else {}


def record_submissions(root: RunRoot, backend: RemoteBackend, ids: dict[str, str]) -> None:
    """Add job name -> backend job id to submissions.json (an atomic rewrite)."""
    now, extra = time.time(), backend.record()
    merged = {
        **read_submissions(root),
        **{name: {"backend": backend.name, "id": i, "submitted": now, **extra} for name, i in ids.items()},
    }
    root.write_json(merged, *SUBMISSIONS)


def backend_of(submission: dict[str, Any]) -> RemoteBackend:
    """The backend a recorded submission went to (enough of it to ask for states)."""
    kind = submission.get("backend")
    if kind not in ("slurm", "ray"):
        raise FlowfleetError(f"submissions.json: unknown backend {kind!r}")
    return make_backend(BackendConfig(kind=kind, address=submission.get("address")))


def backend_states(root: RunRoot) -> dict[str, str]:
    """job name -> "slurm 12_3 RUNNING" for `status`: its backend job and what the backend says of it
    ("finished" once the backend no longer lists it; "unknown" when the backend cannot be asked)."""
    groups: dict[tuple[str, str | None], dict[str, str]] = {}
    for name, s in read_submissions(root).items():
        groups.setdefault((s.get("backend", "?"), s.get("address")), {})[name] = str(s["id"])
    out = {}
    for (kind, address), ids in groups.items():
        try:
            states: dict[str, str] | None = backend_of({"backend": kind, "address": address}).states(list(ids.values()))
        except FlowfleetError:
            states = None
        for name, job_id in ids.items():
            state = "unknown" if states is None else states.get(job_id, "finished")
            out[name] = f"{kind} {job_id} {state}"
    return out
