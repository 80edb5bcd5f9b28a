"""Checkpoints: safetensors + JSON round trips, and a crash mid-write leaving the previous one loadable."""

from __future__ import annotations

import json
import time

import pytest
import torch

from flowfleet.storage import RunRoot
from flowfleet.train.checkpoint import (
    Checkpoint,
    CheckpointError,
    CheckpointStore,
    flatten_state,
    step_dir,
    unflatten_state,
)


def _optimizer_state() -> dict:
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.8, 0.95))
    for _ in range(2):
        model(torch.randn(5, 3)).square().mean().backward()
        opt.step()
    return opt.state_dict()


def _ckpt(step: int, value: float) -> Checkpoint:
    skeleton, tensors = flatten_state(_optimizer_state())
    return Checkpoint(
        step,
        {"model": {"w": torch.full((3, 3), value)}, "optimizer": tensors},
        {"optimizer": skeleton, "data_position": {"samples": step * 4}},
    )


def test_optimizer_state_round_trips_through_json_and_flat_tensors():
    state = _optimizer_state()
    skeleton, tensors = flatten_state(state)
    skeleton = json.loads(json.dumps(skeleton))  # what state.json holds
    back = unflatten_state(skeleton, tensors)
    assert back["param_groups"] == state["param_groups"]  # int keys, tuples (betas) and floats kept
    assert set(back["state"]) == set(state["state"]) == {0, 1, 2, 3}
    for idx, entry in state["state"].items():
        for key, value in entry.items():
            assert torch.equal(back["state"][idx][key], value)
    # an optimizer accepts it and continues exactly as the original would
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters())
    opt.load_state_dict(back)
    assert opt.param_groups[0]["betas"] == (0.8, 0.95)


def test_flatten_refuses_objects_that_would_need_pickle():
    with pytest.raises(TypeError, match="cannot store object"):
        flatten_state({"x": object()})


def test_save_latest_load_and_prune(run_root):
    store = CheckpointStore(RunRoot(run_root), "experts/0", keep=2)
    assert store.latest() is None
    for step in (2, 4, 6):
        store.save(_ckpt(step, float(step)))
    assert store.latest() == step_dir(6)
    assert sorted(p.name for p in (run_root / "experts/0/checkpoints").iterdir()) == [
        "latest.json",
        "step-0000004",
        "step-0000006",
    ]
    loaded = store.load(step_dir(6))
    assert loaded.step == 6 and loaded.state["data_position"] == {"samples": 24}
    assert torch.equal(loaded.tensors["model"]["w"], torch.full((3, 3), 6.0))


@pytest.mark.parametrize("fail_on", ["optimizer.safetensors", "state.json"])
def test_crash_mid_write_leaves_previous_checkpoint_loadable(run_root, monkeypatch, fail_on):
    root = RunRoot(run_root)
    store = CheckpointStore(root, "experts/0", keep=2)
    store.save(_ckpt(2, 2.0))
    real_write = RunRoot.write_bytes

    def failing_write(self, data, *parts):
        if parts[-1] == fail_on and step_dir(4) in parts:
            raise OSError("disk vanished (injected)")
        return real_write(self, data, *parts)

    monkeypatch.setattr(RunRoot, "write_bytes", failing_write)
    with pytest.raises(OSError, match="injected"):
        store.save(_ckpt(4, 4.0))
    monkeypatch.undo()
    assert (run_root / "experts/0/checkpoints/step-0000004").exists()  # the half-written one is there ...
    assert store.latest() == step_dir(2)  # ... but is not the one that loads
    loaded = CheckpointStore(root, "experts/0").load(store.latest())
    assert torch.equal(loaded.tensors["model"]["w"], torch.full((3, 3), 2.0))
    with pytest.raises(CheckpointError, match="incomplete"):
        store.load(step_dir(4))
    store.save(_ckpt(6, 6.0))  # the next good checkpoint cleans the leftover up
    assert not (run_root / "experts/0/checkpoints/step-0000004").exists()


def test_truncated_file_or_missing_pointer_falls_back_to_newest_complete(run_root):
    root = RunRoot(run_root)
    store = CheckpointStore(root, "router", keep=3)
    store.save(_ckpt(1, 1.0))
    store.save(_ckpt(2, 2.0))
    (run_root / "router/checkpoints/latest.json").unlink()  # crash between state.json and the pointer
    assert store.latest() == step_dir(2)
    model_file = run_root / "router/checkpoints/step-0000002/model.safetensors"
    model_file.write_bytes(model_file.read_bytes()[:-5])  # torn by a non-atomic copy
    assert store.latest() == step_dir(1)


def test_the_background_writer_writes_one_checkpoint_at_a_time_and_raises_its_error_in_the_callers_thread(tmp_path):
    import threading

    from flowfleet.train.checkpoint import BackgroundWriter, Checkpoint, CheckpointStore

    store = CheckpointStore(RunRoot(str(tmp_path)), "experts/0")
    release, real = threading.Event(), store.save

    def slow_save(ckpt):  # a slow store: held until released
        release.wait(30)
        return real(ckpt)

    store.save = slow_save  # type: ignore[method-assign]
    writer = BackgroundWriter(store)
    assert writer.write_s is None  # no write yet: nothing known of how long one takes
    ckpt = Checkpoint(step=2, tensors={"model": {"w": torch.ones(3)}}, state={"job": "expert-0"})
    assert writer.start(ckpt) is None and writer.busy and writer.finished() is None  # the caller goes on
    assert store.latest() is None  # nothing complete yet
    # a first write not ended yet: it takes at least as long as it has run (a SIGTERM's grace reads this)
    so_far = writer.write_s
    time.sleep(0.05)
    assert so_far is not None and writer.write_s >= so_far + 0.05 and writer.last_s is None
    release.set()
    assert writer.wait() == "step-0000002" and not writer.busy and writer.last_s is not None
    assert writer.write_s == writer.last_s >= 0.05
    assert store.latest() == "step-0000002" and torch.equal(
        store.load("step-0000002").tensors["model"]["w"], torch.ones(3)
    )

    def failing_save(ckpt):
        raise OSError("disk full")

    store.save = failing_save  # type: ignore[method-assign]
    writer.start(Checkpoint(step=4, tensors={"model": {"w": torch.ones(3)}}, state={}))
    with pytest.raises(OSError, match="disk full"):
        writer.wait()  # (or finished(), at the loop's next step)
    assert store.latest() == "step-0000002"
