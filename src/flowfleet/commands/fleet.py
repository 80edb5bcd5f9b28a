"""Changing a trained fleet: `add-expert`, `remove-expert`, `distill`."""

from __future__ import annotations

import argparse

from flowfleet.commands.options import add_command, add_data_source, add_progress, add_run_root, data_config


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(
        sub,
        "add-expert",
        run_add_expert,
        epilog="example:  flowfleet add-expert runs/r --source folder --path /data/new-images --k 2",
    )
    add_run_root(p)
    add_data_source(p)
    p.add_argument("--k", type=int, default=1, help="experts to split the new data into (default 1)")
    p.add_argument(
        "--objective",
        choices=("fm", "ddpm"),
        default=None,
        help="what the new experts learn: flow matching (default, as run.yaml expert) or DDPM's noise",
    )
    p.add_argument(
        "--schedule", choices=("linear", "cosine"), default=None, help="the VP schedule of --objective ddpm experts"
    )
    add_progress(p)

    p = add_command(
        sub, "remove-expert", run_remove_expert, epilog="example:  flowfleet remove-expert runs/r --expert 1 --purge"
    )
    add_run_root(p)
    p.add_argument("--expert", type=int, required=True, metavar="K", help="the expert to remove, 0..K-1")
    p.add_argument(
        "--purge",
        action="store_true",
        help="also delete experts/K/, partitions/K/ and the routers trained with its data from the run root",
    )
    add_progress(p)
    _register_distill(sub)


def _register_distill(sub: argparse._SubParsersAction) -> None:
    p = add_command(
        sub, "distill", run_distill, epilog="example:  flowfleet distill runs/r --teacher top2 --steps 1000"
    )
    add_run_root(p)
    p.add_argument("--teacher", default="top2", help="the fleet's routing strategy to learn (default top2)")
    p.add_argument(
        "--student",
        default=None,
        metavar="SIZE",
        help="a DiT size (tiny, S, B, L, XL) for the student; default: the architecture of one expert",
    )
    p.add_argument("--steps", type=int, default=None, help="training steps (default: run.yaml train.steps)")
    p.add_argument(
        "--method",
        choices=("velocity", "reflow"),
        default="velocity",
        help="velocity: regress on the teacher's velocity at x_t from the data (default); reflow: flow "
        "matching on the teacher's (noise, sample) pairs, straighter paths for few-step sampling",
    )
    p.add_argument("--pairs", type=int, default=2000, help="reflow: teacher trajectories to learn from (default 2000)")
    p.add_argument(
        "--guidance-scale",
        "--cfg",
        type=float,
        default=None,
        metavar="SCALE",
        help="the teacher's guidance (default sampling.guidance_scale)",
    )
    add_progress(p)


def run_distill(args: argparse.Namespace) -> int:
    """fold the fleet into one student model (trained on the fleet's guided velocity)

    Train one student DiT on the assembled fleet's velocity (routed with --teacher, guided with the run's CFG) at x_t
    from the run's data, as an ordinary job in RUN_ROOT/student/, and assemble RUN_ROOT/model-student: one model,
    sampled without guidance. Interrupted, the same command resumes.
    """

    from flowfleet.stages.distill import distill

    student = {"size": args.student} if args.student else None
    result = distill(
        args.run_root,
        teacher=args.teacher,
        student=student,
        steps=args.steps,
        guidance_scale=args.guidance_scale,
        method=args.method,
        pairs=args.pairs,
        progress=args.progress,
    )
    print(f"wrote {result.model}: one student learned from the fleet's {result.distill.teacher} (sample it with cfg 1)")
    return 0


def run_add_expert(args: argparse.Namespace) -> int:
    """grow a trained fleet with new data: new experts, the router retrained, the rest untouched

    Prepare new data with the run's encoders and cluster it into K partitions in RUN_ROOT/added/<n>/, train K new
    experts on them (isolated jobs, experts/<k>/), train the grown fleet's router on all data warm-started from the
    previous one (router-k<K>/), and re-assemble RUN_ROOT/model. The existing experts' files are not touched.
    Interrupted, the same command resumes.
    """
    from flowfleet.config import load_run_config
    from flowfleet.stages.add_expert import add_expert
    from flowfleet.storage import RunRoot

    run = load_run_config(RunRoot(args.run_root))
    keep = ("image_size", "channels", "shard_size", "batch_size", "image_column", "text_column")
    data = data_config(args, **{name: getattr(run.data, name) for name in keep})
    expert = {name: getattr(args, name) for name in ("objective", "schedule") if getattr(args, name) is not None}
    result = add_expert(args.run_root, data, k=args.k, progress=args.progress, expert=expert or None)
    print(
        f"wrote {result.model}: the fleet with experts {result.experts} on {result.items} added items "
        f"(added/{result.addition}/; router: {', '.join(result.routers)})"
    )
    return 0


def run_remove_expert(args: argparse.Namespace) -> int:
    """take an expert (and its data) out of a trained fleet

    Record the removal in run.yaml (removed_experts), train a new router from scratch on the data that is left
    (router-without-K/; a warm start would carry the removed data), re-assemble RUN_ROOT/model from the remaining
    experts and print what the fleet can no longer draw. No file of the new model folder depends on the removed expert's
    data. Interrupted, the same command resumes.
    """

    from flowfleet.stages.remove_expert import remove_expert

    result = remove_expert(args.run_root, args.expert, purge=args.purge, progress=args.progress)
    print(f"wrote {result.model}: the fleet without experts {result.removed} (router: {', '.join(result.routers)})")
    for k, lost in result.lost.items():
        labels = ", ".join(f"{label} ({n})" for label, n in lost["labels"].items()) or "no labels"
        examples = "; ".join(lost["examples"][:3])
        print(f"expert {k} is gone; the fleet no longer draws: {labels}" + (f" — e.g. {examples}" if examples else ""))
    for folder in result.purged:
        print(f"deleted {folder}")
    return 0
