"""`flowfleet` command line: one sub-command per pipeline stage (see DESIGN.md, "CLI shape").

Each stage is a plain function in its own module; the modules under flowfleet.commands only parse
arguments and call them. Heavy imports (torch, diffusers) happen inside the commands, so
`flowfleet --help` stays fast.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from flowfleet import __version__
from flowfleet.commands import data, evaluate, init, sample, train

COMMAND_MODULES = (init, data, train, sample, evaluate)

# The stages of DESIGN.md, in pipeline order; every one must be registered by a command module.
STAGES = ("init", "prepare", "cluster", "train-expert", "train-router", "train-monolith", "train-all",
          "status", "assemble", "generate", "evaluate", "report", "demo")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flowfleet",
        description="Train a diffusion model as a fleet of isolated flow-matching experts and serve it as one.",
        epilog="Pipeline: init -> prepare -> cluster -> train-expert (x K, anywhere) + train-router -> "
        "assemble -> generate / evaluate -> report.  `flowfleet demo` runs all of it on built-in data.",
    )
    parser.add_argument("--version", action="version", version=f"flowfleet {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="STAGE", required=True)
    for module in COMMAND_MODULES:
        module.register(sub)
    registered = set(sub.choices)
    missing = [s for s in STAGES if s not in registered]
    if missing:  # a programming error, caught by the tests
        raise RuntimeError(f"stages without a command: {missing}")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # to relaunch the same command (generate --nproc)
    from flowfleet.errors import FlowfleetError

    try:
        return int(args.func(args) or 0)
    except FlowfleetError as err:
        print(f"flowfleet {args.command}: error: {err}", file=sys.stderr)
        return 1
    except FileNotFoundError as err:
        print(f"flowfleet {args.command}: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"flowfleet {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
