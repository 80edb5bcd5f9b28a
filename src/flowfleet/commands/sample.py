"""`flowfleet assemble` and `flowfleet generate`."""

from __future__ import annotations

import argparse
import logging

from flowfleet.commands.options import (
    add_command,
    add_device,
    add_model_dir,
    add_parallel,
    add_run_root,
    add_sampling,
    relaunch_parallel,
    sampling_choices,
)
from flowfleet.layout import ROUTER, ROUTERS

log = logging.getLogger(__name__)


def register(sub: argparse._SubParsersAction) -> None:
    _register_assemble(sub)
    p = add_command(sub, "verify", run_verify)
    add_model_dir(p)

    p = add_command(
        sub,
        "generate",
        run_generate,
        epilog="examples:  flowfleet generate runs/r/model --prompt 'a handwritten digit seven' --strategy top1\n"
        "           flowfleet generate runs/r/model --prompt 'a digit 3' --strategy full --sampler heun --steps 10\n"
        "           flowfleet generate runs/r/model --prompt 'a digit 3' --offload 2 --route-every 5",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_dir(p)
    p.add_argument(
        "--prompt",
        action="append",
        default=None,
        metavar="TEXT",
        help="caption to condition on; repeat for several (samples cycle through them)",
    )
    p.add_argument(
        "--label",
        action="append",
        type=int,
        default=None,
        metavar="Y",
        help="class label, for class-conditioned experts; repeat for several",
    )
    p.add_argument("--n", type=int, default=16, help="number of samples (default 16)")
    add_sampling(p)
    p.add_argument(
        "--out",
        default=None,
        metavar="FILE.png",
        help="PNG grid to write (default: DIR/samples/<strategy>-seed<S>.png)",
    )
    p.add_argument(
        "--offload",
        type=int,
        default=None,
        metavar="M",
        help="keep at most M experts loaded; others are released and reloaded when selected",
    )
    p.add_argument("--batch-size", type=int, default=None, metavar="B", help="samples per batch (default: all)")
    add_device(p)
    add_parallel(p)


def _register_assemble(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "assemble", run_assemble)
    add_run_root(p)
    p.add_argument("--out", metavar="DIR", default=None, help="model folder to write (default: RUN_ROOT/model)")
    p.add_argument(
        "--allow-partial",
        action="store_true",
        help="leave out experts that are not finished (with a warning) instead of refusing; the "
        "router's probabilities are renormalised over the experts present",
    )
    p.add_argument(
        "--router",
        default=ROUTER,
        choices=ROUTERS,
        help="which trained router the fleet uses: the run's (default) or router-paris, Paris' "
        "prompt-blind baseline (run.yaml router_baseline)",
    )
    p.add_argument(
        "--monolith",
        action="store_true",
        help="assemble the compute-matched monolith (monolith/final) instead, as a one-expert model "
        "with no router (default --out RUN_ROOT/model-monolith); generate and evaluate open it like a fleet",
    )
    p.add_argument(
        "--student",
        action="store_true",
        help="assemble the distilled student (student/final, `flowfleet distill`) the same way "
        "(default --out RUN_ROOT/model-student), sampled without guidance",
    )
    p.add_argument(
        "--diloco",
        action="store_true",
        help="assemble the model DiLoCo's workers trained (run.yaml diloco; diloco/worker-W/final, equal on every "
        "worker) the same way (default --out RUN_ROOT/model-diloco)",
    )


def run_assemble(args: argparse.Namespace) -> int:
    """collect experts + router into a diffusers-style model folder

    Collect the finished experts (EMA weights, experts/k/final), the router (router/final) and references to the
    encoders into one model folder: model_index.json, expert_0..expert_{K-1}/, router/, text_encoder/ (a reference),
    vae/ (a reference) or a pixel-space note. Every expert's config is checked against run.yaml first; an incompatible
    one is refused naming the expert and the field.
    """

    from flowfleet.stages.assemble import assemble

    result = assemble(
        args.run_root,
        args.out,
        allow_partial=args.allow_partial,
        monolith=args.monolith,
        student=args.student,
        diloco=args.diloco,
        router=args.router,
        progress=True,
    )
    for w in result.warnings:
        log.warning("assemble: warning: %s", w)
    if args.student:
        print(f"wrote {result.out}: the distilled student as a one-expert model")
    elif args.monolith or args.diloco:
        print(f"wrote {result.out}: the {'monolith' if args.monolith else 'DiLoCo model'} as a one-expert model")
    else:
        print(f"wrote {result.out}: experts {result.present} of K = {result.num_experts} + router")
    return 0


def run_verify(args: argparse.Namespace) -> int:
    """check a model folder's weights against its SHA256SUMS

    Hash every weight file that the folder's SHA256SUMS lists (written by assemble) and compare: a file that differs
    or is missing is a one-line error naming it and whose weights it holds (exit 1). Opening a folder (generate,
    evaluate, serve) runs the same check, remembering matches by size and modification time; verify always reads
    everything. A contributed expert's signed manifest is listed too, its installed files are compared with the sha256
    the manifest signed for them, and its signer is printed.
    """
    from flowfleet.sampling.card import read_card
    from flowfleet.sampling.folder import verify_contributions, verify_weights
    from flowfleet.storage import RunRoot

    folder = RunRoot(args.model_dir)
    count = verify_weights(folder, use_cache=False)
    if not count:
        print(f"{args.model_dir}: no SHA256SUMS")
        return 1
    verify_contributions(folder)  # each contributed expert's installed files against its signed manifest
    contributed = [e for e in read_card(folder).experts if e.contributed]
    signed = f", and {len(contributed)} signed contribution manifest(s)," if contributed else ""
    print(f"{args.model_dir}: {count - len(contributed)} weight files{signed} match SHA256SUMS")
    for e in contributed:
        c = e.contributed or {}
        print(f"expert {e.expert}: contributed, signed by key {c['signer']} (manifest sha256 {c['manifest_sha256']})")
    return 0


def run_generate(args: argparse.Namespace) -> int:
    """sample images from an assembled fleet

    Sample images from an assembled fleet with per-sample top-k routing (paris §2.7): the router picks the k most
    probable experts for each sample at each step, their velocities are combined with renormalised weights, and only the
    selected experts run. Writes a PNG grid to --out, and beside it <name>.routing.json (per-sample expert choices per
    step, usage counts) and <name>.routing.png (router probabilities over the steps). Unset sampling options come from
    the fleet's model_index.json.
    """

    relaunched = relaunch_parallel(args)
    if relaunched is not None:
        return relaunched
    from flowfleet.stages.generate import generate

    result = generate(
        args.model_dir,
        prompts=args.prompt,
        labels=args.label,
        n=args.n,
        out=args.out,
        offload=args.offload,
        batch_size=args.batch_size,
        device=args.device,
        nproc=args.nproc,
        parallel=args.parallel,
        warmup=args.warmup,
        ulysses_degree=args.ulysses_degree,
        progress=True,
        **sampling_choices(args),
    )
    if not result.png:  # a patch-parallel rank other than 0: rank 0 reports
        return 0
    from rich.console import Console

    from flowfleet.sampling.views import usage_table

    console = Console(stderr=False)
    console.print(usage_table(result.output.trace, result.loads))
    print(
        f"wrote {result.png} ({result.output.images.shape[0]} samples, {result.output.settings.strategy}), "
        f"{result.routing_json}, {result.heatmap}"
    )
    return 0
