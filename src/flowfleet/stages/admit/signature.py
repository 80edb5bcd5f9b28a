"""Check 1, the signature: first, before a byte of the manifest is parsed; then the manifest's schema, the kit
it was made from (one this fleet issued: a kit of another fleet is another kit, even with the same contract), and
whether this fleet holds, or once held, the same package; then the private copy of every file it lists, each hashed
as it is copied against the sha256 it signed (nothing added, nothing changed, nothing followed)."""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from flowfleet.config import RunConfig
from flowfleet.errors import validated
from flowfleet.layout import PACKAGE_EXPERT, PACKAGE_HELDOUT, PACKAGE_MANIFEST, PACKAGE_SAMPLE, PACKAGE_SIGNATURE
from flowfleet.models.files import WEIGHTS_NAME
from flowfleet.sampling.signing import read_trusted, signed_by
from flowfleet.stages.admit.formats import HEADER_MAX_BYTES, FormatError, load_json
from flowfleet.stages.admit.package import PACKAGE_OWN, copy_capped, list_entries, read_capped
from flowfleet.stages.admit.refusal import Refused, refusing, shown
from flowfleet.stages.kit import Kit, issued_kit
from flowfleet.storage import RunRoot

MANIFEST_MAX_BYTES = 64 << 10
SIGNATURE_BYTES = 64  # an Ed25519 signature
CONFIG_MAX_BYTES = 64 << 10
MAX_FILES = 16
BYTES_PER_PARAM = 4  # float32, the widest dtype a kit takes
CAPTION_MAX_BYTES = 1 << 10  # a caption's share of a shard's header
FEATURE_MAX = 8192  # the widest semantic feature a row may carry (Inception's 2048, DINOv2-L's 1024)
_NAME = re.compile(r"[A-Za-z0-9._-]{1,100}")
_SHA256 = re.compile(r"[0-9a-f]{64}")


class Training(BaseModel):
    """The training record a contributor signs (flowfleet contribute writes it)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    steps: int = Field(ge=1)
    items: int = Field(ge=0)
    final_loss: float = Field(allow_inf_nan=False)
    objective: str = Field(max_length=16)


class Manifest(BaseModel):
    """manifest.json of a package (flowfleet.stages.contribute.sign_package writes it)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    format: Literal[2]
    kit: str = Field(max_length=64)
    fleet_id: str = Field(max_length=64)
    fleet: str = Field(max_length=200)
    time_convention: str = Field(max_length=200)
    files: dict[str, str] = Field(max_length=MAX_FILES)
    training: Training

    @field_validator("files")
    @classmethod
    def _plain_names(cls, files: dict[str, str]) -> dict[str, str]:
        for rel, sha in files.items():
            parts = rel.split("/")
            if len(parts) > 2 or not all(_NAME.fullmatch(p) and p not in (".", "..") for p in parts):
                raise ValueError(f"{shown(rel)} is not a plain file name of the package")
            if rel in PACKAGE_OWN:
                raise ValueError(f"{rel} is the package's own, not a file it may list")
            if not _SHA256.fullmatch(sha):
                raise ValueError(f"{shown(rel)}: {shown(sha)} is not a sha256")
        return files


@dataclass(frozen=True)
class Signed:
    """What `who` found: the manifest's bytes and signature, who signed them, the manifest, the kit it was made from."""

    body: bytes
    signature: bytes
    signer: str
    manifest: Manifest
    kit: Kit

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.body).hexdigest()


def check_signature(pkg: RunRoot, trusted: str, root: RunRoot, cfg: RunConfig) -> Signed:
    """The signature, the manifest, the kit it names, no replay (the checks of the module docstring, up to the copy)."""
    body = read_capped(pkg, PACKAGE_MANIFEST, MANIFEST_MAX_BYTES)
    signature = read_capped(pkg, PACKAGE_SIGNATURE, SIGNATURE_BYTES)
    if len(signature) != SIGNATURE_BYTES:
        raise Refused(
            "signature", f"{PACKAGE_SIGNATURE}: {len(signature)} bytes, an Ed25519 signature has {SIGNATURE_BYTES}"
        )
    keys = read_trusted(trusted)
    signer = signed_by(keys, body, signature)
    if signer is None:
        raise Refused(
            "signature",
            f"{PACKAGE_SIGNATURE}: not a signature over {PACKAGE_MANIFEST} by any of the {len(keys)} trusted "
            f"key(s) in {trusted} (an unknown signer, or a manifest changed after signing)",
        )
    try:
        raw = load_json(body)
    except FormatError as err:
        raise Refused("signature", f"{PACKAGE_MANIFEST}: {err}") from None
    manifest = validated(Manifest, raw, PACKAGE_MANIFEST, refusing("signature"))
    kit = issued_kit(root, manifest.kit)
    if kit is None or kit.fleet_id != manifest.fleet_id:
        raise Refused(
            "signature",
            f"{PACKAGE_MANIFEST}: kit {manifest.kit[:16]}... is not one this fleet issued (a kit of another fleet, "
            "even one of the same contract, or of a kit made before kits had a fleet identity: `flowfleet kit` again)",
        )
    signed = Signed(body, signature, signer, manifest, kit)
    _not_admitted_before(signed, cfg)
    return signed


def _not_admitted_before(signed: Signed, cfg: RunConfig) -> None:
    """Refuse a manifest digest the run holds or once held: an addition's contribution (a removed one's included)."""
    for k in range(cfg.num_experts):
        n, _ = cfg.expert_origin(k)
        contribution = cfg.added[n - 1].contribution if n else None
        if contribution is not None and contribution.manifest_sha256 == signed.digest:
            gone = " (since removed)" if k in cfg.removed_experts else ""
            raise Refused("signature", f"{PACKAGE_MANIFEST}: this package was admitted before, as expert {k}{gone}")


def file_cap(rel: str, kit: Kit) -> int:
    """The most bytes a package file may hold, from the kit's caps: its weights' from the parameter cap, its sample's
    and held-out slice's from the row cap; a config (or any other name, which `what` refuses) 64 KiB."""
    if rel == f"{PACKAGE_EXPERT}/{WEIGHTS_NAME}":
        return kit.max_params * BYTES_PER_PARAM + HEADER_MAX_BYTES
    if rel in (PACKAGE_SAMPLE, PACKAGE_HELDOUT):
        return kit.sample_rows * row_bytes(kit) + HEADER_MAX_BYTES
    return CONFIG_MAX_BYTES


def row_bytes(kit: Kit) -> int:
    """An upper bound of one prepared item's bytes in a shard: its latent, its text (tokens, mask, pooled vector),
    its semantic features and its image, each at the widest dtype, and its caption in the header."""
    width = int((kit.text_encoder or {}).get("width") or 0) or 1024
    length = int((kit.text_encoder or {}).get("max_length") or 0) or 77
    numbers = math.prod(kit.latent_shape) + length * width + length + width + FEATURE_MAX + 16
    return 8 * numbers + kit.image_channels * kit.image_size**2 + CAPTION_MAX_BYTES


def copy_package(pkg: RunRoot, signed: Signed, dest: Path) -> None:
    """The private copy: every entry of the package is a regular file at a name the manifest lists (or its own), or
    its expert/ folder; each listed file copied under its cap and hashed as it is copied."""
    files = signed.manifest.files
    entries = list_entries(pkg)
    for entry in entries:
        if entry.kind == "link":
            raise Refused("signature", f"{shown(entry.rel)}: a symbolic link (never followed)")
        if entry.kind == "other":
            raise Refused(
                "signature", f"{shown(entry.rel)}: not a regular file (a FIFO, a device or a socket is never read)"
            )
        if entry.kind == "directory":
            if entry.rel != PACKAGE_EXPERT:
                raise Refused("signature", f"{shown(entry.rel)}: a folder the package may not hold")
        elif entry.rel not in files and entry.rel not in PACKAGE_OWN:
            raise Refused("signature", f"{shown(entry.rel)}: not in the signed manifest (added after signing)")
    present = {e.rel for e in entries}
    for rel, sha in sorted(files.items()):
        if rel not in present:
            raise Refused("signature", f"{rel}: missing, though the signed manifest lists it")
        if copy_capped(pkg, rel, dest / rel, file_cap(rel, signed.kit)) != sha:
            raise Refused("signature", f"{rel}: sha256 differs from the signed manifest's (changed after signing)")
