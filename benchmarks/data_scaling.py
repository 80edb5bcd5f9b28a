"""Does the fleet close in on the monolith as the data grows? Top-2 and the compute-matched monolith trained on the
first N of a prepared run's training items, each at the same passes over its data as the run's own budget.

For each N, builds OUT/<N>[-seedS]/ from the run (the demo's: `flowfleet demo --out RUN`): data/ holds the run's
first N items (index 0..N-1, the same latents, features and captions); eval/, autoencoder/ and the digit judge are
copied; run.yaml is the run's with train.steps = round(steps * N / N_run), so that every expert (split by size, as
the demo's) and the monolith pass over their data as often as at the run's own size. The copy is clustered afresh
(the run's cluster settings), trained with `train-all`, assembled, and top-2 and the monolith are scored by
`flowfleet evaluate` over a guidance sweep, each at its best classifier FD with prompt accuracy >= 0.95, against the
run's held-out digits. Paris' regime throughout: image-feature clusters, the prompt-blind router, top-2.

The autoencoder stays the run's (trained on all of its training items), so the smaller runs share its latent
space; both models gain from it alike.

    python benchmarks/data_scaling.py --run runs/demo --sizes 1000,2000 --seeds 0,1,2 --out runs/bench/scaling
    python benchmarks/data_scaling.py --run runs/demo --out runs/bench/scaling --plot-only \
        --full-size runs/bench/budget/budget.jsonl      # fleet_budget.py's lines at the run's own budget: N = all

--full-size FILE adds the run's own size to the plot from `fleet_budget.py` result lines (its --budgets at the
run's train.steps, one line per seed), which are those runs exactly. --records FILE adds another curve's lines.
--set KEY=VALUE (dotted key, YAML value; repeatable) changes every copy's run.yaml, a lever along the whole curve
(e.g. `--set expert.hidden_size=32 --tag w32`: experts, router budget and monolith alike); the plot draws one pair
of curves per recipe.

Beyond the demo's 9000 digits: a run prepared on MNIST's 70,000 (`data.source: mnist-70k`; its first 9000
training items and its 1000 held-out digits are the demo's) with `encoders.latent.autoencoder.train_items: 9000`
(the demo's latent space, trained on the same 9000 images) and `train.steps` 23000 (3000 per 9000 items):

    python benchmarks/data_scaling.py --run runs/demo70k --sizes 18000,36000 --seeds 0 --repeats 3 \
        --cfg 1.25,1.5,2,3,4.5 --out runs/bench/scaling70k
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path

import yaml
from fleet_runs import chosen_fd, floor_fd, keep_record, score_fleet, set_budget  # benchmarks/ is the script's folder

KEPT = ("eval", "autoencoder", "reports/digit_classifier")
FIELDS = ("latents", "features", "labels", "index", "text_pooled", "text_tokens", "text_mask")


def build(src: Path, out: Path, n: int, seed: int, sets: list[str] = ()) -> int:
    """OUT with the run's first n training items and the run's budget scaled by n / N, then each --set; returns
    the steps."""
    from flowfleet.data.shards import ShardSet, ShardSetManifest, open_complete
    from flowfleet.layout import DATA
    from flowfleet.storage import RunRoot

    raw = yaml.safe_load((src / "run.yaml").read_text())
    data = open_complete(RunRoot(str(src)), DATA, "flowfleet prepare")
    total = data.manifest().count
    if not 0 < n <= total:
        raise SystemExit(f"--sizes: {n} outside 1..{total} (the run's training items)")
    steps = round(raw["train"]["steps"] * n / total)
    if (out / "run.yaml").exists():
        return steps
    out.mkdir(parents=True, exist_ok=True)
    for name in KEPT:
        if (src / name).is_dir():
            shutil.copytree(src / name, out / name)
    fields, captions = data.load(FIELDS, with_captions=True)
    keep = fields["index"] < n  # [N] the first n items
    shards, manifest = ShardSet(RunRoot(str(out)), DATA), ShardSetManifest(extra=data.manifest().extra)
    rows = keep.nonzero().flatten()
    size = raw["data"]["shard_size"]
    for i in range(0, len(rows), size):
        r = rows[i : i + size]
        shards.append(manifest, {f: v[r] for f, v in fields.items()}, [captions[j] for j in r.tolist()])
    manifest.complete = True
    shards.write_manifest(manifest)
    raw["router_prompt"] = False  # Paris' claim only: top-2 of the prompt-blind router against the monolith
    set_budget(raw, steps, seed, sets)
    (out / "run.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    return steps


def plot(records: list[dict], out: Path) -> None:
    """Each model's chosen classifier FD (mean and sd over seeds, the real floor dotted) and top-2 / monolith
    against the training items: one pair of curves per recipe (the --set levers a line was made with)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    sizes = sorted({r["items"] for r in records})
    recipes = sorted({tuple(r.get("sets", ())) for r in records})

    def curve(ax, recipe: tuple, value, label: str, style: str, color: str) -> None:
        mine = [r for r in records if tuple(r.get("sets", ())) == recipe]
        xs = [n for n in sizes if any(r["items"] == n for r in mine)]
        groups = [[value(r) for r in mine if r["items"] == n] for n in xs]
        sds = [statistics.stdev(v) if len(v) > 1 else 0.0 for v in groups]
        name = f"{label}, {' '.join(recipe)}" if recipe else label
        ax.errorbar(xs, [statistics.fmean(v) for v in groups], yerr=sds, fmt=style, capsize=3, label=name, color=color)

    fig = Figure(figsize=(6, 6 + (len(recipes) > 1)))
    FigureCanvasAgg(fig)
    fd, ratio = fig.add_subplot(2, 1, 1), fig.add_subplot(2, 1, 2)
    for recipe, color in zip(recipes, ("C0", "C1", "C2", "C3", "C4"), strict=False):
        curve(fd, recipe, lambda r: chosen_fd(r, "monolith"), "monolith", "--s", color)
        curve(fd, recipe, lambda r: chosen_fd(r, "top2"), "top-2 (Paris)", "-o", color)
        curve(ratio, recipe, lambda r: chosen_fd(r, "top2") / chosen_fd(r, "monolith"), "top-2 / monolith", "-o", color)
    fd.axhline(floor_fd(records[0]), color="grey", linestyle=":", label="real floor")
    fd.set(ylabel="classifier FD at the chosen scale", title="the fleet and the compute-matched monolith by data")
    ratio.axhline(1.0, color="grey", linestyle=":")
    ratio.set_yscale("log")  # parity's neighbourhood as wide as the small runs' gaps
    ticks = [t for t in (0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 3.0, 4.0) if ratio.get_ylim()[0] <= t <= ratio.get_ylim()[1]]
    ratio.set_yticks(ticks, [f"{t:g}" for t in ticks])
    ratio.set(xlabel="training items (steps in proportion)", ylabel="top-2 / monolith")
    for ax in (fd, ratio):
        ax.set_xscale("log")
        # a size within 20 % of the one before shares its tick's place: label it on a second line
        ax.set_xticks(sizes, [("\n" if i and n < 1.2 * sizes[i - 1] else "") + str(n) for i, n in enumerate(sizes)])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, format="png", dpi=100)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", default="runs/demo", help="a prepared run (the demo's)")
    p.add_argument("--sizes", default="1000,2000", help="training items per run (the first N of the run's)")
    p.add_argument("--seeds", default="0")
    p.add_argument("--n", type=int, default=300)
    p.add_argument("--cfg", default="1.25,1.5,2,3")
    p.add_argument("--parallel", type=int, default=2)
    p.add_argument("--out", default="runs/bench/scaling")
    p.add_argument("--set", action="append", default=[], help="run.yaml KEY=VALUE after the budget (repeatable)")
    p.add_argument("--tag", default="", help="suffix of each run's folder name (a lever's runs)")
    p.add_argument("--plot-only", action="store_true")
    p.add_argument("--full-size", default="", help="fleet_budget.py's budget.jsonl: its lines at the run's steps")
    p.add_argument(
        "--records",
        action="append",
        default=[],
        metavar="FILE",
        help="another curve's scaling.jsonl to plot with this one's (its runs on the same first items, judge and "
        "held-out digits); repeatable",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="evaluation draws at each model's chosen scale (evaluate --repeats; default 1: the sweep's draw)",
    )
    a = p.parse_args()

    from flowfleet.stages.assemble import assemble
    from flowfleet.stages.cluster import cluster
    from flowfleet.stages.train import train_all

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    lines = out / "scaling.jsonl"
    if not a.plot_only:
        for n in (int(x) for x in a.sizes.split(",")):
            for seed in (int(x) for x in a.seeds.split(",")):
                run = out / "-".join([str(n)] + ([f"seed{seed}"] if seed else []) + ([a.tag] if a.tag else []))
                steps = build(Path(a.run), run, n, seed, a.set)
                if not (run / "clusters").exists():
                    cluster(str(run), progress=False)
                t0 = time.perf_counter()
                train_all(str(run), parallel=a.parallel, progress=False)
                rec = {
                    "items": n,
                    "seed": seed,
                    "steps_per_expert": steps,
                    "train_all_s": round(time.perf_counter() - t0, 1),
                    "sets": a.set,
                }
                assemble(str(run), progress=False)
                rec["cluster_sizes"] = json.loads((run / "clusters" / "report.json").read_text())["sizes"]
                rec.update(score_fleet(run, ("top2",), a.cfg, a.n, repeats=a.repeats))
                keep_record(rec, lines)
    files = [lines, *(Path(f) for f in a.records)]
    records = [json.loads(x) for f in files if f.exists() for x in f.read_text().splitlines() if x.strip()]
    if a.full_size:
        from flowfleet.data.shards import open_complete
        from flowfleet.layout import DATA
        from flowfleet.storage import RunRoot

        steps = yaml.safe_load((Path(a.run) / "run.yaml").read_text())["train"]["steps"]
        total = open_complete(RunRoot(a.run), DATA, "flowfleet prepare").manifest().count
        full = [json.loads(x) for x in Path(a.full_size).read_text().splitlines() if x.strip()]
        records += [{**r, "items": total} for r in full if r["budget_per_expert"] == steps]
    if records:
        plot(records, out / "scaling.png")


if __name__ == "__main__":
    main()
