"""Paris Table 2 at small scale: FID of the monolith, top-1, top-2 and the full ensemble at equal
training FLOPs.

    .venv/bin/python benchmarks/paris_table2.py --out runs/table2                # the run in BENCHMARKS.md
    .venv/bin/python benchmarks/paris_table2.py --out runs/table2 --variants     # + what moves top-2

1. A run root from the `mnist` preset: K = 4 experts (DiT tiny/4, cross-attention on MiniLM captions)
   on the MNIST-5k digits in pixel space (32 x 32), clustered on Inception features (--semantic-size
   input). The monolith has the experts' architecture and batch and `monolith.match_compute`: it
   trains K x the expert steps, so its training FLOPs equal the sum over the experts
   (flowfleet.models.flops; the router's FLOPs are extra, as in the paper, and printed beside).
2. prepare -> cluster -> train-all -> assemble (re-running resumes: finished stages are skipped).
3. For each seed of --seeds: `evaluate` with --n samples per model (>= 1000), every model on the same
   prompts and noise within a seed; FID against --ref-n images of data/ (torchmetrics on the offline
   default_1 Inception at --fid-resize px input).
4. --variants: top-2 with the router run every 2 / 5 steps, top-2 and monolith without guidance and
   with 2x the sampling steps: which of these moves top-2 relative to the monolith.

Prints a markdown table (mean +- sample std over the seeds) and writes OUT/reports/table2.json.

--run RUN_ROOT skips 1-2 and measures a run that is already trained and assembled, e.g. the one
`flowfleet demo` leaves (its monolith is compute-matched too): the table for your own run. The run
root is copied to --out first (a local folder), so its own reports/ are left as they were.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def run_config(args: argparse.Namespace):
    from flowfleet.config import RunConfig
    from flowfleet.presets import PRESETS

    raw = PRESETS["mnist"]()
    raw["name"] = "paris-table2"
    raw["encoders"]["semantic"]["image_size"] = args.semantic_size
    steps, rsteps = args.steps, args.router_steps
    raw["train"].update(steps=steps, ckpt_every=max(steps // 4, 1), sample_every=steps, log_every=max(steps // 50, 1))
    raw["router_train"].update(steps=rsteps, ckpt_every=max(rsteps // 2, 1), sample_every=rsteps,
                               log_every=max(rsteps // 50, 1))
    raw["monolith"] = {"enabled": True, "match_compute": True}
    raw["sampling"]["steps"] = args.sampling_steps
    return RunConfig.from_dict(raw, where="paris_table2 configuration")


def flops_table(cfg) -> dict[str, float]:
    from flowfleet.models.flops import train_flops
    from flowfleet.train.jobs import monolith_steps

    experts = cfg.cluster.k * train_flops(cfg.expert, cfg.train.steps, cfg.train.batch_size)
    mono = train_flops(cfg.expert, monolith_steps(cfg), cfg.train.batch_size)
    router = train_flops(cfg.router, cfg.router_train.steps, cfg.router_train.batch_size)
    return {"experts_total": experts, "monolith": mono, "router": router, "monolith_steps": monolith_steps(cfg),
            "expert_steps": cfg.train.steps}


def build(args: argparse.Namespace):
    from flowfleet.config import RUN_FILE, load_run_config
    from flowfleet.stages.assemble import assemble
    from flowfleet.stages.cluster import cluster
    from flowfleet.stages.prepare import prepare
    from flowfleet.stages.train import train_all
    from flowfleet.storage import RunRoot

    cfg = run_config(args)
    root = RunRoot(args.out)
    if root.exists(RUN_FILE):
        if load_run_config(root).to_dict() != cfg.to_dict():
            sys.exit(f"{root.url_of(RUN_FILE)}: exists with another configuration; use another --out")
    else:
        cfg.save(root)
    timings = {}
    if args.data_from and not root.exists("data", "manifest.json"):
        # Another run root prepared the same source with the same encoders (e.g. `flowfleet demo`):
        # copy its data/; prepare() below refuses it if the recipe differs.
        import shutil

        shutil.copytree(os.path.join(args.data_from, "data"), os.path.join(args.out, "data"))
    t0 = time.perf_counter()
    prepare(root)
    timings["prepare_s"] = time.perf_counter() - t0
    if not root.exists("clusters", "report.json"):
        t0 = time.perf_counter()
        cluster(root)
        timings["cluster_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    outcome = train_all(root.url, parallel=args.parallel)
    timings["train_all_s"] = time.perf_counter() - t0
    if not outcome.ok:
        sys.exit(f"training failed: {outcome.results} {outcome.messages}")
    model = assemble(root.url).out
    return root, cfg, model, timings


def existing(args: argparse.Namespace):
    """An already trained + assembled run root (--run): its config, model folder and recorded timings."""
    import shutil

    from flowfleet.config import load_run_config
    from flowfleet.storage import RunRoot

    if not os.path.exists(args.out):
        shutil.copytree(args.run, args.out)
    root = RunRoot(args.out)
    cfg = load_run_config(root)
    if not cfg.monolith.enabled or not cfg.monolith.match_compute:
        sys.exit(f"{root.url_of('run.yaml')}: monolith.enabled and monolith.match_compute must be true for Table 2")
    if not root.exists("model", "model_index.json"):
        sys.exit(f"{root.url_of('model')}: not assembled; run `flowfleet assemble {root.url}` first")
    return root, cfg, root.url_of("model"), {}


def evaluate_seed(args, root, model: str, seed: int, **kw: Any) -> dict[str, Any]:
    from flowfleet.evaluate.fid import FIDSettings
    from flowfleet.stages.evaluate import EvaluateOptions, evaluate

    opts = EvaluateOptions(n=args.n, ref_n=args.ref_n, seed=seed, batch_size=250,
                           fid=FIDSettings(resize=args.fid_resize, batch_size=100), device=args.device,
                           **{"strategies": ("top1", "top2", "full"), "monolith": True, "diagnostics": True, **kw})
    t0 = time.perf_counter()
    result = evaluate(model, root.url, opts)
    result["wall_s"] = time.perf_counter() - t0
    return result


def summarise(results: list[dict[str, Any]]) -> dict[str, tuple[float, float]]:
    names = list(results[0]["fid"]["scores"])
    out = {}
    for name in names:
        vals = [r["fid"]["scores"][name] for r in results]
        out[name] = (statistics.mean(vals), statistics.stdev(vals) if len(vals) > 1 else 0.0)
    return out


def markdown(summary: dict[str, tuple[float, float]], per_seed: list[dict[str, Any]]) -> str:
    seeds = [r["seed"] for r in per_seed]
    lines = ["| model | FID mean ± std | " + " | ".join(f"seed {s}" for s in seeds) + " |",
             "|---|---|" + "---|" * len(seeds)]
    for name, (mean, std) in summary.items():
        cells = " | ".join(f"{r['fid']['scores'][name]:.2f}" for r in per_seed)
        lines.append(f"| {name} | {mean:.2f} ± {std:.2f} | {cells} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/table2")
    p.add_argument("--run", default=None, metavar="RUN_ROOT",
                   help="copy this trained, assembled local run root to --out and evaluate it (e.g. runs/demo)")
    p.add_argument("--steps", type=int, default=1500, help="steps per expert (monolith: K x)")
    p.add_argument("--router-steps", type=int, default=600)
    p.add_argument("--sampling-steps", type=int, default=20)
    p.add_argument("--semantic-size", type=int, default=75, help="Inception input for the clustering features")
    p.add_argument("--n", type=int, default=1000, help="generated images per model and seed (>= 1000)")
    p.add_argument("--ref-n", type=int, default=5000, help="reference images of data/")
    p.add_argument("--fid-resize", type=int, default=299, help="Inception input for FID (299 = standard)")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--parallel", type=int, default=None, help="train-all jobs at a time")
    p.add_argument("--data-from", default=None, metavar="RUN_ROOT",
                   help="copy data/ from a local run root prepared with the same recipe (e.g. runs/demo)")
    p.add_argument("--variants", action="store_true", help="also: top-2 with route-every 2/5, cfg 1, 2x steps")
    p.add_argument("--device", default="auto")
    args = p.parse_args()
    if args.n < 1000:
        print("note: --n below 1000 is below what the Table-2 figures in BENCHMARKS.md use", file=sys.stderr)

    import torch

    if "OMP_NUM_THREADS" not in os.environ:  # as `flowfleet demo`: one thread per process on a shared box
        torch.set_num_threads(1)
    root, cfg, model, timings = existing(args) if args.run else build(args)
    args.sampling_steps = cfg.sampling.steps
    flops = flops_table(cfg)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    per_seed = []
    for seed in seeds:
        r = evaluate_seed(args, root, model, seed)
        per_seed.append(r)
        print(f"seed {seed}: " + ", ".join(f"{k} {v:.2f}" for k, v in r["fid"]["scores"].items()), flush=True)
    summary = summarise(per_seed)
    report: dict[str, Any] = {
        "config": {"steps": cfg.train.steps, "router_steps": cfg.router_train.steps, "k": cfg.cluster.k,
                   "n": args.n, "ref_n": args.ref_n, "fid_resize": args.fid_resize, "seeds": seeds,
                   "sampling_steps": args.sampling_steps, "cfg": cfg.sampling.cfg},
        "flops": flops, "timings": timings,
        "fid": {name: {"mean": m, "std": s} for name, (m, s) in summary.items()},
        "per_seed": [{"seed": r["seed"], "scores": r["fid"]["scores"], "wall_s": r["wall_s"],
                      "router_accuracy": (r["diagnostics"].get("router_accuracy") or {}).get("accuracy"),
                      "alignment": r["diagnostics"].get("alignment"), "usage": r["diagnostics"].get("usage")}
                     for r in per_seed],
    }
    if args.variants:
        variants = {}
        seed = seeds[0]
        for label, kw in {
            "top2 route-every 2": dict(strategies=("top2",), monolith=False, route_every=2),
            "top2 route-every 5": dict(strategies=("top2",), monolith=False, route_every=5),
            "cfg 1 (no guidance)": dict(strategies=("top2",), monolith=True, cfg=1.0),
            "2x sampling steps": dict(strategies=("top2",), monolith=True, steps=2 * args.sampling_steps),
        }.items():
            r = evaluate_seed(args, root, model, seed, diagnostics=False, **kw)
            variants[label] = r["fid"]["scores"]
            print(f"{label}: " + ", ".join(f"{k} {v:.2f}" for k, v in r["fid"]["scores"].items()), flush=True)
        report["variants"] = {"seed": seed, "scores": variants}
    root.write_json(report, "reports", "table2.json")
    print()
    print(f"training FLOPs: experts {flops['experts_total']:.3e} (K = {cfg.cluster.k} x {cfg.train.steps} steps), "
          f"monolith {flops['monolith']:.3e} ({flops['monolith_steps']} steps), router {flops['router']:.3e}")
    print(markdown(summary, per_seed))
    print(json.dumps(report["per_seed"][0]["router_accuracy"]))


if __name__ == "__main__":
    main()
