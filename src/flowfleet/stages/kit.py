"""`flowfleet kit RUN_ROOT OUT`: what a stranger needs to train an expert this fleet can take, without its data.

    OUT/
      kit.json               the contract (Kit): time convention, objectives, latent shape, the encoders' identity,
                             the expert architecture's limits (base config, what may change, parameter cap,
                             dtypes), and its fingerprint
      run.yaml               the run's configuration for `flowfleet contribute` (its data replaced there)
      autoencoder/           the frozen latent encoder, where the run trained its own (its weights are fingerprinted)
      centroids.safetensors  the fleet's cluster centroids in semantic-feature space: is a contributor's data new?

The fingerprint is the sha256 of kit.json's contract (everything but the fingerprint), which names the latent
encoder's weight hashes and the fleet's identity: a random id made with the run's first kit (RUN_ROOT/kits/
fleet.json), so that a kit of another fleet with the same name and configuration is another kit. Every kit issued is
kept in the run (RUN_ROOT/kits/issued/<fingerprint>.json, its caps included): `admit` takes a package made from one
of them only, its caps as issued, and recomputes the rest of the contract from the run as it is now.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from flowfleet.config import EXPERT_OVERRIDABLE, RunConfig, load_run_config
from flowfleet.errors import FlowfleetError, validated
from flowfleet.flow.path import TIME_CONVENTION
from flowfleet.layout import (
    AUTOENCODER,
    AUTOENCODER_RECIPE,
    CENTROIDS,
    FLEET_IDENTITY,
    KIT_CENTROIDS,
    KIT_FILE,
    KIT_RUN,
    KITS_ISSUED,
    RUN_FILE,
)
from flowfleet.models import flops
from flowfleet.models.config import DiTConfig
from flowfleet.storage import RunRoot

OBJECTIVES = ("fm", "ddpm")  # what a fleet's experts may learn: flow matching, or DDPM's noise (converted)
DTYPES = ("float32", "bfloat16", "float16")
PARAMS_HEADROOM = 4  # the default cap: four times the run's expert (a contributor's bigger machine)
SAMPLE_ROWS = 1024  # the default cap of a package's sample and held-out slice (contribute's --sample)


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
    fleet_id: str = ""  # the fleet's random identity (RUN_ROOT/kits/fleet.json)
    sample_rows: int = Field(SAMPLE_ROWS, ge=2)  # the most items a package's sample and its held-out slice hold
    fingerprint: str = ""

    def contract(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude={"fingerprint"})

    def compute_fingerprint(self) -> str:
        text = json.dumps(self.contract(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    def expert_config(self) -> DiTConfig:
        return DiTConfig(**self.expert)


def parameter_count(cfg: DiTConfig) -> int:
    """An expert's parameters, from its config's numbers (flowfleet.models.flops): nothing is built or allocated, so
    any config.json is cheap."""
    return flops.parameter_count(cfg)


def fleet_id(root: RunRoot, create: bool = False) -> str:
    """The fleet's random identity, made (create) with its first kit; "" where the run has none yet."""
    if root.exists(*FLEET_IDENTITY):
        raw = root.read_json(*FLEET_IDENTITY)
        if isinstance(raw, dict) and isinstance(raw.get("fleet_id"), str) and raw["fleet_id"]:
            return raw["fleet_id"]
        raise FlowfleetError(f"{root.url_of(*FLEET_IDENTITY)}: not a fleet identity (no 'fleet_id')")
    if not create:
        return ""
    made = secrets.token_hex(16)
    root.write_json({"fleet_id": made}, *FLEET_IDENTITY)
    return made


def issued_kit(root: RunRoot, fingerprint: str) -> Kit | None:
    """The kit the run issued under this fingerprint (RUN_ROOT/kits/issued/), or None where it issued none."""
    if not (len(fingerprint) == 64 and all(c in "0123456789abcdef" for c in fingerprint)):
        return None
    name = f"{fingerprint}.json"
    if not root.exists(*KITS_ISSUED, name):
        return None
    return validated(Kit, root.read_json(*KITS_ISSUED, name), root.url_of(*KITS_ISSUED, name), FlowfleetError)


def run_kit(
    root: RunRoot,
    cfg: RunConfig,
    max_params: int | None = None,
    sample_rows: int = SAMPLE_ROWS,
    *,
    create: bool = False,
) -> Kit:
    """The run's kit, fingerprinted (nothing written but, with create, the fleet's identity where it has none)."""
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
        fleet_id=fleet_id(root, create),
        sample_rows=sample_rows,
    )
    kit.fingerprint = kit.compute_fingerprint()
    return kit


def make_kit(
    run_root: str | RunRoot, out: str | RunRoot, *, max_params: int | None = None, sample_rows: int = SAMPLE_ROWS
) -> Kit:
    """Write the run's kit to `out` (see the module docstring), and keep it in the run as issued; -> the kit."""
    root = run_root if isinstance(run_root, RunRoot) else RunRoot(run_root)
    dest = out if isinstance(out, RunRoot) else RunRoot(out)
    cfg = load_run_config(root)
    kit = run_kit(root, cfg, max_params, sample_rows, create=True)
    root.write_json(kit.model_dump(mode="json"), *KITS_ISSUED, f"{kit.fingerprint}.json")
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
