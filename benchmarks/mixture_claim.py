"""Guide the mixture, not each expert: Paris' claim on a prepared run (the emoji demo's) under each recipe of the
fleet, against the same compute-matched monolith.

For each training seed, two copies of the run's prepared parts (data/, eval/, autoencoder/, clusters/, partitions/)
are trained with `train-all`, their main router reading the prompt as the experts do (run.yaml router.conditioning
pooled, the experts' condition dropout) and Paris' prompt-blind router beside it (router_baseline):

    OUT/steps-seedS   Paris' compute matching (train.split steps): each expert the monolith's batch, its share of
                      the steps; the routers and the compute-matched monolith
    OUT/batch-seedS   DDM's (train.split batch): each expert its share of the batch for all the steps; the routers
                      and the monolith are the steps run's, copied (the same jobs: run.yaml differs in train.split)

Each is evaluated by `flowfleet evaluate` over the guidance sweep (each row at its own scale), then --repeats draws
at the chosen scales, with the rows: the monolith; STRATEGY.RULE (the prompt-reading router, guided over the mixture
or inside each expert) and STRATEGY.RULE+router-paris (Paris' router, where both rules are one field), for each
--strategies. The monolith is sampled in both evaluations on the same draws (a check that they are the same draws).

    python benchmarks/mixture_claim.py --run runs/demo-emoji --seeds 0 --out runs/bench/mixture
    python benchmarks/mixture_claim.py --run runs/demo-emoji --seeds 1,2 --matchings steps --strategies top2 \
        --out runs/bench/mixture                     # the rows that stay after one seed
    python benchmarks/mixture_claim.py --out runs/bench/mixture --table   # the Markdown table of every seed so far

--set KEY=VALUE changes both copies' run.yaml (a lever: expert.hidden_size=32 with --steps 5618 for the capacity
curve, under --tag). Appends one JSON line per run to OUT/claim.jsonl; --table prints, per row, classifier FD (mean
± sd over seeds of each seed's mean over its draws; one seed: over its draws), its ratio to the monolith draw by
draw, prompt (category) and subcategory accuracy, and the seeds behind it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from dataclasses import replace
from pathlib import Path

import yaml
from fleet_budget import min_accuracy  # benchmarks/ is the script's folder
from fleet_runs import judge_options, keep_record, set_budget

PARTS = ("data", "eval", "autoencoder", "clusters", "partitions", "reports/digit_classifier")
SHARED_JOBS = ("router", "router-paris", "monolith")  # the batch run's, copied from the steps run
PROMPT_ROUTER = ("router.conditioning=pooled", "router.text_dim=384", "router_baseline=true", "router_prompt=false")
MATCHING = {"steps": "Paris' (each expert the monolith's batch)", "batch": "DDM's (each expert a share of the batch)"}


def copy_prepared(src: Path, run: Path, steps: int, seed: int, sets: list[str]) -> None:
    """The prepared parts of `src` into `run` with the training budget, seed and levers (once: a copy is kept)."""
    if (run / "run.yaml").exists():
        return
    run.mkdir(parents=True)
    for name in PARTS:
        if (src / name).is_dir():
            shutil.copytree(src / name, run / name)  # (the digits' judge, trained once per run, in reports/)
    raw = yaml.safe_load((src / "run.yaml").read_text())
    set_budget(raw, steps, seed, [*PROMPT_ROUTER, *sets])
    (run / "run.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))


def share_jobs(steps_run: Path, batch_run: Path) -> None:
    """The routers and the monolith of the steps run into the batch run, whose run.yaml differs in train.split
    alone (checked): the same jobs, trained once."""
    mine, theirs = (yaml.safe_load((r / "run.yaml").read_text()) for r in (batch_run, steps_run))
    mine["train"].pop("split"), theirs["train"].pop("split", None)
    if mine != theirs:
        raise SystemExit(f"{batch_run}: run.yaml differs from {steps_run}'s beyond train.split")
    for job in SHARED_JOBS:
        if (steps_run / job).is_dir() and not (batch_run / job).exists():
            shutil.copytree(steps_run / job, batch_run / job, ignore=shutil.ignore_patterns("checkpoints"))


def evaluate_run(run: Path, a: argparse.Namespace) -> dict:
    """`flowfleet evaluate` of run/model: the monolith, the strategies under both guidance rules, with the run's
    router (prompt-reading) and Paris' (router-paris); every row at its chosen scale, then the draws."""
    from flowfleet.stages.evaluate import evaluate

    options = judge_options(
        a.n,
        tuple(a.strategies.split(",")),
        batch_size=a.n,
        monolith=True,
        routers=("router-paris",),
        guidance_rules=("mixture", "expert"),
        guidance_sweep=tuple(float(c) for c in a.cfg.split(",")),
        repeats=a.repeats,
        min_accuracy=min_accuracy(run),
    )
    return evaluate(str(run / "model"), str(run), options)


def router_probe(run: Path) -> dict | None:
    """The run's router (the prompt-reading one) on 512 held-out items, per noise level, with the prompt and with it
    dropped: `flowfleet evaluate`'s diagnostics, from a small evaluation run before the main one (which then writes
    the run's reports/evaluation.json)."""
    from flowfleet.stages.evaluate import evaluate

    options = replace(judge_options(16, ("top1",), batch_size=16, diagnostic_n=4), diagnostics=True)
    return evaluate(str(run / "model"), str(run), options)["diagnostics"].get("router_accuracy_heldout")


def record(
    run: Path, matching: str, seed: int, result: dict, train_s: float, sets: list[str], tag: str, probe: dict | None
) -> dict:
    """One JSON line: per row its chosen scale and every draw's judged figures (rows that are one model as another:
    that one's), the floor's, and how the run was matched."""
    from flowfleet.config import load_run_config
    from flowfleet.stages.train import describe_matching
    from flowfleet.storage import RunRoot

    root = RunRoot(str(run))
    draws = result["draws"]
    rows = {
        name: {"cfg": r["cfg"], "same_as": r.get("same_as"), **draws["runs"][name]}
        for name, r in result["runs"].items()
    }
    return {
        "run": str(run),
        "tag": tag,
        "matching": matching,
        "compute": describe_matching(root, load_run_config(root)),
        "seed": seed,
        "sets": sets,
        "train_all_s": round(train_s, 1),
        "floor": draws["floor"],
        "rows": rows,
        "router_heldout": probe,
    }


def run_seed(a: argparse.Namespace, seed: int, out: Path) -> None:
    from flowfleet.stages.assemble import assemble
    from flowfleet.stages.train import train_all

    sets = list(a.set)
    tag = f"-{a.tag}" if a.tag else ""
    runs = {m: out / f"{m}-seed{seed}{tag}" for m in a.matchings.split(",")}
    if "batch" in runs and "steps" not in runs:
        runs = {"steps": out / f"steps-seed{seed}{tag}", **runs}  # the shared jobs come from the steps run
    for matching, run in runs.items():
        copy_prepared(Path(a.run), run, a.steps, seed, [*sets, f"train.split={matching}"])
        if matching == "batch":
            share_jobs(runs["steps"], run)
        t0 = time.perf_counter()
        outcome = train_all(str(run), parallel=a.parallel, progress=False)
        if not outcome.ok:
            raise SystemExit(f"{run}: train-all: {outcome.results}")
        train_s = time.perf_counter() - t0
        assemble(str(run), progress=False)
        if matching in a.matchings.split(","):
            probe = router_probe(run) if matching == "steps" else None  # (before: the main one's file stays)
            result = evaluate_run(run, a)
            keep_record(record(run, matching, seed, result, train_s, sets, a.tag, probe), out / "claim.jsonl")


# --------------------------------------------------------------------------------------------------
#                                          The table
# --------------------------------------------------------------------------------------------------

LABELS = {  # (row, matching) -> what the table calls it; the others by their row names
    "top2.mixture+router-paris": "Paris: prompt-blind router (one guidance rule), top-2",
    "top1.mixture+router-paris": "Paris: prompt-blind router, top-1",
    "trajectory.mixture+router-paris": "Paris: prompt-blind router, trajectory",
    "top2.expert": "router reads the prompt, guided inside each expert, top-2",
    "top1.expert": "router reads the prompt, guided inside each expert, top-1",
    "top2.mixture": "router reads the prompt, guided over the mixture, top-2",
    "top1.mixture": "router reads the prompt, guided over the mixture, top-1",
    "trajectory.mixture": "router reads the prompt, trajectory (one expert per image)",
}


MONOLITH_LABEL = "monolith (the experts' architecture, the fleet's FLOPs)"


def spread(values: list[float], digits: int = 2) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):.{digits}f} ± {sd:.{digits}f}"


def per_seed_means(draws: list[list[float]]) -> list[float]:
    """Each seed's mean over its draws; with one seed, its draws (so that the spread is the draws')."""
    return list(draws[0]) if len(draws) == 1 else [statistics.fmean(d) for d in draws]


def table(lines: list[dict], tag: str) -> str:
    """Markdown: one row per (model, matching) over the seeds of the lines with this tag."""
    lines = [line for line in lines if line.get("tag", "") == tag]
    out = [
        "| model | compute matching | seeds × draws | cfg | classifier FD | ÷ monolith | category accuracy | "
        "subcategory accuracy |",
        "|---|---|---|---|---|---|---|---|",
    ]
    monolith_done = False
    names = [n for n in LABELS] + sorted({n for line in lines for n in line["rows"]} - set(LABELS) - {"monolith"})
    keys = [("monolith", "steps")] + [(n, m) for m in ("steps", "batch") for n in names]
    for name, matching in keys:
        per_seed = [line for line in lines if line["matching"] == matching and name in line["rows"]]
        if name == "monolith":
            per_seed = [line for line in lines if line["matching"] == "steps"]  # (the same draws in both)
        if not per_seed or (name == "monolith" and monolith_done):
            continue
        rows = [line["rows"][name] for line in per_seed]
        if any(r.get("same_as") for r in rows):
            continue  # one model as an earlier row
        # per seed its mean over the draws (one seed: the draws themselves); ratios draw by draw
        ratios = [
            [x / m for x, m in zip(r["classifier_fd"], line["rows"]["monolith"]["classifier_fd"])]
            for r, line in zip(rows, per_seed)
        ]
        fd, ratio = per_seed_means([r["classifier_fd"] for r in rows]), per_seed_means(ratios)
        acc = per_seed_means([r["prompt_accuracy"] for r in rows])
        sub = per_seed_means([r["subcategory_accuracy"] for r in rows if r.get("subcategory_accuracy")])
        cfgs = "/".join(sorted({f"{r['cfg']:g}" for r in rows}))
        draws = len(rows[0]["classifier_fd"])
        label = MONOLITH_LABEL if name == "monolith" else LABELS.get(name, name)
        out.append(
            f"| {label} | {'—' if name == 'monolith' else MATCHING[matching]} | {len(rows)} × {draws} | {cfgs} | "
            f"{spread(fd)} | {'1' if name == 'monolith' else spread(ratio, 3)} | {spread(acc, 3)} | "
            f"{spread(sub, 3) if sub else ''} |"
        )
        monolith_done |= name == "monolith"
    floor_draws = [line["floor"]["classifier_fd"] for line in lines if line["matching"] == "steps"]
    if floor_draws:
        seeds = f"{len(floor_draws)} × {len(floor_draws[0])}"
        out.append(f"| real held-out images (the floor) | | {seeds} | | {spread(per_seed_means(floor_draws))} | | | |")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", default="runs/demo-emoji", help="a prepared and clustered run (the emoji demo's)")
    p.add_argument("--seeds", default="0", help="training seeds (every job's)")
    p.add_argument("--steps", type=int, default=1500, help="train.steps: steps per expert of Paris' matching")
    p.add_argument("--matchings", default="steps,batch", help="steps (Paris'), batch (DDM's)")
    p.add_argument("--strategies", default="top2,top1,trajectory")
    p.add_argument("--n", type=int, default=300)
    p.add_argument("--cfg", default="4.5,8", help="the guidance sweep")
    p.add_argument("--repeats", type=int, default=5, help="evaluation draws at the chosen scales")
    p.add_argument("--parallel", type=int, default=2)
    p.add_argument("--set", action="append", default=[], help="run.yaml KEY=VALUE of both copies (repeatable)")
    p.add_argument("--tag", default="", help="suffix of the runs' folder names and key of their table (a lever)")
    p.add_argument("--out", default="runs/bench/mixture")
    p.add_argument("--table", action="store_true", help="print the table of OUT/claim.jsonl, train nothing")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.table:
        lines = [json.loads(x) for x in (out / "claim.jsonl").read_text().splitlines() if x.strip()]
        print(table(lines, a.tag))
        return
    for seed in (int(s) for s in a.seeds.split(",")):
        run_seed(a, seed, out)


if __name__ == "__main__":
    main()
