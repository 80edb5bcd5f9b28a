"""Short training schedules for `demo --quick`: the experts' prompt accuracy after S steps.

Takes a finished `flowfleet demo --quick` run (its data/, clusters, router and cached digit classifier),
copies it to OUT/LABEL with the experts' `train` section changed, trains both experts side by side
(one thread each, as train-all does on 2 cores), assembles the fleet and evaluates top-1 on 100
prompts (the demo's evaluation), printing one JSON line.

    .venv/bin/python benchmarks/probes/quick_schedule.py --from runs/demo-quick --out runs/bench/quick \\
        --label lr4e-3 --steps 300 --warmup 30 --lr 4e-3 --seed 0
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

COPIED = ("data", "clusters", "partitions", "router", "run.yaml")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--from", dest="source", required=True, help="a finished demo --quick run root")
    p.add_argument("--out", default="runs/bench/quick")
    p.add_argument("--label", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--warmup", type=int, required=True)
    p.add_argument("--lr", type=float, required=True)
    p.add_argument("--schedule", default="constant", choices=["constant", "cosine"])
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()

    src, dest = Path(a.source), Path(a.out) / a.label
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    for name in COPIED:
        (shutil.copytree if (src / name).is_dir() else shutil.copy)(src / name, dest / name)
    (dest / "reports").mkdir()
    shutil.copytree(src / "reports" / "digit_classifier", dest / "reports" / "digit_classifier")
    for ref in (src / "reports").glob("fid_ref_*"):
        shutil.copy(ref, dest / "reports" / ref.name)
    cfg = yaml.safe_load((dest / "run.yaml").read_text())
    cfg["train"].update(
        steps=a.steps,
        warmup_steps=a.warmup,
        lr=a.lr,
        schedule=a.schedule,
        seed=a.seed,
        ckpt_every=a.steps,
        sample_every=a.steps,
    )
    (dest / "run.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))

    cli = [sys.executable, "-m", "flowfleet.cli", "-q"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    t0 = time.perf_counter()
    jobs = [
        subprocess.Popen([*cli, "train-expert", "--no-progress", str(dest), "--expert", str(k)], env=env)
        for k in range(int(cfg["cluster"]["k"]))
    ]
    if any(j.wait() for j in jobs):
        raise SystemExit(f"{dest}: an expert failed")
    train_s = time.perf_counter() - t0
    subprocess.run([*cli, "assemble", str(dest)], check=True, capture_output=True)
    subprocess.run(
        [
            *cli,
            "evaluate",
            str(dest / "model"),
            "--n",
            "100",
            "--strategies",
            "top1",
            "--fid-resize",
            "75",
            "--batch-size",
            "100",
            "--ref-n",
            "1000",
            "--no-diagnostics",
        ],
        check=True,
        capture_output=True,
    )
    result = json.loads((dest / "reports" / "evaluation.json").read_text())
    print(
        json.dumps(
            {
                "label": a.label,
                "steps": a.steps,
                "warmup": a.warmup,
                "lr": a.lr,
                "schedule": a.schedule,
                "seed": a.seed,
                "train_s": round(train_s, 1),
                "top1_prompt_accuracy": result["runs"]["top1"]["prompt_accuracy"],
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
