"""Small parts of the trainer: the EMA and its warm-up, the resumable sampler, the status file."""

from __future__ import annotations

import os
import socket
import time

import pytest
import torch
from fixtures.tolerances import gamma

from flowfleet.errors import FlowfleetError
from flowfleet.storage import RunRoot
from flowfleet.train.data import InMemoryData, ResumableSampler
from flowfleet.train.ema import EMA, ema_decay_at
from flowfleet.train.status import JobLease, JobStatus, read_status


def test_ema_follows_the_warmed_up_decay_exactly():
    model = torch.nn.Linear(3, 2)
    ema = EMA(model, decay=0.5, warmup=True)
    expected = model.weight.detach().clone()
    for n in range(6):
        with torch.no_grad():
            model.weight.add_(1.0)
        ema.update(model)
        d = 0.0 if n == 0 else ema_decay_at(0.5, n, True)  # the first update copies
        expected = d * expected + (1 - d) * model.weight.detach()
        # the same update d e + (1 - d) w in another op order: 3 roundings per update of values <= 7
        torch.testing.assert_close(ema.module.weight, expected, rtol=0, atol=gamma(3 * (n + 1), torch.float32) * 7)
    assert [ema_decay_at(0.9999, n, True) for n in (1, 10, 90)] == [2 / 11, 0.55, 91 / 100]
    assert ema_decay_at(0.9, 10_000, True) == 0.9 == ema_decay_at(0.9, 1, False)
    state = ema.state_dict()
    assert int(state["n_averaged"]) == 6  # the update count is checkpointed with the weights
    other = EMA(torch.nn.Linear(3, 2), decay=0.5)
    other.load_state_dict(state)
    assert torch.equal(other.module.weight, ema.module.weight)
    assert not any(p.requires_grad for p in ema.module.parameters())


def test_ema_update_is_averaged_models_own_bit_for_bit():
    """The cached-list update against torch's AveragedModel.update_parameters with the same lerp, on a model with a
    buffer, across a load_state_dict and a .to() of both (the lists must follow the modules' tensors)."""
    from torch.optim.swa_utils import AveragedModel

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    ema = EMA(model, decay=0.9, warmup=True)

    def lerp(ema_params, params, n):
        torch._foreach_lerp_(ema_params, params, 1.0 - ema_decay_at(0.9, int(n), True))

    reference = AveragedModel(model, multi_avg_fn=lerp)
    for step in range(8):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
            model[1].running_mean.add_(1.0)  # a buffer: copied, not averaged
        ema.update(model)
        reference.update_parameters(model)
        for (name, ours), theirs in zip(ema.state_dict().items(), reference.state_dict().values()):
            assert torch.equal(ours, theirs), (step, name)
        if step == 3:
            ema.load_state_dict(reference.state_dict())
            model.to(torch.float64).to(torch.float32)  # new tensors behind the same parameters
    assert int(ema.state_dict()["n_averaged"]) == 8


def test_sampler_is_a_pure_function_of_the_position():
    a, b = ResumableSampler(10, seed=3), ResumableSampler(10, seed=3)
    whole = a.take(0, 35)  # three and a half epochs
    for epoch in range(3):
        assert sorted(whole[10 * epoch : 10 * epoch + 10].tolist()) == list(range(10))  # no repeats in an epoch
    assert not torch.equal(whole[:10], whole[10:20])  # a fresh order each epoch
    pieces = torch.cat([b.take(p, 7) for p in range(0, 35, 7)])
    assert torch.equal(pieces, whole)
    assert torch.equal(ResumableSampler(10, seed=3).take(23, 5), whole[23:28])  # resume mid-epoch
    c = ResumableSampler(10, seed=3)  # a step's batch after the next steps' (read ahead), across epochs
    for p in range(0, 24, 4):
        ahead, now = c.take(p + 8, 4), c.take(p, 4)
        assert torch.equal(ahead, whole[p + 8 : p + 12]) and torch.equal(now, whole[p : p + 4])
    assert not torch.equal(ResumableSampler(10, seed=4).take(0, 10), whole[:10])


def test_in_memory_batches_have_model_dtypes():
    data = InMemoryData(
        {
            "latents": torch.randn(4, 1, 2, 2),
            "text_tokens": torch.randn(4, 3, 5).half(),
            "text_mask": torch.ones(4, 3, dtype=torch.uint8),
            "labels": torch.arange(4),
        },
        [],
        "x",
    )
    batch = data.gather(torch.tensor([2, 0]))
    assert batch["text_tokens"].dtype == torch.float32 and batch["text_mask"].dtype == torch.bool
    assert batch["labels"].tolist() == [2, 0] and batch["latents"].shape == (2, 1, 2, 2)
    with pytest.raises(FlowfleetError, match="different item counts"):
        InMemoryData({"latents": torch.zeros(3, 1), "labels": torch.zeros(2)}, [], "somewhere")


def test_lease_heartbeats_and_releases(run_root):
    root = RunRoot(run_root)
    lease = JobLease(root, "router", JobStatus("router", total_steps=9), interval=0.05)
    lease.acquire()
    first = read_status(root, "router")
    assert (first.state, first.host, first.pid) == ("running", socket.gethostname(), os.getpid())
    lease.update(step=4, last_loss=0.5)  # in memory; the heartbeat thread writes it
    deadline = time.monotonic() + 10
    while read_status(root, "router").step != 4 and time.monotonic() < deadline:
        time.sleep(0.02)
    beat = read_status(root, "router")
    assert beat.step == 4 and beat.heartbeat > first.heartbeat and beat.is_live(stale_after=60)
    lease.release("done")
    final = read_status(root, "router")
    assert final.state == "done" and not final.is_live()
    time.sleep(0.15)
    assert read_status(root, "router").heartbeat == final.heartbeat  # the thread stopped


def test_status_file_errors_name_the_file(run_root):
    root = RunRoot(run_root)
    root.write_json({"job": "expert-0", "state": "sleeping"}, "experts/0", "status.json")
    with pytest.raises(FlowfleetError, match=r"experts/0/status.json: unknown state 'sleeping'"):
        read_status(root, "experts/0")
    (run_root / "router").mkdir()
    (run_root / "router/status.json").write_text("{not json")
    with pytest.raises(FlowfleetError, match=r"router/status.json: not valid JSON"):
        read_status(root, "router")
    dead = JobStatus("expert-0", state="running", host=socket.gethostname(), pid=2**22 + 12345, heartbeat=time.time())
    assert not dead.is_live()  # same host, no such process: dead even with a fresh heartbeat
