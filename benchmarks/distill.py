"""distill on a finished MNIST run: the student next to its top-2 teacher, at 20 and at 4 steps.

Copies a finished demo run (data, clusters, experts, router, model/) to OUT, distils a student the size
of one expert from the fleet's top-2 (guided with the run's CFG), and evaluates with the same prompts,
noise and judge: the teacher (top-2, CFG 6) at 20 steps, the student (no guidance) at 20 and at 4 steps,
and the teacher at 4 steps. Sampling seconds come from evaluate's own timings on this machine.

    .venv/bin/python benchmarks/distill.py runs/demo-fresh-987c745 --out runs/bench/distill --steps 1000
    .venv/bin/python benchmarks/distill.py runs/demo-fresh-987c745 --out runs/bench/reflow --steps 1000 --method reflow
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
    p.add_argument("--out", default="runs/bench/distill")
    p.add_argument("--steps", type=int, default=1000, help="student training steps")
    p.add_argument("--n", type=int, default=1000, help="samples per evaluation")
    p.add_argument("--method", choices=("velocity", "reflow"), default="velocity")
    p.add_argument("--pairs", type=int, default=2000, help="reflow: teacher trajectories")
    a = p.parse_args()

    from flowfleet.cli import configure_logging
    from flowfleet.stages.distill import distill

    configure_logging()
    out = Path(a.out)
    copy_run(Path(a.run), out)
    t0 = time.perf_counter()
    result = distill(str(out), teacher="top2", steps=a.steps, method=a.method, pairs=a.pairs, progress=False)
    train_s = time.perf_counter() - t0
    rows: dict = {"student_train_s": round(train_s, 1), "student_steps": a.steps, "method": a.method}
    for name, model, strategy, steps in (
        ("teacher top2, 20 steps", out / "model", "top2", 20),
        ("student, 20 steps", Path(result.model), "top1", 20),
        ("student, 4 steps", Path(result.model), "top1", 4),
        ("teacher top2, 4 steps", out / "model", "top2", 4),
    ):
        r = rows[name] = evaluate_model(model, out, a.n, (strategy,), steps)[strategy]
        print(
            f"{name:24} prompt accuracy {r['accuracy']:.3f}  classifier FD {r['classifier_fd']:7.2f}  "
            f"FID {r['fid']:7.2f}  sampling {r['sampling_s']:6.1f} s  (cfg {r['cfg']})",
            flush=True,
        )
    (out / "distill.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
