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
    python benchmarks/fleet_budget.py --run runs/demo --budgets 1940 --tag w64 \
        --set expert.hidden_size=64 --set expert.mlp_act=gelu
    python benchmarks/fleet_budget.py --out runs/bench/budget --plot-only --records runs/bench/seeds/budget.jsonl
    python benchmarks/fleet_budget.py --out runs/bench/bysize --plot-only --records runs/bench/budget/budget.jsonl \
        --compare '' --compare train.expert_steps=by_size

--set KEY=VALUE (dotted key, YAML value; repeatable) changes run.yaml after the budget is applied: a lever
(expert width, batch size, cluster settings: a cluster.* setting clusters the copy afresh). --monolith-from
RUN copies RUN's trained monolith instead of training one, after checking that it has the same architecture,
training settings and step count as this run's compute-matched monolith would (a lever that changes neither reuses the
one baseline). A --set machines=... plans the fleet on those machines (`flowfleet plan`: equal machines balance the
experts' work) before it trains, and the record keeps each expert's machine, steps and batch.

    python benchmarks/fleet_budget.py --run runs/demo-emoji --budgets 1500 --tag equal4 \
        --set 'machines={a: {tflops: 1}, b: {tflops: 1}, c: {tflops: 1}, d: {tflops: 1}}'

Appends one JSON line per budget to OUT/budget.jsonl and prints it, then draws OUT/budget.png from every line
of the same --set levers: each model's chosen FD against the budget (mean and sd over seeds), with the real floor,
and top-2's ratio to the monolith. --plot-only --compare draws one top-2 curve per lever set instead (and the
lever's own monolith where the lever changed it: a width does, an expert_overrides with --monolith-from does not).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from pathlib import Path

import yaml
from fleet_runs import (  # benchmarks/ is the script's folder
    chosen_fd,
    floor_fd,
    judge_options,
    keep_record,
    recluster,
    score_fleet,
    set_budget,
)

PARTS = ("data", "eval", "autoencoder", "clusters", "partitions", "reports/digit_classifier")


def copy_prepared(src: Path, out: Path, steps: int, seed: int, sets: list[str] = ()) -> None:
    """The run's prepared parts into `out`, with train.steps = steps, the training seed of every job
    (experts, monolith, router) = seed, then each --set (once: an existing copy is kept)."""
    if (out / "run.yaml").exists():
        return
    for name in PARTS:
        if (src / name).is_dir():
            shutil.copytree(src / name, out / name)
    raw = yaml.safe_load((src / "run.yaml").read_text())
    set_budget(raw, steps, seed, sets)
    (out / "run.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))


def reuse_monolith(src: Path, run: Path) -> None:
    """Copy src's finished monolith into run when it is the one run would train (same architecture,
    batch and compute-matched steps); otherwise say why and train it."""
    from flowfleet.config import load_run_config
    from flowfleet.storage import RunRoot
    from flowfleet.train.specs import monolith_steps

    if (run / "monolith").exists():
        return
    mine, theirs = load_run_config(RunRoot(str(run))), load_run_config(RunRoot(str(src)))

    def recipe(cfg):  # what the monolith's weights depend on: the training settings but the fleet's own steps
        fleet_only = {"steps", "expert_steps", "split", "ckpt_every", "sample_every", "log_every", "keep_checkpoints"}
        return cfg.expert, cfg.train.model_dump(exclude=fleet_only), monolith_steps(cfg)

    same = recipe(mine) == recipe(theirs)
    if not same:
        print(f"--monolith-from {src}: not this run's monolith ({monolith_steps(mine)} steps here); training one")
        return
    shutil.copytree(src / "monolith", run / "monolith")


def min_accuracy(run: Path) -> float:
    """The demo's bar for a swept scale on the run's built-in data (flowfleet.stages.demo.DEMO_DATA)."""
    from flowfleet.config import load_run_config
    from flowfleet.stages.demo import DEMO_DATA
    from flowfleet.storage import RunRoot

    return DEMO_DATA["emoji" if load_run_config(RunRoot(str(run))).data.source == "emoji" else "digits"].min_accuracy


def plot_budget(records: list[Path], levers: list[list[str]], out: Path) -> None:
    """FD at each model's chosen scale against the steps per expert, over the lines of every file of `records`:
    one top-2 curve per entry of `levers` (the --set assignments its lines were made with), the monolith of the
    first; mean and sd over seeds, the real floor dotted; below it top-2 / monolith per lever set."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    lines = [json.loads(line) for path in records for line in path.read_text().splitlines() if line.strip()]
    groups = [[r for r in lines if r.get("sets", []) == sets and "top2" in r and "monolith" in r] for sets in levers]
    if not groups or not groups[0]:
        return

    def spread(values: list[float]) -> tuple[float, float]:
        return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0

    def curve(ax, group: list[dict], value, style: str, label: str, color: str) -> None:
        budgets = sorted({r["budget_per_expert"] for r in group})
        stats = [spread([value(r) for r in group if r["budget_per_expert"] == b]) for b in budgets]
        means, sds = [m for m, _ in stats], [s for _, s in stats]
        ax.errorbar(budgets, means, yerr=sds, fmt=style, capsize=3, label=label, color=color)

    fig = Figure(figsize=(7, 6))
    FigureCanvasAgg(fig)
    fd = fig.add_subplot(2, 1, 1)
    ratio = fig.add_subplot(2, 1, 2, sharex=fd)

    def monolith_fds(group: list[dict]) -> dict[tuple[int, int], float]:
        return {(r["budget_per_expert"], r["seed"]): chosen_fd(r, "monolith") for r in group}

    curve(fd, groups[0], lambda r: chosen_fd(r, "monolith"), "--o", "monolith", "C0")
    first = monolith_fds(groups[0])
    for n, (sets, group) in enumerate(zip(levers, groups), 1):
        label = "top2" + (f" ({', '.join(sets)})" if sets else "")
        curve(fd, group, lambda r: chosen_fd(r, "top2"), "-o", label, f"C{n}")
        if n > 1 and any(first.get(key) != value for key, value in monolith_fds(group).items()):
            # a lever that changed the monolith too (its width): that monolith, in the lever's colour
            curve(fd, group, lambda r: chosen_fd(r, "monolith"), "--s", f"monolith ({', '.join(sets)})", f"C{n}")
        curve(ratio, group, lambda r: chosen_fd(r, "top2") / chosen_fd(r, "monolith"), "-o", label, f"C{n}")
    fd.axhline(floor_fd(groups[0][0]), color="grey", linestyle=":", label="real floor")
    fd.set(ylabel="classifier FD at the chosen scale", title="top-2 against the compute-matched monolith")
    fd.legend(fontsize=8)
    ratio.axhline(1.0, color="grey", linestyle=":")
    if len(levers) > 1:
        ratio.legend(fontsize=8)
    budgets = sorted({r["budget_per_expert"] for group in groups for r in group})
    ratio.set(xscale="log", xlabel="steps per expert (the monolith: K times as many)", ylabel="top-2 / monolith")
    ratio.set_xticks(budgets, [str(b) for b in budgets])
    for ax in (fd, ratio):
        ax.minorticks_off()  # the log axis' minor labels (2x10^3 ...) would crowd the budgets' own
        ax.grid(alpha=0.3)
    fig.tight_layout()
    tmp = out.with_suffix(".png.tmp")
    fig.savefig(tmp, format="png", dpi=100)
    os.replace(tmp, out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", default="runs/demo", help="a prepared and clustered run (the demo's)")
    p.add_argument("--budgets", default="250,1000", help="steps per expert")
    p.add_argument("--seeds", default="0", help="training seeds (every job's), one run per budget and seed")
    p.add_argument("--n", type=int, default=300)
    p.add_argument("--cfg", default="1.5,2,3,4.5,6")
    p.add_argument("--parallel", type=int, default=2)
    p.add_argument("--out", default="runs/bench/budget")
    p.add_argument("--set", action="append", default=[], help="run.yaml KEY=VALUE after the budget (repeatable)")
    p.add_argument("--tag", default="", help="suffix of each run's folder name (a lever's runs)")
    p.add_argument(
        "--monolith-from",
        default=None,
        help="a run whose trained monolith this one reuses; several, comma-separated: one for each of --seeds",
    )
    p.add_argument("--strategies", default="top2")
    p.add_argument(
        "--min-accuracy",
        type=float,
        default=None,
        help="prompt accuracy a swept scale must reach to be chosen (default: the demo's for the run's data: 0.95 "
        "for the digits, 0 for the emoji, whose judge reads 0.86 of real emoji right)",
    )
    p.add_argument("--records", default="", help="more budget.jsonl files (comma-separated) for budget.png")
    p.add_argument("--plot-only", action="store_true", help="redraw OUT/budget.png, train nothing")
    p.add_argument(
        "--compare",
        action="append",
        default=[],
        help="with --plot-only: a top-2 curve of the lines made with these --set levers ('' none, ';' between "
        "several; repeatable; default: --set's)",
    )
    p.add_argument("--routers", default="", help="comparison routers of the run (router-prompt): extra rows")
    p.add_argument(
        "--posthoc-ema",
        default="",
        help="relative EMA lengths (comma-separated; with --set train.posthoc_ema=[...]): after training, each job's "
        "length chosen among them on the validation split (`flowfleet ema --choose`) before the scoring",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="evaluation draws at each model's chosen scale (evaluate --repeats; default 1: the sweep's draw)",
    )
    a = p.parse_args()

    from flowfleet.stages.assemble import assemble
    from flowfleet.stages.train import train_all

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)

    def records() -> list[Path]:  # this OUT's lines (once written) and --records'
        return [p for p in (out / "budget.jsonl", *(Path(f) for f in a.records.split(",") if f)) if p.exists()]

    if a.plot_only:
        levers = [[x for x in c.split(";") if x] for c in a.compare] or [a.set]
        plot_budget(records(), levers, out / "budget.png")
        return
    runs = [(int(b), int(s)) for b in a.budgets.split(",") for s in a.seeds.split(",")]
    seeds = [int(s) for s in a.seeds.split(",")]
    reused = a.monolith_from.split(",") if a.monolith_from else []
    if len(reused) > 1 and len(reused) != len(seeds):
        p.error(f"--monolith-from: {len(reused)} runs for {len(seeds)} seeds")
    for budget, seed in runs:
        run = out / "-".join([str(budget)] + ([f"seed{seed}"] if seed else []) + ([a.tag] if a.tag else []))
        fresh = not (run / "run.yaml").exists()
        copy_prepared(Path(a.run), run, budget, seed, a.set)
        if fresh:  # a --set cluster.* (or partitions older than their counts) clusters the copy afresh
            recluster(run, a.set)
        if reused:
            reuse_monolith(Path(reused[seeds.index(seed)] if len(reused) > 1 else reused[0]), run)
        planned = None
        if yaml.safe_load((run / "run.yaml").read_text()).get("machines"):  # a --set machines=...: the fleet planned
            from flowfleet.stages.plan import plan_fleet

            plan = plan_fleet(str(run))
            planned = {j: [a.machine, a.steps, a.batch] for j, a in plan.jobs.items()}
        t0 = time.perf_counter()
        train_all(str(run), parallel=a.parallel, progress=False)
        train_s = time.perf_counter() - t0
        assemble(str(run), progress=False)
        rec = {"budget_per_expert": budget, "seed": seed, "train_all_s": round(train_s, 1), "sets": a.set}
        bar = min_accuracy(run) if a.min_accuracy is None else a.min_accuracy
        if a.posthoc_ema:  # EDM2's choice on the validation split's draw; the scoring below reads the test split
            from flowfleet.stages.posthoc_ema import choose_posthoc_ema

            lengths = [float(x) for x in a.posthoc_ema.split(",")]
            options = judge_options(a.n, tuple(a.strategies.split(",")), batch_size=a.n, min_accuracy=bar)
            rec["posthoc_ema"] = choose_posthoc_ema(str(run), lengths, options)["chosen"]
        if planned is not None:
            rec["plan"] = planned
        routers = tuple(r for r in a.routers.split(",") if r)
        rec.update(
            score_fleet(
                run,
                tuple(a.strategies.split(",")),
                a.cfg,
                a.n,
                routers=routers,
                repeats=a.repeats,
                min_accuracy=bar,
            )
        )
        keep_record(rec, out / "budget.jsonl")
        plot_budget(records(), [a.set], out / "budget.png")


if __name__ == "__main__":
    main()
