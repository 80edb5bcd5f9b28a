"""The `ray` backend of `train-all`: one Ray job per flowfleet job on an existing Ray cluster (Ray Jobs API).

    flowfleet train-all RUN --backend ray --address http://HEAD:8265 [--cpus-per-job C] [--gpus-per-job G]
    flowfleet train-all RUN --backend ray        # no address, no RAY_ADDRESS: a Ray cluster on this machine

A run.yaml backend of kind ray with nodes_per_job N > 1 runs each job over N nodes: its entrypoint
(flowfleet.backends.ray_nodes) reserves them as a placement group and starts one torchrun on each.
`prepare --parts N --backend ray` and `cluster --parts N --backend ray` run as one Ray job of tasks
(flowfleet.backends.ray_parts).

Each job's entrypoint is the same flowfleet command as the local and Slurm backends (under torchrun with
G > 1 GPUs), with C CPUs and G GPUs reserved for it by Ray; on a shared-folder run root its output is
appended to the job's train.log, and Ray keeps it too (`ray job logs ID`). The submission ids go to
RUN_ROOT/backends/submissions.json. The nodes need the run root (a shared folder or an s3:// URL) and
the same Python environment. The Jobs API client (ray.job_submission) is imported only here.
"""

from __future__ import annotations

import logging
import os
import shlex
import uuid
from typing import Any, Sequence

from flowfleet.backends.ray_parts import entrypoint_args
from flowfleet.config import BackendConfig
from flowfleet.errors import FlowfleetError, ParameterError
from flowfleet.layout import LOG_FILE
from flowfleet.storage import RunRoot
from flowfleet.train.specs import JobSpec, launcher, node_launcher

log = logging.getLogger(__name__)

RAY_ACTIVE = ("PENDING", "RUNNING")


class RayBackend:
    name = "ray"

    def __init__(self, config: BackendConfig | None = None, start_local: bool = False):
        """start_local: with no address (config.address, RAY_ADDRESS), start a Ray cluster on this machine
        for the life of this object (close() ends it), as ray.init() does; otherwise that is an error."""
        self.config = config or BackendConfig(kind="ray")
        if self.config.kind != "ray":
            raise FlowfleetError(f"RayBackend: a {self.config.kind!r} backend config")
        self.address = self.config.address or os.environ.get("RAY_ADDRESS")
        self.start_local = start_local
        self._client: Any = None
        self._started = False

    @property
    def client(self) -> Any:
        if self._client is None:
            try:
                import ray
                from ray.job_submission import JobSubmissionClient
            except ImportError:
                raise ParameterError(
                    "backend ray", "the ray package is not installed (pip install 'flowfleet[ray]')"
                ) from None
            if self.address is None:
                if not self.start_local:
                    raise ParameterError("address", "the Ray cluster's dashboard URL (http://HEAD:8265) is unknown")
                log.info("ray: no --address, starting a Ray cluster on this machine for this train-all")
                context = ray.init(include_dashboard=True, dashboard_host="127.0.0.1", log_to_driver=False)
                self.address, self._started = f"http://{context.dashboard_url}", True
            try:
                self._client = JobSubmissionClient(self.address)
            except Exception as err:  # connection refused, wrong URL, auth: Ray's own exception types
                first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
                raise ParameterError(f"address {self.address}", f"no Ray cluster answers ({first[:200]})") from None
        return self._client

    def command(self, root: RunRoot, spec: JobSpec) -> list[str]:
        """The job's command line; over several nodes, flowfleet.backends.ray_nodes in front of each node's
        torchrun (it reserves the nodes and starts one torchrun on each)."""
        o = self.config
        if o.nodes_per_job == 1:
            return spec.command(root.url, launcher(o.python, o.gpus_per_job))
        spread = [launcher(o.python)[0], "-m", "flowfleet.backends.ray_nodes", f"--nodes={o.nodes_per_job}"]
        return [*spread, *self._share_args(), "--", *spec.command(root.url, node_launcher(o.python))]

    def _share_args(self) -> list[str]:
        """What each node of a job (ray_nodes) or step of a stage in parts (ray_parts) reserves, as their options."""
        o = self.config
        resources = [f"--resource={k}={v}" for k, v in o.resources.items()]
        return [f"--cpus={o.cpus}", f"--gpus={o.gpus_per_job}", *resources]

    def entrypoint(self, root: RunRoot, spec: JobSpec) -> str:
        cmd = shlex.join(self.command(root, spec))
        log = root.local_path(spec.dir, LOG_FILE)
        if log is None:
            return cmd
        # a shared folder: the job's output also where the other backends put it (Ray keeps its own copy)
        log.parent.mkdir(parents=True, exist_ok=True)
        return "bash -o pipefail -c " + shlex.quote(f"{cmd} 2>&1 | tee -a {shlex.quote(str(log))}")

    def submit_one(self, root: RunRoot, spec: JobSpec, run_name: str) -> str:
        o = self.config
        one_node = o.nodes_per_job == 1  # else the entrypoint only waits: ray_nodes reserves the nodes' share
        return self.client.submit_job(
            entrypoint=self.entrypoint(root, spec),
            submission_id=f"flowfleet-{run_name}-{spec.name}-{uuid.uuid4().hex[:8]}",
            entrypoint_num_cpus=o.cpus if one_node else 0,
            entrypoint_num_gpus=(o.gpus_per_job or None) if one_node else None,
            entrypoint_resources=(dict(o.resources) or None) if one_node else None,
            runtime_env={"env_vars": {"OMP_NUM_THREADS": str(o.threads_per_rank)}},
            metadata={"flowfleet_run": root.url, "flowfleet_job": spec.name},
        )

    def submit_parts(
        self, root: RunRoot, stage: str, n: int, run_name: str, folder: str, first: tuple[str, list[str]] | None
    ) -> dict[str, str]:
        """`flowfleet STAGE` in n parts as one Ray job (flowfleet.backends.ray_parts: the first step, the parts as
        tasks of this backend's CPUs and GPUs each, the merge) -> {"STAGE --parts N": its submission id}."""
        o = self.config
        argv = [launcher(o.python)[0], "-m", "flowfleet.backends.ray_parts"]
        argv += [*entrypoint_args(stage, root.url, n, folder, first), *self._share_args()]
        job = self.client.submit_job(
            entrypoint=shlex.join(argv),
            submission_id=f"flowfleet-{run_name}-{stage}-parts-{uuid.uuid4().hex[:8]}",
            runtime_env={"env_vars": {"OMP_NUM_THREADS": str(o.threads_per_rank)}},
            metadata={"flowfleet_run": root.url, "flowfleet_job": f"{stage}-parts"},
        )
        return {f"{stage} --parts {n}": str(job)}

    def submit(self, root: RunRoot, specs: list[JobSpec], run_name: str, then_assemble: bool = False) -> dict[str, str]:
        """One Ray job per spec (Ray jobs cannot wait on each other: assemble once train-all returns,
        as after a local run)."""
        return {spec.name: self.submit_one(root, spec, run_name) for spec in specs}

    def resubmit(self, root: RunRoot, spec: JobSpec, run_name: str) -> str:
        return self.submit_one(root, spec, run_name)

    def states(self, ids: Sequence[str]) -> dict[str, str]:
        """Ray submission id -> PENDING | RUNNING | SUCCEEDED | FAILED | STOPPED."""
        return {i: str(self.client.get_job_status(i).value) for i in ids}

    def is_active(self, state: str | None) -> bool:
        return state in RAY_ACTIVE

    def cancel(self, ids: Sequence[str]) -> None:
        for i in ids:
            try:
                self.client.stop_job(i)
            except Exception as err:  # a job whose node died may not be stoppable: Ray ends it itself
                log.warning(f"ray job {i}: could not stop it ({str(err).splitlines()[0][:200] if str(err) else err})")

    def logs(self, job_id: str) -> str:
        """The job's output; for a job that printed nothing, Ray's own word on it (why it failed before its
        command ran: its node died, its runtime environment could not be set up)."""
        said = str(self.client.get_job_logs(job_id))
        if said.strip():
            return said
        message = str(self.client.get_job_info(job_id).message or "")
        return " ".join(line.strip() for line in message.splitlines() if line.strip())  # one line: train-all's

    def record(self) -> dict[str, Any]:
        return {"address": self.address}

    def close(self) -> None:
        if self._started:
            import ray

            ray.shutdown()
            self._started, self._client = False, None
