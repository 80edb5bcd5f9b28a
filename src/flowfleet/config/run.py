"""run.yaml as a whole: the RunConfig of every section, its checks across sections, reading it and changing a key."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError, model_validator

from flowfleet.config.base import ConfigError, Strict
from flowfleet.config.compute import BACKEND_KINDS, BackendConfig, MachineConfig, StorageConfig
from flowfleet.config.data import AUGMENT_DIM, ClusterConfig, DataConfig, EncodersConfig
from flowfleet.config.fleet import _SHAPE_FIELDS, EXPERT_OVERRIDABLE, Addition, DistillConfig
from flowfleet.config.sampling import SamplingConfig
from flowfleet.config.training import DiLoCoConfig, MonolithConfig, TrainConfig
from flowfleet.errors import ParameterError, validated, validation_message
from flowfleet.layout import RUN_FILE
from flowfleet.models.config import DiTConfig
from flowfleet.storage import RunRoot


class RunConfig(Strict):
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

    @property
    def repa_grid(self) -> tuple[int, int] | None:
        """The token grid the experts' REPA tokens are prepared at (expert.repa_dim > 0), else None: one for every
        expert, whose overrides change neither the grid nor repa_dim (EXPERT_OVERRIDABLE)."""
        return self.expert.grid_size if self.expert.repa_dim else None

    def expert_config(self, k: int) -> DiTConfig:
        """Expert k's architecture: `expert` with its expert_overrides applied (a `size` there replaces
        the width, depth and heads of `expert`)."""
        changes = self.expert_overrides.get(k)
        return _changed(self.expert, changes) if changes else self.expert

    @model_validator(mode="after")
    def _check(self) -> "RunConfig":
        """The checks across sections, one function per concern (below the class), in this order (the first failure
        is the error)."""
        check_shapes(self)
        if self.cluster.features in ("text", "both") and self.encoders.text.name == "none":
            raise ValueError(
                f"cluster.features: {self.cluster.features!r} clusters captions, but encoders.text.name is 'none'"
            )
        if self.expert.num_outputs:
            raise ValueError("expert.num_outputs: experts predict velocities; must be 0")
        check_augment(self)
        for pattern, where in self.placement.items():
            if where not in self.backends and where not in BACKEND_KINDS:
                known = ", ".join([*self.backends, *BACKEND_KINDS])
                raise ValueError(f"placement.{pattern}: unknown backend {where!r} (known: {known})")
        check_machines(self)
        check_fleet(self)
        check_routers(self)
        check_text(self)
        return self

    # -- files ---------------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    @classmethod
    def from_dict(cls, raw: Any, where: str = RUN_FILE) -> "RunConfig":
        return validated(cls, raw, where, ConfigError, expected="a mapping at the top level")

    def save(self, root: RunRoot) -> None:
        root.write_yaml(self.to_dict(), RUN_FILE)


# The checks across run.yaml's sections, one per concern (RunConfig._check calls them in order).


def check_augment(cfg: RunConfig) -> None:
    if cfg.router_train.augment_p:
        raise ValueError("router_train.augment_p: the router trains on the prepared items only; must be 0")
    if cfg.train.augment_p and not cfg.data.augment.copies:
        raise ValueError(f"train.augment_p: {cfg.train.augment_p} draws augmented copies, but data.augment.copies is 0")
    if cfg.train.augment_p and cfg.expert.augment_dim != AUGMENT_DIM:
        raise ValueError(
            f"expert.augment_dim: {cfg.expert.augment_dim}, but train.augment_p conditions the experts on "
            f"{AUGMENT_DIM} augmentation parameters (dx, dy, angle, scale); set it to {AUGMENT_DIM}"
        )


def check_machines(cfg: RunConfig) -> None:
    """Each machine's backend is known, and its target options are its backend's kind's."""
    only = {"nodelist": "slurm", "partition": "slurm", "resource": "ray"}
    for name, machine in cfg.machines.items():
        if machine.backend not in cfg.backends and machine.backend not in BACKEND_KINDS:
            known = ", ".join([*cfg.backends, *BACKEND_KINDS])
            raise ValueError(f"machines.{name}.backend: unknown {machine.backend!r} (known: {known})")
        kind = cfg.backends[machine.backend].kind if machine.backend in cfg.backends else machine.backend
        for option, needs in only.items():
            if getattr(machine, option) and kind != needs:
                raise ValueError(f"machines.{name}.{option}: a {needs} option, but its backend is {kind!r}")


def check_shapes(cfg: RunConfig) -> None:
    """The latent space: the encoder's side, every model's input, the router's outputs, the additions' data."""
    c, h, w = cfg.latent_shape
    if cfg.encoders.latent.name == "sd-vae-ft-mse" and cfg.data.image_size % 8:
        raise ValueError(f"data.image_size: {cfg.data.image_size} must be divisible by 8 for the VAE")
    if cfg.encoders.latent.name == "autoencoder":
        ae, size = cfg.encoders.latent.autoencoder, cfg.data.image_size
        where = "encoders.latent.autoencoder.pad_to"
        if ae.pad_to is not None and (ae.pad_to < size or (ae.pad_to - size) % 2):
            raise ValueError(f"{where}: {ae.pad_to} must be >= data.image_size {size}, by an even margin")
        if ae.side(size) % ae.factor:
            raise ValueError(
                f"{where}: the side {ae.side(size)} must divide by {ae.factor} "
                f"({len(ae.block_out_channels)} block_out_channels halve it {len(ae.block_out_channels) - 1} times)"
            )
    for name, model in (("expert", cfg.expert), ("router", cfg.router)):
        if tuple(model.input_size) != (h, w):
            raise ValueError(f"{name}.input_size: {tuple(model.input_size)} differs from the latent size {(h, w)}")
        if model.in_channels != c:
            raise ValueError(f"{name}.in_channels: {model.in_channels} differs from the latent channels {c}")
    if cfg.router.num_outputs != cfg.num_experts:
        raise ValueError(
            f"router.num_outputs: {cfg.router.num_outputs} differs from the {cfg.num_experts} experts "
            f"(cluster.k {cfg.cluster.k}" + (f" + {cfg.num_experts - cfg.cluster.k} added)" if cfg.added else ")")
        )
    for n, addition in enumerate(cfg.added, 1):
        if (addition.data.image_size, addition.data.channels) != (cfg.data.image_size, cfg.data.channels):
            raise ValueError(
                f"added.{n - 1}.data: image_size/channels {addition.data.image_size}/{addition.data.channels} "
                f"differ from the run's {cfg.data.image_size}/{cfg.data.channels}"
            )


def check_fleet(cfg: RunConfig) -> None:
    """The fleet's experts: removals, per-expert overrides, a student, how the steps are split."""
    if sorted(set(cfg.removed_experts)) != cfg.removed_experts:
        raise ValueError(f"removed_experts: {cfg.removed_experts} must be sorted and without repeats")
    for k in cfg.removed_experts:
        if not 0 <= k < cfg.num_experts:
            raise ValueError(f"removed_experts: {k} is not an expert (the run has {cfg.num_experts})")
    if cfg.removed_experts and len(cfg.removed_experts) >= cfg.num_experts:
        raise ValueError(f"removed_experts: {cfg.removed_experts} would leave no expert")
    if cfg.distill is not None:
        for name in cfg.distill.student:
            if name not in EXPERT_OVERRIDABLE:
                raise ValueError(f"distill.student.{name}: a student may change only {', '.join(EXPERT_OVERRIDABLE)}")
        try:
            cfg.student_config()
        except ValidationError as err:
            raise ValueError(f"distill.student.{validation_message(err)}") from None
    for k, changes in cfg.expert_overrides.items():
        if not 0 <= k < cfg.num_experts:
            raise ValueError(f"expert_overrides.{k}: no such expert (the run has {cfg.num_experts})")
        for name in changes:
            if name not in EXPERT_OVERRIDABLE:
                raise ValueError(
                    f"expert_overrides.{k}.{name}: an expert may change only {', '.join(EXPERT_OVERRIDABLE)} "
                    f"(the latent space, patch grid and text interface are the fleet's)"
                )
        try:  # (a size whose patch differs contradicts the patch_size kept from `expert`)
            cfg.expert_config(k)
        except ValidationError as err:
            raise ValueError(f"expert_overrides.{k}.{validation_message(err)}") from None
    # by_size splits one budget of FLOPs: experts of another architecture would make the monolith's matched
    # compute depend on the split; another objective (the same network, the same FLOPs) does not
    same_flops = ("objective", "schedule", "cond_dropout", "dropout")
    reshaped = any(set(changes) - set(same_flops) for changes in cfg.expert_overrides.values())
    if cfg.train.expert_steps == "by_size" and reshaped:
        raise ValueError(
            "train.expert_steps: by_size splits the steps of experts of one architecture; with "
            "expert_overrides the monolith's matched compute would depend on which expert gets which share"
        )


def check_routers(cfg: RunConfig) -> None:
    """The run's router and its comparison routers."""
    if cfg.router_baseline and not cfg.router.uses_text:
        raise ValueError(
            "router_baseline: the run's router is already prompt-blind (router.conditioning "
            "'none'); the baseline compares it with a prompt-aware one"
        )
    if cfg.router_prompt and cfg.router.uses_text:
        raise ValueError(
            "router_prompt: the run's router already reads the prompt (router.conditioning "
            f"{cfg.router.conditioning!r}); the comparison is a prompt-aware router beside a prompt-blind one"
        )
    if cfg.router_prompt and cfg.encoders.text.name == "none":
        raise ValueError("router_prompt: the prompt-aware router reads the caption's text vector: needs a text encoder")
    if cfg.router.conditioning == "class":
        raise ValueError(
            "router.conditioning: a router sees (x_t, t) and optionally the prompt "
            "('none', 'pooled' or 'cross_attn'), not class labels"
        )


def check_text(cfg: RunConfig) -> None:
    """Every text-conditioned model against the text encoder."""
    for name, model in (("expert", cfg.expert), ("router", cfg.router)):
        if not model.uses_text:
            continue
        if cfg.encoders.text.name == "none":
            raise ValueError(f"{name}.conditioning: {model.conditioning} needs a text encoder")
        if model.text_dim != cfg.encoders.text.width:
            raise ValueError(
                f"{name}.text_dim: {model.text_dim} differs from the {cfg.encoders.text.name} "
                f"text width {cfg.encoders.text.width}"
            )
        if model.conditioning == "cross_attn" and model.text_len != cfg.encoders.text.max_length:
            raise ValueError(
                f"{name}.text_len: {model.text_len} differs from encoders.text.max_length "
                f"{cfg.encoders.text.max_length}"
            )


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
