"""When does a fleet pay? K = 4 isolated machines, each able to do S steps of batch B in the same wall-clock, and the
options a user has with them, trained on the same prepared data and judged on the same draws:

    one machine   a monolith of S steps (K - 1 machines idle)                      OUT/one-seedS
    the fleet     K experts and the router, from a mixture_claim.py run: DDM's recipe (its batch run, top-2 over the
                  mixture, the presets' default) and Paris' (its steps run, top-2 under the prompt-blind router)
    DiLoCo H      K workers of S steps on a random 1/K of the data each, a round every H steps (run.yaml diloco),
                  exchanging only through the run root                              OUT/diloco-H<h>-seedS
    full sync     the compute-matched monolith of K x S steps (the mixture_claim run's): what DDP over a fast
                  network would give

The new rows copy a mixture_claim seed's prepared parts (data/, eval/, autoencoder/, clusters/, partitions/, the
judge) and its finished fleet jobs (so that `train-all` trains only the monolith of S steps, or only DiLoCo's
workers), are assembled and scored by `flowfleet evaluate` over the same guidance sweep and --repeats draws as the
fleet's rows (checked: the real floor's figures of each draw equal the mixture_claim record's).

Bytes per worker, both directions: DiLoCo's are counted by its workers (status.json: its pseudo-gradients written, up;
the others' read, down: K - 1 of them a round); full sync's are a ring all-reduce of the fp32 gradients at every step,
2 (K - 1) / K x 4 |θ| bytes sent and as many received per worker and step (computed, not run); the fleet and one
machine exchange nothing. Their time at 1 and 100 Gbit/s is the larger direction's bytes x 8 / the rate (a full-duplex
link; no latency).

    python benchmarks/decision.py --source runs/bench/mixture --seeds 0 --H 10,100,1000 --out runs/bench/decision-emoji
    python benchmarks/decision.py --source runs/bench/mixture --seeds 1,2 --H 100 --out runs/bench/decision-emoji
    python benchmarks/decision.py --source runs/bench/mixture --out runs/bench/decision-emoji --table

One JSON line per trained row in OUT/decision.jsonl; --table prints the Markdown table from it and the source's
claim.jsonl (mean ± sd over seeds of each seed's mean over its draws; one seed: over its draws).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import time
from pathlib import Path

import yaml
from fleet_budget import min_accuracy  # benchmarks/ is the script's folder
from fleet_runs import judge_options, keep_record
from mixture_claim import per_seed_means, spread

PARTS = ("data", "eval", "autoencoder", "clusters", "partitions", "reports/digit_classifier")
FLEET_JOBS = ("experts", "router", "router-paris")  # finished: train-all leaves them be
NOT_COPIED = shutil.ignore_patterns("checkpoints", "samples", "tb")
GBIT = 1e9 / 8  # bytes per second of 1 Gbit/s
OUTER = {"outer_lr": 0.7, "outer_momentum": 0.9}  # DiLoCo's outer Nesterov step (run.yaml diloco's defaults)
FLEET_ROWS = {  # the fleet's rows of a mixture_claim seed: (its run, its row)
    "fleet, DDM's recipe": ("batch", "top2.mixture"),
    "fleet, Paris' recipe": ("steps", "top2.mixture+router-paris"),
}


def commit() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()


def make_run(src: Path, run: Path, changes: dict, jobs: tuple[str, ...] = FLEET_JOBS) -> None:
    """`src`'s prepared parts and finished `jobs` into `run`, its run.yaml with `changes` (section -> keys)."""
    if (run / "run.yaml").exists():
        return
    run.mkdir(parents=True)
    for name in (*PARTS, *jobs):
        if (src / name).is_dir():
            shutil.copytree(src / name, run / name, ignore=NOT_COPIED)
    raw = yaml.safe_load((src / "run.yaml").read_text())
    for section, keys in changes.items():
        raw[section] = keys if keys is None or not isinstance(raw.get(section), dict) else {**raw[section], **keys}
    (run / "run.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))


def score(model: Path, run: Path, a: argparse.Namespace) -> dict:
    """`flowfleet evaluate` of one single-model folder: its chosen scale and every draw's judged figures."""
    from flowfleet.stages.evaluate import evaluate

    options = judge_options(
        a.n,
        ("top1",),
        batch_size=a.n,
        monolith=False,
        guidance_sweep=tuple(float(c) for c in a.cfg.split(",")),
        repeats=a.repeats,
        min_accuracy=min_accuracy(run),
    )
    result = evaluate(str(model), str(run), options)
    return {"cfg": result["runs"]["top1"]["cfg"], **result["draws"]["runs"]["top1"], "floor": result["draws"]["floor"]}


def check_draws(row: dict, claim: dict, where: Path) -> None:
    """The new row's draws are the fleet's: the real floor's figures of each equal the source record's."""
    n = len(row["floor"]["classifier_fd"])
    if row["floor"]["classifier_fd"] != claim["floor"]["classifier_fd"][:n]:
        raise SystemExit(f"{where}: its evaluation draws are not the source's (the real floor differs)")


def traffic(run: Path, workers: int) -> dict:
    """DiLoCo's counted bytes (mean per worker) and rounds, from its workers' status.json."""
    from flowfleet.layout import diloco_worker
    from flowfleet.storage import RunRoot
    from flowfleet.train.status import read_status

    reports = [read_status(RunRoot(str(run)), diloco_worker(w)).diloco for w in range(workers)]
    return {
        "bytes_written": statistics.fmean(r["bytes_written"] for r in reports),
        "bytes_read": statistics.fmean(r["bytes_read"] for r in reports),
        "rounds": reports[0]["rounds"],
        "short_rounds": sorted({s["round"] for r in reports for s in r["short_rounds"]}),
    }


def train_row(a: argparse.Namespace, seed: int, h: int | None, claims: dict) -> None:
    """Train, assemble and score one new row of one seed (a finished run's training is skipped by train-all)."""
    from flowfleet.stages.assemble import assemble
    from flowfleet.stages.train import train_all

    src = Path(a.source) / f"batch-seed{seed}"
    outer = {"outer_lr": a.outer_lr, "outer_momentum": a.outer_momentum}
    tag = "" if outer == OUTER else f"-lr{a.outer_lr:g}-m{a.outer_momentum:g}"
    run = Path(a.out) / (f"one-seed{seed}" if h is None else f"diloco-H{h}{tag}-seed{seed}")
    if h is None:  # the monolith alone, at an expert's S steps: one machine's budget
        make_run(src, run, {"monolith": {"enabled": True, "match_compute": False}})
    else:
        diloco = {"workers": a.workers, "sync_every": h, **outer}
        make_run(src, run, {"monolith": {"enabled": False}, "diloco": diloco})
    t0 = time.perf_counter()
    outcome = train_all(str(run), parallel=a.parallel, progress=False)
    if not outcome.ok:
        raise SystemExit(f"{run}: train-all: {outcome.results}")
    train_s = time.perf_counter() - t0
    model = Path(assemble(str(run), monolith=h is None, diloco=h is not None, progress=False).out)
    row = score(model, run, a)
    check_draws(row, claims[("batch", seed)], run)
    rec = {
        "row": "one machine" if h is None else "DiLoCo",
        "H": h,
        "seed": seed,
        "run": str(run),
        "commit": commit(),
        "train_all_s": round(train_s, 1),
        "params": param_count(model),
        "scores": row,
    }
    if h is not None:
        rec.update(traffic=traffic(run, a.workers), outer=outer)
    keep_record(rec, Path(a.out) / "decision.jsonl")


def ring_bytes(params: int, workers: int, steps: float) -> float:
    """Bytes each worker sends (and as many it receives) in a ring all-reduce of fp32 gradients at every step."""
    return 2 * (workers - 1) / workers * 4 * params * steps


def param_count(model: Path) -> int:
    """|θ| of a single-model folder's one expert."""
    from safetensors import safe_open

    with safe_open(str(model / "expert_0" / "diffusion_pytorch_model.safetensors"), "pt") as f:
        return sum(f.get_tensor(k).numel() for k in f.keys())


# --------------------------------------------------------------------------------------------------
#                                          The table
# --------------------------------------------------------------------------------------------------


def read_claims(source: Path) -> dict:
    """mixture_claim.py's untagged records by (matching, seed)."""
    lines = [json.loads(x) for x in (source / "claim.jsonl").read_text().splitlines() if x.strip()]
    return {(r["matching"], r["seed"]): r for r in lines if not r.get("tag")}


def seconds(nbytes: float, gbit: float) -> str:
    t = nbytes / (gbit * GBIT)
    return f"{t:.3g} s" if t < 100 else f"{t / 60:.3g} min"


def row_line(
    label: str,
    per_seed: list[dict],
    repeats: int,
    monoliths: list[list[float]],
    traffic: tuple[float, float] | None,
    ref: bool = False,
) -> str:
    """One Markdown row from per-seed scores (the first `repeats` draws of each), ratios to the full-sync monolith
    draw by draw."""
    fd = [r["classifier_fd"][:repeats] for r in per_seed]
    acc = [r["prompt_accuracy"][:repeats] for r in per_seed]
    ratio = [[x / m for x, m in zip(f, mono)] for f, mono in zip(fd, monoliths)]
    cfgs = "/".join(sorted({f"{r['cfg']:g}" for r in per_seed}))
    up, down = traffic or (0.0, 0.0)
    longer = max(up, down)
    traffic_cols = (
        "0 / 0 | — | —"
        if not longer
        else f"{up / 2**20:,.0f} / {down / 2**20:,.0f} MiB | {seconds(longer, 1)} | {seconds(longer, 100)}"
    )
    return (
        f"| {label} | {len(per_seed)} × {repeats} | {cfgs} | {spread(per_seed_means(fd))} | "
        f"{'1' if ref else spread(per_seed_means(ratio), 3)} | {spread(per_seed_means(acc), 3)} | {traffic_cols} |"
    )


def outer_of(line: dict) -> tuple[float, float]:
    outer = line.get("outer") or OUTER
    return (outer["outer_lr"], outer["outer_momentum"])


def table(a: argparse.Namespace) -> str:
    claims = read_claims(Path(a.source))
    lines = [json.loads(x) for x in (Path(a.out) / "decision.jsonl").read_text().splitlines() if x.strip()]
    seeds = sorted({line["seed"] for line in lines if line["row"] == "one machine"})
    monolith = {s: claims[("batch", s)]["rows"]["monolith"] for s in seeds}
    mono = [monolith[s]["classifier_fd"][: a.repeats] for s in seeds]
    params = lines[0]["params"]
    steps = yaml.safe_load((Path(a.source) / "batch-seed0" / "run.yaml").read_text())["train"]["steps"]
    k = a.workers
    out = [
        "| option (K = 4 machines) | seeds × draws | cfg | classifier FD | ÷ full sync | prompt accuracy | "
        "up / down per worker | at 1 Gbit/s | at 100 Gbit/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    one = {line["seed"]: line["scores"] for line in lines if line["row"] == "one machine"}
    out.append(
        row_line(f"one machine: a monolith of S = {steps} steps", [one[s] for s in seeds], a.repeats, mono, None)
    )
    for label, (matching, name) in FLEET_ROWS.items():
        rows = [claims[(matching, s)]["rows"][name] for s in seeds]
        out.append(row_line(f"{label}: {k} experts and the router", rows, a.repeats, mono, None))
    variants = sorted({(line["H"], outer_of(line)) for line in lines if line["row"] == "DiLoCo"})
    for h, outer in sorted(variants, key=lambda v: (v[1] != tuple(OUTER.values()), v[0])):
        mine = {
            line["seed"]: line
            for line in lines
            if line["row"] == "DiLoCo" and (line["H"], outer_of(line)) == (h, outer)
        }
        have = [s for s in seeds if s in mine]
        both = (
            statistics.fmean(mine[s]["traffic"]["bytes_written"] for s in have),
            statistics.fmean(mine[s]["traffic"]["bytes_read"] for s in have),
        )
        label = f"DiLoCo, H = {h}: {k} workers of S steps ({mine[have[0]]['traffic']['rounds']} rounds)"
        if outer != tuple(OUTER.values()):
            label += f", outer lr {outer[0]:g}, momentum {outer[1]:g}"
        out.append(
            row_line(label, [mine[s]["scores"] for s in have], a.repeats, [mono[seeds.index(s)] for s in have], both)
        )
    sync_steps = json.loads((Path(a.source) / "batch-seed0" / "monolith" / "status.json").read_text())["step"]
    ring = ring_bytes(params, k, sync_steps)
    out.append(
        row_line(
            f"full sync: the monolith of the fleet's FLOPs ({sync_steps} steps)",
            list(monolith.values()),
            a.repeats,
            mono,
            (ring, ring),
            ref=True,
        )
    )
    floor = [claims[("batch", s)]["floor"]["classifier_fd"][: a.repeats] for s in seeds]
    floor_fd = f"{statistics.fmean(floor[0]):.2f} (the same draws in every seed)"
    out.append(f"| real held-out images (the floor) | {len(seeds)} × {a.repeats} | | {floor_fd} | | | | | |")
    out.append(f"\n|θ| = {params:,} parameters ({4 * params / 2**20:.2f} MiB in fp32).")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", default="runs/bench/mixture", help="mixture_claim.py's output: its runs and claim.jsonl")
    p.add_argument("--seeds", default="0", help="training seeds (those of the source's runs)")
    p.add_argument("--H", default="10,100,1000", help="DiLoCo's rounds: inner steps per round")
    p.add_argument("--rows", default="one,diloco", help="one (one machine), diloco")
    p.add_argument("--workers", type=int, default=4, help="K: machines, the fleet's experts")
    p.add_argument("--outer-lr", type=float, default=OUTER["outer_lr"], help="DiLoCo's outer learning rate")
    p.add_argument("--outer-momentum", type=float, default=OUTER["outer_momentum"], help="its Nesterov momentum")
    p.add_argument("--n", type=int, default=300)
    p.add_argument("--cfg", default="4.5,8", help="the guidance sweep (the source's: the digits' 1.25,1.5,2,3,4.5)")
    p.add_argument("--repeats", type=int, default=3, help="evaluation draws at the chosen scale")
    p.add_argument("--parallel", type=int, default=2)
    p.add_argument("--out", default="runs/bench/decision-emoji")
    p.add_argument("--table", action="store_true", help="print the table of OUT/decision.jsonl, train nothing")
    a = p.parse_args()
    Path(a.out).mkdir(parents=True, exist_ok=True)
    if a.table:
        print(table(a))
        return
    claims = read_claims(Path(a.source))
    rows = a.rows.split(",")
    for seed in (int(s) for s in a.seeds.split(",")):
        if "one" in rows:
            train_row(a, seed, None, claims)
        if "diloco" in rows:
            for h in (int(x) for x in a.H.split(",")):
                train_row(a, seed, h, claims)


if __name__ == "__main__":
    main()
