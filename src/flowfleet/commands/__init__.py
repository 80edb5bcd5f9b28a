"""Thin CLI commands; each module's register(subparsers) adds its stages."""

from __future__ import annotations

import argparse
import sys


def not_implemented(issue: int):
    """A stage whose implementation has not landed yet: says so and exits non-zero."""

    def run(args: argparse.Namespace) -> int:
        print(f"flowfleet {args.command}: not implemented yet (tracked in issue {issue})", file=sys.stderr)
        return 2

    return run


def add_run_root(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_root", metavar="RUN_ROOT", help="run folder or fsspec URL (s3://bucket/run)")
