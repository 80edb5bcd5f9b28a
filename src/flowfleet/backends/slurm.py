"""The `slurm` backend of `train-all`: the run's jobs as sbatch jobs on an existing Slurm cluster.

    RUN_ROOT/backends/slurm/experts.sbatch     one array task per expert (--array=<expert ids>)
    RUN_ROOT/backends/slurm/<job>.sbatch       router, router-paris, monolith: one job each
    RUN_ROOT/backends/slurm/assemble.sbatch    `flowfleet assemble`, --dependency=afterok on all of them
    RUN_ROOT/backends/submissions.json         job -> {backend, id, submitted}
    RUN_ROOT/<job folder>/train.log            the job's output (appended, as the local backend writes it)

The scripts are plain files a user can read and `sbatch` again. Every job runs the same flowfleet
command as the local backend (`python -m flowfleet.cli train-expert RUN --expert k`, under
`torchrun --nproc-per-node G` with G GPUs per job), so its checkpoints, status.json and final weights are
the ones a local run writes; the nodes need the run root (a shared folder or an s3:// URL) and the same
Python environment. The router does not wait for the experts: it trains on data/ and the cluster ids
only. Job state comes from `squeue` (a one-node cluster often runs without accounting, so `sacct` is
not used) next to each job's status.json.
"""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path
from typing import Sequence

from flowfleet.config import BackendConfig
from flowfleet.errors import FlowfleetError
from flowfleet.layout import LOG_FILE
from flowfleet.storage import RunRoot
from flowfleet.train.specs import JobSpec, cli_command, launcher

FOLDER = ("backends", "slurm")
SQUEUE_ACTIVE = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING")


def _run(cmd: Sequence[str]) -> str:
    """A Slurm client command -> its stdout; a one-line error naming the command otherwise."""
    try:
        out = subprocess.run(list(cmd), capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        raise FlowfleetError(f"slurm: `{cmd[0]}` not found (is this a Slurm login node?)") from None
    except subprocess.TimeoutExpired:
        raise FlowfleetError(f"slurm: `{' '.join(cmd[:2])}` did not answer within 60 s") from None
    if out.returncode != 0:
        first = (out.stderr.strip() or out.stdout.strip()).splitlines()
        raise FlowfleetError(f"slurm: `{' '.join(cmd[:2])}` failed: {first[0] if first else out.returncode}")
    return out.stdout


class SlurmBackend:
    name = "slurm"

    def __init__(self, config: BackendConfig | None = None):
        self.config = config or BackendConfig(kind="slurm")
        if self.config.kind != "slurm":
            raise FlowfleetError(f"SlurmBackend: a {self.config.kind!r} backend config")

    # -- scripts ----------------------------------------------------------------------------------

    def _header(self, job_name: str, output: str) -> list[str]:
        o = self.config
        lines = [
            "#!/bin/bash",
            f"#SBATCH --job-name={job_name}",
            f"#SBATCH --output={output}",
            "#SBATCH --open-mode=append",
        ]
        lines.append(f"#SBATCH --cpus-per-task={o.cpus_per_job}")
        if o.gpus_per_job:
            lines.append(f"#SBATCH --gpus-per-task={o.gpus_per_job}")
        for flag, value in (("partition", o.partition), ("account", o.account), ("time", o.time)):
            if value:
                lines.append(f"#SBATCH --{flag}={value}")
        lines += [f"#SBATCH {arg}" for arg in o.sbatch_args]
        lines += ["set -euo pipefail", 'export OMP_NUM_THREADS="${SLURM_CPUS_PER_TASK:-1}"']
        return lines

    def _command(self, argv: list[str], tail: str = "") -> str:
        """The job's command line; `tail` is appended unquoted (a shell variable such as the array index)."""
        return "exec " + shlex.join(argv) + tail

    def _launcher(self) -> list[str]:
        return launcher(self.config.python, self.config.gpus_per_job)  # G > 1 GPUs: the trainer's DDP under torchrun

    def expert_script(self, root: RunRoot, experts: list[int], run_name: str) -> str:
        """One array task per expert: the task index is the expert id."""
        argv = JobSpec("expert", 0).command(root.url, self._launcher())[:-1]  # ... --expert
        lines = self._header(f"flowfleet-{run_name}-experts", self._log(root, "experts/%a"))
        lines.insert(2, f"#SBATCH --array={','.join(str(k) for k in experts)}")
        return "\n".join([*lines, self._command(argv, ' "$SLURM_ARRAY_TASK_ID"'), ""])

    def job_script(self, root: RunRoot, spec: JobSpec, run_name: str) -> str:
        lines = self._header(f"flowfleet-{run_name}-{spec.name}", self._log(root, spec.dir))
        return "\n".join([*lines, self._command(spec.command(root.url, self._launcher())), ""])

    def assemble_script(self, root: RunRoot, run_name: str) -> str:
        lines = self._header(f"flowfleet-{run_name}-assemble", self._log(root, "/".join(FOLDER)))
        return "\n".join([*lines, self._command(cli_command(["assemble", root.url], launcher(self.config.python))), ""])

    @staticmethod
    def _log(root: RunRoot, folder: str) -> str:
        """Where Slurm appends a job's output: its folder's train.log, as the local backend does (%a: the
        array task, i.e. the expert)."""
        return f"{root.local_path()}/{folder}/{LOG_FILE}"

    # -- submission and state ---------------------------------------------------------------------

    def sbatch(self, script_path: str, dependency: Sequence[str] = ()) -> str:
        cmd = ["sbatch", "--parsable"]
        if dependency:
            cmd.append(f"--dependency=afterok:{':'.join(dependency)}")
        out = _run([*cmd, script_path]).strip()
        return out.split(";")[0]  # "<id>[;cluster]"

    def submit(self, root: RunRoot, specs: list[JobSpec], run_name: str, then_assemble: bool = True) -> dict[str, str]:
        """Write the scripts into the run root and submit them -> job name -> Slurm job id (array
        tasks as "<array id>_<expert>"); then_assemble: an assemble job after all of them (afterok)."""
        local = root.local_path(*FOLDER)
        if local is None:
            raise FlowfleetError(f"--backend slurm: {root.url} is not a local folder; sbatch needs the scripts on disk")
        local.mkdir(parents=True, exist_ok=True)
        for spec in specs:  # Slurm opens its log file itself: the job folders must exist
            (local.parent.parent / spec.dir).mkdir(parents=True, exist_ok=True)
        ids: dict[str, str] = {}
        experts = [s for s in specs if s.kind == "expert" and s.expert is not None]
        if experts:
            path = local / "experts.sbatch"
            script = self.expert_script(root, [s.expert for s in experts if s.expert is not None], run_name)
            root.write_bytes(script.encode(), *FOLDER, "experts.sbatch")
            array = self.sbatch(str(path))
            ids.update({s.name: f"{array}_{s.expert}" for s in experts})
        for spec in specs:
            if spec.kind == "expert":
                continue
            name = f"{spec.name}.sbatch"
            root.write_bytes(self.job_script(root, spec, run_name).encode(), *FOLDER, name)
            ids[spec.name] = self.sbatch(str(local / name))
        if then_assemble and ids:
            root.write_bytes(self.assemble_script(root, run_name).encode(), *FOLDER, "assemble.sbatch")
            parents = sorted({i.split("_")[0] for i in ids.values()})
            ids["assemble"] = self.sbatch(str(local / "assemble.sbatch"), parents)
        return ids

    def resubmit(self, root: RunRoot, spec: JobSpec, run_name: str) -> str:
        """One job again, alone (an expert as a plain job, not an array task) -> its new Slurm job id."""
        local = root.local_path(*FOLDER)
        assert local is not None  # submit() refused remote run roots
        name = f"{spec.name}.sbatch"
        root.write_bytes(self.job_script(root, spec, run_name).encode(), *FOLDER, name)
        return self.sbatch(str(local / name))

    def states(self, ids: Sequence[str]) -> dict[str, str]:
        """Slurm job id -> its squeue state (PENDING, RUNNING, ...); ids squeue no longer lists are absent."""
        if not ids:
            return {}
        arrays = sorted({i.split("_")[0] for i in ids})
        try:
            out = _run(["squeue", "-h", "-r", "-o", "%i %T", "-j", ",".join(arrays)])
        except FlowfleetError as err:
            if "Invalid job id" not in str(err):
                raise
            # squeue refuses a job it has already forgotten (MinJobAge): ask for each job alone
            out = "".join(self._squeue_if_known(a) for a in arrays)
        listed = dict(line.split()[:2] for line in out.splitlines() if line.strip())
        return {i: listed[i] for i in ids if i in listed}

    @staticmethod
    def _squeue_if_known(job_id: str) -> str:
        try:
            return _run(["squeue", "-h", "-r", "-o", "%i %T", "-j", job_id])
        except FlowfleetError as err:
            if "Invalid job id" in str(err):
                return ""
            raise

    def is_active(self, state: str | None) -> bool:
        return active(state)

    def cancel(self, ids: Sequence[str]) -> None:
        if ids:
            _run(["scancel", *ids])

    def logs(self, job_id: str) -> str:
        """The job's output file (its folder's train.log) while Slurm still knows the job."""
        out = _run(["scontrol", "show", "job", job_id])
        path = next((f.split("=", 1)[1] for f in out.split() if f.startswith("StdOut=")), None)
        if path is None or not Path(path).is_file():
            raise FlowfleetError(f"slurm job {job_id}: no output file ({path})")
        return Path(path).read_text(errors="replace")

    def record(self) -> dict[str, str]:
        return {}

    def close(self) -> None:
        pass


def active(state: str | None) -> bool:
    return state is not None and state.split()[0] in SQUEUE_ACTIVE
