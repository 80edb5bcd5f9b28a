"""`train-all --backend slurm` on a real one-node Slurm cluster (tests/fixtures/slurm.py): the same weights
as the local backend, the scripts in the run root, status showing the Slurm state, no job submitted twice."""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest
from fixtures.prepared_runs import make_run
from fixtures.slurm import missing_daemons, slurm_cluster
from fixtures.synthetic_run import fault_run_pair, synthetic_config, wait_past_second_checkpoint, write_synthetic_run

from flowfleet.backends import read_submissions
from flowfleet.backends.slurm import SlurmBackend
from flowfleet.cli import main
from flowfleet.config import BackendConfig
from flowfleet.data.shards import ShardSet
from flowfleet.errors import FlowfleetError
from flowfleet.models.files import WEIGHTS_NAME
from flowfleet.stages.cluster import cluster as cluster_stage
from flowfleet.stages.prepare import prepare
from flowfleet.stages.train import train_all
from flowfleet.storage import RunRoot

pytestmark = pytest.mark.slurm


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if missing_daemons():  # never skipped: make test installs them
        pytest.fail(f"Slurm not installed ({', '.join(missing_daemons())} missing): run .ci/install-clusters")
    with slurm_cluster(tmp_path_factory.mktemp("slurm")) as running:
        yield running


def weights(path, job) -> bytes:
    return (path / job / "final" / WEIGHTS_NAME).read_bytes()


def test_train_all_on_slurm_gives_the_local_backends_weights(tmp_path, cluster, monkeypatch, capsys):
    monkeypatch.setenv("SLURM_CONF", cluster.env["SLURM_CONF"])
    cfg = synthetic_config(k=2, steps=3)
    local, slurm = tmp_path / "local", tmp_path / "slurm"
    write_synthetic_run(RunRoot(str(local)), cfg)
    write_synthetic_run(RunRoot(str(slurm)), cfg)

    assert train_all(str(local), progress=False).ok
    outcome = train_all(str(slurm), progress=False, backend=BackendConfig(kind="slurm", cpus_per_job=1))
    assert outcome.ok and set(outcome.results.values()) == {"done"}, outcome
    for job in ("experts/0", "experts/1", "router"):
        assert weights(slurm, job) == weights(local, job), job  # bit-identical to the local run
        assert f"{job.replace('experts/', 'expert-')}: done" in (slurm / job / "train.log").read_text(), job

    # the scripts a user can read and resubmit, and which Slurm job ran what
    scripts = sorted(p.name for p in (slurm / "backends" / "slurm").glob("*.sbatch"))
    assert scripts == ["assemble.sbatch", "experts.sbatch", "router.sbatch"]
    experts_script = (slurm / "backends" / "slurm" / "experts.sbatch").read_text()
    assert "#SBATCH --array=0,1" in experts_script and '--expert "$SLURM_ARRAY_TASK_ID"' in experts_script
    submitted = read_submissions(RunRoot(str(slurm)))
    array = submitted["expert-0"]["id"].split("_")[0]
    assert submitted["expert-1"]["id"] == f"{array}_1" and submitted["router"]["backend"] == "slurm"

    # the assemble job ran after all of them
    while SlurmBackend().states([submitted["assemble"]["id"]]):  # until squeue no longer lists it
        time.sleep(0.5)
    assert json.loads((slurm / "model" / "model_index.json").read_text())["present_experts"] == [0, 1]

    # status: the backend's word next to status.json
    capsys.readouterr()
    assert main(["status", str(slurm), "--json"]) == 0
    rows = {r["job"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["expert-1"]["backend"] == f"slurm {array}_1 finished" and rows["expert-1"]["state"] == "done"

    # again: nothing is submitted twice
    again = train_all(str(slurm), progress=False, backend="slurm")
    assert set(again.results.values()) == {"skipped"}
    assert read_submissions(RunRoot(str(slurm))) == submitted


def test_prepare_in_parts_on_slurm_gives_the_one_machine_shards(tmp_path, cluster, monkeypatch, capsys):
    """`prepare --parts 3 --backend slurm`: an array of three `prepare --part i/3` and a merge after them; data/
    byte for byte a one-machine prepare's, each part's output in its log, the scripts in the run root."""
    monkeypatch.setenv("SLURM_CONF", cluster.env["SLURM_CONF"])
    kw = dict(limit=40, shard_size=16, batch_size=8)
    prepare(make_run(tmp_path / "whole", **kw), progress=False)
    run = make_run(tmp_path / "parts", **kw)
    assert main(["prepare", str(tmp_path / "parts"), "--parts", "3", "--backend", "slurm"]) == 0
    said = capsys.readouterr().out
    assert "parts: job " in said and "autoencoder" not in said  # (pixel latents: no autoencoder to train)
    merge = said.split("merge: job ")[1].split()[0]
    while SlurmBackend().states([merge]):  # until squeue no longer lists it
        time.sleep(0.5)
    shards = sorted((tmp_path / "whole" / "data").glob("shard-*.safetensors"))
    assert len(shards) == 3 and ShardSet(run, "data").manifest().complete
    for shard in shards:
        assert (tmp_path / "parts" / "data" / shard.name).read_bytes() == shard.read_bytes(), shard.name
    for i in range(3):
        assert f"prepared part {i}/3" in (tmp_path / "parts" / "data-parts" / f"{i}-of-3.log").read_text()
    script = (tmp_path / "parts" / "backends" / "slurm" / "prepare-parts.sbatch").read_text()
    assert "#SBATCH --array=0-2" in script and '--part "$SLURM_ARRAY_TASK_ID/3"' in script


def test_cluster_in_parts_on_slurm_writes_the_one_process_partitions(tmp_path, cluster, monkeypatch, capsys):
    """`cluster --parts 2 --backend slurm`: the fit, an array of two `cluster --part i/2` after it and the merge after
    them; partitions/ byte for byte one process's, each step's output in its log, the scripts in the run root."""
    monkeypatch.setenv("SLURM_CONF", cluster.env["SLURM_CONF"])
    kw = dict(limit=80, shard_size=16, batch_size=8)
    runs = {name: make_run(tmp_path / name, **kw) for name in ("one", "parts")}
    prepare(runs["one"], progress=False)
    shutil.rmtree(tmp_path / "parts")
    shutil.copytree(tmp_path / "one", tmp_path / "parts")  # the same prepared data
    cluster_stage(runs["one"], progress=False)
    assert main(["cluster", str(tmp_path / "parts"), "--parts", "2", "--backend", "slurm"]) == 0
    said = capsys.readouterr().out
    assert said.startswith("fit: job ") and "parts: job " in said
    merge = said.split("merge: job ")[1].split()[0]
    while SlurmBackend().states([merge]):  # until squeue no longer lists it
        time.sleep(0.5)
    whole = sorted(p.relative_to(tmp_path / "one") for p in (tmp_path / "one" / "partitions").rglob("*") if p.is_file())
    assert len(whole) > 4 and ShardSet(runs["parts"], "partitions/0").manifest().complete
    for name in whole:
        assert (tmp_path / "parts" / name).read_bytes() == (tmp_path / "one" / name).read_bytes(), name
    assert "partitions decided" in (tmp_path / "parts" / "cluster-parts" / "fit.log").read_text()
    for i in range(2):
        assert "pieces of shards written" in (tmp_path / "parts" / "cluster-parts" / f"{i}-of-2.log").read_text()
    script = (tmp_path / "parts" / "backends" / "slurm" / "cluster-parts.sbatch").read_text()
    assert "#SBATCH --array=0-1" in script and '--part "$SLURM_ARRAY_TASK_ID/2"' in script


def test_a_job_still_queued_on_slurm_is_not_submitted_again(tmp_path, cluster, monkeypatch):
    monkeypatch.setenv("SLURM_CONF", cluster.env["SLURM_CONF"])
    run = tmp_path / "run"
    write_synthetic_run(RunRoot(str(run)), synthetic_config(k=2, steps=3))
    hold = BackendConfig(kind="slurm", sbatch_args=["--hold"])  # submitted, held: pending until released
    first = train_all(str(run), progress=False, backend=hold, wait=False)
    assert set(first.results.values()) == {"submitted"}
    ids = {name: s["id"] for name, s in read_submissions(RunRoot(str(run))).items()}
    try:
        second = train_all(str(run), progress=False, backend="slurm", wait=False)
        assert set(second.results.values()) == {"queued"}, second
        assert "is PENDING" in second.messages["expert-0"]
        assert {name: s["id"] for name, s in read_submissions(RunRoot(str(run))).items()} == ids
    finally:
        SlurmBackend().cancel(list(ids.values()))


def test_slurm_errors_are_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))  # no Slurm client on PATH
    with pytest.raises(FlowfleetError, match=r"slurm: `squeue` not found"):
        SlurmBackend().states(["1"])
    run = tmp_path / "run"
    write_synthetic_run(RunRoot(str(run)), synthetic_config(k=2, steps=3))
    for argv, error in [
        (["--backend", "slurm", "--cpus-per-job", "0"], "--cpus-per-job: Input should be greater than or equal to 1"),
        (["--backend", "slurm", "--address", "http://x:8265"], "--address: a ray option, but kind is 'slurm'"),
        (["--backend", "slrum"], "--backend: unknown 'slrum' (known: local, slurm, ray)"),
        (
            ["--no-wait"],
            "--no-wait: returning before the jobs end is for jobs on Slurm or Ray (local ones end with train-all)",
        ),
    ]:
        capsys.readouterr()
        assert main(["train-all", str(run), *argv]) == 1
        assert capsys.readouterr().err == f"flowfleet train-all: error: {error}\n"
    assert os.environ["PATH"] == str(tmp_path)


def test_a_job_whose_node_dies_is_resubmitted_and_resumes_to_the_uninterrupted_weights(tmp_path, cluster, monkeypatch):
    """The node running expert 0 dies mid-job (slurmd and the job's process killed) and comes back:
    train-all sees the expired lease, cancels and resubmits the job, which resumes from its checkpoint;
    the final weights equal an uninterrupted run's."""
    import signal
    import threading

    from flowfleet.stages.train import train_expert

    monkeypatch.setenv("SLURM_CONF", cluster.env["SLURM_CONF"])
    local, slurm = fault_run_pair(tmp_path, "slurm")
    root = RunRoot(str(slurm))
    outcome = {}
    watcher = threading.Thread(
        target=lambda: outcome.update(result=train_all(str(slurm), progress=False, backend="slurm")), daemon=True
    )
    watcher.start()
    status = wait_past_second_checkpoint(root, 120)
    first_id = read_submissions(root)["expert-0"]["id"]
    cluster.kill_slurmd()
    os.kill(status.pid, signal.SIGKILL)  # the node's job dies with it
    cluster.start_slurmd()
    watcher.join(timeout=300)
    assert not watcher.is_alive(), "train-all did not finish"
    result = outcome["result"]
    assert result.ok and result.results["expert-0"] == "done", result
    resubmitted = read_submissions(root)["expert-0"]["id"]
    assert resubmitted != first_id and "_" not in resubmitted  # expert 0 alone, as a plain job
    log = (slurm / "experts" / "0" / "train.log").read_text()
    assert "expert-0: resuming from its checkpoint at step" in log  # the second job started from the checkpoint
    train_expert(str(local), 0)  # uninterrupted, in this process
    assert weights(slurm, "experts/0") == weights(local, "experts/0")
