"""Starting N ranks: inside torchrun, by relaunching under torchrun, or as local processes (tests).

The world each rank joins (DistContext, gloo on CPU, NCCL on GPU, collectives with a timeout) is
flowfleet.distributed's; a rank that dies or stalls makes the others raise one line instead of
hanging, and torchrun then stops the rest.

    flowfleet generate DIR --nproc 2 ...     (not under torchrun)  -> relaunch_torchrun(2, argv)
    torchrun --nproc-per-node 2 -m flowfleet.cli generate DIR --nproc 2 ...   -> init_from_env()
    run_local(fn, 2)                         tests/benchmarks: fn(ctx, ...) on 2 local processes

torchrun's launcher is imported only when relaunching.
"""

from __future__ import annotations

import os
import queue as queue_mod
import socket
import time
import traceback
import uuid
from typing import Any, Callable, Sequence

import numpy as np
import torch

from flowfleet.distributed import init_process_group, shutdown  # the world itself; this module only starts ranks
from flowfleet.errors import FlowfleetError, ParameterError
from flowfleet.threads import CEILING, thread_env


def relaunch_torchrun(nproc: int, argv: Sequence[str], threads_per_rank: int = 1) -> int:
    """Run `python -m flowfleet.cli ARGV` on nproc local ranks as torchrun --standalone does; -> 0.

    torchrun's own launcher (elastic_launch) is called directly rather than through its command line,
    whose parser would take the command's options (--n, --nproc) for abbreviations of its own. It
    stops every rank when one fails; the failing rank has printed its own one-line error."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    if os.environ.pop(CEILING, None) is not None:  # the count the policy chose for this process: not the ranks'
        del os.environ["OMP_NUM_THREADS"]
    os.environ.setdefault("OMP_NUM_THREADS", str(threads_per_rank))
    os.environ.update(thread_env("shared"))  # the ranks share this machine's cores: their idle threads sleep
    # What `torchrun --standalone` sets up: a c10d rendezvous on a free local port.
    opts = torchrun.parse_args(
        [
            "--rdzv-backend=c10d",
            "--rdzv-endpoint=localhost:0",
            f"--rdzv-id={uuid.uuid4()}",
            f"--nproc-per-node={nproc}",
            "--max-restarts=0",
            "--module",
            "flowfleet.cli",
        ]
    )
    config, cmd, cmd_args = torchrun.config_from_args(opts)
    try:
        elastic_launch(config, cmd)(*cmd_args, *argv)
    except ChildFailedError as err:
        rank, failure = min(err.failures.items(), key=lambda kv: kv[1].timestamp)  # global rank -> failure
        raise ParameterError(
            f"nproc {nproc}",
            f"rank {rank} failed first (exit code {failure.exitcode}; its error "
            f"is printed above) and the other ranks were stopped",
        ) from None
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
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(obj)
    if isinstance(obj, dict):
        return {k: _from_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_from_plain(v) for v in obj)
    return obj


def _child(
    rank: int, nproc: int, port: int, fn: Callable, args: tuple, timeout_s: float, threads: int, results: Any
) -> None:
    torch.set_num_threads(threads)
    try:
        ctx = init_process_group(rank, nproc, init_method=f"tcp://127.0.0.1:{port}", timeout_s=timeout_s, device="cpu")
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


def run_local(
    fn: Callable[..., Any],
    nproc: int,
    args: tuple = (),
    *,
    timeout_s: float = 30.0,
    threads: int = 1,
    start_method: str = "spawn",
    deadline_s: float | None = None,
) -> list[Any]:
    """fn(ctx, *args) on nproc local CPU ranks (gloo over 127.0.0.1) -> each rank's return value.

    fn must be importable (module level). A rank that raises makes this raise one FlowfleetError naming
    every rank's outcome; ranks still running `timeout_s` after the first failure are terminated.
    `start_method`: "spawn" (clean processes) or "fork" (fast start; only with one thread per rank)."""
    ctx = torch.multiprocessing.get_context(start_method)
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(  # type: ignore[attr-defined]  # typeshed's BaseContext lacks Process; real contexts have it
            target=_child, args=(r, nproc, port, fn, args, timeout_s, threads, results), daemon=True
        )
        for r in range(nproc)
    ]
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
