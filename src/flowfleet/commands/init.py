"""`flowfleet init RUN_ROOT --preset NAME`."""

from __future__ import annotations

import argparse

from flowfleet.commands.options import add_run_root
from flowfleet.layout import RUN_FILE


def register(sub: argparse._SubParsersAction) -> None:
    from flowfleet.presets import PRESETS

    p = sub.add_parser(
        "init",
        help="create RUN_ROOT/run.yaml from a preset",
        description="Write a validated run.yaml into RUN_ROOT (a folder or fsspec URL).",
    )
    add_run_root(p)
    p.add_argument("--preset", default="mnist", choices=sorted(PRESETS), help="starting configuration")
    p.add_argument("--force", action="store_true", help=f"overwrite an existing {RUN_FILE}")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from flowfleet.stages.init import init_run

    path = init_run(args.run_root, args.preset, force=args.force)
    print(f"wrote {path}")
    return 0
