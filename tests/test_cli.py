"""The command line: every stage listed, one-line errors, init end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from flowfleet.cli import build_parser, main

RECORD = Path(__file__).parent / "fixtures" / "cli_options.json"  # every stage's options (test_cli_options.py)


def test_help_lists_every_stage():
    out = subprocess.run(
        [sys.executable, "-m", "flowfleet.cli", "--help"], capture_output=True, text=True, check=True
    ).stdout
    stages = [name for name in json.loads(RECORD.read_text()) if name and " " not in name]  # (not sub-commands)
    assert "prepare" in stages and "demo" in stages
    for stage in stages:
        assert f"    {stage}" in out, stage
    assert set(build_parser()._subparsers._group_actions[0].choices) == set(stages)


def test_init_and_its_errors(tmp_path, capsys):
    assert main(["init", str(tmp_path / "r"), "--preset", "mnist-tiny"]) == 0
    assert (tmp_path / "r" / "run.yaml").exists()
    assert main(["init", str(tmp_path / "r"), "--preset", "mnist-tiny"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "already exists" in err[0]
    assert main(["init", str(tmp_path / "r"), "--preset", "mnist", "--force"]) == 0
