"""`flowfleet kit RUN_ROOT OUT`: what a stranger needs to train an expert this fleet can take, without its data.

    OUT/
      kit.json               the contract (Kit): time convention, objectives, latent shape, the encoders' identity,
                             the expert architecture's limits (base config, what may change, parameter cap,
                             dtypes), and its fingerprint
      run.yaml               the run's configuration for `flowfleet contribute` (its data replaced there)
      autoencoder/           the frozen latent encoder, where the run trained its own (its weights are fingerprinted)
      centroids.safetensors  the fleet's cluster centroids in semantic-feature space: is a contributor's data new?

The fingerprint is the sha256 of kit.json's contract (everything but the fingerprint), which names the latent
encoder's weight hashes: an expert trained with another latent space, time convention or architecture limit
carries another fingerprint, and `admit` refuses it. The same run gives the same fingerprint every time, so a
fleet's owner recomputes it rather than trusting the package's.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field

from flowfleet.config import EXPERT_OVERRIDABLE, RunConfig, load_run_config
from flowfleet.errors import FlowfleetError
from flowfleet.flow.path import TIME_CONVENTION
from flowfleet.layout import AUTOENCODER, AUTOENCODER_RECIPE, CENTROIDS, KIT_CENTROIDS, KIT_FILE, KIT_RUN, RUN_FILE
from flowfleet.models.config import DiTConfig
from flowfleet.models.files import validated
from flowfleet.storage import RunRoot

OBJECTIVES = ("fm", "ddpm")  # what a fleet's experts may learn: flow matching, or DDPM's noise (converted)
DTYPES = ("float32", "bfloat16", "float16")
PARAMS_HEADROOM = 4  # the default cap: four times the run's expert (a contributor's bigger machine)


class Kit(BaseModel):
    """kit.json: the contract a contributed expert must meet (flowfleet.stages.admit checks it)."""

    model_config = ConfigDict(extra="forbid")

    format: int = 1
    run_name: str
    time_convention: str = TIME_CONVENTION
    objectives: list[str] = Field(default_factory=lambda: list(OBJECTIVES))
    latent_shape: tuple[int, int, int]  # (C, H, W) the experts denoise
    image_size: int
    image_channels: int
    latent_encoder: dict[str, Any]  # run.yaml encoders.latent
    latent_weights: dict[str, str] = {}  # the run-trained latent space: file -> sha256 (kit's autoencoder/)
    text_encoder: dict[str, Any] | None  # run.yaml encoders.text (None: unconditional or class-conditioned)
    semantic_encoder: dict[str, Any]
    expert: dict[str, Any]  # the run's expert architecture (DiTConfig)
    overridable: list[str] = Field(default_factory=lambda: list(EXPERT_OVERRIDABLE))
    max_params: int = Field(ge=1)
    dtypes: list[str] = Field(default_factory=lambda: list(DTYPES))
    fingerprint: str = ""

    def contract(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude={"fingerprint"})

    def compute_fingerprint(self) -> str:
        text = json.dumps(self.contract(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    def expert_config(self) -> DiTConfig:
        return DiTConfig(**self.expert)


def parameter_count(cfg: DiTConfig) -> int:
    """An expert's parameters, counted on the meta device: nothing is allocated, so any config.json is cheap."""
    from flowfleet.models.dit import DiTExpert

    with torch.device("meta"):
        model = DiTExpert.from_dit_config(cfg)
    return sum(p.numel() for p in model.parameters())


def run_kit(root: RunRoot, cfg: RunConfig, max_params: int | None = None) -> Kit:
    """The run's kit, fingerprinted (nothing written)."""
    weights = {}
    if cfg.encoders.latent.name == "autoencoder":
        if not root.exists(AUTOENCODER):
            raise FlowfleetError(f"{root.url_of(AUTOENCODER)}: missing; the kit carries the run's latent space")
        for name in root.ls(AUTOENCODER):
            if name != AUTOENCODER_RECIPE:
                weights[name] = hashlib.sha256(root.read_bytes(AUTOENCODER, name)).hexdigest()
    kit = Kit(
        run_name=cfg.name,
        latent_shape=cfg.latent_shape,
        image_size=cfg.data.image_size,
        image_channels=cfg.data.channels,
        latent_encoder=cfg.encoders.latent.model_dump(mode="json"),
        latent_weights=weights,
        text_encoder=cfg.encoders.text.model_dump(mode="json") if cfg.expert.conditioning != "none" else None,
        semantic_encoder=cfg.encoders.semantic.model_dump(mode="json"),
        expert=cfg.expert.model_dump(mode="json"),
        max_params=max_params or PARAMS_HEADROOM * parameter_count(cfg.expert),
    )
    kit.fingerprint = kit.compute_fingerprint()
    return kit


def make_kit(run_root: str | RunRoot, out: str | RunRoot, *, max_params: int | None = None) -> Kit:
    """Write the run's kit to `out` (see the module docstring); -> the kit."""
    root = run_root if isinstance(run_root, RunRoot) else RunRoot(run_root)
    dest = out if isinstance(out, RunRoot) else RunRoot(out)
    cfg = load_run_config(root)
    kit = run_kit(root, cfg, max_params)
    for name in kit.latent_weights:
        dest.write_bytes(root.read_bytes(AUTOENCODER, name), AUTOENCODER, name)
    if root.exists(*CENTROIDS):
        dest.write_bytes(root.read_bytes(*CENTROIDS), KIT_CENTROIDS)
    dest.write_bytes(root.read_bytes(RUN_FILE), KIT_RUN)
    dest.write_json(kit.model_dump(mode="json"), KIT_FILE)  # last: a folder without kit.json is not a kit
    return kit


def read_kit(kit_dir: str | RunRoot) -> Kit:
    """A kit folder's kit.json, its fingerprint checked against its contract and its latent weights against it."""
    root = kit_dir if isinstance(kit_dir, RunRoot) else RunRoot(kit_dir)
    where = root.url_of(KIT_FILE)
    if not root.exists(KIT_FILE):
        raise FlowfleetError(f"{where}: missing; `flowfleet kit RUN_ROOT OUT` writes a kit")
    kit = validated(Kit, root.read_json(KIT_FILE), where, FlowfleetError)
    if kit.fingerprint != kit.compute_fingerprint():
        raise FlowfleetError(f"{where}: fingerprint does not match its contract (the kit was changed)")
    for name, sha in kit.latent_weights.items():
        if hashlib.sha256(root.read_bytes(AUTOENCODER, name)).hexdigest() != sha:
            raise FlowfleetError(f"{root.url_of(AUTOENCODER, name)}: sha256 differs from kit.json's")
    return kit
