"""The `slurm` backend of `train-all`: the run's jobs as sbatch jobs on an existing Slurm cluster.

    RUN_ROOT/backends/slurm/experts.sbatch     one array task per expert (--array=<expert ids>)
    RUN_ROOT/backends/slurm/<job>.sbatch       router, router-paris, monolith: one job each
    RUN_ROOT/backends/slurm/assemble.sbatch    `flowfleet assemble`, --dependency=afterok on all of them
    RUN_ROOT/backends/slurm/prepare-*.sbatch   `flowfleet prepare --parts N --backend slurm`: the autoencoder once,
                                               an array of N `prepare --part i/N`, then `prepare --merge N`
    RUN_ROOT/backends/slurm/cluster-*.sbatch   `flowfleet cluster --parts N --backend slurm`: the fit once, then the
                                               same array and merge of `cluster`
    RUN_ROOT/backends/submissions.json         job -> {backend, id, submitted}
    RUN_ROOT/<job folder>/train.log            the job's output (appended, as the local backend writes it)

A run root on an object store (s3://...) keeps a copy of the scripts in backends/slurm/, and sbatch reads them from
a stage folder the login node and the compute nodes share (backends.NAME.stage_dir, else ~/.cache/flowfleet/slurm/
<run>: a home the nodes mount), where Slurm also writes each job's output (STAGE/<job folder>/train.log).

The scripts are plain files a user can read and `sbatch` again. Every job runs the same flowfleet
command as the local backend (`python -m flowfleet.cli train-expert RUN --expert k`, under
`torchrun --nproc-per-node G` with G GPUs per job), so its checkpoints, status.json and final weights are
the ones a local run writes; the nodes need the run root (a shared folder or an s3:// URL) and the same
Python environment. A job of G GPUs asks for CPUS_PER_GPU CPUs a GPU unless cpus_per_job says, and each rank
runs its share of them as threads. A job over N nodes (nodes_per_job) runs one torchrun per node under srun,
joined by torchrun's c10d rendezvous on the job's first node (PET_* variables: torchrun's own).

The router does not wait for the experts: it trains on data/ and the cluster ids
only. Job state comes from `squeue` (a one-node cluster often runs without accounting, so `sacct` is
not used) next to each job's status.json.
"""

from __future__ import annotations

import hashlib
import shlex
import subprocess
from pathlib import Path
from typing import Sequence

from flowfleet.config import BackendConfig
from flowfleet.data.sources.fetched import cache_dir, write_cache_file
from flowfleet.errors import FlowfleetError
from flowfleet.layout import LOG_FILE
from flowfleet.storage import RunRoot
from flowfleet.train.specs import RENDEZVOUS_PORT, JobSpec, cli_command, launcher, node_launcher, rendezvous_env

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
        if o.nodes_per_job > 1:  # one task a node: its torchrun starts the node's ranks
            lines += [f"#SBATCH --nodes={o.nodes_per_job}", "#SBATCH --ntasks-per-node=1"]
        lines.append(f"#SBATCH --cpus-per-task={o.cpus}")
        if o.gpus_per_job:
            lines.append(f"#SBATCH --gpus-per-task={o.gpus_per_job}")
        for flag, value in (
            ("partition", o.partition),
            ("account", o.account),
            ("time", o.time),
            ("nodelist", o.nodelist),
        ):
            if value:
                lines.append(f"#SBATCH --{flag}={value}")
        lines += [f"#SBATCH {arg}" for arg in o.sbatch_args]
        lines += ["set -euo pipefail", f"export OMP_NUM_THREADS={o.threads_per_rank}"]
        if o.nodes_per_job > 1:  # the values are shell words: the job's first node and its id, read on the node
            first = '$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)'
            env = rendezvous_env(o.nodes_per_job, o.ranks_per_node, f"{first}:{RENDEZVOUS_PORT}", "$SLURM_JOB_ID")
            lines += [f'export {name}="{value}"' for name, value in env.items()]
        return lines

    def _command(self, argv: list[str], tail: str = "") -> str:
        """The job's command line; `tail` is appended unquoted (a shell variable such as the array index). Over
        several nodes: under srun, one torchrun a node."""
        srun = "srun --kill-on-bad-exit=1 " if self.config.nodes_per_job > 1 else ""
        return f"exec {srun}" + shlex.join(argv) + tail

    def _launcher(self) -> list[str]:
        """The job's interpreter; G > 1 GPUs: the trainer's DDP under torchrun (over several nodes: torchrun with its
        rendezvous in the PET_* variables of the script)."""
        o = self.config
        if o.nodes_per_job > 1:
            return node_launcher(o.python)
        return launcher(o.python, o.gpus_per_job)

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

    def stage(self, root: RunRoot) -> Path:
        """Where sbatch reads the scripts and Slurm writes the jobs' output: the run root's backends/slurm/ when it
        is a folder on this machine, else the stage folder (module docstring)."""
        local = root.local_path(*FOLDER)
        if local is not None:
            return local
        if self.config.stage_dir:
            return Path(self.config.stage_dir).expanduser()
        return cache_dir() / "slurm" / hashlib.sha256(root.url.encode()).hexdigest()[:12]

    def _outputs(self, root: RunRoot) -> Path:
        """The folder whose <job folder>/train.log Slurm appends a job's output to: the run root's own, or the stage
        folder's."""
        local = root.local_path()
        return local if local is not None else self.stage(root)

    def _log(self, root: RunRoot, folder: str) -> str:
        """Where Slurm appends a job's output: its folder's train.log, as the local backend does (%a: the
        array task, i.e. the expert)."""
        return f"{self._outputs(root)}/{folder}/{LOG_FILE}"

    def _write(self, root: RunRoot, name: str, script: str) -> Path:
        """A script into the run root's backends/slurm/ (a record) and the stage folder -> the file sbatch reads."""
        root.write_bytes(script.encode(), *FOLDER, name)
        staged = self.stage(root) / name
        if root.local_path(*FOLDER) is None:
            write_cache_file(staged, script.encode())  # (atomic: sbatch never reads half a script)
        return staged

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
        self.stage(root).mkdir(parents=True, exist_ok=True)
        for folder in [s.dir for s in specs] + ["/".join(FOLDER)]:  # Slurm opens its log files itself
            (self._outputs(root) / folder).mkdir(parents=True, exist_ok=True)
        ids: dict[str, str] = {}
        # the experts as one array; on a machine's nodes (a plan's) one job each, as few as the machine has
        experts = [s for s in specs if s.kind == "expert" and s.expert is not None and not self.config.nodelist]
        if experts:
            script = self.expert_script(root, [s.expert for s in experts if s.expert is not None], run_name)
            array = self.sbatch(str(self._write(root, "experts.sbatch", script)))
            ids.update({s.name: f"{array}_{s.expert}" for s in experts})
        for spec in specs:
            if spec in experts:
                continue
            staged = self._write(root, f"{spec.name}.sbatch", self.job_script(root, spec, run_name))
            ids[spec.name] = self.sbatch(str(staged))
        if then_assemble and ids:
            staged = self._write(root, "assemble.sbatch", self.assemble_script(root, run_name))
            parents = sorted({i.split("_")[0] for i in ids.values()})
            ids["assemble"] = self.sbatch(str(staged), parents)
        return ids

    def submit_parts(
        self, root: RunRoot, stage: str, n: int, run_name: str, folder: str, first: tuple[str, list[str]] | None
    ) -> dict[str, str]:
        """`flowfleet STAGE` in n parts as Slurm jobs, each on one node: the `first` step once (its name and the
        arguments that make it: prepare's autoencoder, cluster's fit), an array of n `STAGE --part i/N` tasks after
        it, `STAGE --merge N` after them all -> step name -> Slurm job id. Their output: FOLDER/<i>-of-<N>.log,
        FOLDER/<first>.log, FOLDER/merge.log; the scripts STAGE-<step>.sbatch."""
        one_node = SlurmBackend(self.config.model_copy(update={"nodes_per_job": 1}))
        self.stage(root).mkdir(parents=True, exist_ok=True)
        (self._outputs(root) / folder).mkdir(parents=True, exist_ok=True)
        command = cli_command([stage, root.url, "--quiet"], launcher(self.config.python))

        def script(step: str, output: str, argv: list[str], tail: str = "", array: str = "") -> Path:
            lines = one_node._header(f"flowfleet-{run_name}-{stage}-{step}", f"{self._outputs(root)}/{output}")
            if array:
                lines.insert(2, f"#SBATCH --array={array}")
            return self._write(root, f"{stage}-{step}.sbatch", "\n".join([*lines, one_node._command(argv, tail), ""]))

        ids: dict[str, str] = {}
        if first is not None:
            step, extra = first
            ids[step] = self.sbatch(str(script(step, f"{folder}/{step}.log", [*command, *extra])))
        parts = script(
            "parts", f"{folder}/%a-of-{n}.log", [*command, "--part"], f' "$SLURM_ARRAY_TASK_ID/{n}"', f"0-{n - 1}"
        )
        ids["parts"] = self.sbatch(str(parts), list(ids.values()))
        ids["merge"] = self.sbatch(
            str(script("merge", f"{folder}/merge.log", [*command, "--merge", str(n)])), [ids["parts"]]
        )
        return ids

    def resubmit(self, root: RunRoot, spec: JobSpec, run_name: str) -> str:
        """One job again, alone (an expert as a plain job, not an array task) -> its new Slurm job id."""
        (self._outputs(root) / spec.dir).mkdir(parents=True, exist_ok=True)
        return self.sbatch(str(self._write(root, f"{spec.name}.sbatch", self.job_script(root, spec, run_name))))

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
