"""Dynamic batching across requests: those that arrive within a short window and share their sampling
settings (everything but the seed) are sampled as one batch by one worker thread, which owns the device.

    batcher = Batcher(run_batch, window_s=0.02, max_images=32)
    future = batcher.submit(BatchJob(key, n=1, payload=...))   # run_batch([job, ...]) -> one result per job
    result = future.result()

Policy, as Ray Serve's `@serve.batch` and Triton's dynamic batcher have it: the oldest waiting job opens a
batch; jobs with the same key join it (in arrival order) until `max_images` images are reached; jobs with
another key wait for a batch of their own, in order. The batch starts once it holds as many images as the
previous batch did, or `window_s` after it could first start (its first job's arrival, or the end of the batch
before), whichever comes first: a lone client never waits for a window (its previous batch held its own images
only), the clients of a steady load, which come back together after their batch, fill the next one at once, and
jobs that arrive while a batch samples form the next. A batch that
raises is run again job by job, so one bad request fails alone, never its batch-mates.

Written by hand because `flowfleet serve` runs in one process without Ray (Ray Serve's batcher needs a
Ray deployment) and the batching rule is the only logic: a condition variable and a list.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Sequence

log = logging.getLogger(__name__)


@dataclass(eq=False)
class BatchJob:
    key: Hashable  # jobs with equal keys may share a batch
    n: int  # images this job adds to a batch
    payload: Any = None  # what run_batch needs of it
    future: Future = field(default_factory=Future)
    arrived: float = field(default_factory=time.monotonic)
    started: float | None = None  # when its batch began sampling (monotonic)


class Batcher:
    def __init__(
        self,
        run_batch: Callable[[Sequence[BatchJob]], Sequence[Any]],
        window_s: float,
        max_images: int,
        on_start: Callable[[], None] | None = None,
    ) -> None:
        """on_start: run first in the worker thread (e.g. its share of torch's CPU threads)."""
        if window_s < 0 or max_images < 1:
            raise ValueError(f"batcher: window {window_s} s and max_images {max_images} must be >= 0 and >= 1")
        self.run_batch, self.on_start = run_batch, on_start
        self.window_s = window_s
        self.max_images = max_images
        self.batches = 0  # batches run, for /api/health
        self.batched_images = 0
        self._last_images = 0  # images of the previous batch: how full the next one is expected to get
        self._free_since = time.monotonic()  # when the worker finished its last batch
        self._waiting: list[BatchJob] = []  # arrival order; guarded by _changed
        self._changed = threading.Condition()
        self._closed = False
        self._worker = threading.Thread(target=self._run, name="flowfleet-batcher", daemon=True)
        self._worker.start()

    @property
    def alive(self) -> bool:
        """The worker thread runs (False after close, or if it died)."""
        return self._worker.is_alive()

    def submit(self, job: BatchJob) -> Future:
        with self._changed:
            if self._closed:
                raise RuntimeError("batcher: closed")
            self._waiting.append(job)
            self._changed.notify()
        return job.future

    def close(self) -> None:
        """Stop after the batch being sampled; jobs still waiting get an error."""
        with self._changed:
            self._closed = True
            left, self._waiting = self._waiting, []
            self._changed.notify()
        for job in left:
            job.future.set_exception(RuntimeError("batcher: closed before this request ran"))
        self._worker.join(timeout=60)

    # -- the worker ---------------------------------------------------------------------------------

    def _members(self, first: BatchJob) -> list[BatchJob]:
        """The waiting jobs that join `first`'s batch, in arrival order, within max_images."""
        batch, images = [], 0
        for job in self._waiting:
            if job.key == first.key and images + job.n <= self.max_images:
                batch.append(job)
                images += job.n
        return batch

    def _next_batch(self) -> list[BatchJob] | None:
        with self._changed:
            while not self._waiting and not self._closed:
                self._changed.wait()
            if self._closed:
                return None
            first = self._waiting[0]
            expected = min(self.max_images, self._last_images)
            # the window opens when the batch could first start: a job that waited out the previous batch still
            # gives the clients of that batch, which come back after it, the window to join
            deadline = max(first.arrived, self._free_since) + self.window_s
            while True:
                batch = self._members(first)
                left = deadline - time.monotonic()
                if left <= 0 or sum(j.n for j in batch) >= expected or self._closed:
                    break
                self._changed.wait(left)
            self._waiting = [j for j in self._waiting if j not in batch]
            self._last_images = sum(j.n for j in batch)
            return batch

    def _run(self) -> None:
        if self.on_start is not None:
            self.on_start()
        while (batch := self._next_batch()) is not None:
            started = time.monotonic()
            for job in batch:
                job.started = started
            self.batches += 1
            self.batched_images += sum(j.n for j in batch)
            self._settle(batch)
            self._free_since = time.monotonic()
            log.debug(
                "batch of %d images (%d requests): the first waited %.1f ms, sampled in %.1f ms",
                sum(j.n for j in batch),
                len(batch),
                (started - batch[0].arrived) * 1000,
                (time.monotonic() - started) * 1000,
            )

    def _settle(self, batch: list[BatchJob]) -> None:
        try:
            results = self.run_batch(batch)
        except Exception as err:  # noqa: BLE001 - handed to the requests' futures
            if len(batch) == 1:
                if not batch[0].future.done():
                    batch[0].future.set_exception(err)
                return
            log.warning("a batch of %d requests failed (%s); running them one by one", len(batch), err)
            for job in batch:
                self._settle([job])
            return
        for job, result in zip(batch, results):
            if not job.future.done():  # (a future cancelled by its caller takes no result)
                job.future.set_result(result)
