"""A stage in N parts as one Ray job: the entrypoint the ray backend submits for `prepare --parts N --backend ray`
and `cluster --parts N --backend ray`, the Ray counterpart of the Slurm backend's array between two jobs.

    python -m flowfleet.backends.ray_parts --stage STAGE --run RUN_ROOT --parts N --folder FOLDER
        [--first NAME=ARG] --cpus C [--gpus G] [--resource NAME=AMOUNT]

It runs `flowfleet STAGE RUN --quiet` with the first step's argument once (prepare's --autoencoder-only, cluster's
--fit-only), then its N `--part i/N` as Ray tasks of C CPUs and G GPUs each (as many at once as the cluster has
room for, on any of its nodes), then `--merge N`: each step a task whose output goes to FOLDER/<step>.log in a run
root on a shared folder (<i>-of-<N>.log for a part), and to this job's log through Ray's log forwarding. A step that
fails fails the job; the steps resume where they stopped, so submitting the same command again finishes the stage.
"""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys
from pathlib import Path
from typing import Sequence

from flowfleet.backends.ray_nodes import add_share_options, share_of, task_options
from flowfleet.storage import RunRoot
from flowfleet.train.specs import cli_command, launcher

log = logging.getLogger(__name__)


def run_step(argv: Sequence[str], log_file: str | None) -> int:
    """One step's command -> its exit code; its output appended to log_file when there is one, else this task's."""
    if log_file is None:
        return subprocess.run(list(argv)).returncode
    Path(log_file).parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "ab") as out:
        return subprocess.run(list(argv), stdout=out, stderr=subprocess.STDOUT).returncode


def run(args: argparse.Namespace) -> int:
    """The stage's steps in order -> 0, or the first failing step's exit code."""
    import ray

    root = RunRoot(args.run)
    command = cli_command([args.stage, root.url, "--quiet"], launcher())
    step = ray.remote(run_step).options(**task_options(args.bundle))

    def log_of(name: str) -> str | None:
        local = root.local_path(args.folder, f"{name}.log")
        return None if local is None else str(local)

    ray.init()  # inside a Ray job: its cluster
    n = args.parts
    stages: list[list[tuple[str, list[str]]]] = [
        [(f"{i}-of-{n}", [*command, "--part", f"{i}/{n}"]) for i in range(n)],
        [("merge", [*command, "--merge", str(n)])],
    ]
    if args.first:
        name, arg = args.first.split("=", 1)
        stages.insert(0, [(name, [*command, arg])])
    for steps in stages:
        codes = ray.get([step.remote(argv, log_of(name)) for name, argv in steps])
        failed = [(name, code) for (name, _), code in zip(steps, codes) if code != 0]
        if failed:
            name, code = failed[0]
            where = log_of(name) or "this job's log"
            log.error("%s %s failed (exit code %d): see %s", args.stage, name, code, where)
            return code
        log.info("%s: %s done", args.stage, ", ".join(name for name, _ in steps))
    return 0


def parse(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m flowfleet.backends.ray_parts", description=__doc__)
    p.add_argument("--stage", choices=("prepare", "cluster"), required=True)
    p.add_argument("--run", required=True, help="the run root")
    p.add_argument("--parts", type=int, required=True, help="N >= 1")
    p.add_argument("--folder", required=True, help="the run root's folder of the parts' logs")
    p.add_argument("--first", default=None, metavar="NAME=ARG", help="a step before the parts: its name and argument")
    add_share_options(p, "step")
    args = p.parse_args(argv)
    if args.parts < 1:
        p.error(f"--parts: must be >= 1, got {args.parts}")
    args.bundle = share_of(p, args)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="flowfleet ray_parts: %(message)s", stream=sys.stdout)
    return run(parse(sys.argv[1:] if argv is None else argv))


def entrypoint_args(stage: str, run_root: str, n: int, folder: str, first: tuple[str, list[str]] | None) -> list[str]:
    """This module's arguments for a stage's parts (the ray backend puts the interpreter and resources around them)."""
    extra = [f"--first={first[0]}={first[1][0]}"] if first else []
    return [f"--stage={stage}", f"--run={run_root}", f"--parts={n}", f"--folder={folder}", *extra]


if __name__ == "__main__":
    sys.exit(main())
