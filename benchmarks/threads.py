"""How fast does a model folder sample under each CPU thread setting, and does the command line reach the limit?

Each setting is a fresh Python process (OpenMP reads its variables once, when torch loads) that opens the folder
with FleetPipeline.from_pretrained and times the same call, images per second after a warm-up, the median of
--repeats runs, at batch 1 and at batch --batch:

    torch's defaults         no OMP_* variable: the limit a user's own Python process gets
    PASSIVE                  OMP_WAIT_POLICY=PASSIVE: idle threads sleep (what every flowfleet command set before)
    1 thread                 OMP_NUM_THREADS=1
    the command line's rule  what `flowfleet generate` / `evaluate` run under on this machine (flowfleet.threads)

and then the stages themselves as commands run them, each in a fresh process: `generate` of --batch images and
`evaluate` of --eval-n images (top-2, the demo's Inception at 75 px, no sweep, no diagnostics; of a copy of the
folder, RUN/model-threads/, so that the run's own evaluation.json stays; the copy and its reports/model-threads/
are removed afterwards), under the command line's rule and under torch's defaults, median wall seconds of the
call (the folder's loading included, the same in both).

    .venv/bin/python benchmarks/threads.py --model runs/demo/model
    .venv/bin/python benchmarks/threads.py --model runs/demo/model --out runs/bench/threads.json

The machine's topology (logical CPUs, physical cores, SMT) is printed with the figures.

--beside: the commands a user starts by hand, each a fresh `flowfleet ...` process timed whole, alone and beside
--loads busy processes (`python -c "while True: pass"`, one per number), under each --settings:

    defaults   FLOWFLEET_THREADS=static: the rule of workload and SMT alone (on CPUs that are not SMT siblings:
               torch's defaults, idle threads that spin, one thread per CPU)
    PASSIVE    the same with OMP_WAIT_POLICY=PASSIVE set by hand (idle threads sleep)
    policy     flowfleet's own: it reads the load, the quota and the topology when it starts, and its long loops
               follow the load between steps (flowfleet.threads)

    prepare    `flowfleet prepare` of 1000 emoji, 300 autoencoder steps, 100 held out (a fresh run root each time)
    train      `flowfleet train-expert RUN --expert 0` on that run clustered (--train-steps steps per expert)
    generate   `flowfleet generate MODEL --n 64 --prompt PROMPT`
    evaluate   `flowfleet evaluate MODEL --n 100 --strategies top2` (no sweep, no diagnostics)
    serve      `flowfleet serve MODEL`, then 8 requests of 4 images one after the other (the time to answer them)

    .venv/bin/python benchmarks/threads.py --beside --model runs/demo/model --out runs/bench/threads-beside.json
    .venv/bin/python benchmarks/threads.py --beside --commands prepare --loads 0,1 --settings defaults,policy

Each command runs once untimed first (its files read into the page cache, so that the first setting timed pays no
cold start). It prints each time and its ratio to the same setting alone, and writes them all with --out; a command
still running after --cap-times its time alone is stopped and recorded as '>CAP' (torch's defaults beside busy
processes can take many times that).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

PIPELINE = """
import json, statistics, sys, time
{policy}
import torch
from flowfleet.sampling.pipeline import FleetPipeline
model, batch, repeats, prompt = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
pipe = FleetPipeline.from_pretrained(model)
out = {{"threads": torch.get_num_threads()}}
for n in (1, batch):
    pipe([prompt], n=n, seed=0)  # warm-up: experts loaded, kernels chosen
    times = []
    for r in range(repeats):
        t0 = time.perf_counter()
        pipe([prompt], n=n, seed=r)
        times.append(time.perf_counter() - t0)
    out[str(n)] = n / statistics.median(times)
print(json.dumps(out))
"""

STAGE = """
import json, statistics, sys, time
{policy}
model, what, n, repeats, prompt, run = sys.argv[1:]
n, repeats = int(n), int(repeats)
times = []
for r in range(repeats + 1):  # the first call warms the caches (the digit judge, Inception)
    t0 = time.perf_counter()
    if what == "generate":
        from flowfleet.stages.generate import generate
        generate(model, prompts=[prompt], n=n, seed=r)
    else:
        from flowfleet.evaluate.fid import FIDSettings
        from flowfleet.stages.demo import DEMO_INCEPTION_SIZE
        from flowfleet.stages.evaluate import EvaluateOptions, evaluate
        fid = FIDSettings(resize=DEMO_INCEPTION_SIZE, batch_size=100)  # the demo's
        options = EvaluateOptions(n=n, batch_size=n, strategies=("top2",), seed=r, diagnostics=False, fid=fid)
        evaluate(model, run, options)
    times.append(time.perf_counter() - t0)
print(json.dumps({{"seconds": statistics.median(times[1:])}}))
"""

CLI_RULE = 'from flowfleet.threads import apply_thread_policy; apply_thread_policy("alone")'
SETTINGS = {  # name -> (extra environment, code run before torch loads)
    "torch's defaults": ({}, ""),
    "PASSIVE": ({"OMP_WAIT_POLICY": "PASSIVE"}, ""),
    "1 thread": ({"OMP_NUM_THREADS": "1"}, ""),
    "the command line's rule": ({}, CLI_RULE),
}


def clean_env(extra: dict[str, str]) -> dict[str, str]:
    ours = ("OMP_", "MKL_", "GOMP_", "KMP_", "FLOWFLEET_THREADS")  # the settings each child is given, none inherited
    env = {k: v for k, v in os.environ.items() if not k.startswith(ours)}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", **extra)
    return env


def child(code: str, args: list[str], extra: dict[str, str]) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", code, *args], env=clean_env(extra), capture_output=True, text=True, check=False
    )
    if done.returncode:
        raise SystemExit(f"child failed ({extra}):\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


BUSY = "while True: pass"
BESIDE_SETTINGS = {  # name -> the command's extra environment
    "policy": {},
    "PASSIVE": {"FLOWFLEET_THREADS": "static", "OMP_WAIT_POLICY": "PASSIVE"},
    "defaults": {"FLOWFLEET_THREADS": "static"},
}
PREPARE_SETS = ("data.limit=1000", "encoders.latent.autoencoder.steps=300", "data.holdout=100")


def flowfleet(*args: str) -> list[str]:
    return [sys.executable, "-m", "flowfleet.cli", "-q", *args]


class TooSlow(Exception):
    """A command stopped at the benchmark's cap (its time is at least the cap)."""


def run_cli(cmd: list[str], extra: dict[str, str], cap_s: float | None = None) -> float:
    """Wall seconds of one command (a fresh process), or an exit naming it when it fails; TooSlow past `cap_s`."""
    t0 = time.perf_counter()
    try:
        done = subprocess.run(cmd, env=clean_env(extra), capture_output=True, text=True, check=False, timeout=cap_s)
    except subprocess.TimeoutExpired:
        raise TooSlow from None
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({extra}):\n{done.stderr[-2000:]}")
    return time.perf_counter() - t0


class Beside:
    """The --beside commands on their inputs, made once under OUT_DIR: a prepared and clustered emoji run."""

    def __init__(self, work: Path, model: Path, train_steps: int, prompt: str, cap_s: float | None = None):
        self.work, self.model, self.train_steps, self.prompt, self.cap_s = work, model, train_steps, prompt, cap_s
        self.prepared = work / "prepared"
        if not (self.prepared / "partitions").exists():
            shutil.rmtree(self.prepared, ignore_errors=True)
            self.init(self.prepared)
            run_cli(flowfleet("prepare", str(self.prepared), "--no-progress"), BESIDE_SETTINGS["defaults"])
            run_cli(flowfleet("cluster", str(self.prepared)), BESIDE_SETTINGS["defaults"])

    def init(self, root: Path) -> None:
        sets = [x for s in (*PREPARE_SETS, f"train.steps={self.train_steps}") for x in ("--set", s)]
        run_cli(flowfleet("init", str(root), "--preset", "emoji", *sets), BESIDE_SETTINGS["defaults"])

    def time(self, command: str, extra: dict[str, str]) -> float:
        if command == "prepare":
            root = self.work / "prepare"
            shutil.rmtree(root, ignore_errors=True)
            self.init(root)
            return run_cli(flowfleet("prepare", str(root), "--no-progress"), extra, self.cap_s)
        if command == "train":
            shutil.rmtree(self.prepared / "experts" / "0", ignore_errors=True)
            args = ["train-expert", str(self.prepared), "--expert", "0", "--no-progress"]
            return run_cli(flowfleet(*args), extra, self.cap_s)
        if command == "generate":
            out = str(self.work / "g.png")
            args = ["generate", str(self.model), "--n", "64", "--prompt", self.prompt, "--out", out]
            return run_cli(flowfleet(*args), extra, self.cap_s)
        if command == "evaluate":
            copy = self.work / "model"
            shutil.copytree(self.model, copy, dirs_exist_ok=True)
            args = ["evaluate", str(copy), "--reference", str(self.model.parent), "--n", "100", "--strategies", "top2"]
            return run_cli(flowfleet(*args, "--no-diagnostics"), extra, self.cap_s)
        if command == "serve":
            return serve_requests(self.model, extra, cap_s=self.cap_s)
        raise SystemExit(f"--commands: unknown command {command!r}")


def serve_requests(model: Path, extra: dict[str, str], requests: int = 8, cap_s: float | None = None) -> float:
    """`flowfleet serve MODEL`, then `requests` requests of 4 images one after the other: seconds to answer them
    (TooSlow once they pass `cap_s`)."""
    import socket

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        flowfleet("serve", str(model), "--no-ui", "--port", str(port)), env=clean_env(extra), stderr=subprocess.DEVNULL
    )
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                if httpx.get(f"{url}/api/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        body = {"prompt": "a handwritten digit seven", "n": 4, "seed": 0}
        httpx.post(f"{url}/api/generate", json=body, timeout=600)  # warm-up: the experts loaded
        t0 = time.perf_counter()
        for i in range(requests):
            left = None if cap_s is None else cap_s - (time.perf_counter() - t0)
            if left is not None and left <= 0:
                raise TooSlow
            try:
                httpx.post(f"{url}/api/generate", json={**body, "seed": i}, timeout=left or 600).raise_for_status()
            except httpx.TimeoutException:
                raise TooSlow from None
        return time.perf_counter() - t0
    finally:
        server.terminate()
        server.wait(timeout=60)


def beside(a: argparse.Namespace) -> dict:
    """Every --commands under every --settings alone and beside each --loads busy processes: wall seconds."""
    from flowfleet.threads import CpuTopology

    topo = CpuTopology.read()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    harness = Beside(work, Path(a.model).resolve(), a.train_steps, a.prompt)
    loads = [int(x) for x in a.loads.split(",")]
    out: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(sys.argv), "seconds": {}}
    out["machine"] = f"{platform.machine()}: {topo.cpus} CPUs, {topo.cores} cores, smt {topo.smt}"
    print(out["machine"], flush=True)
    for command in a.commands.split(","):
        harness.cap_s = None
        harness.time(command, BESIDE_SETTINGS["defaults"])  # untimed: files in the page cache for every setting
        for load in loads:
            busy = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(load)]
            try:
                for name in a.settings.split(","):
                    alone = out["seconds"].get(command, {}).get(name, {}).get("0")
                    harness.cap_s = max(a.cap_times * alone, 30.0) if isinstance(alone, float) else None
                    try:
                        seconds: float | str = round(harness.time(command, BESIDE_SETTINGS[name]), 2)
                    except TooSlow:
                        seconds = f">{harness.cap_s:g}"  # stopped at the cap: at least that long
                    timed_at = out["seconds"].setdefault(command, {}).setdefault(name, {})
                    key = str(load) if str(load) not in timed_at else f"{load}#{len(timed_at)}"  # a setting again
                    timed_at[key] = seconds
                    alone = out["seconds"][command][name].get("0")
                    timed = isinstance(seconds, float)
                    shown = f"{seconds:7.1f} s" if timed else f"{seconds} s (stopped)"
                    ratio = f" ({seconds / alone:.2f}x alone)" if timed and isinstance(alone, float) and load else ""
                    print(f"{command:<9} {name:<9} beside {load} busy: {shown}{ratio}", flush=True)
                    if a.out:  # what is measured so far, should the run be stopped
                        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
                        Path(a.out).write_text(json.dumps(out, indent=1))
            finally:
                for proc in busy:
                    proc.kill()
                    proc.wait()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="runs/demo/model", help="an assembled model folder (default runs/demo/model)")
    p.add_argument("--batch", type=int, default=32, help="the larger batch (default 32)")
    p.add_argument("--repeats", type=int, default=15, help="timed calls per batch size (default 15)")
    p.add_argument("--eval-n", type=int, default=300, help="images of the timed evaluate call (default 300)")
    p.add_argument("--stage-repeats", type=int, default=3, help="timed calls of each stage (default 3)")
    p.add_argument("--prompt", default="a handwritten digit seven")
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--beside", action="store_true", help="the commands alone and beside busy processes (see above)")
    p.add_argument("--commands", default="prepare,train,generate,evaluate,serve", help="--beside: which commands")
    p.add_argument("--loads", default="0,1,2,4", help="--beside: busy processes beside each command (0: alone)")
    p.add_argument("--settings", default="policy,PASSIVE,defaults", help="--beside: the thread settings compared")
    p.add_argument("--train-steps", type=int, default=300, help="--beside: train.steps of the training job's run")
    p.add_argument("--work", default="runs/bench/threads-beside", help="--beside: the runs it makes")
    p.add_argument(
        "--cap-times",
        type=float,
        default=8.0,
        help="--beside: stop a command beside busy processes after this many times its time alone, at least 30 s "
        "(recorded as '>CAP')",
    )
    a = p.parse_args()
    if a.beside:
        result = beside(a)
        print(json.dumps(result, indent=1))
        if a.out:
            Path(a.out).parent.mkdir(parents=True, exist_ok=True)
            Path(a.out).write_text(json.dumps(result, indent=1))
        return

    from flowfleet.threads import CpuTopology

    topo = CpuTopology.read()
    result: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": f"{platform.machine()}: {topo.cpus} CPUs, {topo.cores} cores, smt {topo.smt}",
        "command": " ".join(sys.argv),
        "pipeline": {},
        "stages": {},
    }
    print(result["machine"], flush=True)
    print(f"{'setting':<26} {'threads':>7} {'img/s at 1':>11} {f'img/s at {a.batch}':>12}", flush=True)
    for name, (extra, policy) in SETTINGS.items():
        code = PIPELINE.format(policy=policy)
        r = child(code, [a.model, str(a.batch), str(a.repeats), a.prompt], extra)
        result["pipeline"][name] = r
        print(f"{name:<26} {r['threads']:>7} {r['1']:>11.2f} {r[str(a.batch)]:>12.2f}", flush=True)
    run = Path(a.model).resolve().parent  # the run root the folder was assembled from
    copy = run / "model-threads"
    shutil.copytree(a.model, copy, dirs_exist_ok=True)
    try:
        for what, n in (("generate", a.batch), ("evaluate", a.eval_n)):
            for name in ("torch's defaults", "the command line's rule"):
                extra, policy = SETTINGS[name]
                code = STAGE.format(policy=policy)
                r = child(code, [str(copy), what, str(n), str(a.stage_repeats), a.prompt, str(run)], extra)
                result["stages"][f"{what} / {name}"] = r["seconds"]
                print(f"{what} of {n} images, {name}: {r['seconds']:.2f} s", flush=True)
    finally:
        shutil.rmtree(copy, ignore_errors=True)
        shutil.rmtree(run / "reports" / copy.name, ignore_errors=True)
    limit = result["pipeline"]["torch's defaults"]
    rule = result["pipeline"]["the command line's rule"]
    result["rule_over_defaults"] = {k: round(rule[k] / limit[k], 3) for k in ("1", str(a.batch))}
    print(json.dumps(result, indent=1))
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
