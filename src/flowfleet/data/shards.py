"""Shard sets: the on-disk contract between prepare, cluster and the training jobs.

A shard set is a folder (in a run root) holding `manifest.json` and `shard-00000.safetensors`, ...
Each shard holds, for n items:

    latents      [n, C, H, W] float32   what experts and the router learn (pixels or VAE latents)
    features     [n, F]       float32   semantic features used for clustering
    text_tokens  [n, L, T]    float16   per-token text embeddings (cross-attention)
    text_mask    [n, L]       uint8     1 = real token
    text_pooled  [n, T]       float32   pooled text embedding
    labels       [n]          int64     source labels when known (MNIST digit, shape id), else -1
    index        [n]          int64     global item index in data/ (stable across partitions)

and captions as JSON in the safetensors metadata. A shard file stores the text tokens unpadded where the padding is
a suffix of zeros (every encoder's): text_tokens [sum of lengths, T], the items' tokens one after the other,
text_len [n] int32, and text_mask an empty [0, L]; parse_shard gives them back padded, as above.

`data/` is the full prepared set; `partitions/k/` holds partition k only, so an expert job needs nothing else from
the run root. A shard becomes part of the set when the manifest naming it is written (after the shard).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Any, Iterable

import safetensors.torch
import torch

from flowfleet.errors import FlowfleetError
from flowfleet.layout import MANIFEST
from flowfleet.storage import RunRoot

FIELDS = ("latents", "features", "text_tokens", "text_mask", "text_pooled", "labels", "index")


def shard_name(i: int) -> str:
    return f"shard-{i:05d}.safetensors"


@dataclass
class ShardSetManifest:
    """What a shard set holds. `extra` carries stage-specific records (encoders, fingerprint, skipped)."""

    shards: list[dict[str, Any]] = field(default_factory=list)  # [{"name", "count"}]
    fields: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> {"shape", "dtype"}
    complete: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def count(self) -> int:
        return sum(s["count"] for s in self.shards)

    def to_dict(self) -> dict[str, Any]:
        return {
            "count": self.count,
            "complete": self.complete,
            "shards": self.shards,
            "fields": self.fields,
            **self.extra,
        }

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ShardSetManifest":
        known = {"count", "complete", "shards", "fields"}
        return cls(
            shards=list(raw.get("shards", [])),
            fields=dict(raw.get("fields", {})),
            complete=bool(raw.get("complete", False)),
            extra={k: v for k, v in raw.items() if k not in known},
        )


class ShardSet:
    """Read and append shards of one folder of a run root. Its manifest is read once and kept (on an object
    store each read is a request): what this object writes replaces the kept one; another writer's manifest is
    seen by a new ShardSet."""

    def __init__(self, root: RunRoot, folder: str):
        self.root = root
        self.folder = folder
        self._manifest: dict[str, Any] | None = None  # the manifest as last read or written

    @property
    def url(self) -> str:
        return self.root.url_of(self.folder)

    def exists(self) -> bool:
        return self._manifest is not None or self.root.exists(self.folder, MANIFEST)

    def manifest(self) -> ShardSetManifest:
        """The manifest (a fresh object each call: a caller may change its copy and write it)."""
        if self._manifest is None:
            try:
                self._manifest = self.root.read_json(self.folder, MANIFEST)
            except FileNotFoundError:
                raise FileNotFoundError(f"{self.root.url_of(self.folder, MANIFEST)}: missing") from None
        return ShardSetManifest.from_dict(copy.deepcopy(self._manifest))

    def write_manifest(self, manifest: ShardSetManifest) -> None:
        raw = manifest.to_dict()
        self.root.write_json(raw, self.folder, MANIFEST)
        self._manifest = copy.deepcopy(raw)

    def append(
        self,
        manifest: ShardSetManifest,
        tensors: dict[str, torch.Tensor],
        captions: list[str],
        info: dict[str, Any] | None = None,
    ) -> None:
        """Write the next shard, then the manifest that names it (so a crash never exposes half a shard).
        `info` adds keys to the shard's manifest entry (prepare records where in the source it ends)."""
        n = len(captions)
        for name, t in tensors.items():
            if t.shape[0] != n:
                raise ValueError(f"shard field {name!r} has {t.shape[0]} rows, expected {n}")
        name = shard_name(len(manifest.shards))
        self.root.write_bytes(shard_bytes(tensors, captions), self.folder, name)
        if not manifest.fields:
            manifest.fields = fields_of(tensors)
        manifest.shards.append({"name": name, "count": n, **(info or {})})
        self.write_manifest(manifest)

    def read_shard(self, name: str) -> tuple[dict[str, torch.Tensor], list[str]]:
        return parse_shard(self.root.read_bytes(self.folder, name))

    def load(self, fields: Iterable[str] = FIELDS, with_captions: bool = False):
        """Concatenate the requested fields of every shard (in-memory; fine up to a few GB)."""
        manifest = self.manifest()
        fields = [f for f in fields if f in manifest.fields]
        parts: dict[str, list[torch.Tensor]] = {f: [] for f in fields}
        captions: list[str] = []
        for shard in manifest.shards:
            tensors, caps = self.read_shard(shard["name"])
            for f in fields:
                parts[f].append(tensors[f])
            captions.extend(caps)
        out = {f: torch.cat(v) if v else torch.empty(0) for f, v in parts.items()}
        return (out, captions) if with_captions else out


class ShardSetUnion:
    """Several shard sets read as one, in order: a run's data/ and the data its additions brought
    (add-expert). The first set's manifest describes the run's source and encoders."""

    def __init__(self, sets: list[ShardSet]):
        self.sets = sets

    @property
    def url(self) -> str:
        return " + ".join(s.url for s in self.sets)

    def manifest(self) -> ShardSetManifest:
        return self.sets[0].manifest()

    def manifests(self) -> list[ShardSetManifest]:
        return [s.manifest() for s in self.sets]

    def load(self, fields: Iterable[str] = FIELDS, with_captions: bool = False):
        fields = list(fields)
        loaded = [s.load(fields, with_captions=True) for s in self.sets]
        out = {f: torch.cat([t[f] for t, _ in loaded]) for f in loaded[0][0]}
        captions = [c for _, caps in loaded for c in caps]
        return (out, captions) if with_captions else out


def fields_of(tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, Any]]:
    """A manifest's `fields`: each field's item shape and dtype, as the shards' readers give them, by name (the order
    a shard's tensors come in depends on how it was written)."""
    return {
        k: {"shape": list(v.shape[1:]), "dtype": str(v.dtype).removeprefix("torch.")}
        for k, v in sorted(tensors.items())
    }


def open_complete(root: RunRoot, folder: str, made_by: str) -> ShardSet:
    """The shards of `folder` (data/ or a partition), written to the end; otherwise a one-line error
    naming its manifest and `made_by`, the command that writes it ("flowfleet prepare RUN")."""
    shards = ShardSet(root, folder)
    where = root.url_of(folder, MANIFEST)
    if not shards.exists():
        raise FlowfleetError(f"{where}: missing; run `{made_by}` first")
    manifest = shards.manifest()
    if not manifest.complete:
        raise FlowfleetError(
            f"{where}: incomplete ({manifest.count} items so far; its writer is still running or "
            f"stopped early); finish `{made_by}` first"
        )
    return shards


def shard_bytes(tensors: dict[str, torch.Tensor], captions: list[str]) -> bytes:
    """One shard file: the tensors (batch-first; the text tokens unpadded where they can be), the captions in its
    safetensors metadata (its only key: safetensors writes several in no fixed order, and shards are compared byte
    for byte)."""
    meta = {"captions": json.dumps(captions)}
    return safetensors.torch.save({k: v.contiguous() for k, v in pack_tokens(tensors).items()}, metadata=meta)


def parse_shard(raw: bytes) -> tuple[dict[str, torch.Tensor], list[str]]:
    """A shard file's (tensors, captions), its text tokens padded again."""
    meta = _safetensors_metadata(raw)
    return unpack_tokens(safetensors.torch.load(raw)), json.loads(meta.get("captions", "[]"))


def pack_tokens(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The fields to store: text_tokens [n, L, T] whose text_mask [n, L] is a prefix of each row and whose other
    tokens are zeros (an encoder's padding) as text_tokens [sum of lengths, T] and text_len [n] int32, text_mask
    as an empty [0, L] of its dtype (its width and dtype kept); other tensors as given. (A zero of either sign comes
    back as +0.)"""
    tokens, mask = tensors.get("text_tokens"), tensors.get("text_mask")
    if tokens is None or mask is None or tokens.dim() != 3 or mask.shape != tokens.shape[:2]:
        return dict(tensors)
    lengths = mask.bool().sum(1)
    real = torch.arange(tokens.shape[1]) < lengths[:, None]  # [n, L]
    if not torch.equal(mask.bool(), real) or bool((tokens[~real] != 0).any()):
        return dict(tensors)
    stored = dict(tensors)
    stored["text_tokens"] = tokens[real]  # [sum of lengths, T], item after item
    stored["text_len"] = lengths.to(torch.int32)
    stored["text_mask"] = mask.new_zeros(0, mask.shape[1])
    return stored


def is_packed(stored: dict[str, Any]) -> bool:
    """Whether a shard file's fields (tensors, or its header's entries) hold text tokens stored by pack_tokens."""
    return "text_len" in stored


def unpack_tokens(stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """pack_tokens undone: text_tokens [n, L, T] and text_mask [n, L] again (a shard stored padded is returned as
    is). A malformed packing (a stranger's file) raises ValueError."""
    if not is_packed(stored):
        return stored
    lengths, packed, empty = stored["text_len"], stored.get("text_tokens"), stored.get("text_mask")
    if packed is None or packed.dim() != 2 or lengths.dim() != 1 or empty is None or empty.shape[:1] != (0,):
        raise ValueError("packed text tokens need text_tokens [N, T], text_len [n] and an empty text_mask [0, L]")
    length = empty.shape[1] if empty.dim() == 2 else -1
    if bool(((lengths < 0) | (lengths > length)).any()) or int(lengths.sum()) != packed.shape[0]:
        raise ValueError(f"text_len: lengths outside 0..{length} or not summing to text_tokens' {packed.shape[0]} rows")
    real = torch.arange(length) < lengths[:, None]  # [n, L]
    tokens = packed.new_zeros(lengths.shape[0], length, packed.shape[1])
    tokens[real] = packed
    out = {k: v for k, v in stored.items() if k != "text_len"}
    out["text_tokens"], out["text_mask"] = tokens, real.to(empty.dtype)
    return out


def _safetensors_metadata(raw: bytes) -> dict[str, str]:
    header_len = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + header_len])
    return header.get("__metadata__", {}) or {}
