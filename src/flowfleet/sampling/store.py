"""Experts on demand: lazy loading and a bounded number of resident experts (least recently used).

An assembled fleet of K experts rarely needs all of them at once: with top-1 routing a batch usually
touches a few. ExpertStore loads an expert the first time the router selects it and, when
`max_resident` is set (`generate --offload M`), releases the least recently used one before loading
an (M+1)-th. A released expert is reloaded from its model folder the next time it is selected, so the
peak memory is about M experts instead of K, at the price of reloads when routing jumps between more
than M experts. (On a GPU one could park released experts in host memory instead; flowfleet releases
them entirely because the point of --offload on CPU machines is to bound host RAM.)

The store holds any callables, not only DiT modules: tests and the 2-D toy pass closed-form velocity
functions through the same routing code as real experts.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import sys
from collections import Counter, OrderedDict
from typing import Callable, Iterable, Sequence

import torch

ExpertFn = Callable[..., torch.Tensor]  # (x [B, C, H, W], t [B], **condition) -> velocity [B, C, H, W]


class ExpertStore:
    """Expert id -> callable, loaded lazily through `loader(k)`, at most `max_resident` kept at a time.

    num_experts is K (the router's outputs); present lists the ids that exist (an assembled subset may
    lack some). Counters `loads` and `releases` record what happened, for tests and the usage view.
    """

    def __init__(
        self,
        loader: Callable[[int], ExpertFn],
        present: Iterable[int],
        num_experts: int,
        max_resident: int | None = None,
    ):
        self.present = tuple(sorted(int(k) for k in present))
        self.num_experts = int(num_experts)
        if not self.present:
            raise ValueError("an expert store needs at least one expert")
        bad = [k for k in self.present if not 0 <= k < self.num_experts]
        if bad:
            raise ValueError(f"expert ids {bad} outside 0..{self.num_experts - 1}")
        if max_resident is not None and max_resident < 1:
            raise ValueError(f"offload: at most M experts resident needs M >= 1, got {max_resident}")
        self.max_resident = max_resident
        self._loader = loader
        self._resident: OrderedDict[int, ExpertFn] = OrderedDict()  # least recently used first
        self.loads: Counter[int] = Counter()
        self.releases: Counter[int] = Counter()

    @classmethod
    def from_callables(
        cls, experts: Sequence[ExpertFn], present: Iterable[int] | None = None, max_resident: int | None = None
    ) -> "ExpertStore":
        """Experts already in memory (closed-form toys, counting wrappers in tests, benchmarks)."""
        ids = range(len(experts)) if present is None else present
        return cls(lambda k: experts[k], ids, len(experts), max_resident)

    # -- access -----------------------------------------------------------------------------------------

    @property
    def resident(self) -> tuple[int, ...]:
        """Ids currently loaded, least recently used first."""
        return tuple(self._resident)

    def is_resident(self, k: int) -> bool:
        return k in self._resident

    def get(self, k: int) -> ExpertFn:
        """The expert k, loading it (and releasing the least recently used one) when needed."""
        if k not in self.present:
            raise KeyError(f"expert {k} is not part of this fleet (present: {list(self.present)})")
        if k in self._resident:
            self._resident.move_to_end(k)
            return self._resident[k]
        if self.max_resident is not None and len(self._resident) >= self.max_resident:
            while len(self._resident) >= self.max_resident:
                old = next(iter(self._resident))
                del self._resident[old]  # no other reference: its memory is freed here
                self.releases[old] += 1
            return_freed_memory()
        expert = self._loader(k)
        self.loads[k] += 1
        self._resident[k] = expert
        return expert


def return_freed_memory() -> None:
    """Hand the memory of released experts back to the OS before the next one loads.

    glibc keeps freed heap blocks of a few MB (an expert's weight matrices) for reuse instead of
    unmapping them, so without a trim the resident set of a process that releases and reloads experts
    grows to about twice the experts it holds (measured in benchmarks/sample.py). No library exposes
    malloc_trim, hence ctypes; elsewhere than glibc this only collects garbage.
    """
    gc.collect()
    if sys.platform.startswith("linux"):
        name = ctypes.util.find_library("c")
        try:
            ctypes.CDLL(name).malloc_trim(0)
        except (OSError, AttributeError, TypeError):  # musl and friends: no malloc_trim
            pass
