"""The library, the command line and the server agree on every default they share: a user calling
`flowfleet.stages.generate.generate` gets what `flowfleet generate` gives, and `flowfleet serve` what `serve()` does
(the image split over processes was `sync` in the library and `displaced` on the command line until this test)."""

from __future__ import annotations

import argparse
import dataclasses
import inspect

import pytest

from flowfleet.cli import build_parser
from flowfleet.serve.app import serve
from flowfleet.stages.evaluate import EvaluateOptions
from flowfleet.stages.generate import generate


def command(name: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def cli_defaults(name: str) -> dict[str, object]:
    return {a.dest: a.default for a in command(name)._actions if a.dest != "help"}


def shared(library: dict[str, object], cli: dict[str, object]) -> list[str]:
    return sorted(set(library) & set(cli))


@pytest.mark.parametrize(
    "name, function",
    [("generate", generate), ("serve", serve)],
)
def test_the_library_and_the_command_line_share_every_default(name, function):
    library = {
        p.name: p.default
        for p in inspect.signature(function).parameters.values()
        if p.default is not inspect.Parameter.empty
    }
    cli = cli_defaults(name)
    common = shared(library, cli)
    assert {"parallel", "warmup", "nproc", "ulysses_degree", "device"} <= set(common)
    assert {k: library[k] for k in common} == {k: cli[k] for k in common}


def test_evaluate_options_and_the_command_line_share_every_default():
    library = {f.name: f.default for f in dataclasses.fields(EvaluateOptions) if f.default is not dataclasses.MISSING}
    cli = cli_defaults("evaluate")
    for k, v in cli.items():  # a list option's default is its comma-separated text (--strategies top1,top2,full)
        if isinstance(library.get(k), tuple) and isinstance(v, str):
            cli[k] = tuple(x for x in v.split(",") if x)
    common = shared(library, cli)
    assert {"n", "seed", "strategies", "cfg_max_t", "cache", "repeats", "min_accuracy"} <= set(common)
    assert {k: library[k] for k in common} == {k: cli[k] for k in common}
