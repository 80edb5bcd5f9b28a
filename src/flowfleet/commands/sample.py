"""`flowfleet assemble` and `flowfleet generate`."""

from __future__ import annotations

import argparse

from flowfleet.commands import add_run_root, not_implemented


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("assemble", help="collect experts + router into a diffusers-style model folder")
    add_run_root(p)
    p.set_defaults(func=not_implemented(5))
    p = sub.add_parser("generate", help="sample images from an assembled fleet")
    p.add_argument("model_dir", metavar="DIR")
    p.set_defaults(func=not_implemented(5))
