"""An expert over two nodes of a real Ray cluster (tests/fixtures/ray_cluster.py, a head and a worker of one CPU
each): backends.NAME.nodes_per_job 2 runs one torchrun on each node, joined by torchrun's rendezvous, and trains
the weights one process computes from the two ranks' micro-batches, bit for bit; a node that fails ends the job
with its exit code and stops the other; a stopped job leaves nothing running."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import safetensors.torch
import torch
from fixtures.ray_cluster import ray_cluster
from fixtures.synthetic_run import synthetic_config, write_synthetic_run

from flowfleet.backends import read_submissions
from flowfleet.backends.ray import RayBackend
from flowfleet.cli import main
from flowfleet.config import BackendConfig, RunConfig
from flowfleet.models.files import WEIGHTS_NAME
from flowfleet.storage import RunRoot
from flowfleet.train.specs import JobSpec

pytestmark = pytest.mark.ray

FLOWFLEET = str(Path(sys.executable).parent / "flowfleet")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    # gloo's ranks find each other on the namespace's loopback (a real cluster's nodes on their network)
    with ray_cluster(tmp_path_factory.mktemp("ray"), worker_cpus=1, head_cpus=1, env={"GLOO_SOCKET_IFNAME": "lo"}) as c:
        yield c


def test_a_job_over_two_nodes_is_ray_nodes_in_front_of_each_nodes_torchrun(tmp_path):
    config = BackendConfig(kind="ray", nodes_per_job=2, gpus_per_job=4, resources={"lab": 0.01})
    command = RayBackend(config).command(RunRoot(str(tmp_path / "r")), JobSpec("expert", 1))
    cut = command.index("--")
    assert command[1:cut] == [
        "-m",
        "flowfleet.backends.ray_nodes",
        "--nodes=2",
        "--cpus=32",
        "--gpus=4",
        "--resource=lab=0.01",
    ]
    assert command[cut + 1 :] == [command[0], "-m", "torch.distributed.run", "-m", "flowfleet.cli", "train-expert"] + [
        str(tmp_path / "r"),
        "--expert",
        "1",
    ]


def test_an_expert_over_two_ray_nodes_trains_one_process_accumulating_both_ranks_weights(tmp_path, cluster):
    cfg = synthetic_config(k=2, steps=3, batch=8)
    raw = cfg.to_dict()
    raw["backends"] = {"lab": {"kind": "ray", "address": cluster.address, "nodes_per_job": 2, "cpus_per_job": 1}}
    raw["placement"] = {"expert-0": "lab"}
    spread = tmp_path / "spread"
    write_synthetic_run(RunRoot(str(spread)), RunConfig.from_dict(raw))

    out = cluster.run([FLOWFLEET, "train-all", str(spread)])
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert out.stdout.splitlines()[-3:] == ["expert-0: done", "expert-1: done", "router: done"], out.stdout
    assert read_submissions(RunRoot(str(spread)))["expert-0"]["backend"] == "ray"
    log = (spread / "experts/0/train.log").read_text()
    assert "2 nodes reserved; rendezvous at 127.0.0.1:" in log and "expert-0: done (3/3 steps" in log, log[-2000:]

    one = tmp_path / "one"  # the reference: one process, the two ranks' micro-batches accumulated
    write_synthetic_run(RunRoot(str(one)), synthetic_config(k=2, steps=3, batch=8, train={"grad_accum": 2}))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each node's rank (its one CPU)
    try:
        assert main(["train-expert", str(one), "--expert", "0", "--no-progress"]) == 0
    finally:
        torch.set_num_threads(threads)
    a = safetensors.torch.load((spread / "experts/0/final" / WEIGHTS_NAME).read_bytes())
    b = safetensors.torch.load((one / "experts/0/final" / WEIGHTS_NAME).read_bytes())
    assert a.keys() == b.keys()
    for key in a:  # exact: docs/numerics.md (two ranks' mean gradient is one process's accumulated mean)
        assert torch.equal(a[key], b[key]), key


NODE = """
import os, signal, sys, time
try:
    first = os.open(sys.argv[1] + "/first", os.O_CREAT | os.O_EXCL)
except FileExistsError:
    first = None
if first is not None:  # the first node to start fails once the other runs
    while not os.path.exists(sys.argv[1] + "/sleeping"):
        time.sleep(0.1)
    sys.exit(3)
def stopped(*_):
    open(sys.argv[1] + "/stopped", "w").write(os.environ["PET_NNODES"] + " " + os.environ["PET_RDZV_ENDPOINT"])
    sys.exit(0)
signal.signal(signal.SIGTERM, stopped)
open(sys.argv[1] + "/sleeping", "w").write("")
time.sleep(600)
"""


def test_a_node_that_fails_ends_the_job_with_its_exit_code_and_stops_the_other(tmp_path, cluster):
    """Each node runs the command with torchrun's rendezvous variables; the first to fail (exit 3) fails the job with
    its code, and the other node's command gets SIGTERM (a trainer's cue to checkpoint) rather than running on."""
    start = time.monotonic()
    out = cluster.run(
        [sys.executable, "-m", "flowfleet.backends.ray_nodes", "--nodes=2", "--cpus=1", "--", sys.executable]
        + ["-c", NODE, str(tmp_path)],
        env={"RAY_ADDRESS": "127.0.0.1:6379"},
        timeout=300,
    )
    assert out.returncode == 3, out.stdout[-2000:] + out.stderr[-2000:]
    assert time.monotonic() - start < 240  # not the other node's 600 s
    nodes, endpoint = (tmp_path / "stopped").read_text().split()
    assert nodes == "2" and endpoint.startswith("127.0.0.1:")


SLEEPER = """
import os, sys, time
open(os.path.join(sys.argv[1], str(os.getpid())), "w").write("")
time.sleep(600)
"""


def test_a_stopped_job_leaves_no_command_running_on_its_nodes(tmp_path, cluster):
    """`ray job stop` (train-all's cancel) while both nodes run: neither node's command outlives the job."""
    argv = ["submit", "--no-wait", "--submission-id", "ffnodes-stop", "--", sys.executable, "-m"]
    argv += ["flowfleet.backends.ray_nodes", "--nodes=2", "--cpus=1", "--", sys.executable, "-c", SLEEPER]
    submitted = cluster.job(*argv, str(tmp_path))
    assert submitted.returncode == 0, submitted.stderr[-2000:]
    deadline = time.monotonic() + 180
    while len(list(tmp_path.iterdir())) < 2:
        assert time.monotonic() < deadline, cluster.job("logs", "ffnodes-stop").stdout[-2000:]
        time.sleep(0.5)
    pids = [int(p.name) for p in tmp_path.iterdir()]
    stopped = cluster.job("stop", "ffnodes-stop")
    assert stopped.returncode == 0, stopped.stderr[-2000:]
    deadline = time.monotonic() + 120
    while any(Path(f"/proc/{pid}").exists() for pid in pids):
        assert time.monotonic() < deadline, f"still running after the job's stop: {pids}"
        time.sleep(0.5)
