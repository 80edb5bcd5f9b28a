"""CPU threads: how many threads a process runs and whether its idle OpenMP threads spin or sleep, by what it shares.

    alone    a command started by hand (generate, evaluate, serve, prepare, demo, a training job): torch's defaults
             where the machine is idle (idle threads that spin briefly before they sleep, one per CPU); where it is
             not (other runnable threads on its CPUs, two of its CPUs SMT siblings), idle threads sleep and it keeps a
             thread per CPU it may use (a cgroup's CPU quota below its CPUs: that many), while its long loops of small
             steps (the trainer's, the autoencoder's) run as many threads as CPUs nobody else wants, at least one
    shared   it runs beside other processes of the same command on the same cores (train-all's concurrent jobs, the
             CPU ranks of `--nproc N`): idle threads sleep (OMP_WAIT_POLICY=PASSIVE), each its thread budget

A spinning thread holds its core. That is what makes the next parallel region start at once when the process has the
core to itself, and what slows whoever else needs it: another process on the same core, or the other hardware thread of
an SMT core; and a process whose threads outnumber the cores left to it waits, region after region, for its last thread
to be scheduled. That last cost depends on the work: a loop of small steps (an autoencoder's convolutions, a small
expert's training step) meets a barrier every few hundred microseconds and runs fastest on the CPUs left to it, while
sampling's larger operations keep their threads busy between barriers and, the scheduler sharing the cores by thread,
run fastest on every CPU (beside one busy process, the emoji autoencoder's step is faster on one thread than on two
sleeping ones, while `generate` keeps its time alone on two sleeping ones, and one thread samples slower than two even
on an idle machine). With the machine to itself, the demo fleet samples several times faster with spinning threads
than with sleeping ones; beside one busy process, torch's defaults slow `prepare` several times over (BENCHMARKS.md,
"CPU threads").

OpenMP reads its wait policy once, when torch loads, so that part is decided before: by the command line (cli.py)
for its own process from what the machine is doing then, and by whoever starts shared processes for theirs
(train/fanout.py, parallel/launch.py). The thread count can still change later: a long loop keeps a ThreadGovernor,
which holds a count the load does not choose (a training loop's default: the same seed, the same weights) or follows
the load between steps with torch.set_num_threads (`serve`'s batches; a training loop with follow_load). A variable the
user set is never changed (OMP_WAIT_POLICY, OMP_NUM_THREADS); FLOWFLEET_THREADS=static keeps the rule of workload
and SMT alone, as on a machine nobody else uses (the test suite sets it: its decisions must not follow the load of
the machine it runs on).
"""

from __future__ import annotations

import logging
import math
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal, Mapping

log = logging.getLogger(__name__)

Workload = Literal["alone", "shared"]
WORKLOADS: tuple[Workload, ...] = ("alone", "shared")
SYSFS_CPUS = "/sys/devices/system/cpu"
PROC = "/proc"
CGROUP = "/sys/fs/cgroup"
STATIC = "static"  # FLOWFLEET_THREADS=static: no load, no quota, the rule of workload and SMT alone
CEILING = "FLOWFLEET_THREADS_CEILING"  # set beside an OMP_NUM_THREADS the policy chose: the count it may go back up to
BUSY = 0.5  # other runnable threads from which a CPU counts as wanted by someone else
FOLLOW_EVERY_S = 2.0  # how often a long loop reads the load again


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


@dataclass(frozen=True)
class MachineLoad:
    """What else wants this process's CPUs: other runnable threads (a median of a few readings of the kernel's
    runnable count, this process's own running threads left out) and the CPUs its cgroup's quota allows."""

    others: float = 0.0
    quota: float | None = None  # CPUs (cpu.max quota / period); None: no quota

    @classmethod
    def read(
        cls,
        proc: str | Path = PROC,
        cgroup: str | Path = CGROUP,
        samples: int = 5,
        pause_s: float = 0.002,
        sleep: Callable[[float], None] = time.sleep,
    ) -> "MachineLoad":
        """From Linux's /proc and cgroup files; where they are missing (another OS), an idle machine, no quota."""
        readings = []
        for i in range(samples):
            running = _procs_running(Path(proc))
            if running is None:
                return cls(0.0, read_quota(proc, cgroup))
            readings.append(max(0, running - _own_running(Path(proc))))
            if i + 1 < samples:
                sleep(pause_s)
        return cls(float(statistics.median(readings)), read_quota(proc, cgroup))


def _procs_running(proc: Path) -> int | None:
    """/proc/stat's procs_running: the threads runnable on the machine now (this one included)."""
    try:
        for line in (proc / "stat").read_text().splitlines():
            if line.startswith("procs_running "):
                return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def _own_running(proc: Path) -> int:
    """This process's threads in state R (running or runnable), at least the one reading: /proc/self/task/*/stat."""
    count = 0
    try:
        tasks = list((proc / "self" / "task").iterdir())
    except OSError:
        return 1
    for task in tasks:
        try:
            state = (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        count += state == "R"
    return max(count, 1)


def read_quota(proc: str | Path = PROC, cgroup: str | Path = CGROUP) -> float | None:
    """The CPUs this process's cgroup may use: the tightest quota of its cgroup and those above it (cgroup v2
    cpu.max "QUOTA PERIOD"; v1 cpu.cfs_quota_us / cpu.cfs_period_us), None without one or where unreadable."""
    try:
        lines = (Path(proc) / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return None
    quotas = []
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        for folder in _ancestors(path):
            if controllers == "":  # v2: one hierarchy
                quotas.append(_quota_v2(Path(cgroup, folder, "cpu.max")))
            elif "cpu" in controllers.split(","):
                for mount in dict.fromkeys((controllers, "cpu")):
                    quotas.append(_quota_v1(Path(cgroup, mount, folder)))
    found = [q for q in quotas if q is not None]
    return min(found) if found else None


def _ancestors(path: str) -> list[str]:
    """ "/a/b" -> ["a/b", "a", ""]: a cgroup's folder and those above it, relative to the hierarchy's root."""
    parts = [p for p in path.strip().split("/") if p]
    return ["/".join(parts[:n]) for n in range(len(parts), -1, -1)]


def _quota_v2(path: Path) -> float | None:
    try:
        quota, period = path.read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def _quota_v1(folder: Path) -> float | None:
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else quota / period


# --------------------------------------------------------------------------------------------------
#                                          The rule
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ThreadChoice:
    """What the policy chose for a process: whether idle threads sleep, its thread count (None: torch's default, one
    per CPU), the CPUs it may use at most (affinity and quota), and why, in words."""

    sleep: bool
    threads: int | None
    usable: int
    why: str

    def describe(self) -> str:
        """'1 thread, idle threads sleep (1 other runnable thread on its 2 CPUs)'."""
        count = "torch's default threads"
        if self.threads is not None:
            count = f"{self.threads} thread" + "s" * (self.threads > 1)
        return f"{count}, idle threads {'sleep' if self.sleep else 'spin'} ({self.why})"


def usable_cpus(topology: CpuTopology, load: MachineLoad) -> int:
    """The CPUs a process may use: its affinity's, or fewer under a cgroup quota (at least 1)."""
    return topology.cpus if load.quota is None else max(1, min(topology.cpus, math.floor(load.quota)))


def choose(workload: Workload, topology: CpuTopology, load: MachineLoad = MachineLoad()) -> ThreadChoice:
    """The rule as a process starts: idle threads sleep where they would take a core someone else needs, and a process
    alone runs a thread per CPU its affinity and quota allow (its long loops then follow free_cpus)."""
    if workload not in WORKLOADS:
        raise ValueError(f"workload: expected one of {', '.join(WORKLOADS)}, got {workload!r}")
    usable = usable_cpus(topology, load)
    reasons = []
    if workload == "shared":
        reasons.append("beside other processes of the same command")
    if topology.smt:
        reasons.append(f"its {topology.cpus} CPUs are SMT siblings of {topology.cores} cores")
    if load.others >= BUSY:
        reasons.append(f"{load.others:g} other runnable threads on its {topology.cpus} CPUs")
    if load.quota is not None and load.quota < topology.cpus:
        reasons.append(f"a cgroup quota of {load.quota:g} CPUs")
    threads = usable if workload == "alone" and usable < topology.cpus else None
    return ThreadChoice(bool(reasons), threads, usable, "; ".join(reasons) or "nothing else wants its CPUs")


def free_cpus(topology: CpuTopology, load: MachineLoad) -> int:
    """The CPUs nobody else wants, between 1 and those the affinity and quota allow: the threads of a long loop of
    small steps, whose every barrier would otherwise wait for a thread the scheduler gave someone else's turn."""
    usable = usable_cpus(topology, load)
    return max(1, min(usable, math.floor(usable - load.others + 0.5)))


def sleeping_threads(workload: Workload, topology: CpuTopology, load: MachineLoad = MachineLoad()) -> bool:
    """Whether idle threads sleep under the rule (choose)."""
    return choose(workload, topology, load).sleep


def follows_load(environ: Mapping[str, str]) -> bool:
    """Whether the policy reads the machine's load (FLOWFLEET_THREADS is not static)."""
    return environ.get("FLOWFLEET_THREADS", "auto") != STATIC


def loops_follow_load(environ: Mapping[str, str]) -> bool:
    """Whether a long loop's ThreadGovernor follows the load: not under FLOWFLEET_THREADS=static, nor where the user
    set OMP_NUM_THREADS (the policy's own, which names its CEILING, may move)."""
    return follows_load(environ) and not ("OMP_NUM_THREADS" in environ and CEILING not in environ)


def thread_env(
    workload: Workload,
    environ: Mapping[str, str] | None = None,
    topology: CpuTopology | None = None,
    load: MachineLoad | None = None,
) -> dict[str, str]:
    """The variables the policy adds for a process of this workload: OMP_WAIT_POLICY=PASSIVE where its idle threads
    should sleep; for a process alone, OMP_NUM_THREADS where it should run fewer threads than its CPUs (and beside
    it FLOWFLEET_THREADS_CEILING, the count a ThreadGovernor may go back up to). Nothing the user set in `environ`
    (default: os.environ) is changed; `load` None: read now (unless FLOWFLEET_THREADS=static: an idle machine)."""
    environ = os.environ if environ is None else environ
    if load is None:
        load = MachineLoad.read() if follows_load(environ) else MachineLoad()
    choice = choose(workload, topology or CpuTopology.read(), load)
    added: dict[str, str] = {}
    if choice.sleep and "OMP_WAIT_POLICY" not in environ:
        added["OMP_WAIT_POLICY"] = "PASSIVE"
    if choice.threads is not None and "OMP_NUM_THREADS" not in environ:
        added.update({"OMP_NUM_THREADS": str(choice.threads), CEILING: str(choice.usable)})
    return added


def apply_thread_policy(workload: Workload) -> tuple[dict[str, str], str]:
    """Set this process's variables; -> what was set, and one line saying what the policy chose and why (for the
    caller to log once its logging is configured). Only before torch loads: OpenMP reads them once, when its library
    loads, so a variable set later reaches only the processes this one starts."""
    environ = os.environ
    topology = CpuTopology.read()
    load = MachineLoad.read() if follows_load(environ) else MachineLoad()
    added = thread_env(workload, environ, topology, load)
    environ.update(added)
    return added, f"CPU threads ({workload}): {choose(workload, topology, load).describe()}; set {added or 'nothing'}"


# --------------------------------------------------------------------------------------------------
#                                 Following the load while it runs
# --------------------------------------------------------------------------------------------------


class ThreadGovernor:
    """Between the steps of a long loop of small steps (the trainer's, the autoencoder's), torch's thread count follows
    the machine's load: as many threads as CPUs nobody else wants (free_cpus), never more than the count it started
    with (or that the policy may go back up to), never fewer than 1. Idle threads' wait policy cannot change once torch
    has loaded; fewer threads leave none to spin.

        governor = ThreadGovernor()
        for step in ...:
            governor.step()          # reads the load at most every FOLLOW_EVERY_S seconds

    Inert where the user set OMP_NUM_THREADS, under FLOWFLEET_THREADS=static, and where /proc cannot be read.

    follow=False (a seeded run's default: a kernel split over another number of threads adds in another order, so
    the same seed gives the same weights only at the same count): the loop runs `fixed` threads, or the count the
    policy would give it on an idle machine (its ceiling), whatever the load, and restore() gives the process its
    own count back."""

    def __init__(
        self,
        environ: Mapping[str, str] | None = None,
        topology: CpuTopology | None = None,
        read_load: Callable[[], MachineLoad] | None = None,  # None: MachineLoad.read, looked up when built
        every_s: float = FOLLOW_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
        follow: bool = True,
        fixed: int | None = None,
    ):
        import torch

        environ = os.environ if environ is None else environ
        self.topology = topology or CpuTopology.read()
        self.ceiling = int(environ[CEILING]) if CEILING in environ else torch.get_num_threads()
        self.read_load = read_load or MachineLoad.read
        self.every_s, self.clock = every_s, clock
        self._last = -math.inf
        self.started = torch.get_num_threads()
        self.active = follow and loops_follow_load(environ)
        if follow:
            self.setting = f"{self.started} threads" + ("" if self.active else " (fixed)")
        else:  # repeatable: a count the load does not choose
            count = max(1, fixed if fixed is not None else self.ceiling)
            torch.set_num_threads(count)
            self.setting = f"{count} threads (fixed: a repeatable run)"
        self.pinned = not follow

    def step(self) -> str | None:
        """Read the load if it is time and set torch's thread count where it should change; -> the new setting in
        words when it changed (also logged at debug level), else None."""
        now = self.clock()
        if not self.active or now - self._last < self.every_s:
            return None
        self._last = now
        import torch

        load = self.read_load()
        wanted = min(self.ceiling, free_cpus(self.topology, load))
        if wanted == torch.get_num_threads():
            return None
        torch.set_num_threads(wanted)
        self.setting = f"{wanted} of {self.ceiling} threads ({choose('alone', self.topology, load).why})"
        log.debug("CPU threads: %s", self.setting)
        return self.setting

    def restore(self) -> None:
        """Back to the count it started with, at its loop's end: what the process runs next is not that loop."""
        if self.active or self.pinned:
            import torch

            torch.set_num_threads(self.started)
