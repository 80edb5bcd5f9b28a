"""Dynamic batching across requests (flowfleet.serve.batcher) and the service that batches (FleetService)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from fixtures.random_fleet import HashTextEncoder, tiny_run_config, write_random_fleet

from flowfleet.sampling.card import read_card
from flowfleet.sampling.pipeline import FleetPipeline
from flowfleet.sampling.views import to_pil
from flowfleet.serve.batcher import Batcher, BatchJob
from flowfleet.serve.service import FleetService, GenerateRequest, ServeLimits
from flowfleet.stages.assemble import assemble

pytestmark = pytest.mark.usefixtures("one_thread")


class Recorder:
    """run_batch that records each batch's jobs; fails every batch holding a job whose payload is 'bad'."""

    def __init__(self, hold: threading.Event | None = None):
        self.batches: list[list[str]] = []
        self.hold = hold

    def __call__(self, jobs):
        if self.hold is not None:
            self.hold.wait(timeout=30)
        self.batches.append([j.payload for j in jobs])
        if any(j.payload == "bad" for j in jobs):
            raise ValueError("a bad request")
        return [f"done {j.payload}" for j in jobs]


def test_jobs_within_the_window_with_one_key_share_a_batch_others_wait_for_their_own():
    hold = threading.Event()
    run = Recorder(hold)
    batcher = Batcher(run, window_s=0.2, max_images=4)
    try:
        first = batcher.submit(BatchJob("a", 1, "blocker"))  # runs alone, held, while the others arrive
        time.sleep(0.3)
        futures = [batcher.submit(BatchJob(key, n, name)) for key, n, name in JOBS]
        hold.set()
        results = [f.result(timeout=30) for f in futures]
        assert first.result(timeout=30) == "done blocker"
    finally:
        batcher.close()
    assert results == [f"done {name}" for _, _, name in JOBS]
    # in arrival order: a1, a2 and a3 fill 4 images; b1 waits for its own batch; a4 does not fit and follows
    assert run.batches == [["blocker"], ["a1", "a2", "a3"], ["b1"], ["a4"]]
    assert batcher.batches == 4 and batcher.batched_images == 1 + 4 + 1 + 2


JOBS = [("a", 1, "a1"), ("b", 1, "b1"), ("a", 2, "a2"), ("a", 1, "a3"), ("a", 2, "a4")]


def test_a_failing_job_fails_alone_and_its_batch_mates_are_served():
    hold = threading.Event()
    run = Recorder(hold)
    batcher = Batcher(run, window_s=0.2, max_images=8)
    try:
        blocker = batcher.submit(BatchJob("k", 1, "blocker"))
        time.sleep(0.3)
        futures = {name: batcher.submit(BatchJob("k", 1, name)) for name in ("x", "bad", "y")}
        hold.set()
        assert blocker.result(timeout=30) == "done blocker"
        assert futures["x"].result(timeout=30) == "done x" and futures["y"].result(timeout=30) == "done y"
        with pytest.raises(ValueError, match="a bad request"):
            futures["bad"].result(timeout=30)
    finally:
        batcher.close()
    assert run.batches[1] == ["x", "bad", "y"]  # tried together, then one by one
    assert run.batches[2:] == [["x"], ["bad"], ["y"]]


def test_a_lone_client_never_waits_for_the_window_a_steady_load_fills_its_batch():
    """A batch starts once it holds as many images as the previous one (or when the window ends): a lone
    request goes at once, whatever the window; requests of clients that come back together share a batch."""
    hold = threading.Event()
    run = Recorder(hold)
    batcher = Batcher(run, window_s=5.0, max_images=8)
    try:
        t0 = time.monotonic()
        hold.set()
        assert batcher.submit(BatchJob("k", 1, "lone")).result(timeout=30) == "done lone"
        assert time.monotonic() - t0 < 2.5  # not the 5 s window
        hold.clear()
        blocker = batcher.submit(BatchJob("k", 1, "blocker"))
        time.sleep(0.2)
        three = [batcher.submit(BatchJob("k", 1, name)) for name in ("a", "b", "c")]
        hold.set()
        assert [f.result(timeout=30) for f in [blocker, *three]] == ["done blocker", "done a", "done b", "done c"]
        # the previous batch held 3: the next waits for 3 (d, then e and f a moment later)
        later = [batcher.submit(BatchJob("k", 1, "d"))]
        time.sleep(0.3)
        later += [batcher.submit(BatchJob("k", 1, name)) for name in ("e", "f")]
        assert [f.result(timeout=30) for f in later] == ["done d", "done e", "done f"]
    finally:
        batcher.close()
    assert run.batches == [["lone"], ["blocker"], ["a", "b", "c"], ["d", "e", "f"]]


def test_a_batch_does_not_wait_past_its_window_and_close_refuses_what_waits():
    run = Recorder()
    batcher = Batcher(run, window_s=0.05, max_images=8)
    t0 = time.monotonic()
    assert batcher.submit(BatchJob("k", 1, "alone")).result(timeout=30) == "done alone"
    assert time.monotonic() - t0 < 5
    batcher.close()
    with pytest.raises(RuntimeError, match="closed"):
        batcher.submit(BatchJob("k", 1, "late"))
    with pytest.raises(ValueError, match="max_images 0"):
        Batcher(run, window_s=0.01, max_images=0)


@pytest.fixture(scope="module")
def fleet_model(tmp_path_factory) -> str:
    run = tmp_path_factory.mktemp("batching") / "run"
    write_random_fleet(str(run), tiny_run_config(3))
    return assemble(str(run)).out


def pixels(image) -> np.ndarray:
    return np.asarray(image, dtype=np.int16)


def test_a_request_draws_the_same_images_alone_and_batched_with_others(fleet_model):
    pipe = FleetPipeline.from_pretrained(fleet_model, text_encoder=HashTextEncoder(384, 4))
    svc = FleetService(pipe, read_card(fleet_model), ServeLimits(batch_window_ms=300, max_batch=16))
    # the worker holds its first batch until every request waits: the others then queue together, as under load
    assert svc.batcher is not None
    hold, sample_batch = threading.Event(), svc.batcher.run_batch
    svc.batcher.run_batch = lambda jobs: hold.wait(timeout=30) and sample_batch(jobs)
    try:
        requests = [
            GenerateRequest(prompt=f"digit {i}", strategy="top2", steps=4, guidance_scale=2.0, seed=10 + i, n=1 + i % 2)
            for i in range(6)
        ]
        other = GenerateRequest(prompt="digit 3", strategy="top1", steps=4, guidance_scale=2.0, seed=1)  # another key
        with ThreadPoolExecutor(len(requests) + 1) as pool:
            futures = [pool.submit(svc.generate, r) for r in [*requests, other]]
            deadline = time.monotonic() + 30
            while svc.admitted < 10 and time.monotonic() < deadline:  # all 10 images have a place
                time.sleep(0.01)
            hold.set()
            batched = [f.result(timeout=60) for f in futures]
        health = svc.health()
        alone = [
            pipe([r.prompt], r.n, strategy=r.strategy, steps=r.steps, guidance_scale=r.guidance_scale, seed=r.seed)
            for r in [*requests, other]
        ]
    finally:
        svc.close()
    # 7 requests, two settings: at most 2 batches after the first (which may start alone), never 7
    assert health["served"] == 7 and health["batches"] <= 3 and health["batched_images"] == 10
    for got, ref, req in zip(batched, alone, [*requests, other]):
        assert len(got.images) == req.n and got.prompts == [req.prompt] * req.n
        for image, ref_image in zip(got.images, to_pil(ref.images)):
            assert np.abs(pixels(image) - pixels(ref_image)).max() <= 2  # float rounding of a larger batch only
        k = 1 if req.strategy == "top1" else 2  # each image's own routing, with its request's strategy
        assert len(got.routing) == req.n and all(len(steps) == req.steps for steps in got.routing)
        assert all(len(step["experts"]) == k for steps in got.routing for step in steps)
        assert got.settings.seed == req.seed
