"""Machines of different speeds and one deadline: what K machines of speeds 1 : 1 : 2 : 4 (--speeds, the slowest 1)
train by the time the slowest has done one unit U of work (S steps of batch B of the experts' architecture: what
each machine does in the equal-machines comparisons), and how good each option's model is.

    fastest alone     a monolith of max(speed) x S steps on the fastest machine, the others idle
    full sync         DDP at the pace of the slowest: K x min(speed) x S steps of batch B (the project's full-sync
                      convention: the compute-matched monolith's steps, one ring all-reduce of fp32 gradients each)
    DiLoCo, waiting   K workers of min(speed) x S steps, a round every H: each round waits for the slowest
    DiLoCo, at pace   each worker speed x S steps, speed x H a round (run.yaml diloco.pace, Async Local-SGD's dynamic
                      local updates): the same rounds, no worker waits
    the fleet         K experts planned by `flowfleet plan --deadline` on machines of those speeds (the heaviest
                      expert on the fastest, every machine busy until the deadline), DDM's recipe, top-2; the plan
                      is the experts' alone (plan_fleet's router=False) and the router the source run's, trained on
                      top of the deadline on the fastest machine (its FLOPs listed apart); with --router planned,
                      as `flowfleet plan` makes it: the router within the deadline, first on one machine (the same
                      router: the source run's), that machine's expert shorter
    all the work      a monolith of sum(speed) x S steps: synchronous training whose ranks take batch shares by
                      speed on a network fast enough to hide its traffic, the reference every ratio divides by

One box holds every machine here: a speed is emulated as work (a machine of speed s does s units by the deadline),
not as wall-clock. Every row is trained on a copy of a fleet_budget.py seed run (its prepared data, clusters, judge,
validation and test splits) and scored by `flowfleet evaluate` with the same guidance sweep (chosen on the
validation split) and --repeats test draws; each row's real-floor figures are checked equal to the source's.

    python benchmarks/machines.py --source runs/bench/emoji-plain/500,runs/bench/emoji-plain/500-seed1,\
runs/bench/emoji-plain/500-seed2 --out runs/bench/machines-emoji
    python benchmarks/machines.py --source ... --out runs/bench/machines-emoji --table

--speeds 1,1,1,1 is the equal-machines comparison: the fastest alone is one machine, full sync and all the work are
one model (trained once), DiLoCo waiting and at pace are one (trained once), and the fleet's plan balances its
experts' work. --reuse OTHER_OUT takes a monolith or waiting DiLoCo another table trained from the same source (the
same run.yaml but for its steps, checked, and the same test draws, checked) instead of training it again.

One JSON line per trained row in OUT/machines.jsonl; --table prints the Markdown table (mean ± sd over seeds of each
seed's mean over its draws; ratios draw by draw). Wall time: every option computes until the deadline T (the fleet
then trains its router on the fastest machine, router U / its speed); traffic adds max(up, down) x 8 / the link's
rate (a full-duplex link, no overlap with compute, no latency), shown at 1 Gbit/s in units of T as measured here
(T = S steps at the quickest monolith's median step time) and as the link at which the traffic takes one T here.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import yaml
from decision import GBIT, commit, make_run, param_count, ring_bytes, score, traffic  # benchmarks/: the folder
from fleet_budget import min_accuracy
from fleet_runs import keep_record, score_fleet
from mixture_claim import per_seed_means, spread

ROWS = ("fastest", "sync", "diloco", "pace", "fleet", "all")


def speeds_of(a: argparse.Namespace) -> list[int]:
    speeds = [int(s) for s in a.speeds.split(",")]
    if min(speeds) != 1:
        raise SystemExit(f"--speeds {a.speeds}: the slowest machine is the unit (speed 1)")
    return speeds


def unit_flops(run: Path) -> float:
    """U: S steps of batch B of the experts' architecture, training FLOPs."""
    from flowfleet.config import load_run_config
    from flowfleet.models.flops import train_flops_per_sample
    from flowfleet.storage import RunRoot

    cfg = load_run_config(RunRoot(str(run)))
    return cfg.train.steps * cfg.train.batch_size * train_flops_per_sample(cfg.expert)


def check_floor(row: dict, src: Path, where: Path) -> None:
    """The row's test draws are the source's: the real floor's figures of each draw equal its evaluation's."""
    want = json.loads((src / "reports" / "evaluation.json").read_text())["draws"]["floor"]["classifier_fd"]
    if row["floor"]["classifier_fd"] != want[: len(row["floor"]["classifier_fd"])]:
        raise SystemExit(f"{where}: its test draws are not the source's (the real floor differs)")


STEPS_FREE = ("monolith", "diloco", "machines")  # run.yaml sections a row sets itself (with train.steps)


def recipe_of(run: Path) -> dict:
    """run.yaml without what a row sets itself: two runs of one source and one recipe but for their steps are equal."""
    raw = yaml.safe_load((run / "run.yaml").read_text())
    raw = {k: v for k, v in raw.items() if k not in STEPS_FREE}
    raw["train"] = {k: v for k, v in raw["train"].items() if k != "steps"}
    return raw


def reused(src: Path, name: str, seed: int, a: argparse.Namespace) -> dict | None:
    """A record of another table (--reuse) whose run is `name`, of `src`'s recipe, for this seed; None if none."""
    for other in filter(None, (a.reuse or "").split(",")):
        for rec in read_lines(Path(other)):
            if rec["seed"] == seed and Path(rec["run"]).name == name and "same_as" not in rec:
                if recipe_of(Path(rec["run"])) != recipe_of(src):
                    raise SystemExit(f"--reuse {other}: {rec['run']} is not of {src}'s recipe")
                return rec
    return None


def train_monolith_row(src: Path, run: Path, steps: int) -> tuple[Path, float]:
    from flowfleet.stages.assemble import assemble
    from flowfleet.stages.train import train_monolith
    from flowfleet.train.loop import TrainOptions

    make_run(src, run, {"train": {"steps": steps}, "monolith": {"enabled": True, "match_compute": False}}, jobs=())
    t0 = time.perf_counter()
    status = train_monolith(str(run), options=TrainOptions(progress=False, tensorboard=False))
    if status.step != steps:
        raise SystemExit(f"{run}: the monolith stopped at step {status.step} of {steps}")
    return Path(assemble(str(run), monolith=True, progress=False).out), time.perf_counter() - t0


def train_diloco_row(src: Path, run: Path, workers: int, h: int, pace: list[int] | None, steps: int) -> Path:
    from flowfleet.stages.assemble import assemble
    from flowfleet.stages.train import train_all

    diloco = {"workers": workers, "sync_every": h, "steps": steps, "pace": pace}
    # train-all trains the fleet's jobs too: the source's finished experts and router are copied so it skips them
    make_run(src, run, {"monolith": {"enabled": False}, "diloco": diloco}, jobs=("experts", "router"))
    outcome = train_all(str(run), parallel=workers, progress=False)
    if not outcome.ok:
        raise SystemExit(f"{run}: train-all: {outcome.results}")
    return Path(assemble(str(run), diloco=True, progress=False).out)


def train_fleet_row(src: Path, run: Path, speeds: list[int], a: argparse.Namespace) -> tuple[dict, dict]:
    """The fleet planned under the deadline on machines of `speeds`; -> (its plan, its top-2 scores)."""
    from flowfleet.stages.assemble import assemble
    from flowfleet.stages.plan import plan_fleet
    from flowfleet.stages.train import train_all
    from flowfleet.train.plan import TERA

    machines = {f"m{i}-x{s}": {"tflops": float(s)} for i, s in enumerate(speeds)}
    make_run(src, run, {"monolith": {"enabled": False}, "machines": machines}, jobs=("router",))  # experts: planned
    # the speed-1 machine does U by the deadline; the router apart, after one expert, or in the plan (--router planned)
    plan = plan_fleet(str(run), deadline_s=unit_flops(run) / TERA, router=a.router == "planned")
    outcome = train_all(str(run), parallel=a.parallel, progress=False)
    if not outcome.ok:
        raise SystemExit(f"{run}: train-all: {outcome.results}")
    assemble(str(run), progress=False)
    rec = score_fleet(run, ("top2",), a.cfg, a.n, monolith=False, repeats=a.repeats, min_accuracy=min_accuracy(run))
    planned = {
        j: {"machine": p.machine, "steps": p.steps, "batch": p.batch, "flops": p.flops}
        for j, p in plan.jobs.items()
        if j != "router"
    }
    return planned, {"cfg": rec["top2"]["cfg"], **rec["draws"]["runs"]["top2"], "floor": rec["draws"]["floor"]}


def router_flops(run: Path) -> float:
    from flowfleet.config import load_run_config
    from flowfleet.storage import RunRoot
    from flowfleet.train.specs import job_cost, router_spec

    cfg = load_run_config(RunRoot(str(run)))
    return float(job_cost(cfg, router_spec(cfg)))


def run_seed(src: Path, a: argparse.Namespace, rows: list[str]) -> None:
    speeds = speeds_of(a)
    k, s = len(speeds), yaml.safe_load((src / "run.yaml").read_text())["train"]["steps"]
    seed = yaml.safe_load((src / "run.yaml").read_text())["train"]["seed"]
    out = Path(a.out)
    u = unit_flops(src)
    done = {(r["row"], r["seed"]) for r in read_lines(out)}

    def keep(row: str, run: Path, scores: dict, work_units: float, **extra) -> None:
        check_floor(scores, src, run)
        rec = {"row": row, "seed": seed, "run": str(run), "commit": commit(), "speeds": speeds, "S": s}
        rec.update(work_units=work_units, scores=scores, **extra)
        keep_record(rec, out / "machines.jsonl")

    monoliths = {"fastest": max(speeds) * s, "sync": k * min(speeds) * s, "all": sum(speeds) * s}
    for row in ("fastest", "sync", "all"):
        if row not in rows or (row, seed) in done:
            continue
        same = next((r for r in ("fastest", "sync") if r != row and monoliths[r] == monoliths[row]), None)
        if same is not None and (twin := recorded(out, same, seed)) is not None:  # trained once
            keep(row, Path(twin["run"]), twin["scores"], twin["work_units"], same_as=same, params=twin["params"])
            continue
        run = out / f"monolith-{monoliths[row]}-seed{seed}"
        if (old := reused(src, run.name, seed, a)) is not None:
            keep(row, Path(old["run"]), old["scores"], monoliths[row] / s, params=old["params"], train_s=old["train_s"])
            continue
        model, train_s = train_monolith_row(src, run, monoliths[row])
        keep(row, run, score(model, run, a), monoliths[row] / s, params=param_count(model), train_s=train_s)
    equal = len(set(speeds)) == 1
    for row, pace in (("diloco", None), ("pace", speeds)):
        if row not in rows or (row, seed) in done:
            continue
        work = sum(pace) if pace else k * min(speeds)
        if equal and row == "pace" and (twin := recorded(out, "diloco", seed)) is not None:  # the same rounds
            keep(row, Path(twin["run"]), twin["scores"], work, traffic=twin["traffic"], H=a.H, same_as="diloco")
            continue
        run = out / f"diloco-H{a.H}-{'pace' if pace else 'wait'}-seed{seed}"
        if not pace and (old := reused(src, run.name, seed, a)) is not None:
            keep(row, Path(old["run"]), old["scores"], work, traffic=old["traffic"], H=a.H, params=old["params"])
            continue
        model = train_diloco_row(src, run, k, a.H, [p // min(speeds) for p in pace] if pace else None, min(speeds) * s)
        keep(row, run, score(model, run, a), work, traffic=traffic(run, k), H=a.H, params=param_count(model))
    if "fleet" in rows and ("fleet", seed) not in done:
        run = out / f"fleet-seed{seed}"
        planned, scores = train_fleet_row(src, run, speeds, a)
        work = sum(p["flops"] for p in planned.values()) / u
        keep("fleet", run, scores, work, plan=planned, router_units=router_flops(run) / u, router=a.router)


# --------------------------------------------------------------------------------------------------
#                                          The table
# --------------------------------------------------------------------------------------------------


def read_lines(out: Path) -> list[dict]:
    path = out / "machines.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def recorded(out: Path, row: str, seed: int) -> dict | None:
    """OUT's record of `row` for `seed`, if it has one."""
    return next((r for r in read_lines(out) if (r["row"], r["seed"]) == (row, seed)), None)


def moved(nbytes: float) -> str:
    return f"{nbytes / 2**20:,.0f} MiB" if nbytes else "0"


def unit_seconds(lines: list[dict], s: int) -> float:
    """T here: S steps at the median step time of a monolith the table trained (metrics.jsonl's step_s), the quickest
    monolith's (a shared box only slows a run)."""
    runs = {Path(line["run"]) for line in lines if line["row"] in ("fastest", "sync", "all")}
    medians = []
    for run in runs:
        logged = (run / "monolith" / "metrics.jsonl").read_text().splitlines()
        medians.append(statistics.median(json.loads(x)["step_s"] for x in logged if x.strip()))
    return s * min(medians)


def table(a: argparse.Namespace) -> str:
    lines = read_lines(Path(a.out))
    speeds = lines[0]["speeds"]
    k, total, s = len(speeds), sum(speeds), lines[0]["S"]
    equal = len(set(speeds)) == 1
    by_row: dict[str, dict[int, dict]] = {}
    for line in lines:
        by_row.setdefault(line["row"], {})[line["seed"]] = line
    seeds = sorted(by_row["all"])
    ref = [by_row["all"][x]["scores"]["classifier_fd"][: a.repeats] for x in seeds]
    params = by_row["all"][seeds[0]]["params"]
    deadline_s = unit_seconds(lines, s)
    labels = {
        "fastest": f"the fastest alone: a monolith of {max(speeds) * s} steps",
        "sync": f"full sync at the slowest's pace: {k} × {min(speeds) * s} steps",
        "diloco": f"DiLoCo, rounds wait for the slowest: {k} workers × {min(speeds) * s} steps, H = {a.H}",
        "pace": f"DiLoCo at each machine's pace: workers × {', '.join(str(x * s) for x in speeds)} steps",
        "fleet": f"the fleet, planned to the deadline: {k} experts (top-2)",
        "all": f"all the work, synchronous, batch shares by speed: a monolith of {total * s} steps",
    }
    if equal:  # the rows that coincide are shown once
        labels.update(
            fastest=f"one machine: a monolith of {s} steps",
            diloco=f"DiLoCo: {k} workers × {s} steps, H = {a.H}",
            fleet=f"the fleet, planned on {k} equal machines: {k} experts (top-2)",
            all=f"full sync: a monolith of {total * s} steps",
        )
    shown = [r for r in ROWS if not (equal and r in ("sync", "pace"))]
    out = [
        f"| option: {k} machines of speeds {' : '.join(map(str, speeds))}, one deadline T | seeds × draws | cfg | "
        "work (U) | utilisation | classifier FD | ÷ all the work | prompt accuracy | up / down per worker | "
        "wall: compute + traffic at 1 Gbit/s (T) | traffic takes T at |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in shown:
        mine = by_row.get(row, {})
        have = [x for x in seeds if x in mine]
        if not have:
            continue
        fd = [mine[x]["scores"]["classifier_fd"][: a.repeats] for x in have]
        acc = [mine[x]["scores"]["prompt_accuracy"][: a.repeats] for x in have]
        ratio = [[f / m for f, m in zip(fds, ref[seeds.index(x)])] for fds, x in zip(fd, have)]
        cfgs = "/".join(sorted({f"{mine[x]['scores']['cfg']:g}" for x in have}))
        work = statistics.fmean(mine[x]["work_units"] for x in have)
        work_text, compute, used = f"{work:.2f}", 1.0, work
        if row == "fleet":
            router = statistics.fmean(mine[x]["router_units"] for x in have)
            work_text += f" + router {router:.2f}"
            if mine[have[0]].get("router", "apart") == "apart":
                compute += router / max(speeds)  # the router after the fastest machine's expert
            else:  # planned: within the deadline, its machine's expert shorter
                labels["fleet"] += ", its router in the plan"
                used += router
        up = down = 0.0
        if row in ("diloco", "pace"):
            t = [mine[x]["traffic"] for x in have]
            up, down = (statistics.fmean(x[key] for x in t) for key in ("bytes_written", "bytes_read"))
        elif row in ("sync", "all"):
            up = down = ring_bytes(params, k, mine[have[0]]["work_units"] * s)
        link_s = max(up, down) / GBIT  # seconds at 1 Gbit/s
        break_even = f"{max(up, down) * 8 / deadline_s / 1e6:,.0f} Mbit/s" if up else "—"
        out.append(
            f"| {labels[row]} | {len(have)} × {a.repeats} | {cfgs} | {work_text} | {used / total:.2f} | "
            f"{spread(per_seed_means(fd))} | {'1' if row == 'all' else spread(per_seed_means(ratio), 3)} | "
            f"{spread(per_seed_means(acc), 3)} | {moved(up)} / {moved(down)} | "
            f"{compute:.2f} + {link_s / deadline_s:.2f} | {break_even} |"
        )
    out.append(
        f"\nU = {s} steps of batch 32 of the experts' architecture; |θ| = {params:,} parameters; T here (the deadline: "
        f"U on the slowest machine) = {deadline_s:.1f} s; 1 Gbit/s moves {GBIT / 2**20:.0f} MiB a second."
    )
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", required=True, help="fleet_budget.py seed runs, comma-separated (one per seed)")
    p.add_argument("--speeds", default="1,1,2,4", help="the machines' speeds, the slowest 1")
    p.add_argument("--rows", default=",".join(ROWS), help=f"which rows to train: {', '.join(ROWS)}")
    p.add_argument("--H", type=int, default=10, help="DiLoCo's inner steps a round (the slowest worker's)")
    p.add_argument("--n", type=int, default=300)
    p.add_argument("--cfg", default="4.5,8", help="the guidance sweep (the source's)")
    p.add_argument("--repeats", type=int, default=5, help="test draws at each model's chosen scale")
    p.add_argument("--parallel", type=int, default=2)
    p.add_argument(
        "--router",
        default="apart",
        choices=["apart", "planned"],
        help="the fleet's router trained after one expert, past the deadline (apart), or placed by the plan within it",
    )
    p.add_argument("--reuse", default="", help="other tables' OUT folders (comma-separated): their identical trainings")
    p.add_argument("--out", default="runs/bench/machines-emoji")
    p.add_argument("--table", action="store_true", help="print the table of OUT/machines.jsonl, train nothing")
    a = p.parse_args()
    Path(a.out).mkdir(parents=True, exist_ok=True)
    if a.table:
        print(table(a))
        return
    rows = a.rows.split(",")
    for src in a.source.split(","):
        run_seed(Path(src), a, rows)


if __name__ == "__main__":
    main()
