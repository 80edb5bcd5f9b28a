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
from flowfleet.data.shards import ShardSet, ShardSetManifest, parse_shard, shard_bytes
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


def test_text_tokens_are_stored_unpadded_and_given_back_padded(tmp_path):
    """An encoder's padding (zeros past each caption) is not stored: the shard file holds the real tokens one after
    the other and their lengths, parse_shard and the streamed reader give back the padded tokens and the mask bit for
    bit; tokens that are not zero past the mask are stored as they are; a packing whose lengths disagree with its
    tokens is refused."""
    gen = torch.Generator().manual_seed(0)
    lengths = torch.tensor([3, 77, 0, 12])
    mask = (torch.arange(77) < lengths[:, None]).to(torch.uint8)
    tokens = torch.randn(4, 77, 64, generator=gen).half() * mask[..., None]
    item = {"text_tokens": tokens, "text_mask": mask, "index": torch.arange(4)}
    raw = shard_bytes(item, ["a", "b", "c", "d"])
    stored = safetensors.torch.load(raw)
    assert stored["text_tokens"].shape == (92, 64) and stored["text_len"].tolist() == [3, 77, 0, 12]
    assert stored["text_mask"].shape == (0, 77) and stored["text_mask"].dtype == torch.uint8  # its width, its dtype
    assert len(raw) < tokens.numel() * 2 / 3  # a third of the padded tokens' bytes
    back, captions = parse_shard(raw)
    assert captions == ["a", "b", "c", "d"] and back.keys() == item.keys()
    assert all(back[k].dtype == item[k].dtype and torch.equal(back[k], item[k]) for k in item)
    assert shard_bytes(item, list("abcd")) == raw  # the same bytes every time (shards are compared byte for byte)
    noisy = {**item, "text_tokens": torch.randn(4, 77, 64, generator=gen).half()}  # not an encoder's padding
    assert safetensors.torch.load(shard_bytes(noisy, list("abcd")))["text_tokens"].shape == (4, 77, 64)
    assert torch.equal(parse_shard(shard_bytes(noisy, list("abcd")))[0]["text_tokens"], noisy["text_tokens"])
    bad = safetensors.torch.save({**stored, "text_len": torch.tensor([3, 77, 0, 13], dtype=torch.int32)})
    with pytest.raises(ValueError, match=r"text_len: lengths outside 0..77 or not summing to text_tokens' 92 rows"):
        parse_shard(bad)
    # a set of one packed shard and one stored padded: either path gives the same batches
    root = RunRoot(str(tmp_path / "run"))
    shards, manifest = ShardSet(root, "data"), ShardSetManifest()
    shards.append(manifest, {**item, "latents": torch.randn(4, 2, generator=gen)}, list("abcd"))
    shards.append(
        manifest, {**noisy, "latents": torch.randn(4, 2, generator=gen), "index": torch.arange(4, 8)}, list("efgh")
    )
    fields = ["latents", "text_tokens", "text_mask", "index"]
    memory, streamed = InMemoryData.load(shards, fields), StreamedData.load(shards, fields)
    for items in (torch.tensor([1, 5, 2, 2, 7, 0, 3]), torch.arange(8)):
        a, b = memory.gather(items), streamed.gather(items)
        assert all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in fields)
    assert torch.equal(memory.gather(torch.arange(4))["text_tokens"], tokens)
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


class _Counting:
    """A data whose gathers are counted (which thread asked is not: only what was read)."""

    def __init__(self, data):
        self.data, self.calls = data, 0

    def gather(self, items, device="cpu"):
        self.calls += 1
        return self.data.gather(items, device)


def test_batches_read_ahead_are_the_ones_asked_for(tmp_path):
    """BatchFeed: a batch read ahead is handed over when asked for under its key (no second read), equal to a direct
    gather; a batch not read ahead is gathered on the spot and keeps what was read for later keys; what was read for
    an earlier key than the one asked for is dropped."""
    from flowfleet.train.feed import BatchFeed

    root = RunRoot(str(tmp_path / "run"))
    write_synthetic_run(root, synthetic_config(k=2), per_cluster=13, shard_size=5)
    streamed = StreamedData.load(ShardSet(root, "data"), FIELDS)
    data = _Counting(streamed)
    feed = BatchFeed(data, prefetch=2, pin=False)
    first, second, other = torch.tensor([3, 1, 4]), torch.tensor([1, 5, 9, 2]), torch.tensor([6, 5, 3])
    feed.ahead((0, 0), first)
    feed.ahead((0, 0), first)  # (asked twice: read once)
    feed.ahead((3, 0), second)
    got = feed.take((0, 0), first, torch.device("cpu"))
    want = streamed.gather(first)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    assert data.calls == 2  # first and second, each once, both ahead
    got = feed.take((1, 0), other, torch.device("cpu"))  # not read ahead: read now, the later one kept
    want = streamed.gather(other)
    assert all(torch.equal(got[k], want[k]) for k in got) and data.calls == 3
    got = feed.take((3, 0), second, torch.device("cpu"))
    assert all(torch.equal(got[k], v) for k, v in streamed.gather(second).items()) and data.calls == 3
    feed.ahead((5, 0), first)
    got = feed.take((6, 0), other, torch.device("cpu"))  # (5, 0) went by unasked: dropped (its read maybe cancelled)
    assert all(torch.equal(got[k], want[k]) for k in got) and (feed.read_ahead, feed.on_the_spot) == (2, 2)
    assert not feed._pending
    feed.close()
    streamed.close()


@pytest.mark.usefixtures("one_thread")
def test_reading_ahead_changes_no_weight(tmp_path, monkeypatch):
    """An expert whose batches are read two steps ahead in micro-batches of a grad_accum of 2 ends with the weights
    of the same job reading each batch when its step needs it, bit for bit; every batch but the first step's was
    read ahead."""
    from flowfleet.train import feed, loop

    feeds = []

    class Kept(feed.BatchFeed):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            feeds.append(self)

    monkeypatch.setattr(loop, "BatchFeed", Kept)
    options = TrainOptions(progress=False, tensorboard=False)
    finals = []
    for prefetch in (0, 2):
        raw = synthetic_config(k=2, steps=5).to_dict()
        raw["train"].update(loader="stream", prefetch=prefetch, grad_accum=2, loader_workers=2)
        root = RunRoot(str(tmp_path / f"prefetch{prefetch}"))
        write_synthetic_run(root, RunConfig.from_dict(raw), per_cluster=11, shard_size=4)
        assert synthetic_run.run_job(root, JobSpec("expert", 0), options).state == "done"
        finals.append(_final(root, "experts/0"))
    a, b = finals
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [(f.read_ahead, f.on_the_spot) for f in feeds] == [(0, 10), (8, 2)]  # 5 steps x 2 micro-batches


def test_a_negative_prefetch_is_refused_naming_it():
    raw = synthetic_config(k=2).to_dict()
    raw["train"]["prefetch"] = -1
    with pytest.raises(ValueError, match="prefetch"):
        RunConfig.from_dict(raw)
