"""The fleet planned for the machines it trains on (run.yaml `machines`): which machine trains each expert and the
router, for how many steps at what batch, and when each should finish.

The experts exchange nothing, so each machine can run at its own pace. The plan gives every machine work in
proportion to its speed: balanced, all of them finish together, the shortest critical path the compute budget
allows; under a deadline, every machine trains until it, and the fleet's compute is what the machines can do by
then. The heaviest experts (the largest partitions' recipes) go to the fastest machines, so that each expert's
passes over its data stay as near the recipe's as the machines allow; each keeps its recipe's batch, and its steps
follow its share of its machine's work. The router needs no expert: it is a job of the plan too, of its recipe's
steps from the start, on a machine no expert needs where there is one, else first on the fastest machine (of equals,
the one of the lightest experts), whose experts share the rest of its time (balanced, the router's FLOPs are part of
the work shared among the machines).

Hand-written: a scheduling library (OR-Tools, PuLP) solves the general problem of indivisible jobs; here the work
is divisible (steps), so once each machine has its experts the optimum is closed-form.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from flowfleet.config import RunConfig
from flowfleet.errors import FlowfleetError
from flowfleet.layout import PLAN
from flowfleet.storage import RunRoot

TERA = 1e12


@dataclass(frozen=True)
class Work:
    """A job as its recipe trains it (an expert, or the router): `steps` at `batch`, `sample_flops` training FLOPs
    per sample."""

    job: str
    steps: int
    batch: int
    sample_flops: int

    @property
    def step_flops(self) -> int:
        return self.batch * self.sample_flops

    @property
    def flops(self) -> int:
        return self.steps * self.step_flops


@dataclass
class Assignment:
    """One job's place in the plan (an expert's or the router's): its machine, steps and batch, and when it starts
    and ends there (seconds after the fleet starts, at the machine's speed)."""

    job: str
    machine: str
    steps: int
    batch: int
    sample_flops: int
    recipe_steps: int
    start_s: float
    finish_s: float

    @property
    def step_flops(self) -> int:
        return self.batch * self.sample_flops

    @property
    def flops(self) -> int:
        return self.steps * self.step_flops


@dataclass
class Plan:
    """Every planned job's Assignment, the machines' speeds (TFLOP/s) and what the plan was made for."""

    mode: Literal["balanced", "deadline"]
    tflops: dict[str, float]
    jobs: dict[str, Assignment]
    recipe_flops: int  # the planned jobs' FLOPs as the recipe trains them
    deadline_s: float | None = None
    monolith_steps: int | None = None  # a compute-matched monolith's steps for the fleet's FLOPs (the router's too)
    recipe_key: str = ""  # the run.yaml recipe it was made for (recipe_key): another is refused
    lost: list[str] = field(default_factory=list)  # machines `plan --replan` took out
    moves: list[dict[str, Any]] = field(default_factory=list)  # {job, from, to, at_step} of each replanning

    @property
    def total_flops(self) -> int:
        return sum(a.flops for a in self.jobs.values())

    @property
    def critical_path_s(self) -> float:
        return max((a.finish_s for a in self.jobs.values()), default=0.0)

    def machine_finish_s(self, machine: str) -> float:
        return max((a.finish_s for a in self.jobs.values() if a.machine == machine), default=0.0)

    def step_s(self, job: str) -> float:
        """Seconds a step of `job` takes on its machine, at the machine's speed."""
        a = self.jobs[job]
        return a.step_flops / (self.tflops[a.machine] * TERA)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)  # (the assignments too: asdict recurses)
        out["total_flops"] = self.total_flops
        out["critical_path_s"] = self.critical_path_s
        return out

    @classmethod
    def from_json(cls, raw: dict[str, Any], where: str) -> "Plan":
        try:
            jobs = {name: Assignment(**a) for name, a in raw["jobs"].items()}
            return cls(
                mode=raw["mode"],
                tflops={str(k): float(v) for k, v in raw["tflops"].items()},
                jobs=jobs,
                recipe_flops=int(raw["recipe_flops"]),
                deadline_s=raw.get("deadline_s"),
                monolith_steps=raw.get("monolith_steps"),
                recipe_key=str(raw.get("recipe_key", "")),
                lost=list(raw.get("lost", [])),
                moves=list(raw.get("moves", [])),
            )
        except (KeyError, TypeError, ValueError) as err:
            raise FlowfleetError(f"{where}: not a plan flowfleet wrote ({type(err).__name__}: {err})") from None


def assign_machines(works: list[Work], tflops: dict[str, float]) -> dict[str, str]:
    """job -> machine: the heaviest experts one each to the fastest machines, then each further one to the machine
    whose share of the work would end soonest (longest processing time first, on machines of their own speeds).
    With fewer experts than machines the slowest stay idle."""
    if not works:
        raise FlowfleetError("the plan has no expert to place")
    if not tflops:
        raise FlowfleetError("machines: none to place the experts on")
    machines = sorted(tflops, key=lambda m: (-tflops[m], m))
    heaviest = sorted(works, key=lambda w: (-w.flops, w.job))
    placed = {w.job: m for w, m in zip(heaviest, machines)}
    load = {m: 0.0 for m in machines[: len(works)]}
    for w in heaviest[: len(load)]:
        load[placed[w.job]] += w.flops
    for w in heaviest[len(load) :]:
        m = min(load, key=lambda m: ((load[m] + w.flops) / tflops[m], -tflops[m], m))
        placed[w.job] = m
        load[m] += w.flops
    return placed


def make_plan(
    works: list[Work],
    tflops: dict[str, float],
    deadline_s: float | None = None,
    router: Work | None = None,
) -> Plan:
    """The plan for the experts `works` and the `router` on machines of `tflops` (model TFLOP/s each). Balanced (no
    deadline): the recipe's FLOPs (the router's too) shared among the machines in proportion to their speeds, so
    that all finish together. With a deadline: every machine's work is its speed x the deadline. Within a machine,
    its experts share its time after the router's in proportion to their recipes' FLOPs and run one after the other,
    the heaviest first."""
    for m, speed in tflops.items():
        if not speed > 0:
            raise FlowfleetError(f"machines.{m}.tflops: {speed} must be > 0")
    if deadline_s is not None and not deadline_s > 0:
        raise FlowfleetError(f"deadline: {deadline_s} s must be > 0")
    placed = assign_machines(works, tflops)
    used = sorted(set(placed.values()), key=lambda m: (-tflops[m], m))
    recipe = sum(w.flops for w in works) + (router.flops if router else 0)
    before = dict.fromkeys(used, 0.0)  # seconds of each machine's time before its experts: the router's
    routed: Assignment | None = None
    if router is not None:
        free = [m for m in sorted(tflops, key=lambda m: (-tflops[m], m)) if m not in used]
        # else the fastest machine; of equals, the one of the lightest experts (the fewest items lose its time)
        load = {m: sum(w.flops for w in works if placed[w.job] == m) for m in used}
        home = free[0] if free else min(used, key=lambda m: (-tflops[m], load[m], m))
        took = router.flops / (tflops[home] * TERA)
        if deadline_s is not None and took > deadline_s:
            step_s = router.step_flops / (tflops[home] * TERA)
            if step_s > deadline_s:
                raise FlowfleetError(
                    f"deadline: {deadline_s:g} s is shorter than one step of {router.job} on machine {home} (a step "
                    f"of batch {router.batch} takes {step_s:.3g} s there)"
                )
            raise FlowfleetError(
                f"router_train.steps: the router's {router.steps} steps take {took:.3g} s on machine {home}, longer "
                f"than the deadline of {deadline_s:g} s ({math.floor(deadline_s / step_s)} steps fit)"
            )
        routed = Assignment(router.job, home, router.steps, router.batch, router.sample_flops, router.steps, 0.0, took)
        if home in before:
            before[home] = took
    if deadline_s is not None:
        seconds = deadline_s
    else:
        seconds = (recipe - (routed.flops if routed and routed.machine not in before else 0)) / (
            TERA * sum(tflops[m] for m in used)
        )
        if routed is not None and before.get(routed.machine, 0.0) >= seconds:
            # the router alone outlasts the machines' equal share: it has its machine to itself, the experts the rest
            rest = make_plan(works, {m: v for m, v in tflops.items() if m != routed.machine})
            return Plan("balanced", dict(tflops), dict(sorted({**rest.jobs, routed.job: routed}.items())), recipe)
    jobs: dict[str, Assignment] = {} if routed is None else {routed.job: routed}
    for m in used:
        mine = sorted((w for w in works if placed[w.job] == m), key=lambda w: (-w.flops, w.job))
        share, clock = sum(w.flops for w in mine), before[m]
        for w in mine:
            flops = (seconds - before[m]) * tflops[m] * TERA * w.flops / share
            if deadline_s is None:
                steps = max(1, round(flops / w.step_flops))
            else:  # every step must end by the deadline
                steps = math.floor(flops / w.step_flops)
                if steps < 1:
                    step_s = w.step_flops / (tflops[m] * TERA)
                    after = f" after the router's {before[m]:.3g} s there (router_train.steps)" if before[m] else ""
                    raise FlowfleetError(
                        f"deadline: {deadline_s:g} s is shorter than one step of {w.job} on machine {m}{after} "
                        f"(a step of batch {w.batch} takes {step_s:.3g} s there)"
                    )
            took = steps * w.step_flops / (tflops[m] * TERA)
            jobs[w.job] = Assignment(w.job, m, steps, w.batch, w.sample_flops, w.steps, clock, clock + took)
            clock += took
    mode: Literal["balanced", "deadline"] = "deadline" if deadline_s is not None else "balanced"
    return Plan(mode, dict(tflops), dict(sorted(jobs.items())), recipe, deadline_s)


def replan(plan: Plan, lost: str, done_steps: dict[str, int]) -> Plan:
    """The plan without machine `lost`: each of its unfinished experts keeps its steps and batch and moves, from
    `done_steps` (its newest checkpoint's step), to the machine that finishes it soonest after that machine's own
    planned work. Finish times stay the plan's clock (seconds after the fleet's start)."""
    if lost not in plan.tflops or lost in plan.lost:
        known = ", ".join(m for m in plan.tflops if m not in plan.lost)
        raise FlowfleetError(f"machine {lost!r}: not a machine of the plan (its machines: {known})")
    left = [m for m in plan.tflops if m != lost and m not in plan.lost]
    if not left:
        raise FlowfleetError(f"machine {lost!r}: the plan's last machine; no other can take its experts")
    jobs = dict(plan.jobs)
    moves = list(plan.moves)
    for name, a in sorted(plan.jobs.items(), key=lambda item: item[1].start_s):
        done = min(max(done_steps.get(name, 0), 0), a.steps)
        if a.machine != lost or done >= a.steps:
            continue
        rest = (a.steps - done) * a.step_flops
        ends = {m: max((b.finish_s for b in jobs.values() if b.machine == m), default=0.0) for m in left}
        end_on = {m: ends[m] + rest / (plan.tflops[m] * TERA) for m in left}
        to = min(left, key=lambda m: (end_on[m], -plan.tflops[m], m))
        jobs[name] = Assignment(name, to, a.steps, a.batch, a.sample_flops, a.recipe_steps, ends[to], end_on[to])
        moves.append({"job": name, "from": lost, "to": to, "at_step": done})
    return dataclasses.replace(plan, jobs=jobs, lost=[*plan.lost, lost], moves=moves)


def read_plan(root: RunRoot) -> Plan | None:
    """The run's plan (plan/plan.json, `flowfleet plan`), or None where it has none."""
    if not root.exists(*PLAN):
        return None
    try:
        raw = root.read_json(*PLAN)
    except ValueError as err:  # its message names the file
        raise FlowfleetError(str(err)) from None
    return Plan.from_json(raw, root.url_of(*PLAN))


def current_plan(root: RunRoot, cfg: RunConfig) -> Plan | None:
    """The run's plan where run.yaml names machines (a plan made before its `machines` left run.yaml is not
    followed), refused where run.yaml's recipe has changed since it was made."""
    if not cfg.machines:
        return None
    plan = read_plan(root)
    if plan is None:
        return None
    if plan.recipe_key != recipe_key(cfg):
        raise FlowfleetError(
            f"{root.url_of(*PLAN)}: made for another recipe than run.yaml's (its training settings or models changed "
            f"since); run `flowfleet plan {root.url}` again"
        )
    for name, a in plan.jobs.items():
        if a.machine not in cfg.machines:
            raise FlowfleetError(
                f"{root.url_of(*PLAN)}: {name} is planned on machine {a.machine!r}, which run.yaml machines no "
                f"longer has; run `flowfleet plan {root.url}` again"
            )
    return plan


def write_plan(root: RunRoot, plan: Plan) -> None:
    root.write_json(plan.to_json(), *PLAN)


def recipe_key(cfg: RunConfig) -> str:
    """What of run.yaml a plan's steps were derived from (the steps, batch and their split, the experts' and the
    router's architectures): a plan made for another recipe is not followed."""
    recipe = {
        "train": cfg.train.model_dump(include={"steps", "batch_size", "grad_accum", "split", "expert_steps"}),
        "router_train": cfg.router_train.model_dump(include={"steps", "batch_size"}),
        "experts": [cfg.expert_config(k).model_dump(mode="json") for k in cfg.fleet_experts],
        "router": cfg.router.model_dump(mode="json"),
    }
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]
