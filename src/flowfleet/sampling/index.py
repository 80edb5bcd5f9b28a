"""model_index.json of an assembled fleet: the contract between `assemble` and `generate`.

Layout of an assembled model folder (diffusers-style: one sub-folder per component, each with its
config.json + diffusion_pytorch_model.safetensors, and model_index.json naming them at the root):

    model_index.json          this schema; written last, so a folder without it is not a model
    run.yaml                  the run configuration the fleet was trained from (provenance)
    expert_0 ... expert_{K-1} DiTExpert folders (EMA weights); absent ones when assembled partially
    router/                   DiTRouter folder (p(k | x_t, t), K outputs)
    text_encoder/config.json  a reference (name, path, max_length, width) — the encoder is not copied
    vae/config.json           a reference to the latent encoder, or PIXEL_SPACE.txt for pixel-space runs

Component entries follow diffusers: `"expert_0": ["flowfleet", "DiTExpert"]`, `[null, null]` for an
absent component.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from flowfleet.config import LatentEncoderConfig, SamplingConfig, TextEncoderConfig
from flowfleet.errors import FlowfleetError
from flowfleet.flow.path import TIME_CONVENTION
from flowfleet.layout import INDEX_FILE
from flowfleet.models.files import validated
from flowfleet.storage import RunRoot

PIPELINE_CLASS = "FleetPipeline"  # what folders assembled before diffusers could open them name
# diffusers' DiffusionPipeline.from_pretrained(folder, trust_remote_code=True) loads the class that `_class_name`
# names from the folder's own module file: pipeline.py, which assemble writes (flowfleet.sampling.diffusers_pipeline)
DIFFUSERS_CLASS = ["pipeline", "FlowfleetDiffusionPipeline"]
PIPELINE_MODULE_FILE = "pipeline.py"
PIPELINE_MODULE = (
    '"""This folder is a flowfleet fleet: `DiffusionPipeline.from_pretrained(folder, trust_remote_code=True)` '
    'loads this module, which is flowfleet\'s own (pip install flowfleet)."""\n\n'
    "from flowfleet.sampling.diffusers_pipeline import FlowfleetDiffusionPipeline  # noqa: F401\n"
)
PIXEL_NOTE = "PIXEL_SPACE.txt"
_EXPERT_KEY = re.compile(r"^expert_(\d+)$")


def expert_folder(k: int) -> str:
    return f"expert_{k}"


class SchedulerConfig(SamplingConfig):
    """How generate samples by default: run.yaml's `sampling` section, plus the time convention it assumes."""

    time_convention: str = TIME_CONVENTION

    @model_validator(mode="after")
    def _check_convention(self) -> "SchedulerConfig":
        if self.time_convention != TIME_CONVENTION:
            raise ValueError(f"time_convention: {self.time_convention!r} differs from flowfleet's {TIME_CONVENTION!r}")
        return self


class ModelIndex(BaseModel):
    """Root file of an assembled fleet. Component keys (expert_k, router, text_encoder, vae) sit at the
    top level as [library, class] pairs, like diffusers' model_index.json."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    class_name: str | list[str] = Field(default_factory=lambda: list(DIFFUSERS_CLASS), alias="_class_name")
    flowfleet_version: str = Field("", alias="_flowfleet_version")
    num_experts: int = Field(ge=1)  # K: the router's outputs
    present_experts: list[int]  # the expert_k folders that exist (all of 0..K-1 unless partial)
    latent_shape: tuple[int, int, int]  # (C, H, W) the experts denoise
    image_channels: int = Field(3, ge=1)  # channels of the decoded images
    conditioning: str  # the experts' conditioning: none | class | pooled | cross_attn
    num_classes: int = 0
    text_width: int = 0
    text_len: int = 0
    latent_encoder: dict[str, Any]  # LatentEncoderConfig of the run ("pixels": no vae/ folder)
    text_encoder_config: dict[str, Any] | None = None  # TextEncoderConfig of the run, None without text
    scheduler: SchedulerConfig = SchedulerConfig()
    router: tuple[str | None, str | None] = ("flowfleet", "DiTRouter")
    text_encoder: tuple[str | None, str | None] = (None, None)
    vae: tuple[str | None, str | None] = (None, None)
    source: dict[str, Any] = {}  # run root, run name, per-expert steps: where the weights came from

    @model_validator(mode="after")
    def _check(self) -> "ModelIndex":
        if self.class_name not in (PIPELINE_CLASS, DIFFUSERS_CLASS):
            raise ValueError(f"_class_name: {self.class_name!r} is not a flowfleet fleet ({DIFFUSERS_CLASS})")
        if not self.present_experts:
            raise ValueError("present_experts: empty (a fleet needs at least one expert)")
        bad = [k for k in self.present_experts if not 0 <= k < self.num_experts]
        if bad:
            raise ValueError(f"present_experts: {bad} outside 0..{self.num_experts - 1}")
        for key in self.model_extra or {}:
            m = _EXPERT_KEY.match(key)
            if not m:
                raise ValueError(f"{key}: unknown key")
            if int(m.group(1)) not in self.present_experts:
                raise ValueError(f"{key}: listed as a component but not in present_experts")
        for k in self.present_experts:
            if expert_folder(k) not in (self.model_extra or {}):
                raise ValueError(f"{expert_folder(k)}: in present_experts but has no component entry")
        self.latent_config()  # validates
        self.text_config()
        return self

    @property
    def partial(self) -> bool:
        return len(self.present_experts) < self.num_experts

    def latent_config(self) -> LatentEncoderConfig:
        return LatentEncoderConfig(**self.latent_encoder)

    def text_config(self) -> TextEncoderConfig | None:
        return None if self.text_encoder_config is None else TextEncoderConfig(**self.text_encoder_config)

    def to_json_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True)


def read_model_index(folder: RunRoot | str) -> ModelIndex:
    """Parse DIR/model_index.json; one-line FlowfleetError naming the file and field otherwise."""
    root = folder if isinstance(folder, RunRoot) else RunRoot(folder)
    where = root.url_of(INDEX_FILE)
    raw = root.read_document(INDEX_FILE, missing="missing (not an assembled fleet; run `flowfleet assemble RUN_ROOT`)")
    return validated(ModelIndex, raw, where, FlowfleetError)


def set_default_guidance_scale(folder: RunRoot | str, guidance_scale: float) -> None:
    """Make `guidance_scale` the folder's default (model_index.json scheduler.guidance_scale; atomic rewrite)."""
    root = folder if isinstance(folder, RunRoot) else RunRoot(folder)
    index = read_model_index(root)
    index.scheduler = index.scheduler.model_copy(update={"guidance_scale": float(guidance_scale)})
    root.write_json(index.to_json_dict(), INDEX_FILE)
