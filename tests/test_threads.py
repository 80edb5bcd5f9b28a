"""The CPU thread policy (flowfleet.threads): idle OpenMP threads sleep where they would take a core someone else
needs (processes sharing the cores, SMT siblings), the runtime's defaults stand where one process has the machine,
and a variable the user set is never changed."""

from __future__ import annotations

import os

import pytest

from flowfleet import threads
from flowfleet.threads import CpuTopology, sleeping_threads, thread_env
from flowfleet.train.fanout import plan_slots

CORE_PER_THREAD = CpuTopology(cpus=2, cores=2)
SMT = CpuTopology(cpus=2, cores=1)


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
    assert thread_env("alone", {}, CORE_PER_THREAD) == {}
    assert thread_env("alone", {}, SMT) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert thread_env("shared", {}, CORE_PER_THREAD) == {"OMP_WAIT_POLICY": "PASSIVE"}
    for given in ("ACTIVE", "PASSIVE"):
        assert thread_env("shared", {"OMP_WAIT_POLICY": given}, SMT) == {}
        assert thread_env("alone", {"OMP_WAIT_POLICY": given}, SMT) == {}


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
