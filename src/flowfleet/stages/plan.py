"""Stage `plan`: the fleet planned for run.yaml's `machines` (flowfleet.train.plan), written to plan/plan.json, which
train-all, `status` and every training job then follow; and `probe`, a machine's speed measured on it.

    flowfleet probe RUN --machine fast        on the machine itself: plan/probe-fast.json
    flowfleet plan RUN [--deadline 36h]       plan/plan.json: each job's machine, steps, batch, expected finish
    flowfleet plan RUN --replan slow          slow's unfinished jobs, from their newest checkpoints, moved
"""

from __future__ import annotations

import logging
import socket
import time

from flowfleet.config import RunConfig, load_run_config
from flowfleet.device import resolve_device
from flowfleet.errors import FlowfleetError
from flowfleet.layout import probe_file
from flowfleet.models.flops import train_flops_per_sample
from flowfleet.storage import RunRoot
from flowfleet.train.checkpoint import CheckpointStore, step_of
from flowfleet.train.plan import Plan, Work, make_plan, read_plan, recipe_key, replan, write_plan
from flowfleet.train.probe import probe_tflops
from flowfleet.train.specs import JobSpec, job_cost, matched_monolith_steps, router_spec
from flowfleet.train.status import job_finished
from flowfleet.train.tasks import contribution_of, recipe_batch, recipe_steps

log = logging.getLogger(__name__)


def _open(run_root: str | RunRoot) -> tuple[RunRoot, RunConfig]:
    root = run_root if isinstance(run_root, RunRoot) else RunRoot(run_root)
    cfg = load_run_config(root)
    if not cfg.machines:
        raise FlowfleetError(f"{root.url}: run.yaml has no machines to plan the fleet on (run.yaml machines)")
    return root, cfg


def planned_experts(cfg: RunConfig) -> list[JobSpec]:
    """The experts a plan places: the fleet's, without those a contributor trained elsewhere."""
    return [JobSpec("expert", k) for k in cfg.fleet_experts if contribution_of(cfg, JobSpec("expert", k)) is None]


def expert_works(root: RunRoot, cfg: RunConfig) -> list[Work]:
    """Each planned expert as run.yaml's recipe trains it (its partition's share where the recipe reads it)."""
    return [
        Work(
            spec.name,
            recipe_steps(root, cfg, spec),
            recipe_batch(root, cfg, spec),
            train_flops_per_sample(cfg.expert_config(spec.expert or 0)),
        )
        for spec in planned_experts(cfg)
    ]


def router_work(cfg: RunConfig) -> Work:
    """The router as run.yaml's router_train trains it."""
    return Work(
        router_spec(cfg).name, cfg.router_train.steps, cfg.router_train.batch_size, train_flops_per_sample(cfg.router)
    )


def machine_tflops(root: RunRoot, cfg: RunConfig) -> dict[str, float]:
    """Each machine's speed: declared in run.yaml, else its probe's (`flowfleet probe`)."""
    speeds = {}
    for name, machine in cfg.machines.items():
        if machine.tflops is not None:
            speeds[name] = machine.tflops
        elif root.exists(*probe_file(name)):
            speeds[name] = float(root.read_json(*probe_file(name))["tflops"])
        else:
            raise FlowfleetError(
                f"machines.{name}.tflops: neither declared nor probed; run `flowfleet probe {root.url} "
                f"--machine {name}` on that machine"
            )
    return speeds


def _monolith_steps(cfg: RunConfig, plan: Plan) -> int | None:
    """A compute-matched monolith's steps for the plan's experts' FLOPs and the router's."""
    if not (cfg.monolith.enabled and cfg.monolith.match_compute):
        return None
    router = router_spec(cfg)
    return matched_monolith_steps(cfg, plan.total_flops + (0 if router.name in plan.jobs else job_cost(cfg, router)))


def plan_fleet(run_root: str | RunRoot, deadline_s: float | None = None, router: bool = True) -> Plan:
    """Plan the run's experts and its router on its machines (balanced, or every machine until `deadline_s` seconds
    after the start) and write plan/plan.json. router=False: the experts alone (the router trains where run.yaml
    `placement` puts it, outside the plan's time)."""
    root, cfg = _open(run_root)
    works = expert_works(root, cfg)
    plan = make_plan(works, machine_tflops(root, cfg), deadline_s, router_work(cfg) if router else None)
    plan.monolith_steps = _monolith_steps(cfg, plan)
    plan.recipe_key = recipe_key(cfg)
    write_plan(root, plan)
    return plan


def replan_fleet(run_root: str | RunRoot, lost: str) -> Plan:
    """The run's plan with machine `lost` gone: its unfinished experts go on, from their newest checkpoints, on the
    machines that finish them soonest (flowfleet.train.plan.replan); plan/plan.json rewritten."""
    root, cfg = _open(run_root)
    plan = read_plan(root)
    if plan is None:
        raise FlowfleetError(f"{root.url}: no plan to change; run `flowfleet plan {root.url}` first")
    done = {}
    for spec in [*planned_experts(cfg), router_spec(cfg)]:
        if spec.name not in plan.jobs:
            continue
        finished, _, _ = job_finished(root, spec.dir, plan.jobs[spec.name].steps)
        newest = CheckpointStore(root, spec.dir).latest()
        done[spec.name] = plan.jobs[spec.name].steps if finished else step_of(newest) if newest else 0
    changed = replan(plan, lost, done)
    write_plan(root, changed)
    return changed


def probe_machine(
    run_root: str | RunRoot, machine: str, device: str | None = "auto", steps: int = 10
) -> dict[str, float | str]:
    """Measure this machine's speed at the run's heaviest expert's training step and store it as `machine`'s
    (plan/probe-MACHINE.json) -> what was stored."""
    root, cfg = _open(run_root)
    if machine not in cfg.machines:
        raise FlowfleetError(f"machine {machine!r}: not in run.yaml machines ({', '.join(cfg.machines)})")
    works = {w.job: w for w in expert_works(root, cfg)}
    heaviest = max(planned_experts(cfg), key=lambda s: works[s.name].flops)
    batch = works[heaviest.name].batch
    where = resolve_device(device)
    model = cfg.expert_config(heaviest.expert or 0)
    tflops, step_s = probe_tflops(model, batch, cfg.latent_shape, where, cfg.train.precision, steps)
    record: dict[str, float | str] = {
        "tflops": tflops,
        "step_s": step_s,
        "job": heaviest.name,
        "batch": batch,
        "device": str(where),
        "host": socket.gethostname(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    root.write_json(record, *probe_file(machine))
    log.info(f"probe {machine}: {tflops:.3g} model TFLOP/s ({step_s:.3g} s a step of {heaviest.name} at batch {batch})")
    return record
