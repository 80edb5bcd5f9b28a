"""What the sampler alone changes: trained runs (fleet_budget.py's, or a demo's) scored again under other sampling
settings, nothing retrained. Each run is copied (its weights and prepared parts, not its checkpoints) into
OUT/<run>-<tag>/ and evaluated as fleet_budget.py does: top-2 and the monolith, each model's guidance scale chosen
by the sweep on the validation split (the demo's accuracy bar for the run's data), then --repeats draws on the test
split at the chosen scale. One JSON line per run appended to OUT/rescore.jsonl: each model's chosen scale, its
validation sweep, and the test draws' mean classifier FD and prompt accuracy.

    python benchmarks/sampling_rescore.py --runs runs/bench/demo-ae8/3000 --cfg 1.25,1.5,2,3,4.5 \
        --tag euler40 --sampling steps=40
    python benchmarks/sampling_rescore.py --runs runs/bench/emoji-ae8-2400/1500-ae8 --cfg 4.5,8 \
        --tag maxt1 --sampling guidance_max_t=1.0
"""

from __future__ import annotations

import argparse
import shutil
import statistics
from pathlib import Path

from fleet_budget import min_accuracy  # benchmarks/ is the script's folder
from fleet_runs import judge_options, keep_record


def rescore(run: Path, out: Path, cfg: str, sampling: dict, repeats: int, n: int) -> dict:
    """evaluate a copy of `run` under `sampling`: {model: chosen scale, validation sweep, test-draw means}."""
    from flowfleet.stages.evaluate import evaluate

    if not out.exists():  # the copy's reports/ are its own: the run's evaluation is left as it was
        shutil.copytree(run, out, ignore=shutil.ignore_patterns("checkpoints", "*.log"))
    sweep = tuple(float(c) for c in cfg.split(","))
    options = judge_options(
        n,
        ("top2",),
        batch_size=n,
        monolith=True,
        guidance_sweep=sweep,
        repeats=repeats,
        min_accuracy=min_accuracy(run),
        sampling=sampling,
    )
    result = evaluate(str(out / "model"), str(out), options)
    rec: dict = {
        "run": str(run),
        "sampling": sampling,
        "floor": statistics.fmean(result["draws"]["floor"]["classifier_fd"]),
    }
    for name in ("monolith", "top2"):
        draws, row = result["draws"]["runs"][name], result["runs"][name]
        rec[name] = {
            "cfg": row["cfg"],
            "validation_sweep": [
                {k: r.get(k) for k in ("cfg", "classifier_fd", "prompt_accuracy")} for r in row["sweep"]
            ],
            "classifier_fd": statistics.fmean(draws["classifier_fd"]),
            "prompt_accuracy": statistics.fmean(draws["prompt_accuracy"]),
        }
    return rec


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", required=True, help="comma-separated trained and assembled runs")
    p.add_argument("--cfg", required=True, help="the guidance sweep, e.g. 1.25,1.5,2,3,4.5")
    p.add_argument("--sampling", action="append", default=[], help="a sampling setting KEY=VALUE (repeatable)")
    p.add_argument("--tag", required=True, help="the settings' name: each copy's folder suffix")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--n", type=int, default=300)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="runs/bench/rescore")
    a = p.parse_args()

    import torch

    torch.set_num_threads(a.threads)
    from flowfleet.config import set_dotted

    sampling: dict = {}
    for item in a.sampling:
        set_dotted(sampling, item)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for run in (Path(r) for r in a.runs.split(",")):
        rec = rescore(run, out / f"{run.parent.name}-{run.name}-{a.tag}", a.cfg, sampling, a.repeats, a.n)
        keep_record({"tag": a.tag, **rec}, out / "rescore.jsonl")


if __name__ == "__main__":
    main()
