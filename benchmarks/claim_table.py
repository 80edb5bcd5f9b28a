"""Paris' claim over training seeds: top-2 against the compute-matched monolith, each at its chosen guidance scale,
from finished runs' own evaluations (reports/evaluation.json with evaluation draws: `evaluate --repeats`, as the
demo and `fleet_budget.py --repeats` write them). One run per training seed; nothing is trained or sampled here.

    python benchmarks/claim_table.py runs/demo runs/bench/seeds/3000-seed1 runs/bench/seeds/3000-seed2

Prints a Markdown table: per run, each model's classifier FD (mean +- sd over its draws) at its scale, prompt
accuracy over the draws, top-2 / monolith draw by draw, the monolith / the real floor draw by draw; then the
means over the runs (mean +- sd of the per-run means). --json writes the same figures. --sweep also prints top-2's
guidance sweep at every scale (one draw per run, averaged over the runs): two fleets compared at the same guidance,
not each at its own.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def spread(values: list[float], digits: int = 2) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):.{digits}f} ± {sd:.{digits}f}"


def run_figures(run: Path) -> dict:
    ev = json.loads((run / "reports" / "evaluation.json").read_text())
    draws = ev.get("draws")
    if not draws:
        raise SystemExit(f"{run}: its evaluation has no draws (evaluate --repeats N)")
    fd = {m: draws["runs"][m]["classifier_fd"] for m in ("monolith", "top2")}
    floor = draws["floor"]["classifier_fd"]
    return {
        "run": str(run),
        "cfg": {m: ev["runs"][m]["cfg"] for m in fd},
        "classifier_fd": fd,
        "accuracy": {m: draws["runs"][m]["prompt_accuracy"] for m in fd},
        "floor": floor,
        "ratio": [t / m for t, m in zip(fd["top2"], fd["monolith"])],
        "monolith_over_floor": [m / f for m, f in zip(fd["monolith"], floor)],
        "sweep": ev["runs"]["top2"]["sweep"],  # the draw the scales were chosen on: every scale's figures
    }


def sweep_rows(rows: list[dict]) -> list[dict]:
    """Top-2's sweep at each scale, mean over the runs: prompt accuracy, classifier FD, precision, recall."""
    sweeps = [r["sweep"] for r in rows]
    keys = ("prompt_accuracy", "classifier_fd", "precision", "recall")
    return [
        {"cfg": point["cfg"], **{k: statistics.fmean(s[i][k] for s in sweeps) for k in keys}}
        for i, point in enumerate(sweeps[0])
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="finished runs (one per training seed)")
    p.add_argument("--json", help="write the figures here too")
    p.add_argument("--sweep", action="store_true", help="also top-2's guidance sweep, mean over the runs")
    a = p.parse_args()
    rows = [run_figures(Path(r)) for r in a.runs]
    head = ("run", "monolith (cfg)", "top-2 (cfg)", "prompt accuracy, monolith / top-2", "top-2 ÷ monolith")
    print("| " + " | ".join(head) + " | monolith ÷ floor |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        acc = " / ".join(f"{min(r['accuracy'][m]):.3f}–{max(r['accuracy'][m]):.3f}" for m in ("monolith", "top2"))
        print(
            f"| {r['run']} | {spread(r['classifier_fd']['monolith'])} ({r['cfg']['monolith']:g}) "
            f"| {spread(r['classifier_fd']['top2'])} ({r['cfg']['top2']:g}) | {acc} "
            f"| {spread(r['ratio'], 3)} | {spread(r['monolith_over_floor'], 3)} |"
        )
    means = {k: [statistics.fmean(r[k]) for r in rows] for k in ("ratio", "monolith_over_floor", "floor")}
    models = {m: [statistics.fmean(r["classifier_fd"][m]) for r in rows] for m in ("monolith", "top2")}
    print(
        f"| **over {len(rows)} runs** | **{spread(models['monolith'])}** | **{spread(models['top2'])}** | "
        f"| **{spread(means['ratio'], 3)}** | **{spread(means['monolith_over_floor'], 3)}** |"
    )
    print(f"\nreal floor (classifier FD of held-out digits against the reference): {spread(means['floor'])}")
    sweep = sweep_rows(rows) if a.sweep else []
    if sweep:
        print("\n| top-2's cfg | prompt accuracy | classifier FD | precision | recall |\n|---|---|---|---|---|")
        for row in sweep:
            print(
                f"| {row['cfg']:g} | {row['prompt_accuracy']:.3f} | {row['classifier_fd']:.1f} "
                f"| {row['precision']:.2f} | {row['recall']:.2f} |"
            )
    if a.json:
        figures = {"runs": rows, "means": {**means, **models}, "sweep": sweep}
        Path(a.json).write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
