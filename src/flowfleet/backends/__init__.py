"""Where `train-all` runs the jobs of a run: `local` (processes on this machine, flowfleet.train.fanout)
or `slurm` (sbatch jobs on an existing cluster, flowfleet.backends.slurm). Whatever the backend, a job
is the same flowfleet command writing the same files into the run root; status.json's lease says whether
a job is alive, and RUN_ROOT/backends/submissions.json which backend job runs it.
"""

from __future__ import annotations

import time
from typing import Any

from flowfleet.layout import SUBMISSIONS
from flowfleet.storage import RunRoot

BACKEND_NAMES = ("local", "slurm")


def read_submissions(root: RunRoot) -> dict[str, dict[str, Any]]:
    """job name -> {backend, id, submitted}: the newest submission of each job (empty when none)."""
    return dict(root.read_json(*SUBMISSIONS)) if root.exists(*SUBMISSIONS) else {}


def record_submissions(root: RunRoot, backend: str, ids: dict[str, str]) -> None:
    """Add job name -> backend job id to submissions.json (an atomic rewrite)."""
    now = time.time()
    merged = {
        **read_submissions(root),
        **{name: {"backend": backend, "id": i, "submitted": now} for name, i in ids.items()},
    }
    root.write_json(merged, *SUBMISSIONS)


def backend_states(root: RunRoot) -> dict[str, str]:
    """job name -> "slurm 12_3 RUNNING" for `status`: its backend job and what the backend says of it
    ("finished" once the backend no longer lists it; "unknown" when the backend cannot be asked)."""
    from flowfleet.backends.slurm import SlurmBackend
    from flowfleet.errors import FlowfleetError

    submitted = read_submissions(root)
    slurm = {name: str(s["id"]) for name, s in submitted.items() if s.get("backend") == "slurm"}
    try:
        states = SlurmBackend().states(list(slurm.values())) if slurm else {}
    except FlowfleetError:
        states = None
    out = {}
    for name, job_id in slurm.items():
        state = "unknown" if states is None else states.get(job_id, "finished")
        out[name] = f"slurm {job_id} {state}"
    return out
