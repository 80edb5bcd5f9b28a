"""`flowfleet` command line: one sub-command per pipeline stage.

Each stage is a plain function in its own module; the modules under flowfleet.commands only parse
arguments and call them. Heavy imports (torch, diffusers) happen inside the commands, so
`flowfleet --help` stays fast.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Sequence

from flowfleet import __version__
from flowfleet.commands import contrib, data, evaluate, export, fleet, init, sample, serve, train
from flowfleet.errors import FlowfleetError, ParameterError
from flowfleet.threads import apply_thread_policy

COMMAND_MODULES = (init, data, train, sample, evaluate, fleet, contrib, export, serve)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flowfleet",
        description="Train a diffusion model as a fleet of isolated flow-matching experts and serve it as one.",
        epilog="Pipeline: init -> prepare -> cluster -> train-expert (x K, anywhere) + train-router -> "
        "assemble -> generate / evaluate -> report.  `flowfleet demo` runs all of it on built-in data.",
    )
    parser.add_argument("--version", action="version", version=f"flowfleet {__version__}")
    verbosity = parser.add_mutually_exclusive_group()
    verbosity.add_argument("-v", "--verbose", action="store_true", help="also debug messages")
    verbosity.add_argument("-q", "--quiet", action="store_true", help="warnings and errors only")
    sub = parser.add_subparsers(dest="command", metavar="STAGE", required=True)
    for module in COMMAND_MODULES:  # (the stages they register are recorded in tests/fixtures/cli_options.json)
        module.register(sub)
    return parser


def flag_of(parser: argparse.ArgumentParser, args: argparse.Namespace, parameter: str) -> str:
    """The flag of the command `args` ran that sets `parameter` (its dest): "--ref-n" for ref_n; the parameter's own
    name where no flag of that command sets it."""
    while True:  # down to the command that ran (export diffusers: two levels)
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        chosen = getattr(args, subs[0].dest, None) if subs else None
        if chosen not in (subs[0].choices if subs else {}):
            break
        parser = subs[0].choices[chosen]
    for action in parser._actions:
        if action.dest == parameter and action.option_strings:
            return next((o for o in action.option_strings if o.startswith("--")), action.option_strings[0])
    return parameter


def configure_logging(verbose: bool = False, quiet: bool = False) -> None:
    """The one logging set-up: flowfleet's messages (the "flowfleet" logger and its children) on stderr,
    one line each; tables, progress bars and final paths stay console output of the commands."""
    logger = logging.getLogger("flowfleet")
    logger.setLevel(logging.DEBUG if verbose else logging.WARNING if quiet else logging.INFO)
    if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("flowfleet: %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False


class _StderrHandler(logging.StreamHandler):
    """Writes to sys.stderr as it is at each message, not as it was when main() first ran (tests and
    notebooks swap it); the stdlib's own last-resort handler does the same."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def main(argv: Sequence[str] | None = None) -> int:
    # First of all, before torch loads (the parser's options import it, and OpenMP reads its variables once, when its
    # library loads): this process has the machine to itself (a command that starts processes sharing its cores,
    # train-all or --nproc, sets their policy: flowfleet.threads).
    _, policy = apply_thread_policy("alone")
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(args.verbose, args.quiet)
    logging.getLogger("flowfleet.threads").debug("%s", policy)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # to relaunch the same command (generate --nproc)

    try:
        return int(args.func(args) or 0)
    except ParameterError as err:  # the library names its parameter; here it is the flag that set it
        print(f"flowfleet {args.command}: error: {err.as_flag(flag_of(parser, args, err.parameter))}", file=sys.stderr)
        return 1
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
