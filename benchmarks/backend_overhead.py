"""Overhead per job of each train-all backend: from handing the job over to its first training step.

A synthetic run (tests/fixtures/synthetic_run.py: K experts + router, hidden 32, 8 x 8, a few steps) is
trained by `train_all` with each backend; for each job, the time of its first step (metrics.jsonl's
first record) minus the time it was handed over: the start of train_all for `local` (the fan-out starts
the jobs at once, from a forkserver that has imported torch and flowfleet), the `sbatch` time recorded in
backends/submissions.json for `slurm` (a one-node cluster on 127.0.0.1, tests/fixtures/slurm.py, each
job a fresh `python -m flowfleet.cli`) and for `ray` (the Jobs API submission time; a head + worker
cluster on 127.0.0.1 in a loopback-only network namespace, tests/fixtures/ray_cluster.py, needs root;
train-all runs inside the namespace). Jobs beyond the machine's cores wait for a core in all three.

    .venv/bin/python benchmarks/backend_overhead.py --experts 2 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from fixtures.ray_cluster import ray_cluster  # noqa: E402
from fixtures.slurm import slurm_cluster  # noqa: E402
from fixtures.synthetic_run import synthetic_config, write_synthetic_run  # noqa: E402


def first_step_time(run: Path, job_dir: str) -> float:
    with open(run / job_dir / "metrics.jsonl") as f:
        return json.loads(f.readline())["time"]


def measure(tmp: Path, backend: str, k: int, tag: str, ray=None) -> dict[str, float]:
    """Seconds from hand-over to first step, per job; `ray`: the RayCluster train-all runs in."""
    from flowfleet.backends import read_submissions
    from flowfleet.stages.train import train_all
    from flowfleet.storage import RunRoot

    run = tmp / f"{backend}-{tag}"
    write_synthetic_run(RunRoot(str(run)), synthetic_config(k=k, steps=5))
    t0 = time.time()
    if ray is not None:
        cli = [sys.executable, "-m", "flowfleet.cli", "train-all", str(run), "--backend", "ray"]
        done = ray.run([*cli, "--address", ray.address, "--cpus-per-job", "1"])
        assert done.returncode == 0, done.stderr[-2000:]
    else:
        outcome = train_all(str(run), progress=False, backend=backend)
        assert outcome.ok, outcome
    submitted = read_submissions(RunRoot(str(run)))
    jobs = {f"expert-{i}": f"experts/{i}" for i in range(k)} | {"router": "router"}
    return {
        name: first_step_time(run, folder) - (submitted[name]["submitted"] if backend != "local" else t0)
        for name, folder in jobs.items()
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    results: dict[str, list[float]] = {"local": [], "slurm": [], "ray": []}
    with tempfile.TemporaryDirectory() as tmp:
        with slurm_cluster(Path(tmp) / "slurm") as slurm, ray_cluster(Path(tmp) / "ray") as ray:
            os.environ.update(slurm.env)
            for r in range(a.repeats):
                for backend in results:
                    per_job = measure(Path(tmp), backend, a.experts, str(r), ray if backend == "ray" else None)
                    results[backend] += list(per_job.values())
                    print(backend, r, {k: round(v, 2) for k, v in per_job.items()}, flush=True)
    summary = {
        b: {
            "jobs": len(v),
            "median_s": round(statistics.median(v), 2),
            "min_s": round(min(v), 2),
            "max_s": round(max(v), 2),
        }
        for b, v in results.items()
    }
    print(json.dumps({"date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(), "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
