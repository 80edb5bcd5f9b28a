"""Starting N ranks: inside torchrun, by relaunching under torchrun, or as local processes (tests).

One code path for CPU and GPU: gloo when the ranks run on CPU, NCCL when each has a CUDA device.
Every process group is created with a timeout, so a rank that dies or stalls makes the others raise
flowfleet.parallel.comm.ParallelError (one line) instead of hanging; torchrun then stops the rest.

    flowfleet generate DIR --nproc 2 ...     (not under torchrun)  -> relaunch_torchrun(2, argv)
    torchrun --nproc-per-node 2 -m flowfleet.cli generate DIR --nproc 2 ...   -> init_from_env()
    run_local(fn, 2)                         tests/benchmarks: fn(ctx, ...) on 2 local processes
"""

from __future__ import annotations

import datetime
import os
import queue as queue_mod
import socket
import time
import traceback
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from flowfleet.device import resolve_device
from flowfleet.errors import FlowfleetError
from flowfleet.parallel.comm import Group

TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class DistContext:
    """This process's place among the ranks of one parallel run."""

    rank: int
    world_size: int
    device: torch.device
    backend: str  # "gloo" | "nccl" | "none" (a single process, no process group)
    timeout_s: float

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def world(self) -> Group:
        return Group(None, self.rank, self.world_size)

    def subgroups(self, size: int) -> Group:
        """Split the ranks into consecutive groups of `size`; -> the group holding this rank.

        Every rank creates every group (torch.distributed requires it), in the same order."""
        if self.world_size % size:
            raise FlowfleetError(f"cannot split {self.world_size} ranks into groups of {size}")
        if size == self.world_size:
            return self.world
        mine = Group.solo()
        for first in range(0, self.world_size, size):
            ranks = list(range(first, first + size))
            pg = dist.new_group(ranks, timeout=datetime.timedelta(seconds=self.timeout_s)) if size > 1 else None
            if self.rank in ranks:
                mine = Group(pg, self.rank - first, size)
        return mine


def single_process(device: torch.device | str = "cpu") -> DistContext:
    return DistContext(0, 1, torch.device(device), "none", 0.0)


def default_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def in_torchrun() -> bool:
    """Whether this process was started by torchrun (or anything setting its environment)."""
    return all(k in os.environ for k in TORCHRUN_ENV)


def init_process_group(rank: int, world_size: int, *, init_method: str = "env://", timeout_s: float = 60.0,
                       device: str | None = None, local_rank: int | None = None) -> DistContext:
    """Join the process group (gloo on CPU, NCCL on CUDA) with a collective timeout."""
    dev = resolve_device(device, rank if local_rank is None else local_rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    backend = default_backend(dev)
    kwargs: dict[str, Any] = {}
    if backend == "nccl":
        kwargs["device_id"] = dev  # eager NCCL init: a missing peer fails here, within the timeout
    try:
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    except (RuntimeError, ValueError) as err:
        reason = (str(err).strip().splitlines() or ["?"])[0][:200]
        raise FlowfleetError(f"rank {rank} of {world_size}: could not join the process group within "
                             f"{timeout_s:g} s ({reason})") from err
    return DistContext(rank, world_size, dev, backend, timeout_s)


def init_from_env(timeout_s: float = 60.0, device: str | None = None) -> DistContext:
    """Inside torchrun: join the group described by RANK / WORLD_SIZE / LOCAL_RANK / MASTER_*."""
    if not in_torchrun():
        missing = ", ".join(k for k in TORCHRUN_ENV if k not in os.environ)
        raise FlowfleetError(f"not started by torchrun (missing {missing})")
    return init_process_group(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), timeout_s=timeout_s,
                              device=device, local_rank=int(os.environ["LOCAL_RANK"]))


def shutdown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def relaunch_torchrun(nproc: int, argv: Sequence[str], threads_per_rank: int = 1) -> int:
    """Run `python -m flowfleet.cli ARGV` on nproc local ranks as torchrun --standalone does; -> 0.

    torchrun's own launcher (elastic_launch) is called directly rather than through its command line,
    whose parser would take the command's options (--n, --nproc) for abbreviations of its own. It
    stops every rank when one fails; the failing rank has printed its own one-line error."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    os.environ.setdefault("OMP_NUM_THREADS", str(threads_per_rank))
    # What `torchrun --standalone` sets up: a c10d rendezvous on a free local port.
    opts = torchrun.parse_args(["--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0", f"--rdzv-id={uuid.uuid4()}",
                                f"--nproc-per-node={nproc}", "--max-restarts=0", "--module", "flowfleet.cli"])
    config, cmd, cmd_args = torchrun.config_from_args(opts)
    try:
        elastic_launch(config, cmd)(*cmd_args, *argv)
    except ChildFailedError as err:
        rank, failure = min(err.failures.items(), key=lambda kv: kv[1].timestamp)  # global rank -> failure
        raise FlowfleetError(f"--nproc {nproc}: rank {rank} failed first (exit code {failure.exitcode}; its error "
                             f"is printed above) and the other ranks were stopped") from None
    return 0


# --------------------------------------------------------------------------------------------------
#                         Local processes (tests and benchmarks)
# --------------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _to_plain(obj: Any) -> Any:
    """Tensors -> numpy arrays (pickled by value, so results survive their process's exit)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().numpy()
    if isinstance(obj, dict):
        return {k: _to_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_plain(v) for v in obj)
    return obj


def _from_plain(obj: Any) -> Any:
    import numpy as np

    if isinstance(obj, np.ndarray):
        return torch.from_numpy(obj)
    if isinstance(obj, dict):
        return {k: _from_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_from_plain(v) for v in obj)
    return obj


def _child(rank: int, nproc: int, port: int, fn: Callable, args: tuple, timeout_s: float, threads: int,
           results: Any) -> None:
    torch.set_num_threads(threads)
    try:
        ctx = init_process_group(rank, nproc, init_method=f"tcp://127.0.0.1:{port}", timeout_s=timeout_s,
                                 device="cpu")
        try:
            out = fn(ctx, *args)
        finally:
            shutdown()
        results.put((rank, True, _to_plain(out)))
    except BaseException as err:  # reported to the parent as one line (full traceback on stderr)
        if not isinstance(err, FlowfleetError):
            traceback.print_exc()
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        results.put((rank, False, f"{type(err).__name__}: {first}"))


def run_local(fn: Callable[..., Any], nproc: int, args: tuple = (), *, timeout_s: float = 30.0, threads: int = 1,
              start_method: str = "spawn", deadline_s: float | None = None) -> list[Any]:
    """fn(ctx, *args) on nproc local CPU ranks (gloo over 127.0.0.1) -> each rank's return value.

    fn must be importable (module level). A rank that raises makes this raise one FlowfleetError naming
    every rank's outcome; ranks still running `timeout_s` after the first failure are terminated.
    `start_method`: "spawn" (clean processes) or "fork" (fast start; only with one thread per rank)."""
    ctx = torch.multiprocessing.get_context(start_method)
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(r, nproc, port, fn, args, timeout_s, threads, results), daemon=True)
             for r in range(nproc)]
    for p in procs:
        p.start()
    outcomes: dict[int, tuple[bool, Any]] = {}
    end = time.monotonic() + (deadline_s if deadline_s is not None else 3600.0)
    failed_at: float | None = None
    while len(outcomes) < nproc:
        now = time.monotonic()
        limit = end if failed_at is None else min(end, failed_at + timeout_s)
        if now >= limit:
            break
        try:
            rank, ok, value = results.get(timeout=min(0.5, limit - now))
            outcomes[rank] = (ok, value)
            if not ok and failed_at is None:
                failed_at = time.monotonic()
        except queue_mod.Empty:
            dead = [r for r, p in enumerate(procs) if r not in outcomes and p.exitcode is not None]
            if dead and failed_at is None:
                failed_at = time.monotonic()  # a rank exited without reporting: give the others timeout_s
    stopped = set()
    for r, p in enumerate(procs):
        if p.is_alive():
            p.terminate()
            stopped.add(r)
        p.join(timeout=10)
    if len(outcomes) == nproc and all(ok for ok, _ in outcomes.values()):
        return [_from_plain(outcomes[r][1]) for r in range(nproc)]
    lines = []
    for r, p in enumerate(procs):
        if r in outcomes:
            ok, value = outcomes[r]
            lines.append(f"rank {r}: {'ok' if ok else value}")
        elif r in stopped:
            lines.append(f"rank {r}: stopped (no result {timeout_s:g} s after the first failure)")
        else:
            lines.append(f"rank {r}: exited with code {p.exitcode} without a result")
    raise FlowfleetError("parallel run failed: " + "; ".join(lines))
