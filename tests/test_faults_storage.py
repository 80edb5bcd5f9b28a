"""Storage errors during upload: every write of a real run goes through retries; nothing is lost."""

from __future__ import annotations

import pytest

from flowfleet.config import RunConfig
from flowfleet.models.dit import DiTExpert
from flowfleet.models.files import load_model
from flowfleet.presets import preset
from flowfleet.stages.cluster import cluster
from flowfleet.stages.prepare import prepare
from flowfleet.stages.train import train_expert
from flowfleet.storage import RunRoot

pytestmark = pytest.mark.faults


class Flaky:
    """Wraps a filesystem method: every `every`-th call first fails with a transient error."""

    def __init__(self, fn, every: int):
        self.fn, self.every, self.calls, self.failures = fn, every, 0, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls % self.every == 0:
            self.failures += 1
            raise ConnectionError("injected: connection reset during upload")
        return self.fn(*args, **kwargs)


def _run_config() -> RunConfig:
    raw = preset("shapes-tiny").to_dict()
    raw["data"].update(count=24, shard_size=8, batch_size=8)
    raw["encoders"]["semantic"]["name"] = "pixels"
    raw["encoders"]["text"] = {"name": "none", "max_length": 8}
    raw["expert"].update(conditioning="none", text_dim=0, text_len=0, add_pooled=False)
    raw["router"].update(conditioning="none", text_dim=0)
    raw["train"].update(steps=4, batch_size=4, ckpt_every=2, sample_every=4, log_every=1)
    return RunConfig.from_dict(raw)


def test_transient_upload_errors_are_retried_through_a_whole_run(monkeypatch):
    monkeypatch.setattr("flowfleet.storage.time.sleep", lambda s: None)  # no real backoff in the test
    root = RunRoot("memory://flowfleet-faults/flaky")
    writes = Flaky(root.fs.pipe_file, every=3)
    reads = Flaky(root.fs.cat_file, every=5)
    monkeypatch.setattr(root.fs, "pipe_file", writes)
    monkeypatch.setattr(root.fs, "cat_file", reads)
    _run_config().save(root)
    prepare(root, progress=False)
    cluster(root, progress=False)
    status = train_expert(root, 0)
    assert status.state == "done"
    assert writes.failures >= 5 and reads.failures >= 3  # errors really were injected, and survived
    model = load_model(DiTExpert, root, "experts", "0", "final")
    assert model.cfg.input_size == (16, 16)
    manifest = root.read_json("data", "manifest.json")
    assert manifest["count"] == 24 and manifest["complete"]


def test_persistent_storage_failure_is_one_clear_error(monkeypatch):
    monkeypatch.setattr("flowfleet.storage.time.sleep", lambda s: None)
    root = RunRoot("memory://flowfleet-faults/dead")
    _run_config().save(root)

    def dead(*args, **kwargs):
        raise TimeoutError("injected: store unreachable")

    monkeypatch.setattr(root.fs, "pipe_file", dead)
    with pytest.raises(OSError, match=r"write memory://.*failed after 5 attempts"):
        prepare(root, progress=False)
