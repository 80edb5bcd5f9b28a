"""`flowfleet init RUN_ROOT --preset NAME`."""

from __future__ import annotations

import argparse

from flowfleet.commands.options import add_command, add_run_root
from flowfleet.layout import RUN_FILE


def register(sub: argparse._SubParsersAction) -> None:
    from flowfleet.presets import PRESETS

    p = add_command(sub, "init", run)
    add_run_root(p)
    p.add_argument("--preset", default="mnist", choices=sorted(PRESETS), help="starting configuration")
    p.add_argument("--force", action="store_true", help=f"overwrite an existing {RUN_FILE}")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="set a dotted run.yaml key before it is validated, e.g. --set data.path=/my/images --set cluster.k=8 "
        "(repeatable; VALUE is read as YAML)",
    )


def run(args: argparse.Namespace) -> int:
    """create RUN_ROOT/run.yaml from a preset

    Write a validated run.yaml into RUN_ROOT (a folder or fsspec URL).
    """

    from flowfleet.stages.init import init_run

    path = init_run(args.run_root, args.preset, force=args.force, sets=args.set)
    print(f"wrote {path}")
    return 0
