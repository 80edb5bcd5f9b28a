"""Every stage's command line, held against a record: refactoring the parsers must not add, drop or
rename an option (tests/fixtures/cli_options.json; regenerate it deliberately with
`python tests/test_cli_options.py > tests/fixtures/cli_options.json` when a change is meant)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from flowfleet.cli import build_parser

RECORD = Path(__file__).parent / "fixtures" / "cli_options.json"


def options_of(parser: argparse.ArgumentParser, prefix: str = "") -> dict[str, list[str]]:
    """{stage: its positional names and option strings, sorted}, "" for the top-level flags; nested
    sub-commands (export diffusers) as "export diffusers"."""
    names, nested = [], {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in sorted(action.choices.items()):
                nested |= options_of(sub, f"{prefix} {name}".strip())
        else:
            names += action.option_strings or [action.dest]
    return {prefix: sorted(names)} | nested


def test_every_stage_keeps_its_options():
    assert options_of(build_parser()) == json.loads(RECORD.read_text())


if __name__ == "__main__":
    print(json.dumps(options_of(build_parser()), indent=1))
