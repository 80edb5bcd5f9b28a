"""How much does top-2 gain from a router trained longer, once the monolith gets the router's extra FLOPs too?

For each finished run (the demo's, or a fleet_budget.py run: its experts are kept), copies the prepared parts and
the trained experts into OUT/<run name>, gives run.yaml the router recipe of --set (router.* and router_train.*),
trains the router and the compute-matched monolith afresh (`train-all`: the experts are done, so they are not
trained again; the monolith's steps follow from the new router's FLOPs), assembles, and evaluates top-2 and the
monolith over the guidance sweep, then --repeats evaluation draws at each model's chosen scale.

    python benchmarks/probes/router_budget.py --runs runs/demo23,runs/bench/bysize19/3000-seed1-bysize \\
        --set router.hidden_size=32 --set router_train.steps=6000 --set router_train.lr=0.002 \\
        --out runs/bench/router24/seeds

One JSON line per run goes to OUT/router_budget.jsonl (fleet_runs.score_fleet's record with `draws`, the router's
accuracy by t bucket is in OUT/<run>/router/report.json); the summary
over the runs (mean and sd of each model's draws, and top-2 / monolith draw by draw) is printed.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the helpers the probes share
from fleet_budget import set_dotted  # noqa: E402
from fleet_runs import keep_record, score_fleet  # noqa: E402

PARTS = ("data", "eval", "autoencoder", "clusters", "partitions", "experts", "reports/digit_classifier")


def copy_fleet(src: Path, out: Path, sets: list[str]) -> None:
    """src's prepared parts and trained experts (no checkpoints) into out, run.yaml with each --set and no
    comparison router (once: an existing copy is kept)."""
    if (out / "run.yaml").exists():
        return
    for name in PARTS:
        shutil.copytree(src / name, out / name, ignore=shutil.ignore_patterns("checkpoints"))
    raw = yaml.safe_load((src / "run.yaml").read_text())
    raw["router_prompt"] = raw["router_baseline"] = False
    for assignment in sets:
        set_dotted(raw, assignment)
    steps = raw["router_train"]["steps"]
    raw["router_train"].update(ckpt_every=max(steps // 2, 1), sample_every=steps, log_every=max(steps // 50, 1))
    (out / "run.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", required=True, help="finished runs, comma-separated (one per training seed)")
    p.add_argument("--set", action="append", default=[], help="run.yaml KEY=VALUE (router.*, router_train.*)")
    p.add_argument("--cfg", default="1.25,1.5,2")
    p.add_argument("--n", type=int, default=300)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--parallel", type=int, default=2)
    p.add_argument("--out", default="runs/bench/router")
    a = p.parse_args()
    if any(not s.startswith(("router.", "router_train.")) for s in a.set):
        p.error("--set: only router.* and router_train.* (the experts are reused as trained)")

    from flowfleet.stages.assemble import assemble
    from flowfleet.stages.train import train_all

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    ratios, fds = [], {"top2": [], "monolith": []}
    for src in (Path(r) for r in a.runs.split(",")):
        run = out / src.name
        copy_fleet(src, run, a.set)
        train_all(str(run), parallel=a.parallel, progress=False)
        assemble(str(run), progress=False)
        rec = {"run": str(src), "sets": a.set, **score_fleet(run, ("top2",), a.cfg, a.n, repeats=a.repeats)}
        keep_record(rec, out / "router_budget.jsonl")
        draws = rec["draws"]["runs"]
        for name in fds:
            fds[name] += draws[name]["classifier_fd"]
        ratios += [t / m for t, m in zip(draws["top2"]["classifier_fd"], draws["monolith"]["classifier_fd"])]

    def spread(values: list[float]) -> str:
        return f"{statistics.mean(values):.2f} +- {statistics.stdev(values):.2f}" if len(values) > 1 else "-"

    print(f"over {len(ratios)} draws: top-2 {spread(fds['top2'])}, monolith {spread(fds['monolith'])}, ", end="")
    print(f"top-2 / monolith {spread(ratios)}")


if __name__ == "__main__":
    main()
