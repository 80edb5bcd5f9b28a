"""How many reads a training job's start makes of a run root on an object store (each one a request there): on a
counting in-memory fsspec filesystem, an expert job opens the run and loads its partition reading run.yaml once,
its partition's manifest once and each of its shards once, and nothing of the rest of the run."""

from __future__ import annotations

import uuid
from collections import Counter

import fsspec
import pytest
from fixtures.synthetic_run import synthetic_config, write_synthetic_run
from fsspec.implementations.memory import MemoryFileSystem

from flowfleet.stages.train import _open
from flowfleet.storage import RunRoot
from flowfleet.train.specs import JobSpec
from flowfleet.train.tasks import build_task


class CountingFS(MemoryFileSystem):
    """fsspec's memory filesystem, counting every whole-file read by path (class-level: fsspec caches
    filesystem instances, the test reads the counts of the one it wrote through)."""

    protocol = "countmem"
    reads: Counter[str] = Counter()

    def cat_file(self, path, start=None, end=None, **kwargs):
        CountingFS.reads[self._strip_protocol(path)] += 1
        return super().cat_file(path, start=start, end=end, **kwargs)

    def open(self, path, mode="rb", **kwargs):
        if "r" in mode:
            CountingFS.reads[self._strip_protocol(path)] += 1
        return super().open(path, mode, **kwargs)


@pytest.fixture
def counting_root():
    fsspec.register_implementation("countmem", CountingFS, clobber=True)
    url = f"countmem://run-{uuid.uuid4().hex}"
    yield url
    CountingFS.reads.clear()


def test_an_expert_job_reads_run_yaml_its_manifest_and_its_shards_once_each(counting_root):
    cfg = synthetic_config(k=2, train={"expert_steps": "by_size"})
    written = RunRoot(counting_root)
    write_synthetic_run(written, cfg, per_cluster=[14, 9], shard_size=5)
    CountingFS.reads.clear()

    root, cfg = _open(counting_root)  # what `flowfleet train-expert` does first
    task = build_task(root, cfg, JobSpec("expert", 1))
    assert task.total_steps == round(2 * cfg.train.steps * 9 / 23)  # its by-size share, from the manifest

    reads = {path.removeprefix(written.root + "/"): n for path, n in CountingFS.reads.items()}
    shards = [f"partitions/1/shard-{i:05d}.safetensors" for i in range(2)]  # 9 items in shards of 5
    assert reads == {"run.yaml": 1, "partitions/1/manifest.json": 1, **{s: 1 for s in shards}}
