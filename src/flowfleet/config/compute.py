"""Where the jobs run: run.yaml's backends, machines and storage sections."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from flowfleet.config.base import Strict

BACKEND_KINDS = ("local", "slurm", "ray")
CPUS_PER_GPU = 8  # a GPU job's CPUs when backends.NAME.cpus_per_job is unset: its rank's thread, loaders, I/O


class BackendConfig(Strict):
    """Where `train-all` runs jobs (flowfleet.backends): this machine, an existing Slurm cluster, an
    existing Ray cluster. run.yaml `backends` names several, `placement` maps jobs to them; the
    `train-all --backend ...` options build one for the jobs placement does not name."""

    kind: Literal["local", "slurm", "ray"] = "local"
    cpus_per_job: int | None = Field(None, ge=1)  # None: 1, or CPUS_PER_GPU for each of the job's GPUs (cpus)
    gpus_per_job: int = Field(0, ge=0)  # > 1: the job runs its DDP under torchrun --nproc-per-node G
    # slurm, ray: > 1: each job (an expert) spans that many nodes, one torchrun a node (srun; a Ray placement group
    # spread over nodes) of gpus_per_job ranks (none: one rank on CPU, over gloo), joined by torchrun's c10d
    # rendezvous on the first node
    nodes_per_job: int = Field(1, ge=1)
    # slurm with a run root on an object store: where the sbatch scripts and the jobs' output go, a folder the login
    # node and the compute nodes share (None: ~/.cache/flowfleet/slurm/<run>, in a home the nodes mount)
    stage_dir: str | None = None
    python: str | None = None  # the environment's interpreter on the nodes (None: this one)
    # how often train-all resubmits a job of this backend whose node died or that the backend ended unfinished, each
    # time from its newest checkpoint (preemptible nodes want more)
    max_resubmits: int = Field(2, ge=0)
    # slurm: sbatch --partition / --account / --time, and any other sbatch option ("--qos=high")
    partition: str | None = None
    account: str | None = None
    time: str | None = None
    sbatch_args: list[str] = []
    nodelist: str | None = None  # slurm: sbatch --nodelist (a run.yaml machine's nodes)
    # ray: the cluster's dashboard URL (http://HEAD:8265); None: RAY_ADDRESS, else a local cluster
    address: str | None = None
    # ray: custom resources each job asks for (a run.yaml machine's, {"fast": 0.001}: only its nodes have them)
    resources: dict[str, float] = {}

    @model_validator(mode="after")
    def _check(self) -> "BackendConfig":
        only = {
            "slurm": ("partition", "account", "time", "sbatch_args", "stage_dir", "nodelist"),
            "ray": ("address", "resources"),
        }
        if self.nodes_per_job > 1 and self.kind == "local":
            raise ValueError("nodes_per_job: a slurm or ray option, but kind is 'local' (one machine)")
        for kind, fields in only.items():
            for name in fields:
                if self.kind != kind and getattr(self, name):
                    raise ValueError(f"{name}: a {kind} option, but kind is {self.kind!r}")
        return self

    @property
    def cpus(self) -> int:
        """CPUs a job asks for on each of its nodes: cpus_per_job, else 1, or CPUS_PER_GPU per GPU."""
        return self.cpus_per_job or max(1, CPUS_PER_GPU * self.gpus_per_job)

    @property
    def ranks_per_node(self) -> int:
        """Training processes on each of a job's nodes: one a GPU, or one on CPU."""
        return max(1, self.gpus_per_job)

    @property
    def threads_per_rank(self) -> int:
        """OMP_NUM_THREADS of each of a node's ranks: its CPUs shared by its torchrun's processes."""
        return max(1, self.cpus // self.ranks_per_node)


class MachineConfig(Strict):
    """A machine the fleet trains on (run.yaml `machines`, read by `flowfleet plan`): where its jobs go and how
    fast it trains an expert. Without `machines`, the experts run wherever `placement` puts them, each its
    recipe's steps."""

    # a run.yaml `backends` entry or local | slurm | ray: how a job reaches the machine
    backend: str = "local"
    # slurm: sbatch --nodelist (the machine's nodes) and --partition, beside the backend's own options
    nodelist: str | None = None
    partition: str | None = None
    # ray: a custom resource the machine's nodes were started with (`ray start --resources '{"fast": 1}'`)
    resource: str | None = None
    # `export skypilot`: the accelerators its jobs ask for (NAME[:COUNT], e.g. "H100:8")
    accelerators: str | None = Field(None, pattern=r"^[A-Za-z0-9_-]+(:\d+)?$")
    # model TFLOP/s an expert's training step reaches there (the trainer's `model_tflops`); None: measured by
    # `flowfleet probe RUN --machine NAME` run on the machine, which stores it in the run
    tflops: float | None = Field(None, gt=0)


class StorageConfig(Strict):
    endpoint_url: str | None = None
    options: dict[str, Any] = {}
