"""Load on `flowfleet serve`: C concurrent HTTP clients against one served model folder on 127.0.0.1.

Starts the real CLI (`flowfleet serve MODEL --no-ui --max-queue Q --max-batch B --batch-window-ms W`) in
its own process, then sends the same C x R requests (seed = request number) three ways:

  sequential  one client, one request after another: the baseline without concurrency
  once        C client threads at the same moment, each request sent once: every answer must be 200 or
              503 (busy), none lost - the served count in /api/health equals the 200s
  retry       C client threads; a refused request waits Retry-After and is sent again, until served

Reports per behaviour: answers by status, latency p50 / p95 / p99 / max of the served requests (client
side, queue wait included), served images per second; the largest pixel difference between a seed's image
served alone (sequential) and batched (retry), and how many pixels differ; the server's health afterwards
(batches run). Then the limit the server is held against (--pairs rounds, on the same machine in the same
minutes): the same call in a Python process of its own (FleetPipeline, torch's defaults, no client beside it),
each round right after the server's own figure:

  lone_request_over_in_process   a lone request's latency (median of 5) / the in-process batch-1 time
  server_over_in_process         the server's img/s under C closed-loop clients (4 requests each, counted from
                                 the end of their first wave on) / the in-process img/s at batch C

Each is the median of the rounds' ratios (every round's in the JSON). The clients run on the same machine as
the server, and take their share of its cores.

Without MODEL, a random tiny fleet (tests/fixtures/random_fleet.py: K = 3, hidden 32, 8 x 8) is assembled in a
temp dir.

    .venv/bin/python benchmarks/serve_load.py --clients 32 --rounds 2
    .venv/bin/python benchmarks/serve_load.py --model runs/demo/model --clients 32 --rounds 1 --steps 20
    .venv/bin/python benchmarks/serve_load.py --model runs/demo/model --clients 32 --rounds 1 --steps 20 \
        --ray-replicas 1 --ray-cpus 2     # the same through `serve --ray` (Ray Serve, a local Ray)

With --ray-replicas N > 1 the health counts are one replica's (the one that answered /api/health).
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from fixtures.servers import serve_process  # noqa: E402


def tiny_fleet(folder: Path) -> str:
    from fixtures.random_fleet import tiny_run_config, write_random_fleet

    from flowfleet.stages.assemble import assemble

    write_random_fleet(str(folder / "run"), tiny_run_config(3))
    return assemble(str(folder / "run")).out


IN_PROCESS = """
import json, statistics, sys, time
from flowfleet.sampling.pipeline import FleetPipeline
model, body = sys.argv[1], json.loads(sys.argv[2])
pipe = FleetPipeline.from_pretrained(model)
kw = dict(strategy=body["strategy"], steps=body["steps"])
pipe([body["prompt"]], n=1, seed=0, **kw)  # warm-up: experts loaded, kernels chosen
print("ready", flush=True)
for line in sys.stdin:  # "N R": R timed calls of N images; answers their median seconds
    n, repeats = (int(x) for x in line.split())
    times = []
    for r in range(repeats):
        t0 = time.perf_counter()
        pipe([body["prompt"]], n=n, seed=r, **kw)
        times.append(time.perf_counter() - t0)
    print(statistics.median(times), flush=True)
"""


class InProcess:
    """The limit: the same call in a Python process of its own with torch's defaults (no server, no client), kept
    open so that its timings can alternate with the server's, on the same machine in the same minutes."""

    def __init__(self, model: str, body: dict):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "MKL_"))}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", IN_PROCESS, model, json.dumps(body)],
            env={**env, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != "ready":
            raise SystemExit("the in-process measurement did not start")

    def seconds(self, n: int, repeats: int) -> float:
        """The median time of `repeats` calls of n images."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{n} {repeats}\n")
        self.proc.stdin.flush()
        return float(self.proc.stdout.readline())

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)


def steady_images_per_s(url: str, clients: int, requests: int, body: dict) -> float:
    """`clients` closed-loop clients, `requests` each: images per second after the first wave of answers
    (the clients' first requests arrive together and fill batches unlike a running load)."""
    done: list[float] = []
    lock = threading.Lock()
    start = threading.Barrier(clients)

    def client(i: int) -> None:
        with httpx.Client(timeout=600) as http:
            start.wait()
            for r in range(requests):
                http.post(f"{url}/api/generate", json={**body, "seed": i * requests + r}).raise_for_status()
                with lock:
                    done.append(time.perf_counter())

    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(client, range(clients)))
    done.sort()
    after = done[clients - 1 :]  # from the end of the first wave on
    return (len(after) - 1) * body["n"] / (after[-1] - after[0])


def paired(url: str, limit: InProcess, clients: int, rounds: int, body: dict) -> dict:
    """Round by round, the server and the in-process limit one right after the other: a lone request against a
    batch-1 call, `clients` clients against a batch-`clients` call. On a machine whose speed drifts over minutes,
    the ratio of each pair holds where two separate runs would not."""
    big = clients * body["n"]
    out: dict[str, list[float]] = {k: [] for k in ("lone_s", "in_process_1_s", "server_img_s", "in_process_img_s")}
    with httpx.Client(timeout=600) as http:
        for _ in range(rounds):
            lone = []
            for i in range(5):
                t0 = time.perf_counter()
                http.post(f"{url}/api/generate", json={**body, "n": 1, "seed": 10_000 + i}).raise_for_status()
                lone.append(time.perf_counter() - t0)
            out["lone_s"].append(statistics.median(lone))
            out["in_process_1_s"].append(limit.seconds(1, 5))
            out["server_img_s"].append(steady_images_per_s(url, clients, 4, body))
            out["in_process_img_s"].append(big / limit.seconds(big, 2))
    lone_ratio = [a / b for a, b in zip(out["lone_s"], out["in_process_1_s"])]
    load_ratio = [a / b for a, b in zip(out["server_img_s"], out["in_process_img_s"])]
    return {
        "rounds": {k: [round(v, 4) for v in vs] for k, vs in out.items()},
        "lone_request_over_in_process": {"median": round(statistics.median(lone_ratio), 3), "each": lone_ratio},
        "server_over_in_process": {"median": round(statistics.median(load_ratio), 3), "each": load_ratio},
    }


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def decoded(png_b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(png_b64))), dtype=np.int16)


def load(url: str, clients: int, rounds: int, body: dict, retry: bool, images: dict | None = None) -> dict:
    """`clients` threads each sending `rounds` requests (seed = request number); images[seed]: the first
    image of each served request (base64 PNG), when given."""
    start = threading.Barrier(clients)
    latencies: list[float] = []
    codes: list[int] = []
    lock = threading.Lock()

    def client(i: int) -> None:
        with httpx.Client(timeout=600) as http:
            start.wait()
            for r in range(rounds):
                t0 = time.perf_counter()
                seed = i * rounds + r
                while True:
                    resp = http.post(f"{url}/api/generate", json={**body, "seed": seed})
                    with lock:
                        codes.append(resp.status_code)
                    if resp.status_code == 503 and retry:
                        time.sleep(float(resp.headers.get("retry-after", "1")))
                        continue
                    break
                if resp.status_code == 200:
                    with lock:
                        latencies.append(time.perf_counter() - t0)
                        if images is not None:
                            images[seed] = resp.json()["images"][0]  # decoded after the timing

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(client, range(clients)))
    wall = time.perf_counter() - t0
    served = len(latencies)
    return {
        "requests": clients * rounds,
        "answers": {str(c): codes.count(c) for c in sorted(set(codes))},
        "served": served,
        "latency_s": {
            "p50": round(percentile(latencies, 0.5), 3),
            "p95": round(percentile(latencies, 0.95), 3),
            "p99": round(percentile(latencies, 0.99), 3),
            "max": round(max(latencies), 3),
        }
        if latencies
        else None,
        "images_per_s": round(served * body["n"] / wall, 2),
        "wall_s": round(wall, 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="an assembled model folder (default: a random tiny fleet)")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2, help="requests per client")
    p.add_argument("--max-queue", type=int, default=64, help="images that may wait (serve --max-queue)")
    p.add_argument("--max-batch", type=int, default=32, help="serve --max-batch")
    p.add_argument("--batch-window-ms", type=float, default=50.0, help="serve --batch-window-ms (default 50, its own)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--n", type=int, default=1, help="images per request")
    p.add_argument("--strategy", default="top2")
    p.add_argument("--prompt", default="a handwritten digit seven")
    p.add_argument(
        "--ray-replicas",
        type=int,
        default=0,
        metavar="N",
        help="serve through Ray Serve instead (`serve --ray`, a Ray started for it): N sampling replicas of "
        "--ray-cpus CPUs each (default 0: the plain server)",
    )
    p.add_argument("--ray-cpus", type=float, default=2.0, help="CPUs per Ray Serve replica (default 2)")
    p.add_argument(
        "--pairs",
        type=int,
        default=5,
        help="rounds of the server against the in-process pipeline, one right after the other (default 5; 0: none)",
    )
    p.add_argument("--out", help="write the results as JSON here")
    a = p.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        model = a.model or tiny_fleet(Path(tmp))
        body = {"prompt": a.prompt, "strategy": a.strategy, "steps": a.steps, "n": a.n}
        args = ["--no-ui", "--max-queue", str(a.max_queue), "--max-batch", str(a.max_batch)]
        args += ["--batch-window-ms", str(a.batch_window_ms)]
        if a.ray_replicas:
            args += ["--ray", "--replicas", str(a.ray_replicas), "--replica-cpus", str(a.ray_cpus)]
        alone: dict[int, str] = {}
        batched: dict[int, str] = {}
        limit = InProcess(model, body)
        try:
            with serve_process(model, args, timeout=600, log=str(Path(tmp) / "serve.log")) as url:
                httpx.post(f"{url}/api/generate", json=body, timeout=600).raise_for_status()  # warm: experts loaded
                sequential = load(url, 1, a.clients * a.rounds, body, retry=False, images=alone)
                before = httpx.get(f"{url}/api/health").json()["served"]
                once = load(url, a.clients, a.rounds, body, retry=False)
                health_once = httpx.get(f"{url}/api/health").json()
                retry = load(url, a.clients, a.rounds, body, retry=True, images=batched)
                against = paired(url, limit, a.clients, a.pairs, body) if a.pairs else None
                health = httpx.get(f"{url}/api/health").json()
        finally:
            limit.close()
    same_seeds = sorted(set(alone) & set(batched))
    diffs = {s: np.abs(decoded(alone[s]) - decoded(batched[s])) for s in same_seeds}
    diff = max(int(d.max()) for d in diffs.values()) if diffs else None
    differing = sum(int((d > 0).sum()) for d in diffs.values())
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {platform.system()}",
        "command": " ".join(sys.argv),
        "model": a.model or "random tiny fleet (K=3, hidden 32, 8x8)",
        "request": body,
        "max_queue": a.max_queue,
        "clients": a.clients,
        "rounds": a.rounds,
        "max_batch": a.max_batch,
        "batch_window_ms": a.batch_window_ms,
        "server": f"Ray Serve, {a.ray_replicas} replica(s) of {a.ray_cpus} CPUs" if a.ray_replicas else "one process",
        "sequential": sequential,
        "once": once,
        "retry": retry,
        "against_in_process": against,
        "speedup_retry_over_sequential": round(retry["images_per_s"] / sequential["images_per_s"], 2),
        "max_pixel_diff_alone_vs_batched": diff,
        "pixels_differing_alone_vs_batched": differing,
        "seeds_compared": len(same_seeds),
        "none_lost_once": health_once["served"] - before == once["served"],
        "health_after": {
            k: health[k]
            for k in ("status", "served", "refused_busy", "bad_request", "failed", "batches", "batched_images")
        },
    }
    print(json.dumps(result, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
