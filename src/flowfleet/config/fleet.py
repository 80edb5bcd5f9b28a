"""What changes a fleet after its first training: experts of another size, data added, contributed experts, a
distilled student."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import AliasChoices, Field, model_validator

from flowfleet.config.base import Strict
from flowfleet.config.data import DataConfig
from flowfleet.config.sampling import SamplingConfig, StrategyField
from flowfleet.flow import Strategy

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


class Contribution(Strict):
    """An expert a stranger trained and `flowfleet admit` took in (flowfleet.stages.admit): who signed what."""

    signer: str  # the key id (flowfleet.sampling.signing)
    manifest_sha256: str  # the signed manifest's digest (kept in the expert's folder as contribution.json)
    package: str  # where it was admitted from
    steps: int = Field(ge=1)  # its training steps, as signed: its job is finished at these
    items: int = Field(ge=0)  # the items it trained on, as signed


class Addition(Strict):
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


class DistillConfig(Strict):
    """`flowfleet distill`: one student DiT trained on the assembled fleet's guided velocity."""

    teacher: StrategyField = Strategy.parse("top2")  # the fleet's routing strategy the student learns
    student: dict[str, Any] = {}  # what the student changes of `expert` (EXPERT_OVERRIDABLE), e.g. {size: S}
    steps: int = Field(1000, ge=1)
    # the teacher's guidance scale (None: sampling.guidance_scale); `cfg` in a run.yaml written before the name
    guidance_scale: float | None = Field(None, ge=0, validation_alias=AliasChoices("guidance_scale", "cfg"))
    # velocity: regression on the teacher's velocity at x_t from the data. reflow (rectified flow, for few
    # sampling steps): flow matching on (noise, the teacher's sample from that noise) pairs.
    method: Literal["velocity", "reflow"] = "velocity"
    pairs: int = Field(2000, ge=1)  # reflow: teacher trajectories (items of the data, fixed noise)
    teacher_steps: int = Field(20, ge=1)  # reflow: the teacher's sampling steps

    def teacher_guidance(self, sampling: SamplingConfig) -> float:
        """The guidance scale the teacher samples with: this config's, else the fleet's."""
        return sampling.guidance_scale if self.guidance_scale is None else self.guidance_scale
