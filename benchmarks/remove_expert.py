"""remove-expert on a finished MNIST run: prompt accuracy per digit before and after.

Copies a finished demo run (its experts, router, data and clusters) to OUT, evaluates the fleet, removes
one expert with `flowfleet remove-expert`, evaluates again with the same prompts, noise and judge, and
prints per-digit prompt accuracy for each strategy. The digits of the removed expert's cluster should
fall to chance or below; the others should stay within 0.02.

    .venv/bin/python benchmarks/remove_expert.py runs/demo-fresh-987c745 --expert 1 --out runs/bench/remove-1
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from fleet_runs import copy_run, evaluate_model  # benchmarks/fleet_runs.py


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", help="a finished MNIST run root (e.g. a `make demo` run)")
    p.add_argument("--expert", type=int, required=True)
    p.add_argument("--out", default="runs/bench/remove")
    p.add_argument("--n", type=int, default=1000, help="samples per strategy (the same prompts and noise before/after)")
    p.add_argument("--strategies", default="top1,full", help="valid before and after (top2 of 2 experts is full)")
    a = p.parse_args()

    from flowfleet.cli import configure_logging
    from flowfleet.stages.remove_expert import remove_expert

    configure_logging()
    out = Path(a.out)
    copy_run(Path(a.run), out)
    strategies = tuple(s for s in a.strategies.split(",") if s)
    before_file = out / "before.json"
    if not before_file.exists():
        before_file.write_text(json.dumps(evaluate_model(out / "model", out, a.n, strategies)))
    before = json.loads(before_file.read_text())
    t0 = time.perf_counter()
    removed = remove_expert(str(out), a.expert, progress=False)
    seconds = time.perf_counter() - t0
    after = evaluate_model(out / "model", out, a.n, strategies)
    lost = {int(d) for d in removed.lost.get(str(a.expert), {}).get("labels", {})}

    rows = {"expert": a.expert, "lost_digits": sorted(lost), "remove_seconds": round(seconds, 1), "strategies": {}}
    print(f"removed expert {a.expert} in {seconds:.0f} s; its digits: {sorted(lost)}")
    print(f"{'strategy':8} {'digit':>5} {'before':>7} {'after':>7} {'change':>7}")
    for s in strategies:
        per = {}
        for d in range(10):
            b, f = before[s]["per_class"][str(d)], after[s]["per_class"][str(d)]
            per[d] = {"before": b, "after": f, "lost": d in lost}
            print(f"{s:8} {d:5d} {b:7.3f} {f:7.3f} {f - b:+7.3f}{'  (removed)' if d in lost else ''}")
        kept = [v for v in per.values() if not v["lost"]]
        gone = [v for v in per.values() if v["lost"]]
        summary = {
            "kept_max_drop": round(max(v["before"] - v["after"] for v in kept), 4),
            "lost_mean_after": round(sum(v["after"] for v in gone) / max(len(gone), 1), 4),
            "overall_before": before[s]["accuracy"],
            "overall_after": after[s]["accuracy"],
        }
        print(
            f"{s:8} kept digits: largest drop {summary['kept_max_drop']:+.3f}; removed digits: mean "
            f"{summary['lost_mean_after']:.3f} (chance 0.1)"
        )
        rows["strategies"][s] = {"per_digit": per, **summary}
    (out / "remove_expert.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
