"""The fault-injection suite is complete: every case's test exists and docs/reliability.md lists it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from fault_cases import FAULT_CASES

ROOT = Path(__file__).resolve().parents[1]


def test_every_fault_case_is_a_collected_test():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--collect-only",
            "-q",
            "-m",
            "faults or not faults",
            *sorted({node.split("::")[0] for _, node, _ in FAULT_CASES}),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    ).stdout
    collected = set(out.split()) | {node.split("[")[0] for node in out.split()}
    missing = [node for _, node, _ in FAULT_CASES if node not in collected]
    assert not missing, missing


def test_reliability_doc_lists_every_case():
    doc = (ROOT / "docs" / "reliability.md").read_text()
    for case, node, _ in FAULT_CASES:
        assert f"| {case} |" in doc and node.split("::")[1] in doc, case
