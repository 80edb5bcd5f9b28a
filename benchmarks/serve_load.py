"""Load on `flowfleet serve`: C concurrent HTTP clients against one served model folder on 127.0.0.1.

Starts the real CLI (`flowfleet serve MODEL --no-ui --max-queue Q --max-batch B --batch-window-ms W`) in
its own process, then sends the same C x R requests (seed = request number) three ways:

  sequential  one client, one request after another: the baseline without concurrency
  once        C client threads at the same moment, each request sent once: every answer must be 200 or
              503 (busy), none lost - the served count in /api/health equals the 200s
  retry       C client threads; a refused request waits Retry-After and is sent again, until served

Reports per behaviour: answers by status, latency p50 / p95 / p99 / max of the served requests (client
side, queue wait included), served images per second; the largest pixel difference between a seed's image
served alone (sequential) and batched (retry); the server's health afterwards (batches run). And the limit
the server is held against, measured in the same run on the same machine: the same call in one Python
process (FleetPipeline, torch's defaults, a fresh process before and one after the server; the better of the
two medians), images per second at batch 1 and at batch C. The ratios:

  lone_request_over_in_process   a lone request's latency (sequential p50) / the in-process batch-1 time
  server_over_in_process         the server's img/s at C clients (retry) / the in-process img/s at batch C

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
model, body, batch, repeats = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
pipe = FleetPipeline.from_pretrained(model)
kw = dict(strategy=body["strategy"], steps=body["steps"])
out = {}
for n in (1, batch):
    pipe([body["prompt"]], n=n, seed=0, **kw)  # warm-up: experts loaded
    times = []
    for r in range(repeats):
        t0 = time.perf_counter()
        pipe([body["prompt"]], n=n, seed=r, **kw)
        times.append(time.perf_counter() - t0)
    out[str(n)] = {"seconds": statistics.median(times), "images_per_s": n / statistics.median(times)}
print(json.dumps(out))
"""


def in_process(model: str, body: dict, batch: int, repeats: int) -> dict:
    """The limit: the same call in a fresh Python process with torch's defaults, at batch 1 and `batch`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "MKL_"))}
    done = subprocess.run(
        [sys.executable, "-c", IN_PROCESS, model, json.dumps(body), str(batch), str(repeats)],
        env={**env, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
        capture_output=True,
        text=True,
    )
    if done.returncode:
        raise SystemExit(f"in-process measurement failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def first_image(resp: httpx.Response) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(resp.json()["images"][0]))), dtype=np.int16)


def load(url: str, clients: int, rounds: int, body: dict, retry: bool, images: dict | None = None) -> dict:
    """`clients` threads each sending `rounds` requests (seed = request number); images[seed]: the first
    image of each served request, when given."""
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
                            images[seed] = first_image(resp)

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
    p.add_argument("--batch-window-ms", type=float, default=20.0, help="serve --batch-window-ms")
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
    p.add_argument("--repeats", type=int, default=10, help="timed in-process calls per batch size (default 10)")
    p.add_argument("--out", help="write the results as JSON here")
    a = p.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        model = a.model or tiny_fleet(Path(tmp))
        body = {"prompt": a.prompt, "strategy": a.strategy, "steps": a.steps, "n": a.n}
        args = ["--no-ui", "--max-queue", str(a.max_queue), "--max-batch", str(a.max_batch)]
        args += ["--batch-window-ms", str(a.batch_window_ms)]
        if a.ray_replicas:
            args += ["--ray", "--replicas", str(a.ray_replicas), "--replica-cpus", str(a.ray_cpus)]
        alone: dict[int, np.ndarray] = {}
        batched: dict[int, np.ndarray] = {}
        limit_before = in_process(model, body, a.clients * a.n, a.repeats)
        with serve_process(model, args, timeout=600, log=str(Path(tmp) / "serve.log")) as url:
            httpx.post(f"{url}/api/generate", json=body, timeout=600).raise_for_status()  # warm: experts loaded
            sequential = load(url, 1, a.clients * a.rounds, body, retry=False, images=alone)
            before = httpx.get(f"{url}/api/health").json()["served"]
            once = load(url, a.clients, a.rounds, body, retry=False)
            health_once = httpx.get(f"{url}/api/health").json()
            retry = load(url, a.clients, a.rounds, body, retry=True, images=batched)
            health = httpx.get(f"{url}/api/health").json()
        limit_after = in_process(model, body, a.clients * a.n, a.repeats)
    big = str(a.clients * a.n)
    limit = {n: max(limit_before[n], limit_after[n], key=lambda r: r["images_per_s"]) for n in ("1", big)}
    same_seeds = sorted(set(alone) & set(batched))
    diff = max(int(np.abs(alone[s] - batched[s]).max()) for s in same_seeds) if same_seeds else None
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
        "in_process": {"before": limit_before, "after": limit_after},
        "lone_request_over_in_process": round(sequential["latency_s"]["p50"] / limit["1"]["seconds"], 2),
        "server_over_in_process": round(retry["images_per_s"] / limit[big]["images_per_s"], 2),
        "speedup_retry_over_sequential": round(retry["images_per_s"] / sequential["images_per_s"], 2),
        "max_pixel_diff_alone_vs_batched": diff,
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
