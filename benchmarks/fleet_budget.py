"""Where does the fleet catch the monolith? Classifier FD of top-2 and of the compute-matched monolith
against the training budget, on a prepared and clustered run (the demo's: `flowfleet demo --out RUN`).

For each budget B (steps per expert), copies the run's prepared parts (data/, eval/, autoencoder/,
clusters/, partitions/, the digit judge) into OUT/<B>/, sets train.steps = B (the monolith gets K x B,
the same training FLOPs), trains every job with `train-all`, assembles, and evaluates top-2 and the
monolith with `flowfleet evaluate` over a guidance sweep (each at its best FD with prompt accuracy
>= 0.95, as the demo does). Everything runs through the product's own stages, in Paris' regime (image-
feature clusters, a prompt-blind router): nothing here is a stand-in.

    python benchmarks/fleet_budget.py --run runs/demo --budgets 250,1000 --out runs/bench/budget
    python benchmarks/fleet_budget.py --run runs/demo --budgets 500 --seeds 1,2 --out runs/bench/budget

Appends one JSON line per budget to OUT/budget.jsonl and prints it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import yaml

PARTS = ("data", "eval", "autoencoder", "clusters", "partitions", "reports/digit_classifier")


def copy_prepared(src: Path, out: Path, steps: int, seed: int) -> None:
    """The run's prepared parts into `out`, with train.steps = steps and the training seed of every job
    (experts, monolith, router) = seed (once: an existing copy is kept)."""
    if (out / "run.yaml").exists():
        return
    for name in PARTS:
        if (src / name).is_dir():
            shutil.copytree(src / name, out / name)
    raw = yaml.safe_load((src / "run.yaml").read_text())
    raw["train"].update(steps=steps, ckpt_every=max(steps // 2, 1), sample_every=steps, log_every=max(steps // 40, 1))
    raw["train"]["warmup_steps"] = min(raw["train"].get("warmup_steps", 0), steps // 3)
    raw["train"]["seed"] = raw["router_train"]["seed"] = seed
    (out / "run.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", default="runs/demo", help="a prepared and clustered run (the demo's)")
    p.add_argument("--budgets", default="250,1000", help="steps per expert")
    p.add_argument("--seeds", default="0", help="training seeds (every job's), one run per budget and seed")
    p.add_argument("--n", type=int, default=300)
    p.add_argument("--cfg", default="1.5,2,3,4.5,6")
    p.add_argument("--parallel", type=int, default=2)
    p.add_argument("--out", default="runs/bench/budget")
    a = p.parse_args()

    from flowfleet.evaluate.fid import FIDSettings
    from flowfleet.stages.assemble import assemble
    from flowfleet.stages.evaluate import EvaluateOptions, evaluate
    from flowfleet.stages.train import train_all

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = [(int(b), int(s)) for b in a.budgets.split(",") for s in a.seeds.split(",")]
    for budget, seed in runs:
        run = out / (str(budget) if seed == 0 else f"{budget}-seed{seed}")
        copy_prepared(Path(a.run), run, budget, seed)
        t0 = time.perf_counter()
        train_all(str(run), parallel=a.parallel, progress=False)
        train_s = time.perf_counter() - t0
        assemble(str(run), progress=False)
        options = EvaluateOptions(
            n=a.n,
            batch_size=a.n,
            strategies=("top2",),
            monolith=True,
            diagnostics=False,
            cfg_sweep=tuple(float(c) for c in a.cfg.split(",")),
            fid=FIDSettings(resize=75),
            device="cpu",
        )
        result = evaluate(str(run / "model"), str(run), options)
        rec = {"budget_per_expert": budget, "seed": seed, "train_all_s": round(train_s, 1)}
        rec["floor"] = result["reference_split"]
        for name in ("top2", "monolith"):
            r = result["runs"][name]
            rec[name] = {k: r.get(k) for k in ("cfg", "classifier_fd", "precision", "recall", "fid")}
            rec[name]["accuracy"] = result["prompt_accuracy"]["scores"][name]["accuracy"]
        print(json.dumps(rec), flush=True)
        with open(out / "budget.jsonl", "a") as fh:
            fh.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
