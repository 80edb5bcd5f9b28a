"""Paris' claim over training seeds: top-2 against the compute-matched monolith, each at its chosen guidance scale,
from finished runs' own evaluations (reports/evaluation.json with evaluation draws: `evaluate --repeats`, as the
demo and `fleet_budget.py --repeats` write them). One run per training seed; nothing is trained or sampled here.

    python benchmarks/claim_table.py runs/demo runs/bench/seeds/3000-seed1 runs/bench/seeds/3000-seed2

Prints a Markdown table per fleet row (--models: top-2 by default; top1, top2+router-prompt, ...): per run, its and
the monolith's classifier FD (mean +- sd over its draws) at each one's scale, prompt accuracy over the draws, the
row / monolith draw by draw, the monolith / the real floor draw by draw; then the means over the runs (mean +- sd
of the per-run means); then one summary line per model (prompt and, with the emoji judge, subcategory accuracy).
--json writes the figures. --sweep also prints the first row's guidance sweep at every scale (one draw per run,
averaged over the runs): two fleets compared at the same guidance, not each at its own.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def spread(values: list[float], digits: int = 2) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):.{digits}f} ± {sd:.{digits}f}"


def run_figures(run: Path, models: list[str]) -> dict:
    ev = json.loads((run / "reports" / "evaluation.json").read_text())
    draws = ev.get("draws")
    if not draws:
        raise SystemExit(f"{run}: its evaluation has no draws (evaluate --repeats N)")
    names = ["monolith", *models]
    missing = [m for m in names if m not in draws["runs"]]
    if missing:
        raise SystemExit(f"{run}: its evaluation has no {', '.join(missing)} (its rows: {', '.join(draws['runs'])})")
    fd = {m: draws["runs"][m]["classifier_fd"] for m in names}
    floor = draws["floor"]["classifier_fd"]
    return {
        "run": str(run),
        "cfg": {m: ev["runs"][m]["cfg"] for m in names},
        "classifier_fd": fd,
        "accuracy": {m: draws["runs"][m]["prompt_accuracy"] for m in names},
        # the emoji judge reads the subcategory too
        "subcategory_accuracy": {m: draws["runs"][m].get("subcategory_accuracy") for m in names},
        "floor": floor,
        "ratio": {m: [t / mono for t, mono in zip(fd[m], fd["monolith"])] for m in models},
        "monolith_over_floor": [m / f for m, f in zip(fd["monolith"], floor)],
        "sweep": ev["runs"][models[0]]["sweep"],  # the draw the scales were chosen on (validation): every scale's
        "splits": splits_of(ev),
    }


def splits_of(ev: dict) -> str:
    """Which images an evaluation chose on and which it reports, in words."""
    test = ev["reference_split"]
    on = (ev.get("guidance") or {}).get("chosen_on")
    if on == "validation":
        val = ev["validation_split"]
        return (
            f"scales chosen on the validation split ({val['items']} held-out images, prompts and noise of its own), "
            f"figures on the test split ({test['items']} held-out images)"
        )
    return "scales chosen on the draw the figures come from (no validation split: an older run)"


def sweep_rows(rows: list[dict]) -> list[dict]:
    """The first model's sweep at each scale every run sampled (a sweep past its edge adds scales of its own), mean
    over the runs: prompt accuracy, classifier FD, precision, recall."""
    sweeps = [{point["cfg"]: point for point in r["sweep"]} for r in rows]
    keys = ("prompt_accuracy", "classifier_fd", "precision", "recall")
    common = sorted(set.intersection(*(set(s) for s in sweeps)))
    return [{"cfg": c, **{k: statistics.fmean(s[c][k] for s in sweeps) for k in keys}} for c in common]


def accuracy_range(values: list[float] | None) -> str:
    return f"{min(values):.3f}–{max(values):.3f}" if values and None not in values else "—"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="finished runs (one per training seed)")
    p.add_argument(
        "--models",
        default="top2",
        help="the fleet's rows each compared with the monolith, comma-separated (e.g. top1,top2,top2+router-prompt)",
    )
    p.add_argument("--json", help="write the figures here too")
    p.add_argument("--sweep", action="store_true", help="also the first model's guidance sweep, mean over the runs")
    a = p.parse_args()
    models = [m for m in a.models.split(",") if m]
    rows = [run_figures(Path(r), models) for r in a.runs]
    for splits in sorted({r["splits"] for r in rows}):
        print(f"{', '.join(r['run'] for r in rows if r['splits'] == splits)}: {splits}")
    for model in models:
        head = (
            "run",
            "monolith (cfg)",
            f"{model} (cfg)",
            f"prompt accuracy, monolith / {model}",
            f"{model} ÷ monolith",
        )
        print("\n| " + " | ".join(head) + " | monolith ÷ floor |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            acc = " / ".join(accuracy_range(r["accuracy"][m]) for m in ("monolith", model))
            print(
                f"| {r['run']} | {spread(r['classifier_fd']['monolith'])} ({r['cfg']['monolith']:g}) "
                f"| {spread(r['classifier_fd'][model])} ({r['cfg'][model]:g}) | {acc} "
                f"| {spread(r['ratio'][model], 3)} | {spread(r['monolith_over_floor'], 3)} |"
            )
        mono = [statistics.fmean(r["classifier_fd"]["monolith"]) for r in rows]
        mine = [statistics.fmean(r["classifier_fd"][model]) for r in rows]
        ratio = [statistics.fmean(r["ratio"][model]) for r in rows]
        over = [statistics.fmean(r["monolith_over_floor"]) for r in rows]
        print(
            f"| **over {len(rows)} runs** | **{spread(mono)}** | **{spread(mine)}** | "
            f"| **{spread(ratio, 3)}** | **{spread(over, 3)}** |"
        )
    print("\n| model | classifier FD over the runs | ÷ monolith | prompt accuracy | subcategory accuracy |")
    print("|---|---|---|---|---|")
    for m in ["monolith", *models]:
        fds = [statistics.fmean(r["classifier_fd"][m]) for r in rows]
        acc = [statistics.fmean(r["accuracy"][m]) for r in rows]
        sub = [r["subcategory_accuracy"][m] for r in rows]
        subs = spread([statistics.fmean(x) for x in sub], 3) if all(x and None not in x for x in sub) else "—"
        ratio = "1" if m == "monolith" else spread([statistics.fmean(r["ratio"][m]) for r in rows], 3)
        print(f"| {m} | {spread(fds)} | {ratio} | {spread(acc, 3)} | {subs} |")
    floor = [statistics.fmean(r["floor"]) for r in rows]
    print(f"\nreal floor (classifier FD of held-out images against the reference): {spread(floor)}")
    sweep = sweep_rows(rows) if a.sweep else []
    if sweep:
        print(f"\n| {models[0]}'s cfg | prompt accuracy | classifier FD | precision | recall |\n|---|---|---|---|---|")
        for row in sweep:
            print(
                f"| {row['cfg']:g} | {row['prompt_accuracy']:.3f} | {row['classifier_fd']:.1f} "
                f"| {row['precision']:.2f} | {row['recall']:.2f} |"
            )
    if a.json:
        Path(a.json).write_text(json.dumps({"runs": rows, "sweep": sweep}, indent=1))


if __name__ == "__main__":
    main()
