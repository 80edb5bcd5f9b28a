"""add-expert on MNIST: a fleet trained without the digits 8 and 9, then grown with them.

Trains the demo's fleet (its full plan: K = 2 caption clusters, 1000 steps per expert, 300 per router;
no monolith) on MNIST-5k without the digits 8 and 9, evaluates it, runs `add-expert` with the 8s and 9s
(one new expert), evaluates again, and prints per-digit prompt accuracy before and after, and whether
the old experts' files are byte-identical.

    .venv/bin/python benchmarks/add_expert.py --out runs/bench/add-89
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import time
from pathlib import Path

from fleet_runs import evaluate_model, without_8_and_9  # benchmarks/fleet_runs.py


def digests(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/bench/add-89")
    p.add_argument("--n", type=int, default=1000, help="samples per strategy")
    p.add_argument("--strategies", default="top1,full")
    p.add_argument("--judge-from", default=None, help="a run root whose reports/digit_classifier/ to reuse")
    a = p.parse_args()

    from flowfleet.cli import configure_logging
    from flowfleet.config import DataConfig, RunConfig, load_run_config
    from flowfleet.stages.add_expert import add_expert
    from flowfleet.stages.assemble import assemble
    from flowfleet.stages.cluster import cluster
    from flowfleet.stages.prepare import prepare
    from flowfleet.stages.train import train_all
    from flowfleet.storage import RunRoot

    configure_logging()
    out = Path(a.out)
    root = RunRoot(str(out))
    strategies = tuple(s for s in a.strategies.split(",") if s)
    timings: dict[str, float] = {}
    if not (out / "run.yaml").exists():
        RunConfig.from_dict(without_8_and_9("mnist-without-8-9")).save(root)
    if a.judge_from and not (out / "reports" / "digit_classifier").exists():
        shutil.copytree(Path(a.judge_from) / "reports" / "digit_classifier", out / "reports" / "digit_classifier")
    cfg = load_run_config(root)
    t0 = time.perf_counter()
    prepare(root, progress=False)
    if not root.exists("clusters", "report.json"):
        cluster(root, progress=False)
    outcome = train_all(root.url, progress=False)
    assert outcome.ok, outcome.results
    if not (out / "model" / "model_index.json").exists():
        assemble(root.url)
    timings["train_without_8_9_s"] = round(time.perf_counter() - t0, 1)
    old = {k: digests(out / "experts" / str(k)) for k in range(cfg.cluster.k)}
    before_file = out / "before.json"
    if not before_file.exists():
        before_file.write_text(json.dumps(evaluate_model(out / "model", out, a.n, strategies)))
    before = json.loads(before_file.read_text())

    added = DataConfig(**{**cfg.data.model_dump(), "labels": [8, 9]})
    t0 = time.perf_counter()
    result = add_expert(root.url, added, progress=False)
    timings["add_expert_s"] = round(time.perf_counter() - t0, 1)
    after = evaluate_model(out / "model", out, a.n, strategies)
    unchanged = all(digests(out / "experts" / str(k)) == old[k] for k in old)

    print(
        f"add-expert: experts {result.experts} on {result.items} items in {timings['add_expert_s']:.0f} s; "
        f"old experts byte-identical: {unchanged}"
    )
    rows = {
        "timings": timings,
        "new_experts": result.experts,
        "items": result.items,
        "old_experts_identical": unchanged,
        "strategies": {},
    }
    print(f"{'strategy':8} {'digit':>5} {'before':>7} {'after':>7} {'change':>7}")
    for s in strategies:
        per = {}
        for d in range(10):
            b = before[s]["per_class"].get(str(d))
            f = after[s]["per_class"].get(str(d))
            per[d] = {"before": b, "after": f}
            change = f"{f - b:+7.3f}" if b is not None and f is not None else "       "
            print(f"{s:8} {d:5d} {b if b is not None else float('nan'):7.3f} {f:7.3f} {change}")
        old_digits = [v for d, v in per.items() if d < 8]
        summary = {
            "new_digits_after": {d: per[d]["after"] for d in (8, 9)},
            "old_digits_largest_drop": round(max(v["before"] - v["after"] for v in old_digits), 4),
            "overall_before": before[s]["accuracy"],
            "overall_after": after[s]["accuracy"],
        }
        print(
            f"{s:8} digits 8, 9 after: {per[8]['after']:.3f}, {per[9]['after']:.3f}; digits 0-7: largest drop "
            f"{summary['old_digits_largest_drop']:+.3f}"
        )
        rows["strategies"][s] = {"per_digit": per, **summary}
    (out / "add_expert.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
