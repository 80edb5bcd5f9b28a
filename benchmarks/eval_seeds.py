"""How much of a classifier FD at n = 300 is the draw of the evaluation itself? Each run's models are scored
again, at the scale its own evaluation chose, with evaluation seeds 0 .. S-1 (each seed draws other prompts
from data/'s captions and other noise; `flowfleet evaluate --seed`), and every figure is given as the mean and
sd over those draws, the fleet's ratio to the monolith paired by seed (the same prompts and noise).

    python benchmarks/eval_seeds.py --runs runs/demo23,runs/demo23aug --seeds 5 --out runs/bench/evalseeds23

Each run is evaluated in a scratch run under OUT (links to its run.yaml, data/, eval/, model/, monolith/ and
the digit judge), so the run's own reports/evaluation.json is left as it was. One JSON line per run and seed
goes to OUT/eval_seeds.jsonl; the summary is printed.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from fleet_runs import judge_options, keep_record  # benchmarks/ is the script's folder

LINKED = ("run.yaml", "data", "eval", "autoencoder", "clusters", "model", "monolith", "router", "router-prompt")


def scratch(run: Path, out: Path) -> Path:
    """OUT/<run name>: links to what evaluate reads of `run`, and an empty reports/ with its digit judge."""
    where = out / run.name
    (where / "reports").mkdir(parents=True, exist_ok=True)
    for name in (*LINKED, "reports/digit_classifier"):
        link = where / name
        if (run / name).exists() and not link.exists():
            link.symlink_to((run / name).resolve())
    return where


def chosen_scales(run: Path) -> dict[str, float]:
    """model -> the guidance scale the run's own evaluation chose for it."""
    evaluation = json.loads((run / "reports" / "evaluation.json").read_text())
    return {name: r["cfg"] for name, r in evaluation["runs"].items() if not r.get("same_as")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", required=True, help="comma-separated evaluated runs (the demo's)")
    p.add_argument("--seeds", type=int, default=5, help="evaluation seeds 0 .. S-1")
    p.add_argument("--n", type=int, default=300)
    p.add_argument("--strategy", default="top2")
    p.add_argument("--out", default="runs/bench/evalseeds")
    a = p.parse_args()

    from flowfleet.stages.evaluate import evaluate

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = {}
    for run in (Path(r) for r in a.runs.split(",")):
        scales = chosen_scales(run)
        where = scratch(run, out)
        rows = []
        for seed in range(a.seeds):
            rec: dict = {"run": str(run), "seed": seed, "n": a.n}
            for name, strategies, monolith in (("monolith", (), True), (a.strategy, (a.strategy,), False)):
                options = judge_options(
                    a.n, strategies, batch_size=a.n, monolith=monolith, seed=seed, guidance_scale=scales[name], grid=8
                )
                result = evaluate(str(where / "model"), str(where), options)
                r = result["runs"][name]
                rec[name] = {
                    "cfg": scales[name],
                    "classifier_fd": r["classifier_fd"],
                    "precision": r["precision"],
                    "recall": r["recall"],
                    "accuracy": result["prompt_accuracy"]["scores"][name]["accuracy"],
                }
                rec["floor"] = result["reference_split"]["floor"]["classifier_fd"]
            rec["ratio"] = rec[a.strategy]["classifier_fd"] / rec["monolith"]["classifier_fd"]
            keep_record(rec, out / "eval_seeds.jsonl")
            rows.append(rec)

        def spread(values: list[float]) -> str:
            return (
                f"{statistics.mean(values):.2f} ± {statistics.stdev(values):.2f}"
                if len(values) > 1
                else f"{values[0]:.2f}"
            )

        summary[str(run)] = {
            name: spread([r[name]["classifier_fd"] for r in rows]) for name in ("monolith", a.strategy)
        } | {"ratio": spread([r["ratio"] for r in rows]), "floor": rows[0]["floor"]}
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
