"""Helpers of the fleet benchmarks (remove_expert.py, add_expert.py, distill.py, fleet_budget.py,
data_scaling.py, eval_seeds.py): copy a finished run, evaluate a model folder of it by the run's judge, keep a
result line, set a copied run.yaml's budget, seed and --set levers."""

from __future__ import annotations

import json
import shutil
import statistics
from pathlib import Path
from typing import Any

from flowfleet.config import set_dotted  # (the benchmarks' --set: one rule with `flowfleet init --set`)

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


def without_8_and_9(name: str) -> dict[str, Any]:
    """run.yaml of the demo's full plan (K = 4 clusters of image features, 3000 steps per expert shared by size,
    4000 router steps) on the built-in digits without 8 and 9, with no monolith and no comparison router: the fleet
    new digits join."""
    from flowfleet.stages.demo import demo_plan

    raw = demo_plan("full").config.to_dict()
    raw["name"] = name
    raw["data"]["labels"] = list(range(8))
    raw["monolith"]["enabled"] = False
    raw["router_baseline"] = False
    return raw


def set_budget(raw: dict, steps: int, seed: int, sets: list[str] = ()) -> None:
    """A copied run.yaml's train.steps = steps (checkpoints, samples, logs and warm-up scaled to them), the
    training seed of every job (experts, monolith, router) = seed, then each --set (set_dotted)."""
    raw["train"].update(steps=steps, ckpt_every=max(steps // 2, 1), sample_every=steps, log_every=max(steps // 40, 1))
    raw["train"]["warmup_steps"] = min(raw["train"].get("warmup_steps", 0), steps // 3)
    raw["train"]["seed"] = raw["router_train"]["seed"] = seed
    for assignment in sets:
        set_dotted(raw, assignment)


def recluster(run: Path, sets: list[str]) -> None:
    """Cluster a fresh copy of a run again when a --set changed a cluster.* setting (its copied clusters/ and
    partitions/ are the source run's), or when its partitions predate the counts train.expert_steps by_size
    reads (the same seed clusters them identically)."""
    from flowfleet.stages.cluster import cluster

    manifest = json.loads((run / "partitions" / "0" / "manifest.json").read_text())
    if any(s.startswith("cluster.") for s in sets) or "partition_counts" not in manifest:
        shutil.rmtree(run / "clusters")
        shutil.rmtree(run / "partitions")
        cluster(str(run), progress=False)


def judge_options(n: int, strategies: tuple[str, ...], **options: Any) -> Any:
    """The benchmarks' `flowfleet evaluate` options: n samples per model, FID at 75 px, no diagnostics, CPU."""
    from flowfleet.evaluate.fid import FIDSettings
    from flowfleet.stages.evaluate import EvaluateOptions

    return EvaluateOptions(
        n=n, strategies=strategies, diagnostics=False, fid=FIDSettings(resize=75), device="cpu", **options
    )


def evaluate_model(
    model: Path, run: Path, n: int, strategies: tuple[str, ...], steps: int | None = None, repeats: int = 1
) -> dict:
    """`flowfleet evaluate` of one model folder (FID at 75 px, no diagnostics): per strategy, the judge's
    scores (accuracy, per_class, ...) with the run's classifier FD, FID, sampling seconds and settings; with
    repeats > 1 also "draws": the judge's figures of every draw (seeds 0 .. repeats - 1) and the real floor's."""
    from flowfleet.stages.evaluate import evaluate

    options = judge_options(n, strategies, monolith=False, sampling=dict(steps=steps), repeats=repeats)
    result = evaluate(str(model), str(run), options)
    out: dict[str, Any] = {}
    for name in strategies:
        r = result["runs"][name]
        out[name] = {
            **result["prompt_accuracy"]["scores"][name],
            "classifier_fd": r["classifier_fd"],
            "fid": r["fid"],
            "sampling_s": r["sampling_s"],
            "cfg": result["sampling"]["guidance_scale"],
            "steps": result["sampling"]["steps"],
            "floor": result["reference_split"]["floor"],
        }
        if result.get("draws"):
            out[name]["draws"] = {**result["draws"]["runs"][name], "floor": result["draws"]["floor"]}
    return out


def score_fleet(
    run: Path,
    strategies: tuple[str, ...],
    cfg: str,
    n: int,
    monolith: bool = True,
    routers: tuple[str, ...] = (),
    repeats: int = 1,
    min_accuracy: float = 0.95,
) -> dict:
    """`flowfleet evaluate` of run/model against run (held-out reference, the run's judge: the digits' or the
    emoji's) over the guidance sweep `cfg` ("1.5,2,..."), each model at its chosen scale (the lowest classifier FD
    among the scales reaching min_accuracy): {"floor": ..., model: its scores}. `routers`: the run's comparison
    routers (router-prompt), each strategy again as "<strategy>+<router>"."""
    from flowfleet.stages.evaluate import evaluate

    sweep = tuple(float(c) for c in cfg.split(","))
    options = judge_options(
        n,
        strategies,
        batch_size=n,
        monolith=monolith,
        guidance_sweep=sweep,
        routers=routers,
        repeats=repeats,
        min_accuracy=min_accuracy,
    )
    result = evaluate(str(run / "model"), str(run), options)
    rec: dict = {"floor": result["reference_split"]}
    rows = (*strategies, *(f"{s}+{r}" for r in routers for s in strategies), *(["monolith"] if monolith else []))
    for name in rows:
        r = result["runs"][name]
        keys = ("cfg", "classifier_fd", "precision", "recall", "fid", "subcategory_accuracy", "sweep", "chosen_on")
        rec[name] = {k: r.get(k) for k in keys}
        rec[name]["accuracy"] = result["prompt_accuracy"]["scores"][name]["accuracy"]
    if result.get("draws"):  # repeats > 1: every draw's scores at the chosen scales
        rec["draws"] = result["draws"]
    return rec


def chosen_fd(rec: dict, model: str) -> float:
    """A score_fleet record's classifier FD of `model` at its chosen scale: the mean over its evaluation draws
    when it has several (--repeats), else the sweep's draw."""
    draws = (rec.get("draws") or {}).get("runs", {}).get(model)
    return statistics.fmean(draws["classifier_fd"]) if draws else rec[model]["classifier_fd"]


def floor_fd(rec: dict) -> float:
    """The real floor's classifier FD of a score_fleet record (the mean over its draws when it has several)."""
    draws = (rec.get("draws") or {}).get("floor")
    return statistics.fmean(draws["classifier_fd"]) if draws else rec["floor"]["floor"]["classifier_fd"]


def keep_record(rec: dict, path: Path) -> None:
    """Print one result as a JSON line and append it to path."""
    print(json.dumps(rec), flush=True)
    with open(path, "a") as fh:
        fh.write(json.dumps(rec) + "\n")
