"""The fleet planned for its machines (run.yaml machines, `flowfleet plan`): the assignment, steps and finish of each
expert for given cluster sizes, speeds and deadline; train-all following the plan here and into Slurm, Ray and
SkyPilot job specs; replanning a lost machine from its checkpoint; bad entries refused in one line."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time

import pytest
import yaml
from fixtures.synthetic_run import synthetic_config, write_synthetic_run

from flowfleet.backends.ray import RayBackend
from flowfleet.backends.skypilot import export_skypilot
from flowfleet.backends.slurm import SlurmBackend
from flowfleet.cli import main
from flowfleet.config import RunConfig
from flowfleet.errors import FlowfleetError
from flowfleet.stages.plan import plan_fleet
from flowfleet.stages.train import describe_matching, train_all
from flowfleet.storage import RunRoot
from flowfleet.train.plan import TERA, Work, make_plan, read_plan, replan
from flowfleet.train.specs import JobSpec, job_cost
from flowfleet.train.status import read_status
from flowfleet.train.tasks import planned_steps

pytestmark = pytest.mark.usefixtures("one_thread")

SAMPLE = 1_000_000  # training FLOPs of one sample, for the plans without a run


def digits_works(steps: int = 12_000) -> list[Work]:
    """The digits demo's four experts under DDM's split: every one all the steps at its cluster's share of the
    batch (partitions 1485 / 3354 / 2602 / 1559 of batch 32)."""
    return [Work(f"expert-{k}", steps, b, SAMPLE) for k, b in enumerate([5, 12, 9, 6])]


def test_balanced_plan_puts_the_heaviest_on_the_fastest_and_ends_every_machine_together():
    works = digits_works()
    recipe = sum(w.flops for w in works)
    speeds = {"slow-a": 1.0, "slow-b": 1.0, "mid": 2.0, "fast": 4.0}
    plan = make_plan(works, speeds)
    machine = {job: a.machine for job, a in plan.jobs.items()}
    assert machine == {"expert-1": "fast", "expert-2": "mid", "expert-3": "slow-a", "expert-0": "slow-b"}
    ideal = recipe / (sum(speeds.values()) * TERA)  # no plan can end sooner: every machine busy all along
    for job, a in plan.jobs.items():
        assert a.batch == works[int(job[-1])].batch  # the recipe's batch
        assert a.start_s == 0 and abs(a.finish_s - ideal) <= plan.step_s(job)  # one expert each, all end together
    assert ideal <= plan.critical_path_s + max(plan.step_s(j) for j in plan.jobs) / 2
    assert abs(plan.total_flops - recipe) <= sum(a.batch * SAMPLE for a in plan.jobs.values())  # the budget kept
    assert plan.recipe_flops == recipe and plan.mode == "balanced"
    # K equal machines: the heaviest job's FLOPs over the mean job's, 1.5 under the recipe, is 1
    equal = make_plan(works, dict.fromkeys("abcd", 1.0))
    flops = [a.flops for a in equal.jobs.values()]
    assert max(w.flops for w in works) / (recipe / 4) == 1.5
    assert max(flops) / (sum(flops) / 4) < 1.001


def test_a_deadline_keeps_every_machine_busy_until_it_and_the_faster_machines_train_more():
    speeds = {"slow": 1.0, "mid": 2.0, "fast": 4.0}
    deadline = 3600.0
    plan = make_plan(digits_works(), speeds, deadline_s=deadline)
    assert plan.mode == "deadline" and plan.deadline_s == deadline
    for m in speeds:
        mine = sorted((a for a in plan.jobs.values() if a.machine == m), key=lambda a: a.start_s)
        assert mine[0].start_s == 0
        for before, after in zip(mine, mine[1:]):  # one after the other on their machine
            assert after.start_s == pytest.approx(before.finish_s)
        last = max(plan.step_s(a.job) for a in mine)
        assert deadline - last < mine[-1].finish_s <= deadline  # busy to the deadline, never past it
        assert sum(a.flops for a in mine) <= deadline * speeds[m] * TERA
    work = {m: sum(a.flops for a in plan.jobs.values() if a.machine == m) for m in speeds}
    assert work["fast"] > work["mid"] > work["slow"]
    assert plan.total_flops == sum(work.values())
    assert plan.total_flops == pytest.approx(deadline * 7 * TERA, rel=1e-6)


def test_more_experts_than_machines_share_them_longest_first():
    works = [Work(f"expert-{k}", 100, b, SAMPLE) for k, b in enumerate([9, 7, 5, 3, 1])]
    plan = make_plan(works, {"fast": 2.0, "slow": 1.0})
    on = {
        m: [a.job for a in sorted(plan.jobs.values(), key=lambda a: a.start_s) if a.machine == m] for m in plan.tflops
    }
    assert on == {"fast": ["expert-0", "expert-2", "expert-3"], "slow": ["expert-1", "expert-4"]}
    ends = [plan.machine_finish_s(m) for m in plan.tflops]
    assert max(ends) - min(ends) <= max(plan.step_s(j) for j in plan.jobs)
    few = make_plan(works[:1], {"fast": 2.0, "slow": 1.0})  # one expert: the fastest machine alone
    assert few.jobs["expert-0"].machine == "fast" and few.jobs["expert-0"].steps == 100


def test_a_deadline_shorter_than_one_step_is_refused_naming_the_expert_and_machine():
    works = digits_works()
    with pytest.raises(FlowfleetError, match=r"^deadline: 1e-07 s is shorter than one step of expert-\d on machine "):
        make_plan(works, {"a": 1.0, "b": 2.0}, deadline_s=1e-7)
    with pytest.raises(FlowfleetError, match=r"^machines.b.tflops: 0.0 must be > 0"):
        make_plan(works, {"a": 1.0, "b": 0.0})


def router(steps: int = 4000, batch: int = 32, sample_flops: int = SAMPLE // 8) -> Work:
    """A router as the demos train it: its own steps at batch 32, an eighth of an expert's FLOPs a sample."""
    return Work("router", steps, batch, sample_flops)


def test_the_router_is_planned_first_on_the_fastest_machine_and_every_machine_still_ends_together():
    works, r = digits_works(), router()
    speeds = {"slow-a": 1.0, "slow-b": 1.0, "mid": 2.0, "fast": 4.0}
    plan = make_plan(works, speeds, router=r)
    recipe = sum(w.flops for w in works) + r.flops
    assert plan.recipe_flops == recipe
    assert abs(plan.total_flops - recipe) <= sum(a.step_flops for a in plan.jobs.values())  # the budget kept
    routed = plan.jobs["router"]
    assert (routed.machine, routed.steps, routed.start_s) == ("fast", 4000, 0)
    assert plan.jobs["expert-1"].start_s == routed.finish_s  # the fastest's expert after the router
    ideal = recipe / (sum(speeds.values()) * TERA)  # the router's FLOPs shared with the experts'
    for m in speeds:
        assert abs(plan.machine_finish_s(m) - ideal) <= max(plan.step_s(j) for j in plan.jobs)
    without = make_plan(works, speeds)
    assert plan.jobs["expert-1"].steps < without.jobs["expert-1"].steps  # it gives up the router's time
    assert {j: plan.jobs[j].steps for j in ("expert-0", "expert-3")} != {
        j: without.jobs[j].steps for j in ("expert-0", "expert-3")
    }  # the others take a share of the router's work
    # under a deadline: the router first on the fastest, every machine still busy until the deadline, never past it
    deadline = 3600.0
    timed = make_plan(works, speeds, deadline_s=deadline, router=r)
    assert timed.jobs["router"].machine == "fast" and timed.jobs["router"].finish_s < deadline
    for m in speeds:
        last = max(timed.step_s(a.job) for a in timed.jobs.values() if a.machine == m)
        assert deadline - last < timed.machine_finish_s(m) <= deadline
    assert timed.total_flops == pytest.approx(deadline * 8 * TERA, rel=1e-6)


def test_the_router_takes_a_machine_no_expert_needs_or_one_of_its_own_when_it_outlasts_the_share():
    works, r = digits_works(), router()
    five = {"a": 1.0, "b": 1.0, "c": 2.0, "d": 4.0, "e": 1.0}  # the four experts on d, c, a, b: e is free
    spare = make_plan(works, five, router=r)
    assert spare.jobs["router"].machine == "e" and spare.jobs["router"].start_s == 0
    experts = make_plan(works, five)
    assert {j: (a.machine, a.steps) for j, a in spare.jobs.items() if j != "router"} == {
        j: (a.machine, a.steps) for j, a in experts.jobs.items()
    }  # the experts' plan untouched
    # of equal machines, the one whose expert has the fewest items (expert-0, batch 5) gives the router its time
    equal = make_plan(works, dict.fromkeys("abcd", 1.0), router=r)
    assert equal.jobs["router"].machine == equal.jobs["expert-0"].machine == "d"
    assert equal.jobs["expert-0"].start_s == equal.jobs["router"].finish_s
    # a router longer than an equal share of all the work: its machine (of four equals, the lightest expert's: d)
    # trains it alone, the experts share the rest
    big = router(steps=400_000)
    alone = make_plan(works, dict.fromkeys("abcd", 1.0), router=big)
    home = alone.jobs["router"].machine
    assert home == "d" and not [j for j, a in alone.jobs.items() if a.machine == home and j != "router"]
    rest = [alone.machine_finish_s(m) for m in "abc"]
    assert max(rest) - min(rest) <= max(alone.step_s(j) for j in alone.jobs)
    assert alone.critical_path_s == pytest.approx(big.flops / TERA)
    # under a deadline the router must fit: refused naming its steps, or the deadline where not even a step fits
    with pytest.raises(FlowfleetError, match=r"^router_train.steps: the router's 400000 steps take .* on machine d, "):
        make_plan(works, dict.fromkeys("abcd", 1.0), deadline_s=1.0, router=big)
    with pytest.raises(FlowfleetError, match=r"^deadline: 1e-07 s is shorter than one step of router on machine d"):
        make_plan(works, dict.fromkeys("abcd", 1.0), deadline_s=1e-7, router=big)
    # the router fits, but leaves its machine no time for a step of its expert (expert-0, batch 5: 5e-06 s)
    after = r"^deadline: 0.0001 s is shorter than one step of expert-0 on machine d after the router's"
    with pytest.raises(FlowfleetError, match=after):
        make_plan(works, dict.fromkeys("abcd", 1.0), deadline_s=1e-4, router=router(steps=24))


def test_replan_moves_a_lost_machines_expert_from_its_step_to_the_machine_that_ends_it_soonest():
    plan = make_plan(digits_works(), {"a": 1.0, "b": 1.0, "c": 2.0, "d": 4.0})
    lost = plan.jobs["expert-1"]
    assert lost.machine == "d"
    changed = replan(plan, "d", {"expert-1": 5000})
    moved = changed.jobs["expert-1"]
    assert moved.machine == "c"  # c (twice a and b's speed) ends the rest soonest after its own expert
    assert (moved.steps, moved.batch) == (lost.steps, lost.batch)  # nothing lost, nothing repeated
    rest = (lost.steps - 5000) * lost.batch * SAMPLE / (2.0 * TERA)
    assert moved.start_s == pytest.approx(plan.jobs["expert-2"].finish_s)
    assert moved.finish_s == pytest.approx(moved.start_s + rest)
    assert changed.moves == [{"job": "expert-1", "from": "d", "to": "c", "at_step": 5000}] and changed.lost == ["d"]
    assert {j: a.machine for j, a in changed.jobs.items() if j != "expert-1"} == {
        j: a.machine for j, a in plan.jobs.items() if j != "expert-1"
    }
    done = replan(plan, "d", {"expert-1": lost.steps})  # finished before the machine went: nothing moves
    assert done.jobs["expert-1"].machine == "d" and done.moves == []
    with pytest.raises(FlowfleetError, match=r"machine 'e': not a machine of the plan"):
        replan(plan, "e", {})
    # the router moves as an expert does: from its step, both of the lost machine's jobs in the order they ran
    routed = make_plan(digits_works(), {"a": 1.0, "b": 1.0, "c": 2.0, "d": 4.0}, router=router())
    assert routed.jobs["router"].machine == "d"
    both = replan(routed, "d", {"router": 1000, "expert-1": 0})
    assert [(m["job"], m["at_step"]) for m in both.moves] == [("router", 1000), ("expert-1", 0)]
    assert both.jobs["router"].steps == 4000 and both.jobs["router"].machine != "d"


# ------------------------------------------------------------------------------------------------
#                                     A run with machines
# ------------------------------------------------------------------------------------------------


def machine_run(path, machines: dict, steps: int = 6, **raw_changes) -> RunRoot:
    raw = synthetic_config(k=2, steps=steps, monolith=True).to_dict()
    raw["machines"] = machines
    raw.update(raw_changes)
    root = RunRoot(str(path))
    write_synthetic_run(root, RunConfig.from_dict(raw))
    return root


TWO = {"a": {"tflops": 2.0}, "b": {"tflops": 1.0}}


def test_train_all_trains_each_expert_its_planned_steps_and_the_monolith_the_plans_flops(tmp_path, capsys):
    root = machine_run(tmp_path / "run", TWO)
    assert main(["plan", root.url]) == 0
    out = capsys.readouterr().out
    assert "balanced: the fleet's" in out and "critical path" in out
    plan = read_plan(root)
    # the router (6 steps, a third of expert-0's 18 steps' FLOPs on a) first on the fastest machine: a then does
    # 6 of expert-0's steps, b 6 of expert-1's, and both end together
    assert {j: (a.machine, a.steps) for j, a in plan.jobs.items()} == {
        "expert-0": ("a", 6),
        "expert-1": ("b", 6),
        "router": ("a", 6),
    }
    assert plan.jobs["expert-0"].start_s == plan.jobs["router"].finish_s
    assert abs(plan.machine_finish_s("a") - plan.machine_finish_s("b")) <= max(plan.step_s(j) for j in plan.jobs)
    cfg = RunConfig.from_dict(root.read_yaml("run.yaml"))
    fleet = plan.total_flops  # the router's FLOPs are the plan's
    assert plan.total_flops == plan.recipe_flops
    assert plan.monolith_steps * job_cost(cfg, JobSpec("monolith"), steps=1) >= fleet
    assert "the monolith" in describe_matching(root, cfg)  # (refuses a monolith off the fleet's FLOPs by a step)
    assert train_all(root.url, parallel=1, progress=False).ok
    for job, steps in (("experts/0", 6), ("experts/1", 6), ("router", 6), ("monolith", plan.monolith_steps)):
        status = read_status(root, job)
        assert status.state == "done" and status.step == status.total_steps == steps, job
    capsys.readouterr()
    assert main(["status", root.url, "--json"]) == 0
    rows = {r["job"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["expert-0"]["plan"]["machine"] == "a" and rows["expert-0"]["plan"]["steps"] == 6
    assert rows["router"]["plan"]["machine"] == "a"
    assert rows["expert-0"]["threads"].endswith("threads (fixed: a repeatable run)")  # the seed decides the weights
    # another recipe in run.yaml: the plan is not followed silently
    raw = root.read_yaml("run.yaml")
    raw["train"]["steps"] = 7
    root.write_bytes(yaml.safe_dump(raw).encode(), "run.yaml")
    with pytest.raises(FlowfleetError, match=r"plan/plan.json: made for another recipe .*flowfleet plan"):
        planned_steps(root, RunConfig.from_dict(raw), JobSpec("expert", 0))


def test_a_deadline_plan_from_the_cli_and_its_one_line_refusals(tmp_path, capsys):
    root = machine_run(tmp_path / "run", TWO)
    assert main(["plan", root.url, "--deadline", "1h30m"]) == 0
    plan = read_plan(root)
    assert plan.mode == "deadline" and plan.deadline_s == 5400
    assert plan.jobs["expert-0"].steps > plan.jobs["expert-1"].steps  # the faster machine's expert trains more
    capsys.readouterr()
    assert main(["plan", root.url, "--deadline", "0.0000001s"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "deadline: 1e-07 s is shorter than one step of " in err[0]


@pytest.mark.parametrize(
    "machines, field",
    [
        (
            {"a": {"backend": "cloud", "tflops": 1.0}},
            r"machines.a.backend: unknown 'cloud' \(known: local, slurm, ray\)",
        ),
        ({"a": {"tflops": 0}}, r"machines.a.tflops"),
        ({"a": {"tflops": -2.0}}, r"machines.a.tflops"),
        (
            {"a": {"nodelist": "gpu01", "tflops": 1.0}},
            r"machines.a.nodelist: a slurm option, but its backend is 'local'",
        ),
        ({"a": {"accelerators": "H100 x8", "tflops": 1.0}}, r"machines.a.accelerators"),
    ],
)
def test_bad_machines_entries_are_refused_in_one_line_naming_the_field(tmp_path, capsys, machines, field):
    root = RunRoot(str(tmp_path / "run"))
    raw = synthetic_config(k=2).to_dict()
    raw["machines"] = machines
    root.write_bytes(yaml.safe_dump(raw).encode(), "run.yaml")
    assert main(["plan", root.url]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert re.search(field, err[0]), err[0]


def test_an_unprobed_machine_is_refused_until_probed_on_it(tmp_path, capsys):
    root = machine_run(tmp_path / "run", {"a": {"tflops": 2.0}, "here": {}})
    with pytest.raises(
        FlowfleetError, match=r"machines.here.tflops: neither declared nor probed; run `flowfleet probe"
    ):
        plan_fleet(root)
    assert main(["probe", root.url, "--machine", "here", "--steps", "2", "--device", "cpu"]) == 0
    probed = root.read_json("plan", "probe-here.json")
    assert probed["tflops"] > 0 and probed["device"] == "cpu" and probed["batch"] == 8
    assert "here: " in capsys.readouterr().out
    plan = plan_fleet(root)
    assert plan.tflops == {"a": 2.0, "here": probed["tflops"]}


def test_a_lost_machines_expert_resumes_elsewhere_from_its_checkpoint_with_no_step_lost_or_repeated(tmp_path, capsys):
    root = machine_run(tmp_path / "run", TWO, steps=18)
    plan_fleet(root)
    assert read_plan(root).jobs["expert-0"].machine == "a"
    total = read_plan(root).jobs["expert-0"].steps
    metrics = tmp_path / "run" / "experts" / "0" / "metrics.jsonl"

    def lose_the_machine():  # machine a stops after a few steps (its job checkpoints, as a preemption's SIGTERM)
        t0 = time.monotonic()
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
            assert time.monotonic() - t0 < 120
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=lose_the_machine, daemon=True).start()
    assert main(["train-expert", root.url, "--expert", "0", "--no-progress"]) == 0
    stopped = read_status(root, "experts/0")
    assert stopped.state == "stopped" and 3 <= stopped.step < total
    capsys.readouterr()
    assert main(["plan", root.url, "--replan", "a"]) == 0
    assert f"expert-0: from a to b, resuming at step {stopped.step}" in capsys.readouterr().out
    plan = read_plan(root)
    assert plan.jobs["expert-0"].machine == "b" and plan.jobs["expert-0"].steps == total
    assert train_all(root.url, parallel=1, progress=False).ok
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == list(range(1, total + 1))  # every step once: none lost, none repeated
    assert read_status(root, "experts/0").step == total


class FakeRayClient:
    def __init__(self):
        self.jobs: list[dict] = []

    def submit_job(self, **kw):
        self.jobs.append(kw)
        return f"raysubmit_{len(self.jobs)}"


def test_the_plan_reaches_slurm_and_ray_job_specs(tmp_path, monkeypatch):
    machines = {
        "h100": {"backend": "campus", "nodelist": "gpu[01-02]", "partition": "h100", "tflops": 4.0},
        "lab": {"backend": "lab", "resource": "lab_node", "tflops": 1.0},
    }
    backends = {
        "campus": {"kind": "slurm", "stage_dir": str(tmp_path / "stage")},
        "lab": {"kind": "ray", "address": "http://lab:8265"},
    }
    root = machine_run(
        tmp_path / "run", machines, backends=backends, monolith={"enabled": False, "match_compute": True}
    )
    plan_fleet(root)
    scripts: list[str] = []
    monkeypatch.setattr(
        SlurmBackend, "sbatch", lambda self, path, dependency=(): scripts.append(path) or str(len(scripts))
    )
    client = FakeRayClient()
    monkeypatch.setattr(RayBackend, "client", property(lambda self: client))
    outcome = train_all(root.url, backend="campus", wait=False, progress=False)
    assert set(outcome.results.values()) == {"submitted"}
    expert = next(p for p in scripts if p.endswith("expert-0.sbatch"))  # on its machine's nodes: a job of its own
    lines = open(expert).read().splitlines()
    assert "#SBATCH --nodelist=gpu[01-02]" in lines and "#SBATCH --partition=h100" in lines
    assert lines[-1].endswith("--expert 0")
    router = open(next(p for p in scripts if p.endswith("router.sbatch"))).read()  # planned on the fastest too
    assert "#SBATCH --nodelist=gpu[01-02]" in router.splitlines()
    assert router.splitlines()[-1].endswith("train-router " + root.url)
    assert len(client.jobs) == 1 and client.jobs[0]["entrypoint_resources"] == {"lab_node": 0.001}
    assert "--expert 1" in client.jobs[0]["entrypoint"]


def test_the_plan_reaches_skypilot_task_files(s3_url, tmp_path):
    raw = synthetic_config(k=2).to_dict()
    raw["machines"] = {
        "big": {"accelerators": "H100:8", "tflops": 8.0},
        "small": {"accelerators": "L4:1", "tflops": 1.0},
    }
    RunConfig.from_dict(raw).save(RunRoot(s3_url))
    plan_fleet(s3_url)
    export_skypilot(s3_url, str(tmp_path / "sky"))
    tasks = {
        n: yaml.safe_load((tmp_path / "sky" / f"{n}.yaml").read_text()) for n in ("expert-0", "expert-1", "router")
    }
    assert tasks["expert-0"]["resources"]["accelerators"] == "H100:8"
    assert tasks["expert-1"]["resources"]["accelerators"] == "L4:1"
    assert tasks["router"]["resources"]["accelerators"] == "H100:8"  # planned first on the fastest machine
