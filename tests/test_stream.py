"""train.loader: stream: the items read from the shard files as batches ask for them are the in-memory path's bit for
bit: every field of any batch, after select and concat, the captions, and whole training jobs (an expert stopped by
SIGTERM and resumed, the router over every cluster)."""

from __future__ import annotations

import os
import signal

import pytest
import safetensors.torch
import torch
from fixtures import synthetic_run
from fixtures.synthetic_run import synthetic_config, write_synthetic_run

from flowfleet.config import RunConfig
from flowfleet.data.shards import ShardSet
from flowfleet.storage import RunRoot
from flowfleet.train.data import InMemoryData
from flowfleet.train.loop import TrainOptions
from flowfleet.train.specs import JobSpec
from flowfleet.train.stream import StreamedData

FIELDS = ["latents", "text_tokens", "text_mask", "text_pooled", "labels", "index"]


def test_streamed_batches_are_the_in_memory_ones(tmp_path):
    """Any items, in any order and repeated, gather the same tensors (dtype, shape, values) from either path; so do
    a selection and a concatenation; only the scalar fields (labels, index) are held in memory; the captions agree."""
    root = RunRoot(str(tmp_path / "run"))
    write_synthetic_run(root, synthetic_config(k=2), per_cluster=13, shard_size=5)  # 26 items, a short last shard
    shards = ShardSet(root, "data")
    memory, streamed = InMemoryData.load(shards, FIELDS), StreamedData.load(shards, FIELDS)
    assert len(streamed) == len(memory) == 26 and set(streamed.tensors) == {"labels", "index"}
    gen = torch.Generator().manual_seed(0)
    for items in (torch.randint(0, 26, (9,), generator=gen), torch.tensor([25, 0, 5, 5, 24]), torch.arange(26)):
        a, b = memory.gather(items), streamed.gather(items)
        assert a.keys() == b.keys()
        for name in a:
            assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    keep = torch.arange(26) % 3 != 1
    a, b = memory.select(keep), streamed.select(keep)
    both_a, both_b = InMemoryData.concat([a, memory]), StreamedData.concat([b, streamed])
    assert len(both_b) == len(both_a) == int(keep.sum()) + 26
    items = torch.randperm(len(both_a), generator=gen)[:12]
    x, y = both_a.gather(items), both_b.gather(items)
    assert all(torch.equal(x[name], y[name]) for name in x)
    assert [streamed.captions[i] for i in range(26)] == memory.captions
    assert [both_b.captions[i] for i in range(3)] == both_a.captions[:3]
    streamed.close()


def _run(path, loader: str) -> RunRoot:
    raw = synthetic_config(k=2, steps=6, train=dict(ckpt_every=2)).to_dict()
    raw["train"]["loader"] = raw["router_train"]["loader"] = loader
    root = RunRoot(str(path))
    write_synthetic_run(root, RunConfig.from_dict(raw), per_cluster=11, shard_size=4)
    return root


def _final(root: RunRoot, job: str) -> dict[str, torch.Tensor]:
    return safetensors.torch.load(root.read_bytes(job, "final", "diffusion_pytorch_model.safetensors"))


@pytest.mark.usefixtures("one_thread")
def test_a_streamed_job_stopped_and_resumed_trains_the_in_memory_jobs_weights(tmp_path):
    """An expert trained from streamed data, stopped by SIGTERM in step 3 and resumed from its checkpoint, ends with
    the weights of an uninterrupted job that held its data in memory, bit for bit (the same items at every step,
    the position resumed exactly); the router, which reads every cluster, likewise."""
    options = TrainOptions(progress=False, heartbeat_every=0.2, tensorboard=False)
    memory, streamed = _run(tmp_path / "memory", "memory"), _run(tmp_path / "stream", "stream")
    for job in (JobSpec("expert", 0), JobSpec("router")):
        assert synthetic_run.run_job(memory, job, options).state == "done"

    def sigterm_in_step_3(call, loss):
        if call == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return loss

    stopped = synthetic_run.run_job(streamed, JobSpec("expert", 0), options, sigterm_in_step_3)
    assert (stopped.state, stopped.step) == ("stopped", 3)
    assert synthetic_run.run_job(streamed, JobSpec("expert", 0), options).state == "done"
    assert synthetic_run.run_job(streamed, JobSpec("router"), options).state == "done"
    for job in ("experts/0", "router"):
        a, b = _final(memory, job), _final(streamed, job)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), job
