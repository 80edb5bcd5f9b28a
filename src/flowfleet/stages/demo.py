"""Stage `demo`: the whole system on the built-in MNIST-5k digits, ending in report.html.

    init -> prepare -> cluster (K = 2 clusters of the captions, five digits each) -> train-all (2 experts,
    the prompt-aware router, Paris' prompt-blind router for comparison, a compute-matched monolith)
    -> assemble (fleet and monolith) -> generate per strategy -> evaluate -> report

The configuration is the `mnist` preset (pixel space 28 x 28, captions "a handwritten digit seven",
the recipe measured in BENCHMARKS.md) with step counts sized for a 2-core CPU:

    default   all 5000 digits, 1000 steps per expert (the monolith 2000: the same training FLOPs as the
              two experts together), 300 steps per router; evaluation of 300 samples per model
              (target: make demo <= 20 min on a fresh clone, installation included)
    --quick   1000 digits, 300 steps per expert (monolith 600) at learning rate 4e-3 after 30 warm-up
              steps, 100 steps per router, 100 samples per model (target: <= 5 min)

Why K = 2: at equal compute an expert gets 1/K of the monolith's steps, and on this data a
prompt-conditioned DiT needs ~1000 steps (batch 64) before a digit classifier reads >= 0.9 of its
samples as prompted, whatever the number of digits it draws (BENCHMARKS.md, "The mnist recipe"). With
more experts the same 2-core budget leaves each too few steps.

Every model is judged by a digit classifier trained on MNIST-5k (prompt accuracy, classifier FD,
flowfleet.evaluate.digits) and by Inception FID. Inception runs on 75 x 75 inputs (MNIST's 28-pixel
digits gain nothing at 299, which costs ~16x more), for FID only: FIDs are comparable within the demo.
Because prepare's Inception features are then exactly the FID features, the reference statistics come
from data/ without a second Inception pass.

Running the demo again on the same --out resumes: finished stages are skipped by the stages themselves
(prepare returns a complete data/, train-all skips done jobs); a --out made with another
configuration is refused rather than mixed.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Literal

from flowfleet.config import RunConfig, load_run_config
from flowfleet.device import resolve_device
from flowfleet.errors import FlowfleetError
from flowfleet.evaluate.fid import FIDSettings
from flowfleet.evaluate.report import TIMINGS_FILE, write_report
from flowfleet.evaluate.views import captioned_grid_png
from flowfleet.flow import same_as_earlier
from flowfleet.layout import CLUSTER_REPORT, REPORTS, RUN_FILE, SHOWCASE
from flowfleet.presets import PRESETS
from flowfleet.stages.assemble import assemble
from flowfleet.stages.cluster import cluster
from flowfleet.stages.evaluate import EvaluateOptions, evaluate, print_table
from flowfleet.stages.generate import generate
from flowfleet.stages.prepare import prepare
from flowfleet.stages.train import train_all
from flowfleet.storage import RunRoot

DEMO_INCEPTION_SIZE = 75
STRATEGIES = ("top1", "top2", "full")

log = logging.getLogger(__name__)
SHOWCASE_PROMPTS = tuple(
    f"a handwritten digit {w}" for w in ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
)


@dataclass(frozen=True)
class DemoPlan:
    """The run configuration and the evaluation of one demo size."""

    config: RunConfig
    evaluation: EvaluateOptions
    showcase_n: int = 20


DemoSize = Literal["full", "quick", "smoke"]


def demo_plan(size: DemoSize = "full") -> DemoPlan:
    """full: `flowfleet demo`; quick: `flowfleet demo --quick`; smoke: the test suite's (mnist-tiny sized)."""
    if size not in ("full", "quick", "smoke"):
        raise ValueError(f"unknown demo size {size!r}")
    raw = PRESETS["mnist-tiny" if size == "smoke" else "mnist"]()
    raw["name"] = {"full": "demo", "quick": "demo-quick", "smoke": "demo-smoke"}[size]
    raw["encoders"]["semantic"]["image_size"] = DEMO_INCEPTION_SIZE
    raw["router_baseline"] = True  # report both routers' accuracy per t
    fid = FIDSettings(resize=DEMO_INCEPTION_SIZE, batch_size=100)
    if size == "smoke":  # 16 x 16 digits, hidden-64 experts: the whole path in about a minute
        raw["data"].update(limit=64, shard_size=32)
        raw["cluster"].update(k=2, fine_k=8)
        raw["router"]["num_outputs"] = 2
        _steps(raw, "train", 8)
        _steps(raw, "router_train", 8)
        raw["sampling"]["steps"] = 4
        evaluation = EvaluateOptions(n=12, ref_n=24, batch_size=12, fid=fid, grid=12, diagnostic_n=4)
    elif size == "quick":
        raw["data"].update(limit=1000, shard_size=500)
        _steps(raw, "train", 300)
        # A short run gains from a short warm-up and a higher rate (BENCHMARKS.md, "demo --quick")
        raw["train"].update(lr=4e-3, warmup_steps=30)
        _steps(raw, "router_train", 100)
        evaluation = EvaluateOptions(n=100, ref_n=1000, batch_size=100, fid=fid, grid=20, diagnostic_n=8)
    else:
        _steps(raw, "train", 1000)
        _steps(raw, "router_train", 300)
        evaluation = EvaluateOptions(n=300, ref_n=None, batch_size=300, fid=fid, grid=40, diagnostic_n=16)
    evaluation = replace(evaluation, strategies=STRATEGIES, monolith=True)
    return DemoPlan(
        RunConfig.from_dict(raw, where="demo configuration"), evaluation, showcase_n=10 if size == "smoke" else 20
    )


def _steps(raw: dict[str, Any], section: str, steps: int) -> None:
    """Set a training section's steps and the intervals that follow from them."""
    raw[section].update(
        steps=steps,
        ckpt_every=max(steps // 2, 1),
        sample_every=steps,
        log_every=max(steps // 40, 1),
        warmup_steps=min(raw[section].get("warmup_steps", 0), steps // 3),
    )


@dataclass
class DemoResult:
    root: str
    report: str
    seconds: float
    timings: dict[str, float] = field(default_factory=dict)
    evaluation: dict[str, Any] = field(default_factory=dict)


def _open(out: str, plan: DemoPlan) -> RunRoot:
    """Create the run root, or reopen one made by the same demo configuration."""
    root = RunRoot(out)
    if root.exists(RUN_FILE):
        existing = load_run_config(root)
        if existing.to_dict() != plan.config.to_dict():
            raise FlowfleetError(
                f"{root.url_of(RUN_FILE)}: exists with another configuration (not this demo's); "
                "choose another --out or delete the folder"
            )
    else:
        plan.config.save(root)
    return root


def demo(
    out: str = "runs/demo",
    *,
    quick: bool = False,
    size: DemoSize | None = None,
    progress: bool = True,
) -> DemoResult:
    """Run (or resume) the demo in `out`; returns where the report is. `size` overrides `quick`."""
    return _demo(out, size or ("quick" if quick else "full"), progress)


def _demo(out: str, size: DemoSize, progress: bool) -> DemoResult:
    plan = demo_plan(size)
    root = _open(out, plan)
    url = root.url
    timings: dict[str, float] = {}
    t_all = time.perf_counter()

    def stage(name: str, fn: Callable[[], Any]) -> Any:
        log.info(f"demo: {name} ...")
        t0 = time.perf_counter()
        result = fn()
        timings[name] = round(time.perf_counter() - t0, 2)
        log.info(f"demo: {name} done in {timings[name]:.0f} s")
        root.write_json(timings, REPORTS, TIMINGS_FILE)
        return result

    stage("prepare", lambda: prepare(root, progress=progress))
    if not root.exists(*CLUSTER_REPORT):
        stage("cluster", lambda: cluster(root, progress=progress))
    outcome = stage("train-all", lambda: train_all(url, progress=progress))
    if not outcome.ok:
        failed = {k: v for k, v in outcome.results.items() if v not in ("done", "skipped")}
        first = next(iter(failed))
        raise FlowfleetError(
            f"demo: training job {first} {failed[first]}"
            f"{': ' + outcome.messages[first] if first in outcome.messages else ''} "
            f"(logs in {url}/<job>/train.log; run the demo again to resume)"
        )
    model, monolith = stage("assemble", lambda: (assemble(url).out, assemble(url, monolith=True).out))

    def showcase() -> None:
        from flowfleet.data.encoders import build_text_encoder

        # loaded once for the monolith and the three strategies
        text = build_text_encoder(plan.config.encoders.text, resolve_device("auto"))
        same = same_as_earlier(STRATEGIES, plan.config.cluster.k)  # top2 of 2 experts is the full ensemble
        drawn: dict[str, Any] = {}  # name -> its output
        for name, folder, strategy in [("monolith", monolith, "top1")] + [(s, model, s) for s in STRATEGIES]:
            title = name
            if name in same:  # the same images: not drawn twice
                title, out = f"{name} (= {same[name]}: the same experts and weights)", drawn[same[name]]
            else:
                out = generate(
                    folder,
                    prompts=list(SHOWCASE_PROMPTS),
                    n=plan.showcase_n,
                    strategy=strategy,
                    seed=0,
                    out=root.url_of(REPORTS, SHOWCASE, f"{name}.png"),
                    text_encoder=text,
                    progress=progress,
                ).output
                drawn[name] = out
            # each image labelled with its prompt, for the report
            root.write_bytes(
                captioned_grid_png(out.images, out.prompts, cols=len(SHOWCASE_PROMPTS), title=title),
                REPORTS,
                SHOWCASE,
                f"{name}.png",
            )

    stage("generate", showcase)
    evaluation = stage("evaluate", lambda: evaluate(model, url, plan.evaluation))
    print_table(evaluation)
    timings["total"] = round(time.perf_counter() - t_all, 2)
    root.write_json(timings, REPORTS, TIMINGS_FILE)
    report = stage("report", lambda: write_report(root))
    return DemoResult(url, report, time.perf_counter() - t_all, timings, evaluation)
