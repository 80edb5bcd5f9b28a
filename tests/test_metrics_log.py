"""A job's metrics log on an object store: buffered lines and TensorBoard events reach the run root while the job
runs (at most every flush_every_s), not only at its checkpoints."""

from __future__ import annotations

import json

from flowfleet.storage import RunRoot
from flowfleet.train.metrics import MetricsLog


def test_an_object_stores_metrics_and_events_are_uploaded_as_they_come_at_most_every_flush_every_s():
    root = RunRoot("memory://flowfleet-metrics/run")
    now = [0.0]
    log = MetricsLog(root, "experts/0", tensorboard=True, flush_every_s=30.0, clock=lambda: now[0])

    def lines() -> list[int]:
        if not root.exists("experts/0", "metrics.jsonl"):
            return []
        return [json.loads(x)["step"] for x in root.read_bytes("experts/0", "metrics.jsonl").decode().splitlines()]

    log.log({"step": 1, "loss": 0.5})
    now[0] = 10.0
    log.log({"step": 2, "loss": 0.4})
    assert lines() == [] and not root.exists("experts/0", "tb")  # buffered: no upload per line
    now[0] = 31.0
    log.log({"step": 3, "loss": 0.3})
    assert lines() == [1, 2, 3]  # the first line past 30 s uploads everything so far
    assert any(name.startswith("events.out.tfevents") for name in root.ls("experts/0/tb"))
    now[0] = 40.0
    log.log({"step": 4, "loss": 0.2})
    assert lines() == [1, 2, 3]  # 9 s after the upload
    log.close()
    assert lines() == [1, 2, 3, 4]


def test_a_local_run_roots_lines_are_appended_as_they_come(tmp_path):
    root = RunRoot(str(tmp_path))
    log = MetricsLog(root, "router", tensorboard=False, clock=lambda: 0.0)
    log.log({"step": 1, "loss": 0.5})
    assert json.loads((tmp_path / "router" / "metrics.jsonl").read_text())["step"] == 1
    log.close()
