"""Changing a trained fleet: `remove-expert`."""

from __future__ import annotations

import argparse

from flowfleet.commands import add_run_root


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "remove-expert",
        help="take an expert (and its data) out of a trained fleet",
        description="Record the removal in run.yaml (removed_experts), train a new router from scratch on the "
        "data that is left (router-without-K/; a warm start would carry the removed data), re-assemble "
        "RUN_ROOT/model from the remaining experts and print what the fleet can no longer draw. No file of "
        "the new model folder depends on the removed expert's data. Interrupted, the same command resumes.",
        epilog="example:  flowfleet remove-expert runs/r --expert 1 --purge",
    )
    add_run_root(p)
    p.add_argument("--expert", type=int, required=True, metavar="K", help="the expert to remove, 0..K-1")
    p.add_argument(
        "--purge",
        action="store_true",
        help="also delete experts/K/, partitions/K/ and the routers trained with its data from the run root",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=run_remove_expert)


def run_remove_expert(args: argparse.Namespace) -> int:
    from flowfleet.stages.remove_expert import remove_expert

    result = remove_expert(args.run_root, args.expert, purge=args.purge, progress=not args.no_progress)
    print(f"wrote {result.model}: the fleet without experts {result.removed} (router: {', '.join(result.routers)})")
    for k, lost in result.lost.items():
        labels = ", ".join(f"{label} ({n})" for label, n in lost["labels"].items()) or "no labels"
        examples = "; ".join(lost["examples"][:3])
        print(f"expert {k} is gone; the fleet no longer draws: {labels}" + (f" — e.g. {examples}" if examples else ""))
    for folder in result.purged:
        print(f"deleted {folder}")
    return 0
