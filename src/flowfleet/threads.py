"""CPU threads: whether a process's idle OpenMP threads spin or sleep, by what the process shares.

    alone    the process has the machine (generate, evaluate, serve, prepare, a training job started by hand):
             the runtime's defaults stand, torch's thread count and idle threads that spin briefly before they
             sleep, unless two of its CPUs are SMT siblings of one physical core
    shared   it runs beside other processes of the same command on the same cores (train-all's concurrent
             jobs, the CPU ranks of `--nproc N`): idle threads sleep (OMP_WAIT_POLICY=PASSIVE)

A spinning thread holds its core. That is what makes the next parallel region start at once when the
process has the core to itself, and what slows whoever else needs it: another process on the same core, or the
other hardware thread of an SMT core. On a 2-core Xeon with a core per thread the demo fleet samples 3-4x
faster with spinning threads than with sleeping ones; on a 2-vCPU VM whose vCPUs were SMT siblings,
`evaluate` ran 44 s with sleeping threads against 53 s with spinning ones (BENCHMARKS.md, "CPU threads").

OpenMP reads these variables once, when torch loads, so the policy is applied before that: by the command line
(cli.py) for its own process, and by whoever starts shared processes for theirs (train/fanout.py,
parallel/launch.py). A variable the user set is never changed.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Mapping

log = logging.getLogger(__name__)

Workload = Literal["alone", "shared"]
WORKLOADS: tuple[Workload, ...] = ("alone", "shared")
SYSFS_CPUS = "/sys/devices/system/cpu"


@dataclass(frozen=True)
class CpuTopology:
    """The logical CPUs this process may run on and the physical cores they belong to."""

    cpus: int
    cores: int

    @property
    def smt(self) -> bool:
        """Two of the CPUs are hardware threads of one core."""
        return self.cpus > self.cores

    @classmethod
    def read(cls, sysfs: str | Path = SYSFS_CPUS, cpus: set[int] | None = None) -> "CpuTopology":
        """From Linux's sysfs (each CPU's thread_siblings_list); where it is missing (another OS, a container
        without /sys), every CPU counts as its own core."""
        if cpus is None:
            cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
        cores: set[frozenset[int]] = set()
        for cpu in cpus:
            try:
                siblings = (Path(sysfs) / f"cpu{cpu}" / "topology" / "thread_siblings_list").read_text()
            except OSError:
                return cls(len(cpus), len(cpus))
            cores.add(frozenset(_cpu_list(siblings)) & frozenset(cpus) or frozenset({cpu}))
        return cls(len(cpus), len(cores))


def _cpu_list(text: str) -> set[int]:
    """Linux's CPU list format: "0-3,8,10-11" -> {0, 1, 2, 3, 8, 10, 11}."""
    out: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def sleeping_threads(workload: Workload, topology: CpuTopology) -> bool:
    """The rule: idle threads sleep where they would take a core someone else needs."""
    if workload not in WORKLOADS:
        raise ValueError(f"workload: expected one of {', '.join(WORKLOADS)}, got {workload!r}")
    return workload == "shared" or topology.smt


def thread_env(
    workload: Workload, environ: Mapping[str, str] | None = None, topology: CpuTopology | None = None
) -> dict[str, str]:
    """The variables the policy adds for a process of this workload: OMP_WAIT_POLICY=PASSIVE where its idle
    threads should sleep, nothing where the defaults stand or where `environ` (default: os.environ) has it."""
    environ = os.environ if environ is None else environ
    if "OMP_WAIT_POLICY" in environ:
        return {}
    return {"OMP_WAIT_POLICY": "PASSIVE"} if sleeping_threads(workload, topology or CpuTopology.read()) else {}


def apply_thread_policy(workload: Workload) -> dict[str, str]:
    """Set this process's variables (before torch loads: later, only processes it starts see them); returns
    what was set."""
    added = thread_env(workload)
    os.environ.update(added)
    if added:
        log.debug("CPU threads (%s): %s", workload, added)
    return added
