"""Thin CLI commands; each module's register(subparsers) adds its stages."""

from __future__ import annotations

import argparse


def add_run_root(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_root", metavar="RUN_ROOT", help="run folder or fsspec URL (s3://bucket/run)")
