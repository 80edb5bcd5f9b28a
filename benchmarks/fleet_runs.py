"""Helpers of the fleet-change benchmarks (remove_expert.py, add_expert.py, distill.py): copy a finished
run, evaluate one model folder of it by the MNIST digit judge."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

# What a fleet change needs of a finished run (no checkpoints, no monolith): the judge is reused.
RUN_PARTS = ("run.yaml", "data", "clusters", "partitions", "experts", "router", "model", "reports/digit_classifier")


def copy_run(src: Path, out: Path) -> None:
    """The parts of `src` a fleet change reads, into `out` (once: an existing copy is kept)."""
    if (out / "run.yaml").exists():
        return
    for name in RUN_PARTS:
        if (src / name).is_dir():
            shutil.copytree(src / name, out / name, ignore=shutil.ignore_patterns("checkpoints"))
        elif (src / name).exists():
            out.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src / name, out / name)


def evaluate_model(model: Path, run: Path, n: int, strategies: tuple[str, ...], steps: int | None = None) -> dict:
    """`flowfleet evaluate` of one model folder (FID at 75 px, no diagnostics): per strategy, the judge's
    scores (accuracy, per_class, ...) with the run's classifier FD, FID, sampling seconds and settings."""
    from flowfleet.evaluate.fid import FIDSettings
    from flowfleet.stages.evaluate import EvaluateOptions, evaluate

    options = EvaluateOptions(
        n=n,
        strategies=strategies,
        monolith=False,
        diagnostics=False,
        steps=steps,
        fid=FIDSettings(resize=75),
        device="cpu",
    )
    result = evaluate(str(model), str(run), options)
    out: dict[str, Any] = {}
    for name in strategies:
        r = result["runs"][name]
        out[name] = {
            **result["prompt_accuracy"]["scores"][name],
            "classifier_fd": r["classifier_fd"],
            "fid": r["fid"],
            "sampling_s": r["sampling_s"],
            "cfg": result["sampling"]["cfg"],
            "steps": result["sampling"]["steps"],
        }
    return out
