"""`flowfleet evaluate`, `flowfleet report`, `flowfleet demo`."""

from __future__ import annotations

import argparse

from flowfleet.commands import add_run_root, not_implemented


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("evaluate", help="FID per routing strategy and for the monolith; diagnostics")
    p.add_argument("model_dir", metavar="DIR")
    p.set_defaults(func=not_implemented(6))
    p = sub.add_parser("report", help="write RUN_ROOT/reports/report.html")
    add_run_root(p)
    p.set_defaults(func=not_implemented(6))
    p = sub.add_parser("demo", help="the whole pipeline on built-in MNIST-5k, ending in an HTML report")
    p.add_argument("--out", default="runs/demo")
    p.add_argument("--quick", action="store_true")
    p.set_defaults(func=not_implemented(6))
