"""One flowfleet job over several nodes of a Ray cluster: the entrypoint the ray backend submits for a job of
backends.NAME.nodes_per_job > 1, as the Slurm backend runs one under srun.

    python -m flowfleet.backends.ray_nodes --nodes N --cpus C [--gpus G] [--resource NAME=AMOUNT] -- COMMAND...

It reserves N bundles of C CPUs, G GPUs and the resources on N different nodes (a placement group of strategy
STRICT_SPREAD: Ray's own gang scheduling, so no node starts before all have their share), then runs COMMAND
(torchrun: train.specs.node_launcher) once in each bundle with torchrun's rendezvous variables (train.specs.
rendezvous_env: the c10d store on the first bundle's node, the Ray job's id), so the nodes' torchruns form one world
of N x max(1, G) ranks. The job ends when every node's torchrun has, or with the first that fails: the others get
SIGTERM (the trainer checkpoints and stops) and the job fails, for train-all to resubmit from the checkpoint. The
bundles are given back either way. Ray's log forwarding brings each node's output to this job's log.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import subprocess
import sys
from typing import Any, Sequence

from flowfleet.train.specs import rendezvous_env

log = logging.getLogger(__name__)

STOP_GRACE_S = 60.0  # a node's torchrun after SIGTERM (its trainer's checkpoint), then SIGKILL
WAIT_REPORT_S = 60.0  # how often a job still waiting for its nodes says so


def add_share_options(p: argparse.ArgumentParser, per: str) -> None:
    """--cpus, --gpus and --resource: what each `per` (a node, a step) reserves; share_of reads them."""
    p.add_argument("--cpus", type=int, required=True, help=f"CPUs of each {per} (>= 1)")
    p.add_argument("--gpus", type=int, default=0, help=f"GPUs of each {per}")
    p.add_argument("--resource", action="append", default=[], metavar="NAME=AMOUNT", help=f"a custom resource a {per}")


def share_of(p: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, float]:
    """add_share_options' values -> the bundle of Ray resources each node or step reserves."""
    if args.cpus < 1 or args.gpus < 0:
        p.error(f"--cpus >= 1 and --gpus >= 0 are required, got {args.cpus} and {args.gpus}")
    try:
        resources = {k: float(v) for k, v in (r.split("=", 1) for r in args.resource)}
    except ValueError:
        p.error(f"--resource: NAME=AMOUNT, got {args.resource}")
    return {"CPU": float(args.cpus), **({"GPU": float(args.gpus)} if args.gpus else {}), **resources}


def task_options(bundle: dict[str, float]) -> dict[str, Any]:
    """Ray task options that take a whole bundle, and never run again by themselves."""
    custom = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")}
    return dict(num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0), resources=custom, max_retries=0)


def node_endpoint() -> str:
    """host:port on this node for the rendezvous store: a port the OS has just handed out (torchrun binds it
    within seconds; a port taken in between fails the rendezvous, and the job, in one line)."""
    import ray

    with socket.socket() as sock:
        sock.bind(("", 0))
        port = sock.getsockname()[1]
    return f"{ray.util.get_node_ip_address()}:{port}"


def run_node(command: Sequence[str], env: dict[str, str]) -> int:
    """One node's torchrun, its output this task's (Ray forwards it) -> its exit code. It names its node by the
    address Ray knows it by (torchrun's --local-addr; else the host's name, which a node need not resolve to an
    address the others reach). Cancelled (ray.cancel raises KeyboardInterrupt here): SIGTERM to its process group,
    SIGKILL after STOP_GRACE_S."""
    import ray

    env = {**os.environ, **env, "PET_LOCAL_ADDR": ray.util.get_node_ip_address()}
    proc = subprocess.Popen(list(command), env=env, start_new_session=True)
    try:
        return proc.wait()
    except BaseException:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        raise


def run(nodes: int, bundle: dict[str, float], command: Sequence[str]) -> int:
    """COMMAND on `nodes` nodes of this job's Ray cluster, one bundle each -> the job's exit code."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    ray.init()  # inside a Ray job: its cluster
    group = placement_group([bundle] * nodes, strategy="STRICT_SPREAD")
    while not group.wait(timeout_seconds=WAIT_REPORT_S):
        log.info("waiting for %d nodes with %s free each", nodes, bundle)
    try:

        def on_node(i: int) -> Any:
            return PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i)

        endpoint = ray.get(ray.remote(node_endpoint).options(num_cpus=0, scheduling_strategy=on_node(0)).remote())
        job_id = ray.get_runtime_context().get_job_id()
        env = rendezvous_env(nodes, max(1, int(bundle.get("GPU", 0))), endpoint, f"flowfleet-{job_id}")
        log.info("%d nodes reserved; rendezvous at %s", nodes, endpoint)
        task = ray.remote(run_node)
        return wait_all(
            [
                task.options(**task_options(bundle), scheduling_strategy=on_node(i)).remote(command, env)
                for i in range(nodes)
            ]
        )
    finally:
        remove_placement_group(group)


def wait_all(pending: list[Any]) -> int:
    """The nodes' exit codes as they end -> 0 when all are 0; else the first failure's, the rest cancelled."""
    import ray

    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        try:
            code = int(ray.get(done[0]))
        except ray.exceptions.RayError as err:  # its node or worker died
            log.error("a node of the job was lost: %s", (str(err).strip().splitlines() or ["?"])[0][:200])
            code = 1
        if code != 0:
            for ref in pending:
                ray.cancel(ref)
            ray.wait(pending, num_returns=len(pending), timeout=STOP_GRACE_S + 10)
            return code
    return 0


def parse(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m flowfleet.backends.ray_nodes", description=__doc__)
    p.add_argument("--nodes", type=int, required=True, help="nodes of the job (>= 2)")
    add_share_options(p, "node (the GPUs: its ranks there)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- and each node's command (torchrun ...)")
    args = p.parse_args(argv)
    args.command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.nodes < 2 or not args.command:
        p.error("--nodes >= 2 and a command after -- are required")
    args.bundle = share_of(p, args)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="flowfleet ray_nodes: %(message)s", stream=sys.stdout)
    args = parse(sys.argv[1:] if argv is None else argv)
    return run(args.nodes, args.bundle, args.command)


if __name__ == "__main__":
    sys.exit(main())
