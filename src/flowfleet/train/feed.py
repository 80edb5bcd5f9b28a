"""A training job's batches, read ahead: while a step computes, a background thread gathers the micro-batches of the
next `prefetch` steps (and pins them where they go to a GPU), as a DataLoader's workers with prefetch_factor and
pin_memory do. The batches are the sampler's, so they are the same whether read ahead or not, and the data position
that a checkpoint saves is untouched by what was read ahead.

A thread rather than DataLoader's worker processes: a gather is byte-range reads and index_select, which release the
GIL, and a worker process would copy every batch once more through shared memory to hand it over.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import torch

from flowfleet.train.data import batch_field

Batch = dict[str, torch.Tensor]


class Gatherable(Protocol):
    def gather(self, items: torch.Tensor, device: torch.device | str = "cpu") -> Batch: ...


class BatchFeed:
    """`take(key, items, device)`: the batch of `items`, read ahead by `ahead(key, items)` where it was; any other
    request is gathered on the spot. Keys grow as training goes on (sample position, micro-batch): what was read
    ahead under a smaller key than the one asked for is dropped."""

    def __init__(self, data: Gatherable, prefetch: int, pin: bool):
        self.data, self.prefetch, self.pin = data, prefetch, pin
        self._pending: deque[tuple[tuple[int, int], torch.Tensor, Future[Batch]]] = deque()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="flowfleet-feed") if prefetch else None
        self.read_ahead = self.on_the_spot = 0  # batches handed over of each kind

    def _read(self, items: torch.Tensor) -> Batch:
        batch = self.data.gather(items)  # on the CPU
        return {name: x.pin_memory() for name, x in batch.items()} if self.pin else batch

    def ahead(self, key: tuple[int, int], items: torch.Tensor) -> None:
        """Start reading `items` (the batch known as `key`, e.g. (sample position, micro-batch)) in the background."""
        if self._pool is None or any(k == key for k, _, _ in self._pending):
            return
        self._pending.append((key, items, self._pool.submit(self._read, items)))

    def take(self, key: tuple[int, int], items: torch.Tensor, device: torch.device) -> Batch:
        while self._pending and self._pending[0][0] < key:  # read ahead for steps that went by without asking
            self._pending.popleft()[2].cancel()
        if self._pending and self._pending[0][0] == key:
            _, read_items, future = self._pending.popleft()
            if torch.equal(read_items, items):
                self.read_ahead += 1
                return {name: batch_field(name, x, device) for name, x in future.result().items()}
        self.on_the_spot += 1
        return self.data.gather(items, device)

    def close(self) -> None:
        for _, _, future in self._pending:
            future.cancel()
        self._pending.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
