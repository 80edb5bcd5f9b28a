"""The CPU thread policy (flowfleet.threads): idle OpenMP threads sleep where they would take a core someone else
needs (processes sharing the cores, SMT siblings, other runnable work, a cgroup quota), a process alone runs as many
threads as CPUs nobody else wants and follows the load between steps, the runtime's defaults stand where one
process has the machine, and a variable the user set is never changed. Loads, quotas and topologies come from fake
/proc, cgroup and sysfs trees (the suite itself runs under FLOWFLEET_THREADS=static: conftest.py)."""

from __future__ import annotations

import os

import pytest

from flowfleet import threads
from flowfleet.threads import (
    CpuTopology,
    MachineLoad,
    ThreadGovernor,
    choose,
    free_cpus,
    read_quota,
    sleeping_threads,
    thread_env,
)
from flowfleet.train.fanout import plan_slots

CORE_PER_THREAD = CpuTopology(cpus=2, cores=2)
SMT = CpuTopology(cpus=2, cores=1)
IDLE = MachineLoad()


def fake_sysfs(tmp_path, siblings: dict[int, str]):
    for cpu, listed in siblings.items():
        topo = tmp_path / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        (topo / "thread_siblings_list").write_text(listed + "\n")
    return tmp_path


def test_topology_is_read_from_sysfs(tmp_path):
    smt = fake_sysfs(tmp_path / "smt", {0: "0,2", 1: "1,3", 2: "0,2", 3: "1,3"})
    assert CpuTopology.read(smt, cpus={0, 1, 2, 3}) == CpuTopology(4, 2) and CpuTopology.read(smt, {0, 1, 2, 3}).smt
    # a process allowed on one thread of each core uses no two siblings
    assert not CpuTopology.read(smt, cpus={0, 1}).smt
    cores = fake_sysfs(tmp_path / "cores", {0: "0", 1: "1"})
    assert CpuTopology.read(cores, cpus={0, 1}) == CpuTopology(2, 2)
    ranges = fake_sysfs(tmp_path / "ranges", {c: "0-1" if c < 2 else "2-3" for c in range(4)})
    assert CpuTopology.read(ranges, cpus={0, 1, 2, 3}) == CpuTopology(4, 2)
    # no sysfs (another OS, a container without /sys): every CPU is its own core
    assert CpuTopology.read(tmp_path / "missing", cpus={0, 1, 2}) == CpuTopology(3, 3)


def test_the_rule():
    assert not sleeping_threads("alone", CORE_PER_THREAD)  # the machine to itself: spinning threads win
    assert sleeping_threads("alone", SMT)  # a spinning thread slows its sibling
    assert sleeping_threads("shared", CORE_PER_THREAD) and sleeping_threads("shared", SMT)
    with pytest.raises(ValueError, match="workload"):
        sleeping_threads("busy", CORE_PER_THREAD)  # type: ignore[arg-type]


def test_the_users_own_setting_wins():
    assert thread_env("alone", {}, CORE_PER_THREAD, IDLE) == {}
    assert thread_env("alone", {}, SMT, IDLE) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert thread_env("shared", {}, CORE_PER_THREAD, IDLE) == {"OMP_WAIT_POLICY": "PASSIVE"}
    for given in ("ACTIVE", "PASSIVE"):
        assert thread_env("shared", {"OMP_WAIT_POLICY": given}, SMT, IDLE) == {}
        assert thread_env("alone", {"OMP_WAIT_POLICY": given}, SMT, IDLE) == {}
    busy = MachineLoad(others=1)
    assert thread_env("alone", {}, CORE_PER_THREAD, busy) == {"OMP_WAIT_POLICY": "PASSIVE"}  # its loops: free_cpus
    assert thread_env("alone", {}, CpuTopology(8, 8), MachineLoad(0.0, quota=2.0)) == {
        "OMP_WAIT_POLICY": "PASSIVE",
        "OMP_NUM_THREADS": "2",
        "FLOWFLEET_THREADS_CEILING": "2",
    }
    assert thread_env("alone", {"OMP_NUM_THREADS": "2"}, CORE_PER_THREAD, busy) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert thread_env("alone", {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "ACTIVE"}, CORE_PER_THREAD, busy) == {}


@pytest.mark.parametrize(
    "topology, user, expected",
    [
        (CORE_PER_THREAD, None, None),
        (SMT, None, "PASSIVE"),
        (SMT, "ACTIVE", "ACTIVE"),
        (CORE_PER_THREAD, "PASSIVE", "PASSIVE"),
    ],
)
def test_every_command_runs_under_the_rule_for_a_process_alone(monkeypatch, tmp_path, topology, user, expected):
    """The command line applies the rule before a command loads torch (here `init`, which loads none)."""
    from flowfleet.cli import main

    monkeypatch.setattr(threads.CpuTopology, "read", classmethod(lambda cls, *a, **k: topology))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    if user is None:
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    else:
        monkeypatch.setenv("OMP_WAIT_POLICY", user)
    assert main(["-q", "init", str(tmp_path / "run"), "--preset", "mnist-tiny"]) == 0
    assert os.environ.get("OMP_WAIT_POLICY") == expected


def test_train_all_jobs_side_by_side_sleep_a_lone_job_does_not(monkeypatch):
    monkeypatch.setattr(threads.CpuTopology, "read", classmethod(lambda cls, *a, **k: CORE_PER_THREAD))
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    side_by_side = plan_slots(5, None, cpus=2, gpus=0)
    assert [s.env()["OMP_WAIT_POLICY"] for s in side_by_side] == ["PASSIVE", "PASSIVE"]
    assert [s.env()["OMP_NUM_THREADS"] for s in side_by_side] == ["1", "1"]
    (alone,) = plan_slots(5, 1, cpus=2, gpus=0)
    assert "OMP_WAIT_POLICY" not in alone.env() and alone.env()["OMP_NUM_THREADS"] == "2"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # the user's choice reaches every job
    assert {s.env()["OMP_WAIT_POLICY"] for s in side_by_side} == {"ACTIVE"}


# --------------------------------------------------------------------------------------------------
#                                 The load, the quota, the decision
# --------------------------------------------------------------------------------------------------


def fake_proc(tmp_path, running: int, own_states: str = "R", cgroup: str = "0::/user.slice/job\n"):
    """A /proc with /proc/stat's procs_running, this process's threads (one per letter of own_states) and its
    cgroup line."""
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True, exist_ok=True)
    (proc / "stat").write_text(f"cpu  10 0 5 100 0 0 0 0 0 0\nprocs_running {running}\nprocs_blocked 0\n")
    for i, state in enumerate(own_states):
        task = proc / "self" / "task" / str(100 + i)
        task.mkdir(parents=True, exist_ok=True)
        (task / "stat").write_text(f"{100 + i} (python (a) b) {state} 1 2 3\n")  # a name with ") " in it
    (proc / "self" / "cgroup").write_text(cgroup)
    return proc


def test_other_runnable_threads_are_read_without_this_processes_own(tmp_path):
    proc = fake_proc(tmp_path, running=4, own_states="RSR")  # 4 runnable, 2 of them this process's
    load = MachineLoad.read(proc, tmp_path / "no-cgroup", sleep=lambda s: None)
    assert load == MachineLoad(others=2.0, quota=None)
    idle = fake_proc(tmp_path / "idle", running=1, own_states="RS")
    assert MachineLoad.read(idle, tmp_path, sleep=lambda s: None).others == 0.0
    # no /proc (another OS): an idle machine
    assert MachineLoad.read(tmp_path / "nothing", tmp_path, sleep=lambda s: None) == MachineLoad()


def test_the_cgroup_quota_is_the_tightest_of_the_cgroup_and_those_above_it(tmp_path):
    cg = tmp_path / "cg"
    for folder, value in (("", "max 100000"), ("user.slice", "150000 100000"), ("user.slice/job", "max 100000")):
        (cg / folder).mkdir(parents=True, exist_ok=True)
        (cg / folder / "cpu.max").write_text(value + "\n")
    proc = fake_proc(tmp_path, running=1)
    assert read_quota(proc, cg) == 1.5  # v2: the parent's 1.5 CPUs bind the job's unlimited cgroup
    (cg / "user.slice" / "cpu.max").write_text("max 100000\n")
    assert read_quota(proc, cg) is None
    v1 = tmp_path / "v1"
    (v1 / "cpu,cpuacct" / "docker" / "c1").mkdir(parents=True)
    (v1 / "cpu,cpuacct" / "docker" / "c1" / "cpu.cfs_quota_us").write_text("50000\n")
    (v1 / "cpu,cpuacct" / "docker" / "c1" / "cpu.cfs_period_us").write_text("100000\n")
    proc_v1 = fake_proc(tmp_path / "p1", running=1, cgroup="12:cpu,cpuacct:/docker/c1\n11:memory:/docker/c1\n")
    assert read_quota(proc_v1, v1) == 0.5
    assert read_quota(tmp_path / "nothing", v1) is None


@pytest.mark.parametrize(
    "workload, topology, load, sleep, threads",
    [
        ("alone", CORE_PER_THREAD, MachineLoad(0.0), False, None),  # the machine to itself: torch's defaults
        ("alone", CORE_PER_THREAD, MachineLoad(0.4), False, None),  # a reading in passing is not a busy CPU
        ("alone", CORE_PER_THREAD, MachineLoad(1.0), True, None),  # one busy process: asleep, every CPU
        ("alone", CORE_PER_THREAD, MachineLoad(4.0), True, None),  # a load of twice the cores: the same
        ("alone", CpuTopology(8, 8), MachineLoad(3.0), True, None),  # 8 CPUs, 3 wanted: asleep
        ("alone", CpuTopology(8, 8), MachineLoad(0.0, quota=2.5), True, 2),  # a container's quota of 2.5 CPUs
        ("alone", CpuTopology(8, 8), MachineLoad(0.0, quota=16.0), False, None),  # a quota above the CPUs
        ("alone", SMT, MachineLoad(0.0), True, None),  # SMT siblings: asleep, the default count
        ("shared", CORE_PER_THREAD, MachineLoad(3.0), True, None),  # train-all's jobs: their budgets stand
    ],
)
def test_the_decision_from_load_quota_and_topology(workload, topology, load, sleep, threads):
    choice = choose(workload, topology, load)
    assert (choice.sleep, choice.threads) == (sleep, threads)
    assert "\n" not in choice.describe() and choice.why


@pytest.mark.parametrize(
    "topology, load, threads",
    [
        (CORE_PER_THREAD, MachineLoad(0.0), 2),  # nobody else: every CPU
        (CORE_PER_THREAD, MachineLoad(0.4), 2),  # a reading in passing
        (CORE_PER_THREAD, MachineLoad(1.0), 1),  # one busy process: the CPU left
        (CORE_PER_THREAD, MachineLoad(4.0), 1),  # twice the cores wanted: at least one
        (CpuTopology(8, 8), MachineLoad(3.0), 5),  # 8 CPUs, 3 wanted: the 5 others
        (CpuTopology(8, 8), MachineLoad(1.0, quota=2.5), 1),  # a quota of 2.5 CPUs, one of them wanted
    ],
)
def test_a_long_loop_of_small_steps_runs_the_cpus_nobody_else_wants(topology, load, threads):
    assert free_cpus(topology, load) == threads


SET_BEFORE_TORCH = """
import os, sys
import flowfleet.threads as t
t.MachineLoad.read = classmethod(lambda cls, *a, **k: t.MachineLoad(others=1.0))  # a busy box
apply, seen = t.apply_thread_policy, {}
def spy(workload):
    seen["torch loaded"] = "torch" in sys.modules
    return apply(workload)
import flowfleet.cli as cli
cli.apply_thread_policy = spy
cli.main(["-q", "init", sys.argv[1], "--preset", "mnist-tiny"])
print(seen["torch loaded"], "torch" in sys.modules, os.environ.get("OMP_WAIT_POLICY"))
"""


def test_the_command_line_sets_the_policy_before_torch_loads(tmp_path):
    """OpenMP reads its variables once, when torch's library loads: a variable set after that is not read (the
    parser's options import torch), so the command line sets them first of all."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "FLOWFLEET_THREADS"))}
    done = subprocess.run(
        [sys.executable, "-c", SET_BEFORE_TORCH, str(tmp_path / "r")], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    seen = done.stdout.strip().splitlines()[-1].split()  # (after init's own line)
    assert seen == ["False", "True", "PASSIVE"]  # set before torch, which the command then loaded


def test_the_command_line_reads_the_load_unless_static(monkeypatch, tmp_path):
    """flowfleet COMMAND on a busy box: its idle threads sleep and it runs the CPU left; FLOWFLEET_THREADS=static
    (the suite's) and the user's own variables keep it out."""
    from flowfleet.cli import main

    monkeypatch.setattr(threads.CpuTopology, "read", classmethod(lambda cls, *a, **k: CORE_PER_THREAD))
    monkeypatch.setattr(threads.MachineLoad, "read", classmethod(lambda cls, *a, **k: MachineLoad(others=1.0)))
    for name in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS", "FLOWFLEET_THREADS_CEILING"):
        monkeypatch.delenv(name, raising=False)
    assert main(["-q", "init", str(tmp_path / "static"), "--preset", "mnist-tiny"]) == 0
    assert "OMP_WAIT_POLICY" not in os.environ and "OMP_NUM_THREADS" not in os.environ  # static: an idle box
    monkeypatch.setenv("FLOWFLEET_THREADS", "auto")
    assert main(["-q", "init", str(tmp_path / "auto"), "--preset", "mnist-tiny"]) == 0
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE" and "OMP_NUM_THREADS" not in os.environ  # asleep, every CPU


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_governor_follows_the_load_between_steps_within_its_ceiling(monkeypatch):
    import torch

    monkeypatch.setattr(torch, "get_num_threads", lambda: state["threads"])
    monkeypatch.setattr(torch, "set_num_threads", lambda n: state.update(threads=n))
    state, loads, clock = {"threads": 2}, iter([1.0, 1.0, 4.0, 0.0]), FakeClock()
    governor = ThreadGovernor({}, CORE_PER_THREAD, lambda: MachineLoad(next(loads)), every_s=2.0, clock=clock)
    assert governor.active and governor.ceiling == 2
    assert governor.step() == "1 of 2 threads (1 other runnable threads on its 2 CPUs)" and state["threads"] == 1
    clock.now = 1.0
    assert governor.step() is None  # not read again before every_s
    clock.now = 2.5
    assert governor.step() is None and state["threads"] == 1  # still busy: unchanged
    clock.now = 5.0
    assert governor.step() is None and state["threads"] == 1  # busier: still one
    clock.now = 7.5
    assert governor.step() == "2 of 2 threads (nothing else wants its CPUs)" and state["threads"] == 2  # back up
    clock.now = 10.0
    loads = iter([1.0])
    assert governor.step() is not None and state["threads"] == 1
    governor.restore()  # the loop's end: the process's next work gets the count the loop started with
    assert state["threads"] == 2
    # the policy's own OMP_NUM_THREADS (busy at the start) may go back up to its ceiling; the user's never moves
    assert ThreadGovernor({"OMP_NUM_THREADS": "1", "FLOWFLEET_THREADS_CEILING": "2"}, CORE_PER_THREAD).ceiling == 2
    assert not ThreadGovernor({"OMP_NUM_THREADS": "2"}, CORE_PER_THREAD).active
    assert not ThreadGovernor({"FLOWFLEET_THREADS": "static"}, CORE_PER_THREAD).active


def test_a_jobs_budget_from_train_all_is_its_own(monkeypatch):
    """train-all's job env: its budget, never the ceiling of the command that started it."""
    monkeypatch.setattr(threads.CpuTopology, "read", classmethod(lambda cls, *a, **k: CORE_PER_THREAD))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("FLOWFLEET_THREADS_CEILING", "2")
    (alone,) = plan_slots(5, 1, cpus=2, gpus=0)
    env = alone.env()
    assert env["OMP_NUM_THREADS"] == "2" and "FLOWFLEET_THREADS_CEILING" not in env


def test_a_fixed_governor_holds_its_count_whatever_the_load(monkeypatch):
    """follow=False (a seeded run's default): the loop runs the policy's count for an idle machine (its ceiling) or
    the count it is given, step after step, and gives the process its own count back at the end."""
    import torch

    monkeypatch.setattr(torch, "get_num_threads", lambda: state["threads"])
    monkeypatch.setattr(torch, "set_num_threads", lambda n: state.update(threads=n))
    state, clock = {"threads": 1}, FakeClock()  # the policy lowered the count: the machine was busy at the start
    busy = {"OMP_NUM_THREADS": "1", "FLOWFLEET_THREADS_CEILING": "2", "FLOWFLEET_THREADS": "auto"}
    governor = ThreadGovernor(busy, CORE_PER_THREAD, lambda: MachineLoad(4.0), clock=clock, follow=False)
    assert state["threads"] == 2 and governor.setting == "2 threads (fixed: a repeatable run)"
    for now in (0.0, 2.5, 5.0):
        clock.now = now
        assert governor.step() is None and state["threads"] == 2
    governor.restore()
    assert state["threads"] == 1
    given = ThreadGovernor({}, CORE_PER_THREAD, lambda: MachineLoad(0.0), follow=False, fixed=1)
    assert state["threads"] == 1 and given.setting == "1 threads (fixed: a repeatable run)"


def test_the_same_seed_gives_the_same_autoencoder_under_another_load(monkeypatch):
    """Two trainings of one seed, one started on a busy machine (the policy had lowered the process's count, and the
    load stays high) and one on an idle one: bit-identical weights with the loop's count fixed; following the load,
    the busy one runs on fewer threads and its weights differ (the test could fail)."""
    import torch

    from flowfleet.config import AutoencoderConfig
    from flowfleet.data.autoencoder import train_autoencoder

    images = torch.rand(24, 1, 16, 16, generator=torch.Generator().manual_seed(0)) * 2 - 1
    cfg = AutoencoderConfig(block_out_channels=[8, 16], latent_channels=2, steps=12, batch_size=8, lr=4e-3)
    started = torch.get_num_threads()

    def train(environ: dict[str, str], threads_now: int, load: float, follow: bool) -> dict[str, torch.Tensor]:
        monkeypatch.setattr(os, "environ", {**os.environ, "FLOWFLEET_THREADS": "auto", **environ})
        monkeypatch.setattr(threads.MachineLoad, "read", classmethod(lambda cls, *a, **k: MachineLoad(load)))
        monkeypatch.setattr(threads.CpuTopology, "read", classmethod(lambda cls, *a, **k: CORE_PER_THREAD))
        torch.set_num_threads(threads_now)
        try:
            vae = train_autoencoder(images, cfg.model_copy(update={"follow_load": follow}), progress=False)
        finally:
            torch.set_num_threads(started)
        return {k: v.clone() for k, v in vae.state_dict().items()}

    busy = {"OMP_NUM_THREADS": "1", "FLOWFLEET_THREADS_CEILING": "2"}
    idle = train({}, 2, 0.0, follow=False)
    loaded = train(busy, 1, 4.0, follow=False)
    assert all(torch.equal(idle[k], loaded[k]) for k in idle)
    following = train(busy, 1, 4.0, follow=True)  # one thread: the busy machine's count
    assert any(not torch.equal(idle[k], following[k]) for k in idle)
