"""`flowfleet prepare` and `flowfleet cluster`."""

from __future__ import annotations

import argparse

from flowfleet.commands import add_run_root, not_implemented


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("prepare", help="encode the source into shards (latents, features, text)")
    add_run_root(p)
    p.set_defaults(func=not_implemented(3))
    p = sub.add_parser("cluster", help="split the data into K semantic partitions (two-stage k-means)")
    add_run_root(p)
    p.set_defaults(func=not_implemented(3))
