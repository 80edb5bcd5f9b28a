"""What the training jobs of a run are, by name: a JobSpec names a job (its folder, its command line,
its steps and cost); flowfleet.train.tasks turns one into a TrainTask ready to train.

    expert k      DiTExpert on partitions/k only             flow matching (paris §2.3-2.4)
    router        DiTRouter on data/ + cluster ids           cross-entropy on x_t, t ~ U[0, 1] (paris §2.5.3);
                                                             prompt-aware: also sees the caption
    router-paris  the same router blind to the prompt        (run.yaml router_baseline: the comparison)
    router-prompt the same router told the prompt too         (run.yaml router_prompt: the comparison "beyond
                                                             Paris" for a run whose router is Paris')
    monolith      DiTExpert architecture on all of data/     flow matching; the evaluation baseline
    diloco w      DiTExpert on a random 1/W of data/         flow matching; W workers of one model that exchange
                                                             pseudo-gradients through the run root (DiLoCo)
    student       one DiT on the fleet's guided velocity     `flowfleet distill` (not a fleet job)

A job's command line is built here once (JobSpec.command) and used by every backend: the local fan-out,
Slurm, Ray and SkyPilot all run `python -m flowfleet.cli train-... RUN_ROOT`, the command a user types.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Literal

from flowfleet.config import RunConfig
from flowfleet.errors import FlowfleetError
from flowfleet.layout import (
    PARIS_ROUTER,
    PROMPT_ROUTER,
    ROUTERS,
    diloco_worker,
    expert_job,
    router_job,
)
from flowfleet.models.config import DiTConfig
from flowfleet.models.flops import train_flops, train_flops_per_sample

# all but expert: also their folders
JobKind = Literal["expert", "router", "router-paris", "router-prompt", "monolith", "student", "diloco"]
CLI_MODULE = "flowfleet.cli"  # every job runs `python -m flowfleet.cli ARGS`


def cli_command(args: list[str], launch: list[str]) -> list[str]:
    """`flowfleet ARGS` as a command line: LAUNCH -m flowfleet.cli ARGS (launch: launcher(...), or []
    where a backend writes its own launcher in front, as SkyPilot's torchrun line with shell variables)."""
    return [*launch, "-m", CLI_MODULE, *args]


def launcher(python: str | None = None, gpus: int = 1) -> list[str]:
    """The interpreter a job's command starts with, or (gpus > 1) torchrun under it, one process per GPU
    of the job's node (the trainer's DDP)."""
    cmd = [python or sys.executable]
    if gpus > 1:
        cmd += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}"]
    return cmd


RENDEZVOUS_PORT = 29500  # torchrun's c10d rendezvous on a multi-node job's first node, where the backend fixes it


def node_launcher(python: str | None = None) -> list[str]:
    """The interpreter of a job over several nodes: torchrun, told its world by rendezvous_env's variables."""
    return [python or sys.executable, "-m", "torch.distributed.run"]


def rendezvous_env(nodes: int, ranks_per_node: int, endpoint: str, run_id: str) -> dict[str, str]:
    """torchrun's own environment variables (PET_*) for one of `nodes` torchruns of a job: ranks_per_node processes
    each, joined by the c10d rendezvous at ENDPOINT (host:port, the first node's) under the job's id."""
    return {
        "PET_NNODES": str(nodes),
        "PET_NPROC_PER_NODE": str(ranks_per_node),
        "PET_RDZV_BACKEND": "c10d",
        "PET_RDZV_ENDPOINT": endpoint,
        "PET_RDZV_ID": run_id,
    }


@dataclass(frozen=True)
class JobSpec:
    kind: JobKind
    expert: int | None = None
    without: tuple[int, ...] = ()  # routers: the removed experts whose data they leave out
    num_experts: int | None = None  # routers of a fleet grown by add-expert: their outputs
    worker: int | None = None  # diloco: which worker

    @property
    def name(self) -> str:
        if self.kind == "expert":
            return f"expert-{self.expert}"
        if self.kind == "diloco":
            return f"diloco-{self.worker}"
        return router_job(self.kind, self.without, self.num_experts) if self.kind in ROUTERS else self.kind

    @property
    def dir(self) -> str:
        """The job's folder in the run root (flowfleet.layout)."""
        if self.kind == "expert" and self.expert is not None:
            return expert_job(self.expert)
        if self.kind == "diloco" and self.worker is not None:
            return diloco_worker(self.worker)
        return self.name

    def cli_args(self, run_root: str) -> list[str]:
        """Arguments of `flowfleet ...` that run this job."""
        if self.kind == "student":
            raise FlowfleetError("student: trained by `flowfleet distill`, not as a job of train-all")
        if self.kind == "expert":
            return ["train-expert", run_root, "--expert", str(self.expert)]
        if self.kind == "diloco":
            return ["train-diloco", run_root, "--worker", str(self.worker)]
        if self.kind == "router-paris":
            return ["train-router", run_root, "--paris"]
        if self.kind == "router-prompt":
            return ["train-router", run_root, "--prompt-aware"]
        return [f"train-{self.kind}", run_root]

    def command(self, run_root: str, launch: list[str]) -> list[str]:
        """The job's whole command line (cli_command): what every backend runs."""
        return cli_command(self.cli_args(run_root), launch)


def router_spec(cfg: RunConfig, paris: bool = False, *, prompt: bool = False) -> JobSpec:
    """The run's router job (or a comparison router: Paris' prompt-blind one, or the prompt-aware one), without
    the data of removed experts."""
    grown = cfg.num_experts if cfg.added else None
    kind: JobKind = "router-paris" if paris else "router-prompt" if prompt else "router"
    return JobSpec(kind, without=tuple(cfg.removed_experts), num_experts=grown)


def run_routers(cfg: RunConfig) -> list[JobSpec]:
    """The run's router, then the comparison routers run.yaml asks for (router_baseline, router_prompt)."""
    specs = [router_spec(cfg)]
    if cfg.router_baseline:
        specs.append(router_spec(cfg, paris=True))
    if cfg.router_prompt:
        specs.append(router_spec(cfg, prompt=True))
    return specs


def router_of_folder(cfg: RunConfig, router: str) -> JobSpec:
    """The job of a router folder name as assemble's --router gives it (router, router-paris, router-prompt)."""
    return router_spec(cfg, paris=router == PARIS_ROUTER, prompt=router == PROMPT_ROUTER)


def diloco_jobs(cfg: RunConfig) -> list[JobSpec]:
    """The workers of run.yaml diloco (none without it)."""
    return [JobSpec("diloco", worker=w) for w in range(cfg.diloco.workers)] if cfg.diloco else []


def fleet_jobs(cfg: RunConfig) -> list[JobSpec]:
    """Every training job of a run: the fleet's experts, its routers, the monolith when enabled, DiLoCo's workers
    when run.yaml has diloco."""
    jobs = [JobSpec("expert", k) for k in cfg.fleet_experts] + run_routers(cfg)
    if cfg.monolith.enabled:
        jobs.append(JobSpec("monolith"))
    return jobs + diloco_jobs(cfg)


def fleet_flops(cfg: RunConfig) -> int:
    """Training FLOPs of the fleet as sampled: its K experts and its router (flowfleet.models.flops)."""
    experts = sum(
        train_flops(cfg.expert_config(k), cfg.train.steps, cfg.train.batch_size) for k in range(cfg.cluster.k)
    )
    return experts + train_flops(cfg.router, cfg.router_train.steps, cfg.router_train.batch_size)


def monolith_steps(cfg: RunConfig, match_compute: bool | None = None) -> int:
    """The monolith's optimiser steps: cfg.train.steps, or (match_compute) as many as make its training
    FLOPs equal the fleet's, the router's included as in DDM's comparisons (the same architecture and
    batch as an expert: a little over K x the expert steps)."""
    match = cfg.monolith.match_compute if match_compute is None else match_compute
    if not match:
        return cfg.train.steps
    return matched_monolith_steps(cfg, fleet_flops(cfg))


def matched_monolith_steps(cfg: RunConfig, flops: float) -> int:
    """The monolith's steps (the experts' architecture and batch) whose training FLOPs reach `flops`."""
    return math.ceil(flops / (train_flops_per_sample(cfg.expert) * cfg.train.batch_size))


def paris_router_config(cfg: RunConfig) -> DiTConfig:
    """The run's router blind to the prompt: p(k | x_t, t) as in Paris §2.5."""
    return DiTConfig(
        **{**cfg.router.model_dump(), "conditioning": "none", "text_dim": 0, "text_len": 0, "add_pooled": False}
    )


def prompt_router_config(cfg: RunConfig) -> DiTConfig:
    """The run's router told the prompt too, as the experts are told it: their conditioning (the caption's pooled
    vector, or cross-attention to its tokens) and their condition dropout, so that one network gives both posteriors
    of guidance over the mixture, p(k | x_t, t, prompt) and p(k | x_t, t, null) (DDM: a router that "uses the same
    conditioning mechanisms as a DiT denoiser")."""
    e = cfg.expert
    told = dict(
        conditioning=e.conditioning if e.uses_text else "pooled",
        text_dim=cfg.encoders.text.width,
        text_len=e.text_len if e.conditioning == "cross_attn" else 0,
        add_pooled=e.add_pooled if e.conditioning == "cross_attn" else False,
        cross_norm=e.cross_norm,
        cond_dropout=e.cond_dropout if e.uses_text else cfg.router.cond_dropout,
    )
    return DiTConfig(**{**cfg.router.model_dump(), **told})


def router_config(cfg: RunConfig, spec: JobSpec) -> DiTConfig:
    """The architecture of one of the run's router jobs."""
    if spec.kind == "router-paris":
        return paris_router_config(cfg)
    if spec.kind == "router-prompt":
        return prompt_router_config(cfg)
    return cfg.router


def split_steps(total: int, counts: list[int], j: int) -> int:
    """Partition j's share of `total` steps (or batch rows) split in proportion to the partitions' item counts:
    cumulative floors, so that the shares add up to `total` exactly (the monolith's compute-matched steps stay
    exact)."""
    n = sum(counts)
    if not 0 <= j < len(counts) or counts[j] <= 0 or n <= 0:
        raise FlowfleetError(f"partition {j}: no items among the partitions' counts {counts}")
    before = sum(counts[:j])
    return total * (before + counts[j]) // n - total * before // n


def _expert_shares(cfg: RunConfig, spec: JobSpec, partition_counts: list[int] | None) -> tuple[list[int], int]:
    """An expert's (shares of its clustering's partitions, its partition j): their item counts under
    train.expert_steps by_size, else one each."""
    assert spec.expert is not None
    n, j = cfg.expert_origin(spec.expert)
    if cfg.train.expert_steps == "by_size":
        if partition_counts is None:
            raise FlowfleetError(f"{spec.name}: train.expert_steps by_size needs its partitions' item counts")
        return list(partition_counts), j
    return [1] * (cfg.cluster.k if n == 0 else cfg.added[n - 1].k), j


def job_steps(
    cfg: RunConfig,
    spec: JobSpec,
    match_compute: bool | None = None,
    partition_counts: list[int] | None = None,
) -> int:
    """A job's optimiser steps. An expert's: train.steps, or (train.expert_steps by_size) its partition's share of K x
    train.steps, or (train.split batch, DDM's matching) all K x train.steps (`partition_counts`: the item counts of
    its clustering's partitions, from its manifest; flowfleet.train.tasks.planned_steps reads them)."""
    if spec.kind == "expert" and spec.expert is not None:
        if cfg.train.split == "batch":
            shares, _ = _expert_shares(cfg, spec, partition_counts)
            return len(shares) * cfg.train.steps
        if cfg.train.expert_steps == "by_size":
            shares, j = _expert_shares(cfg, spec, partition_counts)
            return split_steps(len(shares) * cfg.train.steps, shares, j)
    if spec.kind in ROUTERS:
        return cfg.router_train.steps
    if spec.kind == "monolith":
        return monolith_steps(cfg, match_compute)
    if spec.kind == "student":
        return cfg.distill.steps if cfg.distill else cfg.train.steps
    if spec.kind == "diloco" and cfg.diloco:
        return (cfg.diloco.steps or cfg.train.steps) * cfg.diloco.pace_of(spec.worker or 0)
    return cfg.train.steps


def job_batch(cfg: RunConfig, spec: JobSpec, partition_counts: list[int] | None = None) -> int:
    """A job's batch per optimiser step: train.batch_size (router_train's for a router), or for an expert under
    train.split batch (DDM's matching) its share of it: equal, or (expert_steps by_size) its partition's share."""
    if spec.kind in ROUTERS:
        return cfg.router_train.batch_size
    if spec.kind != "expert" or spec.expert is None or cfg.train.split != "batch":
        return cfg.train.batch_size
    shares, j = _expert_shares(cfg, spec, partition_counts)
    batch = split_steps(cfg.train.batch_size, shares, j)
    if batch < cfg.train.grad_accum or batch % cfg.train.grad_accum:
        raise FlowfleetError(
            f"train.batch_size: {spec.name}'s share of {cfg.train.batch_size} under train.split batch is {batch}, "
            f"not a multiple of train.grad_accum {cfg.train.grad_accum}"
        )
    return batch


def compute_matching(cfg: RunConfig) -> str:
    """The run's compute-matching convention in one line, for the report, train-all and the benchmarks."""
    k, b, s = cfg.cluster.k, cfg.train.batch_size, cfg.train.steps
    share = "its cluster's share" if cfg.train.expert_steps == "by_size" else f"1/{k}"
    if cfg.train.split == "batch":
        return f"DDM's compute matching: each of the {k} experts {share} of the monolith's batch of {b}, {k * s} steps"
    steps = f"{share} of {k} x {s} steps" if cfg.train.expert_steps == "by_size" else f"{s} steps"
    return f"Paris' compute matching: each of the {k} experts the monolith's batch of {b}, for {steps}"


def job_cost(cfg: RunConfig, spec: JobSpec, steps: int | None = None, batch_size: int | None = None) -> int:
    """Training FLOPs of a job (to start the longest jobs first); `steps`, `batch_size`: its planned ones where
    job_steps and the run's batch alone cannot tell them (an expert of a by-size split or of a split batch:
    flowfleet.train.tasks.planned_steps, planned_batch)."""
    if spec.kind in ROUTERS:
        return train_flops(cfg.router, cfg.router_train.steps, cfg.router_train.batch_size)
    if spec.kind == "student":
        model = cfg.student_config()
    elif spec.kind == "expert" and spec.expert is not None:
        model = cfg.expert_config(spec.expert)
    else:
        model = cfg.expert
    batch = cfg.train.batch_size if batch_size is None else batch_size
    return train_flops(model, job_steps(cfg, spec) if steps is None else steps, batch)
