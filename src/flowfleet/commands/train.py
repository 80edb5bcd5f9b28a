"""Training jobs: `train-expert`, `train-router`, `train-monolith`, `train-all`, `status`."""

from __future__ import annotations

import argparse

from flowfleet.commands import add_run_root, not_implemented


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train-expert", help="train expert k on partition k only (an isolated job)")
    add_run_root(p)
    p.add_argument("--expert", type=int, required=True, metavar="K")
    p.set_defaults(func=not_implemented(4))
    p = sub.add_parser("train-router", help="train the router p(k | x_t, t) on all data")
    add_run_root(p)
    p.set_defaults(func=not_implemented(4))
    p = sub.add_parser("train-monolith", help="train the single-model baseline on all data")
    add_run_root(p)
    p.set_defaults(func=not_implemented(4))
    p = sub.add_parser("train-all", help="run every expert job, the router and the monolith as local processes")
    add_run_root(p)
    p.set_defaults(func=not_implemented(4))
    p = sub.add_parser("status", help="table of every job's state from its status file")
    add_run_root(p)
    p.set_defaults(func=not_implemented(4))
