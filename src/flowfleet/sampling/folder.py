"""An assembled model folder: the contract between `assemble` and `generate`, and how it is opened.

Layout (diffusers-style: one sub-folder per component, each with its config.json +
diffusion_pytorch_model.safetensors, and model_index.json naming them at the root):

    model_index.json          ModelIndex; written last, so a folder without it is not a model
    SHA256SUMS                every weight file's sha256, in sha256sum's own format
    run.yaml                  the run configuration the fleet was trained from (provenance)
    expert_0 ... expert_{K-1} DiTExpert folders (EMA weights); absent ones when assembled partially
    router/                   DiTRouter folder (p(k | x_t, t), K outputs)
    text_encoder/config.json  a reference (name, path, max_length, width) — the encoder is not copied
    vae/config.json           a reference to the latent encoder, or PIXEL_SPACE.txt for pixel-space runs

Component entries follow diffusers: `"expert_0": ["flowfleet", "DiTExpert"]`, `[null, null]` for an
absent component.

SHA256SUMS is written by `assemble` for every weight file (*.safetensors: experts, router, vae) so that
`cd DIR && sha256sum -c SHA256SUMS` checks a folder by hand, and it is verified whenever the folder is
opened: a flipped byte in an expert's file is a one-line error naming the expert, never different images.
Hashing streams each file in 1 MiB reads; a match is remembered in .verified.json by the file's size and
modification time, so a folder opened again (a restarted server) is not read twice; `flowfleet verify`
always hashes everything.

`open_folder` checks everything before anything samples (every listed expert present and of the fleet's
latent shape, every weight file its SHA256SUMS line, the router's outputs the fleet's K), loads the router,
and puts the experts behind an ExpertStore that loads each when first selected.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from dataclasses import dataclass
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from flowfleet.config import LatentEncoderConfig, SamplingConfig, TextEncoderConfig
from flowfleet.errors import FlowfleetError, validated
from flowfleet.flow.path import TIME_CONVENTION
from flowfleet.layout import CHECKSUMS, CONTRIBUTION, INDEX_FILE, PACKAGE_EXPERT, VERIFIED
from flowfleet.models.files import load_model, read_dit_config
from flowfleet.sampling.store import ExpertStore
from flowfleet.storage import RunRoot

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------------
#                                   model_index.json
# --------------------------------------------------------------------------------------------------

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


# --------------------------------------------------------------------------------------------------
#                                   SHA256SUMS
# --------------------------------------------------------------------------------------------------


WEIGHTS_SUFFIX = ".safetensors"
CHUNK = 1 << 20


class CorruptWeights(FlowfleetError):
    """A weight file of a model folder whose sha256 differs from SHA256SUMS, or one that is missing."""


def weight_files(root: RunRoot) -> list[str]:
    """The files SHA256SUMS lists, relative paths: the weights at the top level and one folder down (expert_k/,
    router/...), and a contributed expert's signed manifest (its provenance)."""
    found = []
    for name in root.ls():
        if name.endswith(WEIGHTS_SUFFIX):
            found.append(name)
        elif root.fs.isdir(root.path(name)):
            found += [f"{name}/{inner}" for inner in root.ls(name) if _listed(inner)]
    return sorted(found)


def _listed(name: str) -> bool:
    return name.endswith(WEIGHTS_SUFFIX) or name == CONTRIBUTION


def sha256_of(root: RunRoot, rel: str) -> str:
    digest = hashlib.sha256()
    with root.fs.open(root.path(rel), "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def write_checksums(root: RunRoot) -> dict[str, str]:
    """Hash every weight file of the folder into SHA256SUMS (atomic); its old cache goes."""
    sums = {rel: sha256_of(root, rel) for rel in weight_files(root)}
    root.write_bytes("".join(f"{sha}  {rel}\n" for rel, sha in sums.items()).encode(), CHECKSUMS)
    root.remove(VERIFIED)
    return sums


def read_checksums(root: RunRoot) -> dict[str, str] | None:
    """SHA256SUMS as {relative path: sha256}, or None for a folder assembled before it existed."""
    if not root.exists(CHECKSUMS):
        return None
    sums = {}
    for n, line in enumerate(root.read_bytes(CHECKSUMS).decode("utf-8", "replace").splitlines(), 1):
        sha, sep, rel = line.partition("  ")
        if not sep or len(sha) != 64 or not rel:
            raise CorruptWeights(f"{root.url_of(CHECKSUMS)}: line {n} is not '<sha256>  <file>'")
        sums[rel.strip()] = sha.lower()
    return sums


def _owner(rel: str) -> str:
    """Whose weights a file holds, in words."""
    folder = rel.split("/")[0]
    if folder.startswith("expert_"):
        return f"expert {folder.removeprefix('expert_')}"
    return {"router": "the router", "vae": "the autoencoder (vae/)"}.get(folder, rel)


def _stamp(root: RunRoot, rel: str) -> list | None:
    """What identifies this version of a file without reading it: size and modification time (None: unknown)."""
    info = root.fs.info(root.path(rel))
    mtime = info.get("mtime") or info.get("LastModified") or info.get("ETag")
    return None if mtime is None else [int(info["size"]), str(mtime)]


def verify_weights(root: RunRoot, *, use_cache: bool = True) -> int:
    """Check every file SHA256SUMS lists; -> how many. CorruptWeights (one line, naming the file and whose
    weights it holds) on the first mismatch or missing file. A folder without SHA256SUMS is opened with a
    warning (assembled before checksums existed: re-assemble it to have them)."""
    sums = read_checksums(root)
    if sums is None:
        log.warning("%s: no %s (an older assembly): its weights are not verified", root.url, CHECKSUMS)
        return 0
    cache = {}
    if use_cache and root.exists(VERIFIED):
        try:
            cache = root.read_json(VERIFIED)
        except ValueError:
            cache = {}
    remembered = {}
    for rel, want in sums.items():
        if not root.exists(rel):
            raise CorruptWeights(f"{root.url_of(rel)}: missing ({_owner(rel)}'s weights, listed in {CHECKSUMS})")
        stamp = _stamp(root, rel)
        if stamp is not None and cache.get(rel) == [*stamp, want]:
            remembered[rel] = cache[rel]
            continue
        got = sha256_of(root, rel)
        if got != want:
            raise CorruptWeights(
                f"{root.url_of(rel)}: sha256 {got[:12]}... differs from {CHECKSUMS}'s {want[:12]}...: "
                f"{_owner(rel)}'s weights are corrupted or were replaced (restore the file or assemble again)"
            )
        if stamp is not None:
            remembered[rel] = [*stamp, want]
    if use_cache and remembered != cache:
        try:
            root.write_json(remembered, VERIFIED)
        except OSError as err:  # a read-only folder is verified every time
            log.debug("%s: cannot remember verified weights (%s)", root.url, err)
    return len(sums)


def verify_contributions(root: RunRoot) -> int:
    """Every contributed expert's installed files (expert_k/ beside its signed manifest, contribution.json) against the
    sha256 the manifest signed for them (its expert/ entries); -> how many contributions. CorruptWeights (one line,
    naming the file and the expert) where a file differs or is missing: the bytes serving are not the bytes signed."""
    count = 0
    for name in root.ls():
        if not (name.startswith("expert_") and root.exists(name, CONTRIBUTION)):
            continue
        count += 1
        try:
            signed = json.loads(root.read_bytes(name, CONTRIBUTION)).get("files") or {}
        except (ValueError, AttributeError):
            raise CorruptWeights(f"{root.url_of(name, CONTRIBUTION)}: not a signed manifest") from None
        expected = {rel.split("/", 1)[1]: sha for rel, sha in signed.items() if rel.startswith(PACKAGE_EXPERT + "/")}
        for file, want in sorted(expected.items()):
            if not root.exists(name, file):
                raise CorruptWeights(f"{root.url_of(name, file)}: missing ({_owner(name)}'s signed file)")
            got = sha256_of(root, f"{name}/{file}")
            if got != want:
                raise CorruptWeights(
                    f"{root.url_of(name, file)}: sha256 {got[:12]}... is not the {want[:12]}... its signed manifest "
                    f"({CONTRIBUTION}) gives: {_owner(name)}'s installed bytes are not the contributor's"
                )
    return count


# --------------------------------------------------------------------------------------------------
#                                   Opening a folder
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OpenedFolder:
    root: RunRoot
    index: ModelIndex
    experts: ExpertStore
    router: Any  # a DiTRouter on the device, or None for a one-expert model (the monolith)


def open_folder(model_dir: str, device: torch.device | str, offload: int | None) -> OpenedFolder:
    """Check and open a model folder: a one-line error naming the file at fault, before any sampling."""
    from flowfleet.models.dit import DiTExpert, DiTRouter

    root = RunRoot(model_dir)
    index = read_model_index(root)
    c, h, w = index.latent_shape
    for k in index.present_experts:  # fail now, not when the router first selects a broken expert
        folder = expert_folder(k)
        if not root.exists(folder):
            raise FlowfleetError(f"{root.url_of(folder)}: missing (model_index.json lists expert {k})")
        cfg = read_dit_config(root, folder)
        if (cfg.in_channels, *cfg.input_size) != (c, h, w):
            shape = (cfg.in_channels, *cfg.input_size)
            raise FlowfleetError(
                f"{root.url_of(folder)}: expert {k} denoises {shape}, model_index.json says latent_shape {(c, h, w)}"
            )
    verify_weights(root)  # SHA256SUMS: a corrupted expert is an error now, not different images later
    router = None
    if tuple(index.router) == (None, None):  # a one-expert model (the monolith): nothing to route
        if index.num_experts != 1:
            raise FlowfleetError(f"{root.url_of(INDEX_FILE)}: no router for {index.num_experts} experts")
    elif not root.exists("router"):
        raise FlowfleetError(f"{root.url_of('router')}: missing (the fleet's router)")
    else:
        router = load_model(DiTRouter, root, "router").to(device)
    if router is not None and router.cfg.num_outputs != index.num_experts:
        raise FlowfleetError(
            f"{root.url_of('router')}: num_outputs {router.cfg.num_outputs} differs from "
            f"the fleet's K = {index.num_experts}"
        )

    def load_expert(k: int) -> DiTExpert:
        return load_model(DiTExpert, root, expert_folder(k)).to(device)

    store = ExpertStore(load_expert, index.present_experts, index.num_experts, offload)
    return OpenedFolder(root, index, store, router)
