"""A lever for the fleet: branch the experts from a shared seed model (c-BTM's seed phase), at equal FLOPs.

c-BTM (Gururangan et al., 2023), the language-model twin of DDM and Paris (cluster the data, train one
expert per cluster in isolation, route at inference), starts every expert from one seed model trained
briefly on all the data. The seed is one job before the experts; after it nothing passes between them.
Here: the seed is the expert architecture trained S steps on all of data/ (the monolith's own job, with
match_compute off), every expert then trains (K x B - S) / K steps from its EMA weights on its cluster, so
seed + experts + router cost exactly the fleet's B steps per expert from scratch, and the monolith is the
run's own compute-matched one (copied: its FLOPs are the same), evaluated again beside top-2.

    HF_HUB_OFFLINE=1 python benchmarks/probes/seed_branch.py --run runs/demo --seed-steps 2000 --out runs/bench/seed
    HF_HUB_OFFLINE=1 python benchmarks/probes/seed_branch.py --run runs/demo --seed-steps 4000 --out runs/bench/seed \
        --trunk-from runs/bench/seed/seed4000/seed --set cluster.features=latent --tag latent --strategies top1,top2

--set cluster.KEY=VALUE clusters the experts' copy afresh (the trunk, trained on all data, does not depend on
it); --trunk-from reuses the seed run of an earlier S instead of training it again.

Prints and appends one JSON line per S to OUT/seed.jsonl.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the helpers the probes share
from fleet_budget import copy_prepared  # noqa: E402
from fleet_runs import keep_record, recluster, score_fleet  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", default="runs/demo", help="a prepared, clustered and trained run (the demo's)")
    p.add_argument("--seed-steps", default="2000", help="steps of the seed model on all data (comma list)")
    p.add_argument("--budget", type=int, default=None, help="steps per expert from scratch (default: the run's)")
    p.add_argument("--n", type=int, default=300)
    p.add_argument("--cfg", default="1.5,2,3,3.5,4.5")
    p.add_argument("--parallel", type=int, default=2)
    p.add_argument("--strategies", default="top2")
    p.add_argument("--set", action="append", default=[], help="run.yaml KEY=VALUE for the experts (repeatable)")
    p.add_argument("--out", default="runs/bench/seed")
    p.add_argument("--trunk-from", default=None, help="an earlier seed run (OUT/seedS/seed) of the same S")
    p.add_argument("--tag", default="", help="suffix of each run's folder name (a lever's runs)")
    a = p.parse_args()

    from flowfleet.config import load_run_config
    from flowfleet.layout import FINAL, MONOLITH
    from flowfleet.stages.assemble import assemble
    from flowfleet.stages.train import train_all, train_monolith
    from flowfleet.storage import RunRoot
    from flowfleet.train.loop import TrainOptions

    src, out = Path(a.run), Path(a.out)
    cfg = load_run_config(RunRoot(str(src)))
    budget, k = a.budget or cfg.train.steps, cfg.cluster.k
    for seed_steps in (int(s) for s in a.seed_steps.split(",")):
        expert_steps = (k * budget - seed_steps) // k
        base = out / f"seed{seed_steps}{a.tag}"
        # 1. the seed: the expert architecture on all data, S steps
        seed_run = Path(a.trunk_from) if a.trunk_from else base / "seed"
        copy_prepared(src, seed_run, seed_steps, 0, ["monolith.match_compute=false"])
        t0 = time.perf_counter()
        status = train_monolith(str(seed_run), options=TrainOptions(progress=False, tensorboard=False))
        seed_s = time.perf_counter() - t0
        if status.total_steps != seed_steps:
            raise SystemExit(f"{seed_run}: a seed of {status.total_steps} steps, not {seed_steps}")
        # 2. the experts from the seed, (K B - S) / K steps each, and the router; the run's monolith copied
        fleet = base / "fleet"
        init = (seed_run / MONOLITH / FINAL).resolve()
        fresh = not (fleet / "run.yaml").exists()
        copy_prepared(src, fleet, expert_steps, 0, [f"expert_init={init}", *a.set])
        if fresh:  # the experts' clusters made afresh when a --set changes them
            recluster(fleet, a.set)
        if not (fleet / MONOLITH).exists():
            shutil.copytree(src / MONOLITH, fleet / MONOLITH)
        t0 = time.perf_counter()
        train_all(str(fleet), parallel=a.parallel, progress=False)
        fleet_s = time.perf_counter() - t0
        assemble(str(fleet), progress=False)
        rec = {"seed_steps": seed_steps, "expert_steps": expert_steps, "seed_s": round(seed_s, 1)}
        rec.update(fleet_s=round(fleet_s, 1), sets=a.set)
        rec.update(score_fleet(fleet, tuple(a.strategies.split(",")), a.cfg, a.n))
        keep_record(rec, out / "seed.jsonl")


if __name__ == "__main__":
    main()
