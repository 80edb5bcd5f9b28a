"""`flowfleet serve --ray`: the API as Ray Serve replicas.

On the suite's real 2-node Ray cluster (tests/fixtures/ray_cluster.py, here one CPU on each node, so the
two one-CPU sampling replicas sit on different nodes): both replicas answer; the worker node is killed
under steady load; every request is answered 200 (those in flight on the lost replica are sent again to
the other one), and the head's replica answers everything after.

Without a cluster: the ingress's retry rule (ReplicaFront) over a stand-in handle, and the option checks."""

from __future__ import annotations

import collections
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from fixtures.processes import stop_session
from fixtures.random_fleet import tiny_run_config, write_random_fleet
from fixtures.ray_cluster import ray_cluster
from fixtures.servers import app_in_thread
from ray.exceptions import ActorDiedError, RayTaskError

from flowfleet.cli import main
from flowfleet.sampling.pipeline import SamplingSettings
from flowfleet.sampling.trace import RoutingTrace
from flowfleet.serve.app import create_app
from flowfleet.serve.ray_serve import ReplicaFront, ReplicaLost
from flowfleet.serve.service import BadRequest, GenerateRequest, Generation
from flowfleet.stages.assemble import assemble

FLOWFLEET = str(Path(sys.executable).parent / "flowfleet")
LOAD_CLIENT = str(Path(__file__).parent / "fixtures" / "load_client.py")
PORT = 8000  # Serve's proxy, inside the cluster's own network namespace


# -- the retry rule, without a cluster --------------------------------------------------------------


class Call:
    def __init__(self, outcome):
        self.outcome = outcome

    def result(self):
        if isinstance(self.outcome, Exception):
            raise self.outcome
        return self.outcome


class Method:
    def __init__(self, outcomes):
        self.outcomes, self.calls = list(outcomes), []

    def remote(self, *args):
        self.calls.append(args)
        return Call(self.outcomes.pop(0))


class StandInHandle:
    """A DeploymentHandle's shape: handle.method.remote(*args).result(), each call's outcome scripted."""

    def __init__(self, **methods):
        for name, outcomes in methods.items():
            setattr(self, name, Method(outcomes))


def test_a_call_whose_replica_dies_is_sent_again_and_its_own_errors_are_not():
    req = GenerateRequest(prompt="a digit", seed=7)
    settings = SamplingSettings(strategy="top2", k=2, steps=4, guidance_scale=2.0, seed=7)
    drawn = Generation([], [], RoutingTrace(num_experts=2), settings, 0.0, 0.0, replica="r2")
    handle = StandInHandle(generate=[ActorDiedError(), drawn])
    front = ReplicaFront(handle)
    assert front.generate(req) is drawn and drawn.attempts == 2  # the client is told (X-Flowfleet-Attempts)
    assert handle.generate.calls == [(req,), (req,)] and front.retried == 1  # the same request again

    # the replica's own answer (a bad request) comes back as that error, with its one-line message
    bad = RayTaskError("generate", "Traceback ...", BadRequest("steps: expected 1..200, got 0"))
    with pytest.raises(BadRequest, match=r"^steps: expected 1\.\.200, got 0$"):
        ReplicaFront(StandInHandle(generate=[bad])).generate(req)

    # replicas lost on every attempt: a 503 the client may retry (ReplicaLost is a Busy)
    front = ReplicaFront(StandInHandle(generate=[ActorDiedError()] * 3), attempts=3)
    with pytest.raises(ReplicaLost, match="^replica lost: 3 sampling replicas went away"):
        front.generate(req)
    assert front.retried == 2


def test_the_ingress_app_answers_a_lost_replica_with_a_503_and_retry_after():
    front = ReplicaFront(StandInHandle(generate=[ActorDiedError()] * 3, health=[{"status": "ok"}] * 50))
    with app_in_thread(create_app(front, "nowhere", ui=False)) as url:  # up: its health answers
        r = httpx.post(f"{url}/api/generate", json={"prompt": "a digit"}, timeout=30)
        health = httpx.get(f"{url}/api/health", timeout=30).json()
    assert r.status_code == 503 and r.headers["retry-after"] == "2"
    assert r.json()["error"].startswith("replica lost: 3 sampling replicas went away")
    assert health["ray_serve"]["retried"] == 2


def test_serve_ray_refuses_bad_options_in_one_line(tmp_path, capsys):
    assert main(["serve", str(tmp_path), "--ray", "--replicas", "3", "--max-replicas", "2"]) == 1
    assert capsys.readouterr().err.strip().endswith("--max-replicas: 2 is below replicas 3")
    assert main(["serve", str(tmp_path), "--ray", "--replicas", "0"]) == 1
    assert "--replicas: " in capsys.readouterr().err
    assert main(["serve", str(tmp_path), "--ray", "--nproc", "2"]) == 1
    assert "--nproc is not supported with it" in capsys.readouterr().err


# -- on the real 2-node cluster -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with ray_cluster(tmp_path_factory.mktemp("ray-serve"), worker_cpus=1, head_cpus=1) as running:
        yield running


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _wait_for(predicate, timeout: float, what: str, proc: subprocess.Popen | None = None, log: Path | None = None):
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{what}: the server exited with {proc.returncode}: {log.read_text()[-2000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s" + (f": {log.read_text()[-2000:]}" if log else ""))
        time.sleep(0.5)


def _serve_logs(cluster) -> str:
    """The ingress replicas' and the proxy's logs (Ray's session folder), for a failure's message."""
    logs = sorted(Path(cluster.temp_dir).glob("session_latest/logs/serve/*"))
    lines = [
        f"{p.name}: {line}"
        for p in logs
        if "Ingress" in p.name or "proxy" in p.name
        for line in p.read_text().splitlines()
        if " 200 " not in line  # not the requests answered
    ]
    return "\n".join(lines[-60:])


@pytest.mark.ray
def test_two_replicas_on_two_nodes_keep_serving_when_one_node_dies(tmp_path, cluster):
    run = tmp_path / "run"
    write_random_fleet(str(run), tiny_run_config(2))
    model = assemble(str(run)).out
    log = tmp_path / "serve.log"
    argv = [FLOWFLEET, "serve", model, "--ray", "--address", "127.0.0.1:6379", "--replicas", "2"]
    argv += ["--port", str(PORT), "--proxy-location", "HeadOnly"]  # both nodes are 127.0.0.1: one proxy
    server = cluster.popen(argv, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{PORT}"
    try:
        _wait_for(lambda: "serving " in log.read_text(), 600, "deploying 2 replicas", server, log)

        def health() -> dict:
            out = cluster.run(["curl", "-sf", "-m", "60", f"{url}/api/health"], timeout=90)
            assert out.returncode == 0, out.stderr
            return json.loads(out.stdout)

        assert health()["ray_serve"]["replicas"] == {"RUNNING": 2}
        # the OpenAI Images API through Ray Serve too (the same routes: flowfleet.serve.openai_api)
        body = json.dumps({"prompt": "a digit", "n": 2, "seed": 3, "steps": 2})
        v1 = [f"{url}/v1/images/generations", "-H", "Content-Type: application/json", "-d", body]
        out = cluster.run(["curl", "-sf", "-m", "120", *v1], timeout=150)
        assert out.returncode == 0, out.stderr
        assert [len(d["b64_json"]) > 0 for d in json.loads(out.stdout)["data"]] == [True, True]

        answers = tmp_path / "answers.jsonl"
        answers.touch()
        # 8 clients over the 2 replicas: Serve's router sends each call to the shorter of the two queues, so the
        # worker's replica holds some of the calls at any moment, and the kill below finds one in flight there
        load = cluster.popen([sys.executable, LOAD_CLIENT, url, "60", "8", str(answers), "40"])

        # both replicas draw, twice each, before the node dies
        def answered_twice() -> bool:
            drawn = collections.Counter(r["replica"] for r in _records(answers) if r["status"] == 200)
            return len(drawn) == 2 and min(drawn.values()) >= 2

        _wait_for(answered_twice, 120, "both")
        killed_at = time.time()
        cluster.kill_worker()
        assert load.wait(timeout=600) == 0

        records = _records(answers)
        failed = [r for r in records if r["status"] != 200]
        assert not failed, f"{failed[:5]}\n{_serve_logs(cluster)}"  # none lost: in flight on the dead node is retried
        after = [r for r in records if r["start"] > killed_at]
        assert len(after) >= 8, len(after)
        survivors = {r["replica"] for r in after}
        assert len(survivors) == 1, survivors  # the head's replica answers everything after
        before = {r["replica"] for r in records if r["end"] < killed_at}
        assert survivors < before

        retried = [r for r in records if r["attempts"] > 1]
        assert retried, "no request was in flight on the dead node"  # those were sent again, and answered
        assert all(r["end"] > killed_at and r["replica"] in survivors for r in retried), retried
        now = health()["ray_serve"]
        assert now["replicas"].get("RUNNING") == 1, now  # Serve wants 2; the other waits for room
    finally:
        stop_session(server, grace=60)  # SIGTERM: the command deletes its application
    assert server.returncode == 0, log.read_text()[-2000:]
