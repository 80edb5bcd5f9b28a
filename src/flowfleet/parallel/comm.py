"""One communication manager per patch-parallel run: registered buffers, one flat allocation, batched
asynchronous all-gathers, per-step byte counts, and one clear error when a rank dies or stalls.

Layers talk to the manager by name and never call torch.distributed themselves:

    comm.register("expert0.block3.attn", shape, family="expert0")   # once per layer, before allocate()
    comm.allocate()                                                 # one flat send + one flat receive buffer
    full = comm.gather(name, fresh)             # blocking all-gather of this step's data      (sync)
    stale = comm.wait(name)                     # what the last gather of this slot delivered   (displaced)
    comm.enqueue(name, fresh)                   # asynchronous all-gather for the next step     (displaced)

A slot is a [shape] region of the flat buffers; the receive side holds every rank's copy,
[group size, *shape]. Consecutive slots of one `family` (the layers of one model, which always run
together) form batches of about `batch_bytes`; a batch's all-gather starts when its last slot is
enqueued, and `wait(name)` blocks only on the batch holding that slot, so a layer waits for exactly
the data it needs while the rest keeps flowing. `batch_bytes=None` sizes batches from the model: about
AUTO_BATCHES per family and forward (at most 8 MiB each), so that the first leaves early in the forward
even for a small model whose whole exchange is smaller than a fixed batch. Shapes are arbitrary and
`rows` selects leading-dim entries (batch rows), so the same slots serve attention keys/values,
convolution halos (register a [B, C, halo, W] slot per boundary) and normalisation statistics.

Why hand-written: torch.distributed offers collectives but no register-once flat buffer with batched
asynchronous gathers; distrifuser's comm manager (read, not copied) is the model for this one.

Bandwidth accounting: for each all-gather a rank must deliver its own chunk to the other size - 1
ranks, so it counts (size - 1) * chunk bytes; a broadcast counts (size - 1) * bytes on the source.
Overlap accounting (`overlap_by_step`): of the asynchronous bytes of a step, those whose gather started
while layers of the forward were still to run (a batch completed before its family's last batch), and
those started at its end (the family's last batch, or flush()): nothing left to hide them behind.
Blocked time (`blocked_by_step`): seconds this rank waited inside band exchanges (a blocking gather, or
waiting for an asynchronous one to land); the step output's gather, which every mode needs, is not in it.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F

from flowfleet.distributed import Group
from flowfleet.errors import FlowfleetError

AUTO_BATCHES = 8  # batch_bytes=None: about this many all-gathers per family and forward
MAX_AUTO_BATCH_BYTES = 8 << 20


class ParallelError(FlowfleetError):
    """A collective failed: another rank died, stalled past the timeout, or the group is misconfigured."""


@dataclass
class _Slot:
    name: str
    family: str
    shape: tuple[int, ...]
    start: int
    numel: int
    batch: int = -1
    enqueued: bool = False


@dataclass
class _Batch:
    slots: list[int]
    start: int
    end: int
    pending: int = 0  # slots enqueued since the last issue
    handle: Any = None  # torch.distributed Work while in flight
    label: str = ""


@dataclass
class _Counter:
    step: int = 0
    by_step: dict[int, int] = field(default_factory=lambda: defaultdict(int))

    def add(self, nbytes: int) -> None:
        self.by_step[self.step] += nbytes


class Collectives:
    """The ranks' groups and the collectives over them that are not the flat-buffer gathers: one-off collectives
    over `world` (step outputs, routing decisions), sequence parallelism's all-to-all and ring exchanges within
    `bands`; the bytes each sends per step, the seconds each waits, and one line naming the op when a peer fails."""

    def __init__(self, bands: Group, world: Group | None, device: torch.device | str, timeout_s: float):
        self.bands = bands
        self.world = world or bands
        self.device = torch.device(device)
        self.timeout_s = float(timeout_s)
        self._bytes = _Counter()
        self._blocked: dict[int, float] = defaultdict(float)  # step -> seconds waited in band exchanges

    # ----------------------------------------------------------------------------------------------
    #                              One-off collectives over all ranks
    # ----------------------------------------------------------------------------------------------

    def all_gather_world(self, tensor: torch.Tensor, what: str = "step output") -> torch.Tensor:
        """Blocking all-gather over every rank -> [world size, *tensor.shape]."""
        if self.world.size == 1:
            return tensor[None]
        tensor = tensor.contiguous()
        outs = [torch.empty_like(tensor) for _ in range(self.world.size)]
        with self._guard("all-gather", what, world=True):
            dist.all_gather(outs, tensor, group=self.world.pg)
        self._bytes.add((self.world.size - 1) * tensor.numel() * tensor.element_size())
        return torch.stack(outs)

    def gather_image(self, band: torch.Tensor, sizes: list[int], what: str = "output band") -> list[torch.Tensor]:
        """Every rank's band of the output -> the whole output of each band group (one group, or two with a
        CFG split), on every rank. sizes: every band's extent along dim -2; unequal bands travel padded to
        the largest and are trimmed on arrival."""
        if band.shape[-2] < max(sizes):
            band = F.pad(band, (0, 0, 0, max(sizes) - band.shape[-2]))
        bands = self.all_gather_world(band, what=what)  # [world, *band.shape]
        n = self.bands.size
        return [
            torch.cat([bands[g * n + i].narrow(-2, 0, sizes[i]) for i in range(n)], dim=-2)
            for g in range(self.world.size // n)
        ]

    def broadcast_world(self, tensor: torch.Tensor, src: int = 0, what: str = "routing") -> torch.Tensor:
        """Every rank gets rank `src`'s tensor (same shape and dtype on every rank)."""
        if self.world.size == 1:
            return tensor
        tensor = tensor.contiguous().clone()
        with self._guard("broadcast", what, world=True):
            dist.broadcast(tensor, src=src, group=self.world.pg)
        if self.world.rank == src:
            self._bytes.add((self.world.size - 1) * tensor.numel() * tensor.element_size())
        return tensor

    def sum_world(self, tensor: torch.Tensor, what: str) -> torch.Tensor:
        """The elementwise sum of every rank's tensor (same shape and dtype on every rank), on every rank."""
        if self.world.size == 1:
            return tensor
        tensor = tensor.contiguous().clone()
        with self._guard("all-reduce", what, world=True):
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.world.pg)
        self._bytes.add(2 * (self.world.size - 1) * tensor.numel() * tensor.element_size() // self.world.size)
        return tensor

    # ----------------------------------------------------------------------------------------------
    #                      Sequence parallelism (flowfleet.parallel.sequence)
    # ----------------------------------------------------------------------------------------------

    def all_to_all_bands(
        self, chunks: list[torch.Tensor], out_shapes: list[tuple[int, ...]], what: str, group: Group | None = None
    ) -> list[torch.Tensor]:
        """Blocking all-to-all within the band group (or `group`, a subgroup of it): chunks[j] goes to member
        j; out[j] (of out_shapes[j]) comes from member j. Chunks may differ in size (uneven bands)."""
        group = group or self.bands
        # one flat all_to_all_single with split sizes: gloo's list all_to_all wants equal tensors
        sizes_in = [c.numel() for c in chunks]
        sizes_out = [math.prod(shape) for shape in out_shapes]
        flat = torch.cat([c.reshape(-1) for c in chunks])
        got = torch.empty(sum(sizes_out), device=self.device, dtype=flat.dtype)
        t0 = time.perf_counter()
        with self._guard("all-to-all", what):
            dist.all_to_all_single(got, flat, sizes_out, sizes_in, group=group.pg)
        self._blocked[self._bytes.step] += time.perf_counter() - t0
        mine = group.rank
        self._bytes.add(sum(n for j, n in enumerate(sizes_in) if j != mine) * flat.element_size())
        return [part.reshape(shape) for part, shape in zip(got.split(sizes_out), out_shapes)]

    def ring_shift(
        self, tensor: torch.Tensor, recv_shape: tuple[int, ...], what: str, group: Group | None = None
    ) -> "RingShift":
        """Send `tensor` to the next member of the band group (or of `group`, a subgroup of it) and receive
        the previous one's (of recv_shape), asynchronously: compute, then .wait() for what arrived."""
        group = group or self.bands
        tensor = tensor.contiguous()
        out = torch.empty(recv_shape, device=self.device, dtype=tensor.dtype)
        size, rank, pg = group.size, group.rank, group.pg
        nxt, prev = (rank + 1) % size, (rank - 1) % size
        if pg is not None:  # point-to-point ops name peers by their rank in the default group
            nxt, prev = dist.get_global_rank(pg, nxt), dist.get_global_rank(pg, prev)
        with self._guard("ring send/receive", what):
            ops = [dist.P2POp(dist.isend, tensor, nxt, group=pg), dist.P2POp(dist.irecv, out, prev, group=pg)]
            handles = dist.batch_isend_irecv(ops)
        self._bytes.add(tensor.numel() * tensor.element_size())
        return RingShift(self, handles, out, what)

    # ----------------------------------------------------------------------------------------------
    #                                         Byte counter
    # ----------------------------------------------------------------------------------------------

    def begin_step(self, step: int) -> None:
        """Count what follows as step `step`'s traffic."""
        self._bytes.step = int(step)

    @property
    def bytes_by_step(self) -> dict[int, int]:
        """Bytes this rank sent per sampler step."""
        return dict(self._bytes.by_step)

    @property
    def blocked_by_step(self) -> dict[int, float]:
        """Seconds this rank waited in band exchanges per step (module docstring)."""
        return dict(self._blocked)

    @property
    def bytes_total(self) -> int:
        return sum(self._bytes.by_step.values())

    @contextmanager
    def _guard(self, op: str, what: str, world: bool = False) -> Iterator[None]:
        """Turn a backend failure (peer closed, timeout) into one line naming the op, rank and timeout."""
        group = self.world if world else self.bands
        t0 = time.monotonic()
        try:
            yield
        except RuntimeError as err:  # DistBackendError and gloo/NCCL errors are RuntimeErrors
            reason = (str(err).strip().splitlines() or ["?"])[0]
            if "] " in reason:  # drop gloo's "[/path/to/file.cc:123] " prefix
                reason = reason.split("] ", 1)[1]
            raise ParallelError(
                f"{op} of {what!r} failed on rank {group.rank} of {group.size} after "
                f"{time.monotonic() - t0:.1f} s (timeout {self.timeout_s:g} s): another rank died or stalled "
                f"({reason[:160]})"
            ) from err


class CommManager(Collectives):
    """Flat-buffer all-gathers within `bands` (the ranks splitting one image), beside the Collectives every
    parallel runner uses."""

    def __init__(
        self,
        bands: Group,
        world: Group | None = None,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        batch_bytes: int | None = 8 << 20,
        timeout_s: float = 60.0,
    ):
        if batch_bytes is not None and batch_bytes < 1:
            raise FlowfleetError(f"batch_bytes: must be >= 1 or None (from the model), got {batch_bytes}")
        super().__init__(bands, world, device, timeout_s)
        self.dtype = dtype
        self.batch_bytes = batch_bytes  # None: chosen per family in allocate()
        self._slots: list[_Slot] = []
        self._index: dict[str, int] = {}
        self._batches: list[_Batch] = []
        self._numel = 0
        self._allocated = False
        self._send = torch.empty(0, device=self.device, dtype=dtype)  # [numel] once allocated
        self._recv = torch.empty(0, 0, device=self.device, dtype=dtype)  # [group size, numel] once allocated
        self._early = _Counter()  # asynchronous bytes whose gather started with layers still to run
        self._late = _Counter()  # ... started at the end of the forward
        self._last_batch: dict[str, int] = {}  # family -> index of its last batch (after allocate())

    # ----------------------------------------------------------------------------------------------
    #                                   Registration
    # ----------------------------------------------------------------------------------------------

    def register(self, name: str, shape: tuple[int, ...], family: str = "") -> None:
        """Reserve a [shape] slot. Once per layer, in forward order, before allocate()."""
        if self._allocated:
            raise RuntimeError(f"comm buffer {name!r} registered after allocate()")
        if name in self._index:
            raise RuntimeError(f"comm buffer {name!r} registered twice")
        numel = 1
        for s in shape:
            numel *= int(s)
        self._index[name] = len(self._slots)
        self._slots.append(_Slot(name, family, tuple(int(s) for s in shape), self._numel, numel))
        self._numel += numel

    def allocate(self) -> None:
        """One flat send buffer and one flat receive buffer for every slot; slots -> batches."""
        if self._allocated:
            return
        self._allocated = True
        self._send = torch.zeros(self._numel, device=self.device, dtype=self.dtype)
        self._recv = torch.zeros(self.bands.size, self._numel, device=self.device, dtype=self.dtype)
        elem = self._send.element_size()
        family_bytes: dict[str, int] = defaultdict(int)
        for slot in self._slots:
            family_bytes[slot.family] += slot.numel * elem
        for i, slot in enumerate(self._slots):
            last = self._batches[-1] if self._batches else None
            same_family = last is not None and self._slots[last.slots[-1]].family == slot.family
            limit = self.batch_bytes or min(MAX_AUTO_BATCH_BYTES, -(-family_bytes[slot.family] // AUTO_BATCHES))
            if last is None or not same_family or (last.end - last.start + slot.numel) * elem > limit:
                self._batches.append(_Batch([], slot.start, slot.start, label=slot.name))
                last = self._batches[-1]
            last.slots.append(i)
            last.end = slot.start + slot.numel
            slot.batch = len(self._batches) - 1
            self._last_batch[slot.family] = slot.batch

    @property
    def num_batches(self) -> int:
        return len(self._batches)

    @property
    def buffer_bytes(self) -> int:
        """Bytes held by the flat buffers (send + receive)."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self._numel * (1 + self.bands.size) * elem

    # ----------------------------------------------------------------------------------------------
    #                                 Registered slots
    # ----------------------------------------------------------------------------------------------

    def gather(self, name: str, tensor: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Blocking all-gather of this slot now -> every rank's data for `rows`, [size, len(rows), ...].

        rows: indices along the slot's first dimension that `tensor` fills (None = the leading ones).
        Without rows the result is a view of the receive buffer, valid until this slot's next transfer."""
        slot = self._slot(name)
        self._await(slot.batch)  # an in-flight asynchronous gather of this slot must land first
        self._write(slot, tensor, rows)
        t0 = time.perf_counter()
        with self._guard("all-gather", name):
            self._all_gather(slot.start, slot.start + slot.numel, async_op=False)
        self._blocked[self._bytes.step] += time.perf_counter() - t0
        full = self._view(slot)
        return full[:, : tensor.shape[0]] if rows is None else full[:, rows]

    def wait(self, name: str) -> torch.Tensor:
        """Every rank's last delivered data of this slot, [size, *shape], waiting only for its own batch.

        The returned tensor is a view of the receive buffer: copy what you need before enqueue()."""
        slot = self._slot(name)
        self._await(slot.batch)
        return self._view(slot)

    def enqueue(self, name: str, tensor: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """Stage this slot's fresh data; its batch's asynchronous all-gather starts once all its slots are in."""
        slot = self._slot(name)
        batch = self._batches[slot.batch]
        if slot.enqueued:
            raise RuntimeError(f"comm buffer {name!r} enqueued twice before its batch was sent")
        self._await(slot.batch)  # never overwrite data that an in-flight gather is still reading
        self._write(slot, tensor, rows)
        slot.enqueued = True
        batch.pending += 1
        if batch.pending == len(batch.slots):
            self._issue(slot.batch, self._late if self._last_batch[slot.family] == slot.batch else self._early)

    def flush(self, family: str | None = None) -> None:
        """Start the gathers of partially enqueued batches (of one family, or all)."""
        for i, batch in enumerate(self._batches):
            if batch.pending and (family is None or self._slots[batch.slots[0]].family == family):
                self._issue(i, self._late)

    def drain(self) -> None:
        """Flush, then wait for every in-flight gather (before tearing the process group down)."""
        self.flush()
        for i in range(len(self._batches)):
            self._await(i)

    # ----------------------------------------------------------------------------------------------
    #                                 Byte counter: overlap
    # ----------------------------------------------------------------------------------------------

    @property
    def overlap_by_step(self) -> dict[int, tuple[int, int]]:
        """step -> (asynchronous bytes sent with layers still to run, bytes sent at the forward's end)."""
        steps = sorted(set(self._early.by_step) | set(self._late.by_step))
        return {s: (self._early.by_step.get(s, 0), self._late.by_step.get(s, 0)) for s in steps}

    # ----------------------------------------------------------------------------------------------
    #                                   Internals
    # ----------------------------------------------------------------------------------------------

    def _slot(self, name: str) -> _Slot:
        if not self._allocated:
            raise RuntimeError("CommManager.allocate() has not been called")
        try:
            return self._slots[self._index[name]]
        except KeyError:
            raise RuntimeError(f"comm buffer {name!r} was never registered") from None

    def _view(self, slot: _Slot) -> torch.Tensor:
        return self._recv[:, slot.start : slot.start + slot.numel].view(self.bands.size, *slot.shape)

    def _write(self, slot: _Slot, tensor: torch.Tensor, rows: torch.Tensor | None) -> None:
        if tuple(tensor.shape[1:]) != slot.shape[1:] or tensor.shape[0] > slot.shape[0]:
            raise RuntimeError(
                f"comm buffer {slot.name!r}: tensor {tuple(tensor.shape)} does not fit slot {slot.shape}"
            )
        view = self._send[slot.start : slot.start + slot.numel].view(slot.shape)
        if rows is None:
            view[: tensor.shape[0]].copy_(tensor)
        else:
            view.index_copy_(0, rows, tensor.to(view.dtype))

    def _all_gather(self, start: int, end: int, async_op: bool):
        size = self.bands.size
        self._bytes.add((size - 1) * (end - start) * self._send.element_size())
        if size == 1:
            self._recv[0, start:end].copy_(self._send[start:end])
            return None
        outs = [self._recv[r, start:end] for r in range(size)]
        return dist.all_gather(outs, self._send[start:end], group=self.bands.pg, async_op=async_op)

    def _issue(self, index: int, counter: _Counter) -> None:
        batch = self._batches[index]
        counter.step = self._bytes.step
        counter.add((self.bands.size - 1) * (batch.end - batch.start) * self._send.element_size())
        with self._guard("all-gather", batch.label):
            batch.handle = self._all_gather(batch.start, batch.end, async_op=True)
        batch.pending = 0
        for i in batch.slots:
            self._slots[i].enqueued = False

    def _await(self, index: int) -> None:
        batch = self._batches[index]
        if batch.handle is None:
            return
        handle, batch.handle = batch.handle, None
        t0 = time.perf_counter()
        with self._guard("asynchronous all-gather", batch.label):
            handle.wait()
        self._blocked[self._bytes.step] += time.perf_counter() - t0


@dataclass
class RingShift:
    """A ring send/receive in flight (Collectives.ring_shift)."""

    comm: Collectives
    handles: list[Any]
    out: torch.Tensor
    what: str

    def wait(self) -> torch.Tensor:
        t0 = time.perf_counter()
        with self.comm._guard("ring send/receive", self.what):
            for handle in self.handles:
                handle.wait()
        self.comm._blocked[self.comm._bytes.step] += time.perf_counter() - t0
        return self.out
