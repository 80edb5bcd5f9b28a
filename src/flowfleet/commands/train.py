"""Training jobs: `train-expert`, `train-router`, `train-monolith`, `train-diloco`, `train-all`, `status`; the
fleet's plan for its machines: `probe`, `plan`; the EMA's length after training: `ema`."""

from __future__ import annotations

import argparse
import json
import re
import sys
import time

from flowfleet.commands.options import add_command, add_device, add_progress, add_run_root
from flowfleet.train.status import JobStatus

_RESUME = (
    "Resumes from the job's newest checkpoint when there is one. SIGTERM or Ctrl-C: finish the step, "
    "checkpoint, mark the job 'stopped' and exit 0; re-run the same command to continue."
)


def _job_options(p: argparse.ArgumentParser) -> None:
    add_device(p)
    add_progress(p)


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "train-expert", run_expert, epilog=_RESUME)
    add_run_root(p)
    p.add_argument("--expert", type=int, required=True, metavar="K", help="partition / expert number, 0..K-1")
    _job_options(p)

    p = add_command(sub, "train-router", run_router, epilog=_RESUME)
    add_run_root(p)
    which = p.add_mutually_exclusive_group()
    which.add_argument(
        "--paris",
        action="store_true",
        help="train the prompt-blind router p(k | x_t, t) of Paris into router-paris/ (a comparison "
        "for a prompt-aware run.yaml router; train-all does it when run.yaml router_baseline is true)",
    )
    which.add_argument(
        "--prompt-aware",
        action="store_true",
        help="train a router that also reads the prompt, p(k | x_t, t, prompt), into router-prompt/ (a "
        "comparison for Paris' prompt-blind run.yaml router; train-all does it when run.yaml router_prompt is true)",
    )
    _job_options(p)

    p = add_command(sub, "train-monolith", run_monolith, epilog=_RESUME)
    add_run_root(p)
    p.add_argument(
        "--match-compute",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="set the steps so its training FLOPs equal the fleet's: the K experts' and the router's "
        "(default: run.yaml monolith.match_compute)",
    )
    _job_options(p)

    p = add_command(sub, "train-diloco", run_diloco, epilog=_RESUME)
    add_run_root(p)
    p.add_argument("--worker", type=int, required=True, metavar="W", help="DiLoCo worker number, 0..W-1")
    _job_options(p)

    _register_train_all(sub)
    p = add_command(sub, "status", run_status)
    add_run_root(p)
    p.add_argument("--json", action="store_true", help="print the status files as one JSON list instead")
    _register_plan(sub)

    p = add_command(sub, "ema", run_ema)
    add_run_root(p)
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument(
        "--sigma-rel",
        type=_sigma_rel,
        metavar="S",
        help="the EMA's length relative to the training (EDM2's sigma_rel, e.g. 0.08), reconstructed from the "
        "snapshots of run.yaml train.posthoc_ema; 'trained': final/ as training wrote it",
    )
    which.add_argument(
        "--choose",
        dest="lengths",
        type=_lengths,
        metavar="LIST",
        help="lengths to choose from, e.g. 0.05,0.1,0.15: each sampled on the run's validation split, the fleet and "
        "the monolith each keep the one with the lowest classifier FD (FID without a judge); the scores in "
        "reports/posthoc_ema.json",
    )
    p.add_argument("--n", type=int, default=300, help="--choose: images sampled per length and model")
    p.add_argument("--seed", type=int, default=0, help="--choose: the evaluation seed of the validation draw")
    add_device(p)


def _register_plan(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "probe", run_probe)
    add_run_root(p)
    p.add_argument("--machine", required=True, metavar="NAME", help="the run.yaml machines entry this machine is")
    p.add_argument("--steps", type=int, default=10, help="timed training steps (after a short warm-up)")
    add_device(p)

    p = add_command(sub, "plan", run_plan)
    add_run_root(p)
    p.add_argument(
        "--deadline",
        type=parse_duration,
        metavar="DURATION",
        help="every machine trains until then (e.g. 90m, 36h, 2d, 1h30m): a faster machine's expert gets more "
        "steps; default: the recipe's compute, balanced so that every machine finishes together",
    )
    p.add_argument(
        "--replan",
        metavar="MACHINE",
        help="MACHINE is lost: its unfinished experts move, from their newest checkpoints, to the machines that "
        "finish them soonest",
    )


def parse_duration(text: str) -> float:
    """'90m', '36h', '2d', '1h30m', '45s' or plain seconds -> seconds."""
    units = {"d": 86400, "h": 3600, "m": 60, "s": 1}
    parts = re.fullmatch(r"(?:(\d+(?:\.\d+)?)d)?(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s?)?", text)
    if not text or parts is None or not any(parts.groups()):
        raise argparse.ArgumentTypeError(f"{text!r}: a duration such as 90m, 36h, 2d or 1h30m")
    return sum(float(v) * units[u] for v, u in zip(parts.groups(), "dhms") if v)


def _register_train_all(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "train-all", run_all)
    add_run_root(p)
    p.add_argument(
        "--parallel",
        type=int,
        default=None,
        metavar="N",
        help="jobs at a time (default: one per GPU, else one per CPU core; cores are shared out "
        "as each job's thread count)",
    )
    add_progress(p)
    p.add_argument(
        "--backend",
        default="local",
        metavar="NAME",
        help="where the jobs run run.yaml `placement` does not place: local, slurm, ray or a name of "
        "run.yaml `backends` (default local)",
    )
    both = p.add_argument_group("--backend slurm or ray")
    both.add_argument("--cpus-per-job", type=int, default=None, metavar="C", help="CPUs reserved per job (default 1)")
    both.add_argument(
        "--gpus-per-job", type=int, default=None, metavar="G", help="GPUs per job (G > 1: the job runs under torchrun)"
    )
    both.add_argument("--no-wait", dest="wait", action="store_false", help="return once the jobs are submitted")
    slurm = p.add_argument_group("--backend slurm")
    slurm.add_argument("--partition", default=None, help="sbatch --partition")
    slurm.add_argument("--account", default=None, help="sbatch --account")
    slurm.add_argument("--time", default=None, help="sbatch --time, e.g. 2:00:00")
    slurm.add_argument(
        "--sbatch-arg",
        dest="sbatch_args",
        action="append",
        default=None,
        metavar="ARG",
        help="any other sbatch option (repeatable)",
    )
    ray = p.add_argument_group("--backend ray")
    ray.add_argument(
        "--address",
        default=None,
        help="the Ray cluster's dashboard URL, http://HEAD:8265 (default: RAY_ADDRESS; neither: a Ray cluster "
        "started on this machine for this train-all)",
    )


def _options(args: argparse.Namespace):
    from flowfleet.train.loop import TrainOptions

    return TrainOptions(progress=args.progress, device=args.device)


def _report(status) -> int:
    import os

    if int(os.environ.get("RANK", "0")) != 0:
        return 0
    if status.state == "done":
        print(
            f"{status.job}: done ({status.step}/{status.total_steps} steps, last loss "
            f"{status.last_loss if status.last_loss is not None else 'n/a'})"
        )
    else:
        print(f"{status.job}: {status.state} at step {status.step}/{status.total_steps}. {status.message}")
    return 0


def run_expert(args: argparse.Namespace) -> int:
    """train expert k on partition k only (an isolated job)

    Train expert K on RUN_ROOT/partitions/K with the run.yaml `expert` model and `train` settings: train.steps
    steps, or with train.expert_steps by_size its partition's share of K x train.steps. Reads nothing but
    run.yaml and partitions/K; writes experts/K/ (status.json, metrics.jsonl, tb/, checkpoints/, samples/, final/).
    Under `torchrun --nproc_per_node N flowfleet train-expert ...` the job uses DDP over that node's devices (NCCL on
    GPUs, gloo on CPU).
    """

    from flowfleet.stages.train import train_expert

    return _report(train_expert(args.run_root, args.expert, options=_options(args)))


def run_router(args: argparse.Namespace) -> int:
    """train the router p(k | x_t, t) on all data

    Train the DiT router on RUN_ROOT/data with cross-entropy against the cluster ids in
    clusters/assignments.safetensors, x_t at t ~ U[0,1] (run.yaml `router`, `router_train`). Writes router/ and
    router/report.json (accuracy per t-bucket).
    """

    from flowfleet.stages.train import train_router

    return _report(train_router(args.run_root, paris=args.paris, prompt=args.prompt_aware, options=_options(args)))


def run_monolith(args: argparse.Namespace) -> int:
    """train the single-model baseline on all data

    Train one model of the expert architecture on all of RUN_ROOT/data: the baseline for evaluation. Writes monolith/.
    """

    from flowfleet.stages.train import train_monolith

    return _report(train_monolith(args.run_root, match_compute=args.match_compute, options=_options(args)))


def run_diloco(args: argparse.Namespace) -> int:
    """train DiLoCo worker w of one model (run.yaml diloco)

    Train worker W of run.yaml diloco: the expert architecture on a random 1/W of RUN_ROOT/data, diloco.sync_every
    inner steps per round; at each round's end it writes its pseudo-gradient to diloco/rounds/<r>/, waits for the
    other workers' (up to diloco.round_timeout_s, then goes on with those present) and applies the outer Nesterov step
    of their mean. The workers share nothing but the run root: start one per machine, on any backend. Writes
    diloco/worker-W/; `flowfleet assemble --diloco` makes the model folder.
    """

    from flowfleet.stages.train import train_diloco

    return _report(train_diloco(args.run_root, args.worker, options=_options(args)))


_BACKEND_OPTIONS = {
    "cpus_per_job": "--cpus-per-job",
    "gpus_per_job": "--gpus-per-job",
    "partition": "--partition",
    "account": "--account",
    "time": "--time",
    "sbatch_args": "--sbatch-arg",
    "address": "--address",
}


def _backend(args: argparse.Namespace):
    """--backend and its options -> a BackendConfig, or the name of a run.yaml backend (no options)."""
    from pydantic import ValidationError

    from flowfleet.config import BACKEND_KINDS, BackendConfig
    from flowfleet.errors import FlowfleetError

    given = {field: getattr(args, field) for field in _BACKEND_OPTIONS if getattr(args, field) is not None}
    if args.backend not in BACKEND_KINDS:
        if given:
            flags = ", ".join(_BACKEND_OPTIONS[f] for f in given)
            raise FlowfleetError(f"{flags}: --backend {args.backend} takes its options from run.yaml backends")
        return args.backend
    try:
        return BackendConfig(kind=args.backend, **given)
    except ValidationError as err:
        first = err.errors()[0]
        msg = first["msg"].removeprefix("Value error, ")
        field = str(first["loc"][0]) if first["loc"] else msg.split(":")[0]  # (the config's checks name it first)
        msg = msg.removeprefix(f"{field}: ")
        raise FlowfleetError(f"{_BACKEND_OPTIONS.get(field, f'--backend {args.backend}')}: {msg}") from None


def run_all(args: argparse.Namespace) -> int:
    """run every expert job, the router and the monolith (local processes, Slurm or Ray jobs)

    Run the K expert jobs, the router and (if run.yaml monolith.enabled) the monolith: as separate processes on this
    machine, N at a time, longest first (--backend local); as jobs of a Slurm cluster (--backend slurm: an sbatch array
    for the experts, one job per other job, an assemble job after all; the scripts are written to
    RUN_ROOT/backends/slurm/); or as Ray jobs (--backend ray --address http://HEAD:8265). run.yaml `backends` and
    `placement` may spread the jobs over several (mixed compute). Jobs on Slurm or Ray are watched: one whose node dies
    is resubmitted and resumes from its checkpoint. Finished jobs are skipped, unfinished ones resume, a job still
    queued or running is not submitted twice. Each job's output goes to its folder's train.log.
    """

    from flowfleet.errors import FlowfleetError
    from flowfleet.stages.train import train_all

    if args.parallel is not None and args.parallel < 1:
        raise FlowfleetError(f"--parallel: must be >= 1, got {args.parallel}")
    outcome = train_all(
        args.run_root,
        parallel=args.parallel,
        progress=args.progress,
        backend=_backend(args),
        wait=args.wait,
    )
    for name, result in outcome.results.items():
        why = outcome.messages.get(name, "")
        print(f"{name}: {result}" + (f" ({why})" if why and result not in ("skipped",) else ""))
    return 0 if outcome.ok else 1


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.0f} s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min ago"
    return f"{seconds / 3600:.1f} h ago"


def _rounds(diloco: dict | None) -> str:
    """A DiLoCo worker's rounds for the status table: '2/3, 1 short, 1.2 MB out, 1.2 MB in'."""
    if not diloco:
        return "-"
    short = len(diloco.get("short_rounds", []))
    out, back = diloco.get("bytes_written", 0) / 1e6, diloco.get("bytes_read", 0) / 1e6
    return (
        f"{diloco['round']}/{diloco['rounds']}"
        + (f", {short} short" if short else "")
        + (f", {out:.1f} MB out, {back:.1f} MB in")
    )


def _speed(status: JobStatus) -> str:
    """'S s/step, MFU M %, G GiB' from a job's last log line ('-' before its first)."""
    if status.step_s is None:
        return "-"
    parts = [f"{status.step_s:.3g} s/step"]
    if status.mfu is not None:
        parts.append(f"MFU {100 * status.mfu:.1f} %")
    if status.peak_memory_gib is not None:
        parts.append(f"{status.peak_memory_gib:.1f} GiB")
    return ", ".join(parts)


def job_plans(run_root: str) -> dict[str, dict]:
    """job -> its place in the run's plan (machine, steps, batch, planned seconds a step, planned finish), where
    the run has one."""
    from flowfleet.config import load_run_config
    from flowfleet.storage import RunRoot
    from flowfleet.train.plan import current_plan

    root = RunRoot(run_root)
    plan = current_plan(root, load_run_config(root))
    if plan is None:
        return {}
    return {
        job: {
            "machine": a.machine,
            "steps": a.steps,
            "batch": a.batch,
            "step_s": plan.step_s(job),
            "finish_s": a.finish_s,
        }
        for job, a in plan.jobs.items()
    }


def _against_plan(status: JobStatus, planned: dict | None) -> str:
    """'fast, S s/step planned (at P %)': the machine the plan gives the job, and its measured pace against
    the planned one."""
    if planned is None:
        return "-"
    cell = f"{planned['machine']}, {planned['step_s']:.3g} s/step planned"
    if status.step_s:
        cell += f" (at {100 * planned['step_s'] / status.step_s:.0f} %)"
    return cell


def run_status(args: argparse.Namespace) -> int:
    """table of every job's state from its status file

    One table of all jobs of the run from their status.json: state, step/total, progress, age of the heartbeat, last
    loss, speed (seconds a step, MFU where the device's peak is known, peak memory), host, a CPU job's thread setting
    (as the machine's load last changed it); for DiLoCo's workers their rounds, the rounds that went on without a
    worker, and the bytes each wrote and read.
    """

    from rich.console import Console
    from rich.table import Table

    from flowfleet.backends import backend_states
    from flowfleet.stages.train import job_status
    from flowfleet.storage import RunRoot

    rows = job_status(args.run_root)
    backends = backend_states(RunRoot(args.run_root))
    planned = job_plans(args.run_root)
    if args.json:
        print(
            json.dumps(
                [{**r.to_dict(), "backend": backends.get(r.job), "plan": planned.get(r.job)} for r in rows], indent=2
            )
        )
        return 0
    colours = {"done": "green", "running": "cyan", "failed": "red", "stopped": "yellow", "pending": "dim"}
    table = Table(title=f"jobs of {args.run_root}")
    cols = [
        "job",
        "state",
        "step",
        "progress",
        "heartbeat",
        "last loss",
        "speed",
        "host",
        "threads",
        "backend",
        "message",
    ]
    if planned:
        cols.insert(cols.index("speed") + 1, "plan")
    rounds = any(r.diloco for r in rows)
    if rounds:
        cols.insert(4, "rounds")
    for col in cols:
        table.add_column(col, justify="right" if col in ("step", "progress", "last loss") else "left", overflow="fold")
    now = time.time()
    for r in rows:
        state = r.state
        if state == "running" and not r.is_live(now=now):
            state = "running?"  # heartbeat stale: the process probably died
        frac = r.step / r.total_steps if r.total_steps else 0.0
        cells = [
            r.job,
            f"[{colours.get(r.state, 'white')}]{state}[/]",
            f"{r.step}/{r.total_steps}",
            f"{100 * frac:.0f}%",
            *([_rounds(r.diloco)] if rounds else []),
            _age(r.heartbeat_age(now)),
            "-" if r.last_loss is None else f"{r.last_loss:.4f}",
            _speed(r),
            *([_against_plan(r, planned.get(r.job))] if planned else []),
            f"{r.host}:{r.pid}" if r.host else "-",
            r.threads or "-",
            backends.get(r.job, "local" if r.host else "-"),
            r.message,
        ]
        table.add_row(*cells)
    Console(width=None if sys.stdout.isatty() else 160).print(table)
    return 0


def run_probe(args: argparse.Namespace) -> int:
    """measure this machine's speed at the run's heaviest expert's training step

    Run on the machine itself (e.g. `srun -w node07 flowfleet probe RUN --machine fast`): a few training steps of
    the expert's own shape and batch, timed; the model TFLOP/s they reach is stored in RUN/plan/probe-NAME.json,
    where `flowfleet plan` reads it for a machine whose run.yaml entry declares no tflops.
    """
    from flowfleet.stages.plan import probe_machine

    record = probe_machine(args.run_root, args.machine, args.device, args.steps)
    print(f"{args.machine}: {record['tflops']:.4g} model TFLOP/s ({record['step_s']:.3g} s a step, {record['device']})")
    return 0


def _sigma_rel(text: str) -> float | str:
    """--sigma-rel: a number, or 'trained' (kept as the word: argparse takes a value equal to the default, None, for
    an option not given)."""
    if text == "trained":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: a relative length such as 0.08, or 'trained'") from None


def _lengths(text: str) -> tuple[float, ...]:
    """--choose: comma-separated relative lengths."""
    try:
        return tuple(float(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: relative lengths such as 0.05,0.1,0.15") from None


def run_ema(args: argparse.Namespace) -> int:
    """every finished job's final/ from its post-hoc EMA of length --sigma-rel

    Reconstructed from the snapshots the job kept (run.yaml train.posthoc_ema, EDM2's post-hoc EMA) at its last
    step; final/ as training wrote it is kept in final-ema/ and comes back with --sigma-rel trained. Run
    `flowfleet assemble` after it to serve the new weights. --choose: the length chosen on the validation split,
    the fleet and the monolith each their own, both assembled.
    """
    if args.lengths is not None:
        return _choose_ema(args)
    from flowfleet.stages.posthoc_ema import apply_posthoc_ema

    sigma_rel = None if args.sigma_rel == "trained" else args.sigma_rel
    changed = apply_posthoc_ema(args.run_root, sigma_rel)
    if not changed:
        print(f"{args.run_root}: no finished job kept post-hoc EMA snapshots (run.yaml train.posthoc_ema)")
        return 1
    what = "as trained" if sigma_rel is None else f"the EMA of sigma_rel {sigma_rel:g}"
    for c in changed:
        print(f"{c.job}: final/ is {what} at step {c.step} ({c.snapshots} snapshots)")
    print(f"then: flowfleet assemble {args.run_root}")
    return 0


def _choose_ema(args: argparse.Namespace) -> int:
    from flowfleet.stages.evaluate import EvaluateOptions
    from flowfleet.stages.evaluate.pieces import distance
    from flowfleet.stages.posthoc_ema import choose_posthoc_ema

    options = EvaluateOptions(n=args.n, seed=args.seed, device=args.device, diagnostics=False)
    record = choose_posthoc_ema(args.run_root, args.lengths, options)
    for row in record["lengths"]:
        scores = "  ".join(f"{name} {distance(row[name]):.2f}" for name in ("fleet", "monolith") if name in row)
        print(f"sigma_rel {row['sigma_rel']:g}: {scores}")
    chosen = ", ".join(f"{name} {length:g}" for name, length in record["chosen"].items())
    print(f"chosen on the validation split: {chosen} (final/ of their jobs, assembled)")
    return 0


def run_plan(args: argparse.Namespace) -> int:
    """assign the experts to run.yaml's machines, with their steps and batch

    Balanced by default: each machine's share of the recipe's compute follows its speed, the heaviest experts on
    the fastest machines, so that every machine finishes together. --deadline: every machine trains until then, and
    the fleet's compute (and the compute-matched monolith's steps) is what they do by then. Prints each machine's
    experts, steps, batch, FLOPs and expected finish, and writes RUN/plan/plan.json, which train-all follows on every
    backend and `status` compares against. --replan MACHINE moves a lost machine's unfinished experts.
    """
    from flowfleet.stages.plan import plan_fleet, replan_fleet

    plan = replan_fleet(args.run_root, args.replan) if args.replan else plan_fleet(args.run_root, args.deadline)
    print(format_plan(plan))
    return 0


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:.2f} h" if seconds >= 360 else f"{seconds:.0f} s"


def format_plan(plan) -> str:
    """The plan as a table of machines and their experts, then its totals."""
    lines = [f"{'machine':<12} {'TFLOP/s':>8} {'expert':<10} {'steps':>8} {'batch':>6} {'FLOPs':>9} {'finish':>9}"]
    for machine, tflops in sorted(plan.tflops.items(), key=lambda m: -m[1]):
        mine = sorted((a for a in plan.jobs.values() if a.machine == machine), key=lambda a: a.start_s)
        label = machine + (" (lost)" if machine in plan.lost else "")
        if not mine:
            lines.append(f"{label:<12} {tflops:>8.3g} {'-':<10}")
        for a in mine:
            lines.append(
                f"{label:<12} {tflops:>8.3g} {a.job:<10} {a.steps:>8} {a.batch:>6} {a.flops:>9.3g} "
                f"{_hours(a.finish_s):>9}"
            )
            label = ""
    busy = sum(a.finish_s - a.start_s for a in plan.jobs.values())
    machines = len(plan.tflops) - len(plan.lost)
    lines.append(
        f"{plan.mode}: the fleet's {plan.total_flops:.4g} training FLOPs ({plan.total_flops / plan.recipe_flops:.3g}x "
        f"the recipe's {plan.recipe_flops:.4g}); critical path {_hours(plan.critical_path_s)}"
        + (f", deadline {_hours(plan.deadline_s)}" if plan.deadline_s else "")
        + f"; machines busy {busy / max(1e-9, plan.critical_path_s * machines):.0%} of it"
    )
    if plan.monolith_steps is not None:
        lines.append(f"the compute-matched monolith: {plan.monolith_steps} steps (the experts' FLOPs and the router's)")
    for move in plan.moves:
        lines.append(f"{move['job']}: from {move['from']} to {move['to']}, resuming at step {move['at_step']}")
    return "\n".join(lines)
