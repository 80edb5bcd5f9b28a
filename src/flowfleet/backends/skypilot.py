"""`flowfleet export skypilot RUN DIR`: one SkyPilot task file per training job of the run.

    DIR/expert-0.yaml ... DIR/router.yaml [DIR/router-paris.yaml, DIR/monolith.yaml]
    DIR/launch.sh           `sky jobs launch` for each of them (managed jobs: SkyPilot restarts a job
                            whose spot instance is taken; flowfleet resumes it from its checkpoint)

Each task runs the same command as the local and Slurm backends, under torchrun driven by SkyPilot's
variables (SKYPILOT_NUM_GPUS_PER_NODE, SKYPILOT_NUM_NODES, SKYPILOT_NODE_RANK, SKYPILOT_NODE_IPS), on
a run root that every cloud can reach: an object store URL (s3://..., gs://...), read and written by
flowfleet itself with its atomic-write protocol (a FUSE-mounted bucket cannot rename atomically, so
the run root is not a SkyPilot file mount). The files are written here and checked by SkyPilot's own
`sky.Task.from_yaml` in the tests; nothing is launched.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from dataclasses import dataclass

import yaml

from flowfleet.config import load_run_config
from flowfleet.errors import FlowfleetError, ParameterError
from flowfleet.storage import RunRoot
from flowfleet.train.plan import current_plan
from flowfleet.train.specs import JobSpec, fleet_jobs

DEFAULT_SETUP = 'pip install "flowfleet[all]"'
_ACCELERATORS = re.compile(r"^[A-Za-z0-9_-]+(:\d+)?$")  # SkyPilot's NAME[:COUNT]


@dataclass(frozen=True)
class SkyPilotOptions:
    accelerators: str | None = None  # e.g. "A100:1", "H100:8"; None: a CPU job
    cpus: str | None = None  # e.g. "8+"
    memory: str | None = None  # e.g. "32+"
    num_nodes: int = 1  # nodes per job (multi-node DDP under torchrun)
    setup: str = DEFAULT_SETUP
    use_spot: bool = False

    def __post_init__(self) -> None:
        if self.accelerators is not None and not _ACCELERATORS.match(self.accelerators):
            raise ParameterError("accelerators", f"expected NAME[:COUNT] such as A100:1, got {self.accelerators!r}")
        if self.num_nodes < 1:
            raise ParameterError("num_nodes", f"must be >= 1, got {self.num_nodes}")
        for flag, value in (("cpus", self.cpus), ("memory", self.memory)):
            if value is not None and not re.match(r"^\d+(\.\d+)?\+?$", value):
                raise ParameterError(flag, f"expected a number with an optional +, such as 8+, got {value!r}")


def _run_command(spec: JobSpec, root_url: str) -> str:
    """torchrun over SkyPilot's nodes and GPUs (one process per GPU; one per node on CPUs)."""
    torchrun = (
        "torchrun --nnodes=$SKYPILOT_NUM_NODES --node_rank=$SKYPILOT_NODE_RANK "
        "--nproc_per_node=${SKYPILOT_NUM_GPUS_PER_NODE:-1} "
        '--master_addr=$(echo "$SKYPILOT_NODE_IPS" | head -n1) --master_port=29500'
    )
    return f"{torchrun} {shlex.join(spec.command(root_url, []))}\n"


def task(spec: JobSpec, root_url: str, run_name: str, options: SkyPilotOptions) -> dict:
    resources: dict = {}
    if options.accelerators:
        resources["accelerators"] = options.accelerators
    if options.cpus:
        resources["cpus"] = options.cpus
    if options.memory:
        resources["memory"] = options.memory
    if options.use_spot:
        resources["use_spot"] = True
    out: dict = {"name": f"flowfleet-{run_name}-{spec.name}"}
    if resources:
        out["resources"] = resources
    out.update(
        num_nodes=options.num_nodes,
        envs={"FLOWFLEET_RUN_ROOT": root_url, "HF_HUB_DISABLE_TELEMETRY": "1"},
        setup=options.setup + "\n",
        run=_run_command(spec, root_url),
    )
    return out


def export_skypilot(run_root: str, out: str, options: SkyPilotOptions | None = None) -> list[str]:
    """Write DIR/<job>.yaml for every training job of the run and DIR/launch.sh -> the files written."""
    options = options or SkyPilotOptions()
    root = RunRoot(run_root)
    if root.is_local:
        raise FlowfleetError(
            f"{run_root}: a SkyPilot job runs on a machine of its own; the run root must be an object store "
            f"URL every job can reach (s3://..., gs://...), not a local folder"
        )
    cfg = load_run_config(root)
    dest = RunRoot(out)
    written, launch = [], ["#!/usr/bin/env bash", "# one managed SkyPilot job per flowfleet job", "set -euo pipefail"]
    plan = current_plan(root, cfg)
    for spec in fleet_jobs(cfg):
        name = f"{spec.name}.yaml"
        machine = cfg.machines[plan.jobs[spec.name].machine] if plan and spec.name in plan.jobs else None
        mine = options
        if machine is not None and machine.accelerators:  # the plan's machine for this expert
            mine = dataclasses.replace(options, accelerators=machine.accelerators)
        text = yaml.safe_dump(task(spec, root.url, cfg.name, mine), sort_keys=False)
        dest.write_bytes(text.encode(), name)
        written.append(dest.url_of(name))
        launch.append(f"sky jobs launch -y -n {shlex.quote(f'flowfleet-{cfg.name}-{spec.name}')} {shlex.quote(name)}")
    dest.write_bytes(("\n".join(launch) + "\n").encode(), "launch.sh")
    return [*written, dest.url_of("launch.sh")]
