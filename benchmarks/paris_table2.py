"""Paris Table 2 at small scale: monolith vs top-1 / top-2 / full ensemble at equal training FLOPs,
over several training seeds, judged by prompt accuracy, classifier FD and Inception FID.

    .venv/bin/python benchmarks/paris_table2.py --out runs/table2 --seeds 0,1,2 --run0 runs/demo --data-from runs/demo

For each training seed S the configuration is exactly `flowfleet demo`'s (the `mnist` preset, K = 2
caption clusters, 1000 steps per expert, a monolith trained K x as many steps so that its training
FLOPs equal the experts' sum, a prompt-aware router and Paris' prompt-blind one), with train.seed and
router_train.seed set to S. The experts are assembled twice, with each router (model/, model-paris/),
and both fleets are evaluated with top-1, top-2 and the full ensemble. Each seed is a run root
OUT/seed-S: prepare (or data/ copied from --data-from, which must have the same recipe) -> cluster
-> train-all -> assemble -> evaluate (--n samples per model, evaluation seed S; the same prompts and noise
for every model of a seed). --run0 RUN_ROOT uses an already trained demo run (its configuration must be seed
0's) instead of training seed 0 again; it is copied, so its own reports/ are left as they are.

Prints a markdown table (mean ± sample standard deviation over the seeds) and writes
OUT/table2.json. The router's FLOPs are extra, as in the paper, and printed beside.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

STRATEGIES = ("top1", "top2", "full")
# the monolith, the fleet with the run's prompt-aware router, the fleet with Paris' prompt-blind router
MODELS = ("monolith", *STRATEGIES, *(f"paris-{s}" for s in STRATEGIES))
METRICS = (("prompt_accuracy", "prompt accuracy", 3), ("classifier_fd", "classifier FD", 2), ("fid", "FID", 1))


def seed_config(seed: int):
    from flowfleet.config import RunConfig
    from flowfleet.stages.demo import demo_plan

    raw = demo_plan("full").config.to_dict()
    raw["train"]["seed"] = raw["router_train"]["seed"] = seed
    return RunConfig.from_dict(raw, where=f"paris_table2 seed {seed}")


def flops_table(cfg) -> dict[str, float]:
    from flowfleet.models.flops import train_flops
    from flowfleet.train.specs import monolith_steps

    experts = cfg.cluster.k * train_flops(cfg.expert, cfg.train.steps, cfg.train.batch_size)
    mono = train_flops(cfg.expert, monolith_steps(cfg), cfg.train.batch_size)
    router = train_flops(cfg.router, cfg.router_train.steps, cfg.router_train.batch_size)
    return {
        "experts_total": experts,
        "monolith": mono,
        "router": router,
        "monolith_steps": monolith_steps(cfg),
        "expert_steps": cfg.train.steps,
    }


def trained_run(args: argparse.Namespace, seed: int) -> tuple[Any, dict[str, float]]:
    """OUT/seed-S trained and assembled (resuming whatever is there); -> (RunRoot, timings)."""
    from flowfleet.config import load_run_config
    from flowfleet.layout import RUN_FILE
    from flowfleet.stages.assemble import assemble
    from flowfleet.stages.cluster import cluster
    from flowfleet.stages.prepare import prepare
    from flowfleet.stages.train import train_all
    from flowfleet.storage import RunRoot

    cfg = seed_config(seed)
    out = os.path.join(args.out, f"seed-{seed}")
    if seed == 0 and args.run0 and not os.path.exists(out):
        shutil.copytree(args.run0, out)
    root = RunRoot(out)
    if root.exists(RUN_FILE):
        if load_run_config(root).to_dict() != cfg.to_dict():
            sys.exit(f"{root.url_of(RUN_FILE)}: exists with another configuration than seed {seed}'s")
    else:
        cfg.save(root)
    if args.data_from and not root.exists("data", "manifest.json"):
        shutil.copytree(os.path.join(args.data_from, "data"), os.path.join(out, "data"))
    timings = {}

    def cluster_once() -> None:
        if not root.exists("clusters", "report.json"):
            cluster(root, progress=False)

    for name, step in (("prepare", lambda: prepare(root, progress=False)), ("cluster", cluster_once)):
        t0 = time.perf_counter()
        step()
        timings[name] = time.perf_counter() - t0
    t0 = time.perf_counter()
    outcome = train_all(root.url, parallel=args.parallel, progress=False)
    timings["train_all"] = time.perf_counter() - t0
    if not outcome.ok:
        sys.exit(f"seed {seed}: training failed: {outcome.results} {outcome.messages}")
    assemble(root.url)
    assemble(root.url, root.url_of("model-paris"), router="router-paris")
    return root, timings


def evaluate_seed(args: argparse.Namespace, root, seed: int) -> dict[str, Any]:
    """Both fleets and the monolith on the same prompts and noise; runs keyed as in MODELS."""
    from flowfleet.evaluate.fid import FIDSettings
    from flowfleet.stages.evaluate import EvaluateOptions, evaluate

    t0 = time.perf_counter()
    result: dict[str, Any] = {"runs": {}, "router_accuracy": {}}
    for folder, prefix, monolith in (("model", "", True), ("model-paris", "paris-", False)):
        opts = EvaluateOptions(
            n=args.n,
            ref_n=None,
            seed=seed,
            batch_size=args.n,
            strategies=STRATEGIES,
            monolith=monolith,
            fid=FIDSettings(resize=args.fid_resize, batch_size=100),
            diagnostics=True,
            diagnostic_n=16,
            device=args.device,
        )
        r = evaluate(root.url_of(folder), root.url, opts)
        result["runs"].update({(name if name == "monolith" else prefix + name): run for name, run in r["runs"].items()})
        result["router_accuracy"][folder] = (r["diagnostics"].get("router_accuracy") or {}).get("accuracy")
    result["wall_s"] = time.perf_counter() - t0
    return result


def markdown(per_seed: list[dict[str, Any]]) -> str:
    seeds = [r["seed"] for r in per_seed]
    lines = []
    for key, label, digits in METRICS:
        lines += [
            f"| {label} | mean ± sd | " + " | ".join(f"seed {s}" for s in seeds) + " |",
            "|---|---|" + "---|" * len(seeds),
        ]
        for name in MODELS:
            vals = [r["runs"][name][key] for r in per_seed]
            sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
            lines.append(
                f"| {name} | {statistics.mean(vals):.{digits}f} ± {sd:.{digits}f} | "
                + " | ".join(f"{v:.{digits}f}" for v in vals)
                + " |"
            )
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/table2")
    p.add_argument("--seeds", default="0,1,2", help="training seeds (each also the evaluation seed)")
    p.add_argument("--run0", default=None, metavar="RUN_ROOT", help="a trained demo run to use as seed 0")
    p.add_argument(
        "--data-from",
        default=None,
        metavar="RUN_ROOT",
        help="copy data/ from a local run root prepared with the same recipe (e.g. runs/demo)",
    )
    p.add_argument("--n", type=int, default=500, help="generated images per model and seed")
    p.add_argument("--fid-resize", type=int, default=75, help="Inception input for FID (the demo's 75 px)")
    p.add_argument("--parallel", type=int, default=None, help="train-all jobs at a time")
    p.add_argument("--device", default="auto")
    args = p.parse_args()

    import torch

    if "OMP_NUM_THREADS" not in os.environ:  # as `flowfleet demo`: one thread per process on a shared box
        torch.set_num_threads(1)
    per_seed, timings = [], {}
    for seed in [int(s) for s in args.seeds.split(",") if s.strip()]:
        root, timings[seed] = trained_run(args, seed)
        r = evaluate_seed(args, root, seed)
        per_seed.append(
            {
                "seed": seed,
                "wall_s": r["wall_s"],
                "runs": {name: {k: r["runs"][name][k] for k, _, _ in METRICS} for name in MODELS},
                "router_accuracy": r["router_accuracy"],
            }
        )
        print(
            f"seed {seed}: "
            + ", ".join(f"{name} {per_seed[-1]['runs'][name]['prompt_accuracy']:.3f}" for name in MODELS)
            + " (prompt accuracy)",
            flush=True,
        )
    cfg = seed_config(0)
    flops = flops_table(cfg)
    report = {
        "config": {
            "k": cfg.cluster.k,
            "expert_steps": cfg.train.steps,
            "n": args.n,
            "fid_resize": args.fid_resize,
            "cfg": cfg.sampling.guidance_scale,
            "sampling_steps": cfg.sampling.steps,
        },
        "flops": flops,
        "timings": timings,
        "per_seed": per_seed,
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "table2.json"), "w") as f:
        json.dump(report, f, indent=2)
    print(
        f"\ntraining FLOPs: experts {flops['experts_total']:.3e} (K = {cfg.cluster.k} x {cfg.train.steps} steps), "
        f"monolith {flops['monolith']:.3e} ({flops['monolith_steps']} steps), router {flops['router']:.3e}\n"
    )
    print(markdown(per_seed))


if __name__ == "__main__":
    main()
