"""`train-all --backend ray` on a real 2-node Ray cluster in a loopback-only network namespace
(tests/fixtures/ray_cluster.py): the local backend's weights, Ray's state in `status`, the job's output in
train.log and in Ray's logs, no job submitted twice, and a job whose node dies resubmitted and resumed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fixtures.ray_cluster import ray_cluster
from fixtures.synthetic_run import fault_run_pair, synthetic_config, wait_past_second_checkpoint, write_synthetic_run

from flowfleet.backends import read_submissions
from flowfleet.config import RunConfig
from flowfleet.models.files import WEIGHTS_NAME
from flowfleet.stages.train import train_all, train_expert
from flowfleet.storage import RunRoot

pytestmark = pytest.mark.ray

FLOWFLEET = str(Path(sys.executable).parent / "flowfleet")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with ray_cluster(tmp_path_factory.mktemp("ray")) as running:
        yield running


def weights(path, job) -> bytes:
    return (path / job / "final" / WEIGHTS_NAME).read_bytes()


def test_train_all_on_ray_gives_the_local_backends_weights(tmp_path, cluster):
    cfg = synthetic_config(k=2, steps=3)
    local, ray = tmp_path / "local", tmp_path / "ray"
    write_synthetic_run(RunRoot(str(local)), cfg)
    write_synthetic_run(RunRoot(str(ray)), cfg)

    assert train_all(str(local), progress=False).ok
    out = cluster.run([FLOWFLEET, "train-all", str(ray), "--backend", "ray", "--address", cluster.address])
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines() == ["expert-0: done", "expert-1: done", "router: done"], out.stdout
    for job in ("experts/0", "experts/1", "router"):
        assert weights(ray, job) == weights(local, job), job  # bit-identical to the local run
        assert f"{job.replace('experts/', 'expert-')}: done" in (ray / job / "train.log").read_text(), job

    submitted = read_submissions(RunRoot(str(ray)))
    assert {s["backend"] for s in submitted.values()} == {"ray"}
    assert {s["address"] for s in submitted.values()} == {cluster.address}

    # status: Ray's word next to status.json; Ray keeps the job's output too
    status = cluster.run([FLOWFLEET, "status", str(ray), "--json"])
    rows = {r["job"]: r for r in json.loads(status.stdout)}
    assert rows["expert-1"]["backend"] == f"ray {submitted['expert-1']['id']} SUCCEEDED"
    assert rows["expert-1"]["state"] == "done"
    logs = cluster.job("logs", submitted["expert-1"]["id"])
    assert "expert-1: done" in logs.stdout, logs.stderr[-500:]

    # again: nothing is submitted twice
    again = cluster.run([FLOWFLEET, "train-all", str(ray), "--backend", "ray", "--address", cluster.address])
    assert again.returncode == 0 and again.stdout.count(": skipped") == 3, again.stdout
    assert read_submissions(RunRoot(str(ray))) == submitted


def test_a_job_whose_ray_node_dies_is_resubmitted_and_resumes_to_the_uninterrupted_weights(tmp_path, cluster):
    """The worker node running expert 0 dies mid-job (its raylet and the job's process killed) and comes
    back: train-all sees the expired lease, resubmits the job, which resumes from its checkpoint; the final
    weights equal an uninterrupted run's."""
    local, ray = fault_run_pair(tmp_path, "ray")
    root = RunRoot(str(ray))
    out = open(tmp_path / "train-all.out", "w+")
    watcher = cluster.popen(
        [FLOWFLEET, "train-all", str(ray), "--backend", "ray", "--address", cluster.address, "--no-progress"],
        stdout=out,
        stderr=out,
    )
    try:
        status = wait_past_second_checkpoint(
            root, 180, lambda: None if watcher.poll() is None else (tmp_path / "train-all.out").read_text()[-2000:]
        )
        first_id = read_submissions(root)["expert-0"]["id"]
        cluster.kill_worker()
        os.kill(status.pid, signal.SIGKILL)  # the node's job dies with it
        cluster.wait_for_worker_death()  # a job resubmitted before Ray knows would die with the old node
        cluster.start_worker()
        assert watcher.wait(timeout=400) == 0, (tmp_path / "train-all.out").read_text()[-3000:]
    finally:
        if watcher.poll() is None:
            os.killpg(watcher.pid, signal.SIGKILL)
    text = (tmp_path / "train-all.out").read_text()
    assert {"expert-0: done", "expert-1: done", "router: done"} <= set(text.splitlines()), text[-2000:]
    assert text.count("expert-0: ray job") == 1, text[-2000:]  # resubmitted once
    assert read_submissions(root)["expert-0"]["id"] != first_id
    log = (ray / "experts" / "0" / "train.log").read_text()
    assert "expert-0: resuming from its checkpoint at step" in log  # the second job started from the checkpoint
    train_expert(str(local), 0)  # uninterrupted, in this process
    assert weights(ray, "experts/0") == weights(local, "experts/0")


def test_mixed_compute_places_jobs_on_slurm_ray_and_here_with_the_local_weights(tmp_path, cluster):
    """run.yaml `backends` + `placement`: expert 0 on a Slurm cluster, expert 1 on the Ray cluster, expert 2
    and the router on this machine, one run root. The same weights as an all-local run; `status` shows
    each job's backend."""
    from fixtures.slurm import slurm_cluster

    raw = synthetic_config(k=3, steps=3).to_dict()
    local, mixed = tmp_path / "local", tmp_path / "mixed"
    write_synthetic_run(RunRoot(str(local)), RunConfig.from_dict(raw))
    raw["backends"] = {"campus": {"kind": "slurm"}, "lab": {"kind": "ray", "address": cluster.address}}
    raw["placement"] = {"expert-0": "campus", "expert-1": "lab", "router": "local"}
    write_synthetic_run(RunRoot(str(mixed)), RunConfig.from_dict(raw))
    assert train_all(str(local), progress=False).ok

    with slurm_cluster(tmp_path / "slurm", prefix=cluster.command([])) as slurm:  # in the Ray cluster's namespace
        env = slurm.env  # SLURM_CONF
        out = cluster.run([FLOWFLEET, "train-all", str(mixed), "--no-progress"], env=env)
        assert out.returncode == 0, out.stderr[-2000:]
        results = out.stdout.splitlines()[-4:]  # (after the local jobs' started/done lines)
        assert results == [f"{j}: done" for j in ("expert-0", "expert-1", "expert-2", "router")], out.stdout
        assert "expert-0: submitted as slurm job" in out.stderr and "(campus)" in out.stderr
        assert "expert-1: submitted as ray job" in out.stderr and "(lab)" in out.stderr
        for job in ("experts/0", "experts/1", "experts/2", "router"):
            assert weights(mixed, job) == weights(local, job), job
        status = cluster.run([FLOWFLEET, "status", str(mixed), "--json"], env=env)
    rows = {r["job"]: r for r in json.loads(status.stdout)}
    submitted = read_submissions(RunRoot(str(mixed)))
    assert set(submitted) == {"expert-0", "expert-1"}  # no assemble job: Slurm holds only part of the run
    assert rows["expert-0"]["backend"].startswith(f"slurm {submitted['expert-0']['id']} ")
    assert rows["expert-1"]["backend"] == f"ray {submitted['expert-1']['id']} SUCCEEDED"
    assert rows["expert-2"]["backend"] is None and rows["expert-2"]["host"]  # ran here
    assert all(r["state"] == "done" for r in rows.values())


def test_backend_ray_without_an_address_starts_a_cluster_here_for_the_run(tmp_path):
    from fixtures.ray_cluster import cluster_env, inside, network_namespace

    cfg = synthetic_config(k=2, steps=3)
    local, ray = tmp_path / "local", tmp_path / "ray"
    write_synthetic_run(RunRoot(str(local)), cfg)
    write_synthetic_run(RunRoot(str(ray)), cfg)
    assert train_all(str(local), progress=False).ok
    env = {k: v for k, v in cluster_env(tmp_path).items() if k != "RAY_ADDRESS"}
    with network_namespace() as namespace:
        argv = inside(namespace, [FLOWFLEET, "train-all", str(ray), "--backend", "ray"])
        out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-2000:]
        assert "no --address, starting a Ray cluster on this machine" in out.stderr
        assert out.stdout.splitlines() == ["expert-0: done", "expert-1: done", "router: done"]
        deadline = time.monotonic() + 15  # (the dashboard's forkserver exits a moment after it)
        while subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True).stdout.split():
            assert time.monotonic() < deadline, "the Ray cluster outlived train-all"
            time.sleep(0.5)
        nowait = subprocess.run([*argv, "--no-wait"], env=env, capture_output=True, text=True, timeout=120)
    assert nowait.returncode == 1
    assert nowait.stderr.endswith(
        "error: --no-wait: returning before the jobs end needs a Ray address: a cluster train-all starts for "
        "itself ends with it\n"
    )
    for job in ("experts/0", "experts/1", "router"):
        assert weights(ray, job) == weights(local, job), job


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _run_ray_parts(cluster, argv: list[str]) -> None:
    """`flowfleet STAGE RUN --parts N --backend ray` inside the cluster's network, then until its Ray job ends."""
    out = cluster.run([FLOWFLEET, *argv, "--backend", "ray"], env={"RAY_ADDRESS": cluster.address})
    assert out.returncode == 0, out.stderr[-2000:]
    job = out.stdout.split(": job ")[1].split()[0]
    follow = cluster.job("logs", "--follow", job)
    status = cluster.job("status", job)
    assert "succeeded" in status.stdout, follow.stdout[-3000:] + status.stdout[-500:]


def test_prepare_and_cluster_in_parts_as_a_ray_job_write_what_one_process_writes(tmp_path, cluster):
    """`prepare --parts 2 --backend ray`, then `cluster --parts 2 --backend ray`: each one Ray job of tasks (the
    parts at once, the merge after them; cluster's fit before them); data/ and partitions/ byte for byte one
    process's, each step's output in its log."""
    from fixtures.prepared_runs import make_run

    from flowfleet.stages.cluster import cluster as cluster_stage
    from flowfleet.stages.prepare import prepare

    kw = dict(limit=80, shard_size=16, batch_size=8)
    one, parts = make_run(tmp_path / "one", **kw), make_run(tmp_path / "parts", **kw)
    prepare(one, progress=False)
    _run_ray_parts(cluster, ["prepare", parts.url, "--parts", "2"])
    shards = {k: v for k, v in _files(tmp_path / "one" / "data").items() if k.startswith("shard-")}
    assert len(shards) == 5 and {k: v for k, v in _files(tmp_path / "parts" / "data").items() if k in shards} == shards
    for i in range(2):
        assert f"prepared part {i}/2" in (tmp_path / "parts" / "data-parts" / f"{i}-of-2.log").read_text()

    cluster_stage(one, progress=False)
    _run_ray_parts(cluster, ["cluster", parts.url, "--parts", "2"])
    whole = _files(tmp_path / "one" / "partitions")
    assert len(whole) > 4 and _files(tmp_path / "parts" / "partitions") == whole
    assert "partitions decided" in (tmp_path / "parts" / "cluster-parts" / "fit.log").read_text()
    assert "partitions" in (tmp_path / "parts" / "cluster-parts" / "merge.log").read_text()
