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
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "MKL_", "GOMP_", "KMP_"))}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", **extra)
    return env


def child(code: str, args: list[str], extra: dict[str, str]) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", code, *args], env=clean_env(extra), capture_output=True, text=True, check=False
    )
    if done.returncode:
        raise SystemExit(f"child failed ({extra}):\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="runs/demo/model", help="an assembled model folder (default runs/demo/model)")
    p.add_argument("--batch", type=int, default=32, help="the larger batch (default 32)")
    p.add_argument("--repeats", type=int, default=15, help="timed calls per batch size (default 15)")
    p.add_argument("--eval-n", type=int, default=300, help="images of the timed evaluate call (default 300)")
    p.add_argument("--stage-repeats", type=int, default=3, help="timed calls of each stage (default 3)")
    p.add_argument("--prompt", default="a handwritten digit seven")
    p.add_argument("--out", help="write the results as JSON here")
    a = p.parse_args()

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
