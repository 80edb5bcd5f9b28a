"""A TrainTask is a job (flowfleet.train.specs.JobSpec) ready to train in the one training loop
(flowfleet.train.loop): its data loaded and checked against its model configuration, its loss, its
preview and its final report.

The latent decoder (diffusers VAE) is imported only when a preview decodes latents.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Literal

import safetensors.torch
import torch
import torch.nn.functional as F

from flowfleet.cluster.assignments import read_assignments
from flowfleet.config import Contribution, RunConfig, TrainConfig
from flowfleet.data.augment import choose
from flowfleet.data.encoders import REPA_FIELD
from flowfleet.data.shards import ShardSet, open_complete
from flowfleet.errors import FlowfleetError, ParameterError
from flowfleet.flow import (
    Strategy,
    alignment_loss,
    ddpm_loss,
    dispersive_loss,
    flow_matching_loss,
    interpolate,
    loss_weight,
    sample_t,
)
from flowfleet.flow.path import vp_log_snr
from flowfleet.layout import (
    ASSIGNMENTS,
    AUTOENCODER,
    DATA,
    FINAL,
    INDEX_FILE,
    MANIFEST,
    MODEL,
    REFLOW_PAIRS,
    RUN_FILE,
    origin_partition,
)
from flowfleet.models.config import DiTConfig
from flowfleet.models.dit import DiTExpert, DiTModel, DiTRouter, block_output
from flowfleet.models.files import load_model
from flowfleet.models.init import load_expert_init
from flowfleet.storage import RunRoot
from flowfleet.train import preview
from flowfleet.train.data import InMemoryData, check_compatible, derive_seed, model_fields, training_fields
from flowfleet.train.plan import current_plan
from flowfleet.train.specs import JobSpec, job_batch, job_steps, router_config
from flowfleet.train.status import job_finished
from flowfleet.train.stream import Data, open_data

PREVIEW_COUNT = 8  # samples in an expert's grid
_SHARE_STREAM = 2  # derive_seed tag of the DiLoCo workers' shares of the data
ROUTER_EVAL_ITEMS = 512  # items the router's accuracy is measured on

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------------
#                                        Tasks
# ------------------------------------------------------------------------------------------------


class TrainTask:
    """A job ready to train. Subclasses define the loss, the preview and the final report."""

    model_cls: type[DiTModel] = DiTModel
    latent_weights: str | None = None  # the run's autoencoder/ (a run-trained latent space), for previews

    def __init__(
        self,
        spec: JobSpec,
        run: RunConfig,
        model_cfg: DiTConfig,
        train_cfg: TrainConfig,
        total_steps: int,
        data: Data,
    ):
        self.spec = spec
        self.run = run
        self.model_cfg = model_cfg
        self.train_cfg = train_cfg
        self.total_steps = total_steps
        self.data = data

    @property
    def name(self) -> str:
        return self.spec.name

    def build_model(self) -> DiTModel:
        return self.model_cls.from_dit_config(self.model_cfg)

    def loss(
        self, model: Callable[..., torch.Tensor], batch: dict[str, torch.Tensor], gen: torch.Generator
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Scalar loss of one micro-batch, and extra per-batch metrics (means)."""
        raise NotImplementedError

    def draw_t(self, n: int, gen: torch.Generator, device: torch.device) -> torch.Tensor:
        """n training times [n] by the job's time sampler (train.time_sampling, time_mean, time_std)."""
        tc = self.train_cfg
        return sample_t(n, mode=tc.time_sampling, mean=tc.time_mean, std=tc.time_std, generator=gen, device=device)

    def preview(self, model: DiTModel, step: int, device: torch.device) -> bytes:
        """PNG bytes of what the model does at this step."""
        raise NotImplementedError

    def report(self, model: DiTModel, device: torch.device) -> dict[str, Any] | None:
        """A final report (JSON) written beside final/, or None."""
        return None


class FlowTask(TrainTask):
    """Experts and the monolith: velocity regression with condition dropout for CFG."""

    model_cls = DiTExpert

    @property
    def preview_guidance_scale(self) -> float:
        """The guidance scale of the training previews."""
        return self.run.sampling.guidance_scale

    def build_model(self) -> DiTModel:
        """A fresh expert, or one started from run.yaml expert_init (a PixArt transformer or a flowfleet DiT)."""
        model = super().build_model()
        if self.spec.kind == "expert" and self.run.expert_init:
            load_expert_init(model, self.model_cfg, self.run.expert_init)
            log.info("%s: starts from %s", self.name, self.run.expert_init)
        return model

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._decoder: Callable[[torch.Tensor], torch.Tensor] | Literal[False] | None = None  # False: unavailable
        self._vp_table: torch.Tensor | None = None  # a ddpm expert's log SNR per VP step
        tc, depth = self.train_cfg, self.model_cfg.depth
        self.repa_block = depth // 3 if tc.repa_block is None else tc.repa_block  # REPA's depth, by default
        for setting, block, used in (
            ("dispersive_block", tc.dispersive_block, tc.dispersive_weight > 0),
            ("repa_block", self.repa_block, self.model_cfg.repa_dim > 0),
        ):
            if used and not -depth <= block < depth:
                raise ParameterError(f"train.{setting}", f"{block} is out of range for {self.name}'s {depth} blocks")

    def loss(self, model, batch, gen):
        tc, repa = self.train_cfg, self.model_cfg.repa_dim > 0
        if not (tc.dispersive_weight or repa):
            return self._regression(model, batch, gen), {}
        bare = getattr(model, "_orig_mod", model)  # the module in torch.compile's wrapper (train.compile), in DDP's
        bare = bare.module if isinstance(bare, torch.nn.parallel.DistributedDataParallel) else bare
        with contextlib.ExitStack() as reads:  # the hidden tokens each regulariser reads, from the one forward
            spread = reads.enter_context(block_output(bare, tc.dispersive_block)) if tc.dispersive_weight else None
            aligned = reads.enter_context(block_output(bare, self.repa_block)) if repa else None
            regression = self._regression(model, batch, gen)
        loss, extras = regression, {"regression": regression.detach()}
        if spread is not None:
            dispersive = dispersive_loss(spread[0], tc.dispersive_tau)
            loss, extras["dispersive"] = loss + tc.dispersive_weight * dispersive, dispersive.detach()
        if aligned is not None:
            alignment = alignment_loss(bare.repa_projector(aligned[0]), batch[REPA_FIELD])
            loss, extras["alignment"] = loss + tc.repa_weight * alignment, alignment.detach()
        return loss, extras

    def _regression(self, model, batch, gen) -> torch.Tensor:
        """The velocity regression (a ddpm expert's noise regression) of one batch."""
        x0, augment = batch["latents"], None  # [B, C, H, W]
        if self.train_cfg.augment_p:  # some items replaced by an augmented copy; augment [B, AUGMENT_DIM]
            x0, augment = choose(x0, batch["aug_latents"], batch["aug_params"], self.train_cfg.augment_p, gen)
        b, dev, tc = x0.shape[0], x0.device, self.train_cfg
        t = self.draw_t(b, gen, dev)  # [B]
        eps = torch.randn(x0.shape, generator=gen, device=dev)  # [B, C, H, W]
        drop = torch.rand(b, generator=gen, device=dev) < self.model_cfg.cond_dropout  # [B] null condition
        cond = preview.condition_kwargs(batch, self.model_cfg)
        if augment is not None:
            cond["augment"] = augment  # how each item was augmented (zeros: as prepared)
        if self.model_cfg.schedule is not None:  # a ddpm expert: its noise at uniform integer VP steps (DiT's)
            if self._vp_table is None:
                self._vp_table = vp_log_snr(self.model_cfg.schedule)  # [1000]
            table = self._vp_table
            tau = torch.randint(0, len(table), (b,), generator=gen, device=dev)  # [B]
            eps_fn = lambda x, s: model(x, s, raw=True, drop=drop, **cond)[:, : x.shape[1]]  # noqa: E731
            return ddpm_loss(eps_fn, x0, tau, eps, table)
        weight = loss_weight(t, tc.loss_weighting, tc.min_snr_gamma)  # [B]
        return flow_matching_loss(lambda x_t, tt: model(x_t, tt, drop=drop, **cond), x0, t, eps, weight)

    def _decode(self, device: torch.device) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """The latent decoder for previews; pixel latents need none. A decoder that cannot be loaded
        (no weights on this machine) must not fail the job: previews then show the latents."""
        if self.run.encoders.latent.name == "pixels" or self._decoder is False:
            return None
        if self._decoder is None:
            try:
                from flowfleet.data.encoders import build_latent_encoder

                latent, channels = self.run.encoders.latent, self.run.data.channels
                encoder = build_latent_encoder(latent, channels, device, self.latent_weights)
                self._decoder = encoder.decode
            except Exception as err:  # any loader failure (hub offline, missing files) -> latent previews
                why = str(err).splitlines()[0][:200] if str(err) else type(err).__name__
                log.warning(
                    "%s: previews show raw latents; the %s decoder did not load (%s)",
                    self.name,
                    self.run.encoders.latent.name,
                    why,
                )
                self._decoder = False
                return None
        return self._decoder

    def preview(self, model, step, device):
        n = min(PREVIEW_COUNT, len(self.data))
        items = torch.arange(n)
        batch = self.data.gather(items, device)
        s = self.run.sampling
        samples = preview.sample_flow(
            model,
            self.model_cfg,
            preview.condition_kwargs(batch, self.model_cfg),
            n,
            steps=s.steps,
            sampler=s.sampler,
            guidance=self.preview_guidance_scale,
            shift=s.shift,
            seed=self.train_cfg.seed,
            device=device,
        )
        decode = self._decode(device)
        captions = [self.data.captions[i] if i < len(self.data.captions) else "" for i in range(n)]
        title = f"{self.name}  step {step}  (EMA, {s.sampler} {s.steps} steps, guidance {self.preview_guidance_scale})"
        return preview.sample_grid_png(
            preview.latents_to_images(samples, decode),
            preview.latents_to_images(batch["latents"], decode),
            captions,
            title,
        )


class WorkerTask(FlowTask):
    """A DiLoCo worker (run.yaml diloco): the monolith's flow matching on its random share of the data. Every worker
    starts from the same weights, those of train.seed (the outer model's first round), while its train_cfg.seed,
    which draws its data order and noise, is its own."""

    def build_model(self) -> DiTModel:
        with torch.random.fork_rng():
            torch.manual_seed(self.run.train.seed)
            return super().build_model()


def worker_share(n: int, workers: int, w: int, seed: int) -> torch.Tensor:
    """[N] bool: worker w's random 1/workers of n items (a permutation of train.seed, dealt out in turn)."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(derive_seed(seed, _SHARE_STREAM)))
    keep = torch.zeros(n, dtype=torch.bool)
    keep[order[w::workers]] = True
    return keep


class DistillTask(FlowTask):
    """A student regressing onto the assembled fleet's guided velocity at x_t from the data: the teacher
    routes with `distill.teacher` and guides with `distill.guidance_scale`, so the student, sampled without guidance,
    does in one model call per step what the fleet does in k experts x 2 (CFG) calls plus the router."""

    def __init__(self, *args: Any, teacher: str, strategy: Strategy, teacher_guidance: float, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.teacher_dir, self.strategy, self.teacher_guidance = teacher, strategy, teacher_guidance
        self._teacher: Any = None  # the FleetPipeline, opened on the training device at the first step
        self._calls = 0

    @property
    def preview_guidance_scale(self) -> float:
        return 1.0  # the guidance is in the student's weights

    def teacher(self, device: torch.device) -> Any:
        if self._teacher is None:
            from flowfleet.sampling.pipeline import FleetPipeline  # (sampling's floor: imported where needed)

            self._teacher = FleetPipeline.from_pretrained(self.teacher_dir, device=device, load_encoders=False)
        return self._teacher

    def loss(self, model, batch, gen):
        if "noise" in batch:  # reflow: flow matching on the teacher's (noise, sample) pairs
            t = self.draw_t(batch["latents"].shape[0], gen, batch["latents"].device)  # [B]
            cond = preview.condition_kwargs(batch, self.model_cfg)
            return flow_matching_loss(lambda x_t, tt: model(x_t, tt, **cond), batch["latents"], t, batch["noise"]), {}
        from flowfleet.sampling.routing import Condition
        from flowfleet.sampling.trace import RoutingTrace

        x0, augment = batch["latents"], None  # [B, C, H, W]
        if self.train_cfg.augment_p:  # some items replaced by an augmented copy; augment [B, AUGMENT_DIM]
            x0, augment = choose(x0, batch["aug_latents"], batch["aug_params"], self.train_cfg.augment_p, gen)
        b, dev = x0.shape[0], x0.device
        t = self.draw_t(b, gen, dev)  # [B]
        eps = torch.randn(x0.shape, generator=gen, device=dev)
        x_t = interpolate(x0, eps, t)  # [B, C, H, W]
        pipe = self.teacher(dev)
        # every step's rows have their own t: guided at every t (guidance_max_t 1), routed at every call
        settings = pipe.settings(self.strategy, guidance_scale=self.teacher_guidance, route_every=1, guidance_max_t=1.0)
        cond = preview.condition_kwargs(batch, self.run.expert)
        self._calls += 1
        with torch.no_grad():
            velocity = pipe.velocity_fn(Condition(**cond), settings, RoutingTrace(pipe.num_experts))
            target = velocity(x_t, t, self._calls)  # [B, C, H, W] the routed, guided fleet
        loss = F.mse_loss(model(x_t, t, **preview.condition_kwargs(batch, self.model_cfg)).float(), target.float())
        return loss, {}


class RouterTask(TrainTask):
    """The router: cross-entropy of p(k | x_t, t) against the cluster id of x0 (paris Eq. 12)."""

    model_cls = DiTRouter
    warm_start: tuple[RunRoot, str] | None = None  # (run root, job folder) of a router to start from

    def build_model(self) -> DiTModel:
        """A fresh router, or (a grown fleet) the previous router's weights with its K outputs kept and
        the new experts' outputs fresh: every tensor of equal shape is copied, and the head's rows for
        the first K experts."""
        model = super().build_model()
        if self.warm_start is None:
            return model
        root, job = self.warm_start
        old = load_model(DiTRouter, root, job, FINAL).state_dict()
        state = model.state_dict()
        with torch.no_grad():
            for name, tensor in state.items():
                prev = old.get(name)
                if prev is None:
                    continue
                if prev.shape == tensor.shape:
                    tensor.copy_(prev)
                elif prev.shape[1:] == tensor.shape[1:] and prev.shape[0] < tensor.shape[0]:
                    tensor[: prev.shape[0]].copy_(prev)  # the head: the old experts' rows
        log.info("%s: warm start from %s", self.name, root.url_of(job, FINAL))
        return model

    def loss(self, model, batch, gen):
        x0, k = batch["latents"], batch["cluster"]  # [B, C, H, W], [B]
        b, dev = x0.shape[0], x0.device
        t = self.draw_t(b, gen, dev)  # [B]
        eps = torch.randn(x0.shape, generator=gen, device=dev)
        # A prompt-aware router also sees the prompt; dropped like an expert's, so it can route without one.
        drop = None
        if self.model_cfg.uses_text:
            drop = torch.rand(b, generator=gen, device=dev) < self.model_cfg.cond_dropout  # [B]
        cond = preview.condition_kwargs(batch, self.model_cfg)
        logits = model(interpolate(x0, eps, t), t, drop=drop, **cond)  # [B, K]
        loss = F.cross_entropy(logits.float(), k)
        return loss, {"accuracy": (logits.argmax(dim=1) == k).float().mean()}

    def _evaluate(self, model, device, items: int) -> dict[str, Any]:
        n = min(items, len(self.data))
        pick = torch.randperm(len(self.data), generator=torch.Generator().manual_seed(self.train_cfg.seed))[:n]
        batch = self.data.gather(pick)
        report = preview.router_accuracy(
            model,
            batch["latents"],
            batch["cluster"],
            self.model_cfg.num_outputs,
            seed=self.train_cfg.seed + 1,
            device=device,
            cond=preview.condition_kwargs(batch, self.model_cfg),
        )
        report["note"] = (
            "EMA router on a fixed random subset of the training items, fresh noise; t uniform within each bucket"
        )
        return report

    def preview(self, model, step, device):
        report = self._evaluate(model, device, ROUTER_EVAL_ITEMS // 2)
        title = f"router  step {step}  (EMA; overall accuracy {report['overall_accuracy']:.3f})"
        return preview.router_png(report, title)

    def report(self, model, device):
        return self._evaluate(model, device, ROUTER_EVAL_ITEMS)


# ------------------------------------------------------------------------------------------------
#                                   Building a task from a run root
# ------------------------------------------------------------------------------------------------


def load_assignments(root: RunRoot, data: Data, k: int) -> torch.Tensor:
    """Cluster id of every item of data/ ([N] int64), from clusters/assignments.safetensors."""
    assign = read_assignments(root, num_clusters=k)
    index = data.tensors["index"]
    if int(index.max()) >= assign.shape[0] or int(index.min()) < 0:
        raise FlowfleetError(
            f"{root.url_of(*ASSIGNMENTS)}: 'assign' has shape {tuple(assign.shape)}, but data/ "
            f"holds item index {int(index.max())}; re-run `flowfleet cluster`"
        )
    return assign[index]


def clustered_data(root: RunRoot, cfg: RunConfig, fields: list[str], loader: str = "memory", readers: int = 4) -> Data:
    """Every prepared item of the run (data/, then each addition's added/<n>/data/) with `fields` and its
    expert in "cluster" (an addition's clusters follow the run's: cluster.k + j for its j-th)."""
    parts = []
    first = 0
    for n, k in [(0, cfg.cluster.k)] + [(n, a.k) for n, a in enumerate(cfg.added, 1)]:
        sub = root.origin(n)
        shards = open_complete(sub, DATA, f"flowfleet prepare {sub.url}" if n == 0 else "flowfleet add-expert")
        data = open_data(shards, [*fields, "index"], loader, readers)
        data.tensors["cluster"] = load_assignments(sub, data, k) + first
        del data.tensors["index"]
        parts.append(data)
        first += k
    return type(parts[0]).concat(parts)  # type: ignore[arg-type]  # (the parts are of one kind)


def contribution_of(cfg: RunConfig, spec: JobSpec) -> Contribution | None:
    """The contribution an expert job's weights came from (flowfleet admit), or None for an expert trained here."""
    if spec.kind != "expert" or spec.expert is None or not 0 <= spec.expert < cfg.num_experts:
        return None
    n, _ = cfg.expert_origin(spec.expert)
    return cfg.added[n - 1].contribution if n else None


def planned_steps(
    root: RunRoot,
    cfg: RunConfig,
    spec: JobSpec,
    match_compute: bool | None = None,
    shards: ShardSet | None = None,
) -> int:
    """The run's job's steps: where the run has a plan (`flowfleet plan`), an expert's planned steps and the
    compute-matched monolith's for the plan's FLOPs; else its recipe's (recipe_steps). `shards`: the expert's
    partition, where the caller has opened it already (its manifest is read once)."""
    plan = current_plan(root, cfg)
    if plan is not None and spec.name in plan.jobs:
        return plan.jobs[spec.name].steps
    matched = cfg.monolith.match_compute if match_compute is None else match_compute
    if plan is not None and spec.kind == "monolith" and matched and plan.monolith_steps is not None:
        return plan.monolith_steps
    return recipe_steps(root, cfg, spec, match_compute, shards)


def recipe_steps(
    root: RunRoot,
    cfg: RunConfig,
    spec: JobSpec,
    match_compute: bool | None = None,
    shards: ShardSet | None = None,
) -> int:
    """job_steps of the run's job, as run.yaml's recipe has it; an expert's share of a by-size split
    (train.expert_steps) is read from its own partition's manifest (the counts `flowfleet cluster` writes there),
    nothing else."""
    contributed = contribution_of(cfg, spec)
    if contributed is not None:  # trained elsewhere: finished at the steps its signed manifest records
        return contributed.steps
    return job_steps(cfg, spec, match_compute, partition_counts=_partition_counts(root, cfg, spec, shards))


def planned_batch(root: RunRoot, cfg: RunConfig, spec: JobSpec, shards: ShardSet | None = None) -> int:
    """The run's job's batch: its plan's where it has one (an expert keeps its recipe's), else recipe_batch."""
    plan = current_plan(root, cfg)
    if plan is not None and spec.name in plan.jobs:
        return plan.jobs[spec.name].batch
    return recipe_batch(root, cfg, spec, shards)


def recipe_batch(root: RunRoot, cfg: RunConfig, spec: JobSpec, shards: ShardSet | None = None) -> int:
    """job_batch of the run's job: an expert's share of the batch under train.split batch (DDM's matching), by
    size read from its own partition's manifest as recipe_steps reads it."""
    return job_batch(cfg, spec, partition_counts=_partition_counts(root, cfg, spec, shards))


def _partition_counts(root: RunRoot, cfg: RunConfig, spec: JobSpec, shards: ShardSet | None) -> list[int] | None:
    """The item counts of an expert's clustering's partitions, where its share is by size; None where no share
    reads them."""
    if spec.kind != "expert" or spec.expert is None or cfg.train.expert_steps != "by_size":
        return None
    n, j = cfg.expert_origin(spec.expert)
    folder = origin_partition(n, j)
    shards = shards or ShardSet(root, folder)
    where = root.url_of(folder, MANIFEST)
    if not shards.exists():
        raise FlowfleetError(f"{where}: missing; train.expert_steps by_size needs `flowfleet cluster` first")
    counts = shards.manifest().extra.get("partition_counts")
    if not counts:
        raise FlowfleetError(
            f"{where}: no partition_counts (clustered by an older flowfleet); run `flowfleet cluster` again "
            "for train.expert_steps by_size"
        )
    return list(counts)


def _worker_task(cfg: RunConfig, spec: JobSpec, data: Data) -> WorkerTask:
    """DiLoCo worker `spec.worker` on its share of `data` (all of data/)."""
    if cfg.diloco is None:
        raise FlowfleetError(f"{spec.name}: run.yaml has no diloco block")
    workers, w = cfg.diloco.workers, spec.worker
    if w is None or not 0 <= w < workers:
        raise ParameterError(f"worker {w}", f"run.yaml diloco.workers is {workers} (0..{workers - 1})")
    if len(data) < workers:
        raise FlowfleetError(f"{data.where}: {len(data)} items for {workers} DiLoCo workers")
    share = data.select(worker_share(len(data), workers, w, cfg.train.seed))
    train = cfg.train.model_copy(update={"seed": derive_seed(cfg.train.seed, _SHARE_STREAM, w)})
    return WorkerTask(spec, cfg, cfg.expert, train, job_steps(cfg, spec), share)


def build_task(root: RunRoot, cfg: RunConfig, spec: JobSpec, *, match_compute: bool | None = None) -> TrainTask:
    """The job `spec` of the run, its data loaded."""
    task = _build_task(root, cfg, spec, match_compute=match_compute)
    task.latent_weights = root.url_of(AUTOENCODER)
    return task


def _build_task(root: RunRoot, cfg: RunConfig, spec: JobSpec, *, match_compute: bool | None = None) -> TrainTask:
    """Load and check a job's data; an expert reads its partition and nothing else."""
    if spec.kind == "expert":
        k = spec.expert
        if k is None or not 0 <= k < cfg.num_experts:
            raise ParameterError(f"expert {k}", f"run.yaml has {cfg.num_experts} experts (0..{cfg.num_experts - 1})")
        if contribution_of(cfg, spec) is not None:
            raise ParameterError(f"expert {k}", "contributed (flowfleet admit), trained by its contributor, not here")
        n, j = cfg.expert_origin(k)
        folder = origin_partition(n, j)
        shards = open_complete(root, folder, f"flowfleet cluster {root.url}" if n == 0 else "flowfleet add-expert")
        model = cfg.expert_config(k)
        p = cfg.train.augment_p
        check_compatible(shards.manifest(), model, data_where=shards.url, model_where="run.yaml expert", augment_p=p)
        data = open_data(shards, training_fields(model, p), cfg.train.loader, cfg.train.loader_workers)
        train = cfg.train.model_copy(update={"batch_size": planned_batch(root, cfg, spec, shards)})  # DDM's split
        return FlowTask(spec, cfg, model, train, planned_steps(root, cfg, spec, shards=shards), data)

    shards = open_complete(root, DATA, f"flowfleet prepare {root.url}")
    if spec.kind == "student":
        if cfg.distill is None:
            raise FlowfleetError(f"{root.url_of(RUN_FILE)}: no distill block; run `flowfleet distill {root.url}`")
        student = cfg.student_config()
        teacher = root.url_of(MODEL)
        if not root.exists(MODEL, INDEX_FILE):
            raise FlowfleetError(f"{teacher}: not assembled; the student learns from the fleet (`flowfleet assemble`)")
        if cfg.distill.method == "reflow":
            if not root.exists(*REFLOW_PAIRS):
                raise FlowfleetError(f"{root.url_of(*REFLOW_PAIRS)}: missing; `flowfleet distill` writes it")
            tensors = safetensors.torch.load(root.read_bytes(*REFLOW_PAIRS))
            data = InMemoryData(tensors, [], root.url_of(*REFLOW_PAIRS))
        else:
            data = clustered_data(root, cfg, model_fields(cfg.expert), cfg.train.loader, cfg.train.loader_workers)
        teacher_guidance = cfg.distill.teacher_guidance(cfg.sampling)
        return DistillTask(
            spec,
            cfg,
            student,
            cfg.train,
            job_steps(cfg, spec),
            data,
            teacher=teacher,
            strategy=cfg.distill.teacher,
            teacher_guidance=teacher_guidance,
        )
    if spec.kind in ("monolith", "diloco"):
        p = cfg.train.augment_p
        check_compatible(
            shards.manifest(), cfg.expert, data_where=shards.url, model_where="run.yaml expert", augment_p=p
        )
        data = open_data(shards, training_fields(cfg.expert, p), cfg.train.loader, cfg.train.loader_workers)
        if spec.kind == "monolith":
            steps = planned_steps(root, cfg, spec, match_compute)
            return FlowTask(spec, cfg, cfg.expert, cfg.train, steps, data)
        return _worker_task(cfg, spec, data)

    router = router_config(cfg, spec)
    check_compatible(shards.manifest(), router, data_where=shards.url, model_where="run.yaml router")
    data = clustered_data(root, cfg, model_fields(router), cfg.router_train.loader, cfg.router_train.loader_workers)
    if spec.without:  # removed experts: their data is in no weight of the new router
        data = data.select(~torch.isin(data.tensors["cluster"], torch.tensor(spec.without)))
        if len(data) == 0:
            raise FlowfleetError(f"{spec.name}: no data is left without experts {list(spec.without)}")
    task = RouterTask(spec, cfg, router, cfg.router_train, job_steps(cfg, spec), data)
    if cfg.added and not spec.without:  # a grown fleet: start from the router before the last addition
        before = cfg.num_experts - cfg.added[-1].k
        previous = JobSpec(spec.kind, num_experts=before if len(cfg.added) > 1 else None).dir
        if job_finished(root, previous)[0]:
            task.warm_start = (root, previous)
    return task
