"""The whole training half of the pipeline on the built-in data: init, prepare, cluster, train-all, status.

Slow (opt-in, `make test-slow`): prepare runs the real MiniLM and Inception encoders over 384 MNIST
digits and train-all starts five Python processes; see BENCHMARKS.md for its time on the dev box.
"""

from __future__ import annotations

import json

import pytest

from flowfleet.cli import main
from flowfleet.config import load_run_config
from flowfleet.models.dit import DiTExpert, DiTRouter
from flowfleet.models.files import load_model
from flowfleet.storage import RunRoot
from flowfleet.train.specs import monolith_steps


@pytest.mark.slow
def test_mnist_tiny_init_prepare_cluster_train_all_status(tmp_path, capsys):
    run = str(tmp_path / "r")
    assert main(["init", run, "--preset", "mnist-tiny"]) == 0
    assert main(["prepare", run]) == 0
    assert main(["cluster", run]) == 0
    assert main(["train-all", run, "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["status", run]) == 0
    table = capsys.readouterr().out
    mono = monolith_steps(load_run_config(RunRoot(run)))
    assert mono > 90  # matched compute: 3 experts x 30 steps and the router's FLOPs
    jobs = {
        "expert-0": "30/30",
        "expert-1": "30/30",
        "expert-2": "30/30",
        "router": "30/30",
        "monolith": f"{mono}/{mono}",
    }
    for job, steps in jobs.items():
        row = next(line for line in table.splitlines() if f" {job} " in line)
        assert " done " in row and steps in row and "100%" in row, row
    root = RunRoot(run)
    for k in range(3):
        assert load_model(DiTExpert, root, f"experts/{k}", "final").cfg.in_channels == 1
    assert load_model(DiTRouter, root, "router", "final").cfg.num_outputs == 3
    report = json.loads((tmp_path / "r/router/report.json").read_text())
    assert len(report["accuracy"]) == 10
    assert main(["train-all", run, "--no-progress"]) == 0  # everything done: nothing runs again
    out = capsys.readouterr()
    assert out.out.count(": skipped") == 5 and out.err.count("already done, skipped") == 5
