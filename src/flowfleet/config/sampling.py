"""run.yaml's sampling section (and a model folder's scheduler): how a fleet samples, a sampling call's settings,
and the routing strategy as a config holds it."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AliasChoices, ConfigDict, Field, PlainSerializer, PlainValidator, ValidationError, WithJsonSchema

from flowfleet.config.base import Strict
from flowfleet.errors import ParameterError
from flowfleet.flow import Strategy, guidance_scale_at

# A routing strategy in a config: parsed from its name once, where it enters (Strategy.parse: a one-line ValueError
# names the strategies there are), carried as a Strategy, written back as its name
StrategyField = Annotated[
    Strategy,
    PlainValidator(Strategy.parse),
    PlainSerializer(lambda s: s.name, return_type=str),
    WithJsonSchema({"type": "string", "examples": ["top1", "top2", "topk:3", "full", "trajectory"]}),
]


class SamplingConfig(Strict):
    """How a fleet samples: every sampling setting, declared here once with its default and its check.

    run.yaml's `sampling` and a model folder's model_index.json `scheduler` hold one. A sampling call (the command
    line, the server, the OpenAI route, the library's generate, evaluate) starts from its fleet's and changes what it
    names (`for_call`), into that call's SamplingSettings. A field's description is its --help text."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    steps: int = Field(30, ge=1, description="sampling steps")
    sampler: Literal["euler", "heun"] = Field("euler", description="ODE sampler")
    # diffusers' name; run.yaml and model_index.json files written before it say `cfg` and `cfg_max_t`
    guidance_scale: float = Field(
        4.0,
        ge=0,
        validation_alias=AliasChoices("guidance_scale", "cfg"),
        description="classifier-free guidance scale on all channels; 1 = none",
    )
    # Kynkäänniemi et al. 2024 ("Applying guidance in a limited interval") found guiding only the less noisy steps
    # better for FID; guidance_at applies it.
    guidance_max_t: float = Field(
        1.0,
        gt=0,
        le=1,
        validation_alias=AliasChoices("guidance_max_t", "cfg_max_t"),
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
        return guidance_scale_at(self.guidance_scale, t, self.guidance_max_t)

    def describe(self) -> str:
        """'20 euler steps, guidance 3 at t <= 0.78' (the interval only when it is not every step; ', guided inside
        each expert' under that rule; a scale as its shortest decimal, 1.28 rather than 1.2800000000000002)."""
        interval = f" at t <= {self.guidance_max_t:g}" if self.guidance_max_t < 1 else ""
        rule = ", guided inside each expert" if self.guidance == "expert" else ""
        return f"{self.steps} {self.sampler} steps, guidance {self.guidance_scale:g}{interval}{rule}"

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
    """A sampling choice that is not valid, in one line naming the setting: 'guidance_max_t: ...' (the command line
    says it as its option, '--guidance-max-t: ...'; the server as the request's field)."""

    def __init__(self, name: str, message: str):
        super().__init__(name, message)
        self.name = name

    @classmethod
    def of(cls, err: ValidationError) -> "SettingError":
        first = err.errors()[0]
        name = str(first["loc"][0]) if first["loc"] else "settings"
        return cls(name, f"{first['msg'].removeprefix('Value error, ')}, got {first['input']!r}")
