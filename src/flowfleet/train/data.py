"""Training data: a ShardSet held in memory, served as seeded batches with a resumable position.

The whole data position is one integer, the number of samples drawn so far. Sample number s is item
perm_e[s mod N] with e = s div N and perm_e a permutation seeded by (seed, e), so a job resumed from a
checkpoint draws exactly the batches it would have drawn had it never stopped, on any number of
ranks. In memory is fine up to a few GB (MNIST-5k with MiniLM tokens is ~60 MB); larger runs need a
streaming loader with the same position contract.
"""

from __future__ import annotations

import hashlib
from typing import Iterable

import torch

from flowfleet.data.encoders import REPA_FIELD
from flowfleet.data.shards import ShardSet, ShardSetManifest
from flowfleet.errors import FlowfleetError
from flowfleet.models.config import DiTConfig

AUGMENT_FIELDS = ["aug_latents", "aug_params"]  # data.augment's copies: [A, C, H, W] and [A, AUGMENT_DIM] per item


class DataMismatchError(FlowfleetError):
    """Shards whose shapes do not fit the model configuration."""


def derive_seed(*parts: int) -> int:
    """A 63-bit seed from integers (seed, epoch, step, chunk, ...), stable across Python versions."""
    digest = hashlib.blake2b(",".join(str(int(p)) for p in parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def model_fields(cfg: DiTConfig) -> list[str]:
    """Shard fields a model with this configuration consumes."""
    fields = ["latents"]
    if cfg.conditioning == "class":
        fields.append("labels")
    if cfg.conditioning == "pooled" or (cfg.conditioning == "cross_attn" and cfg.add_pooled):
        fields.append("text_pooled")
    if cfg.conditioning == "cross_attn":
        fields += ["text_tokens", "text_mask"]
    return fields


def training_fields(cfg: DiTConfig, augment_p: float = 0.0) -> list[str]:
    """Shard fields a model's training reads: its condition, with train.augment_p each item's augmented copies and
    their parameters (flowfleet.data.augment), with a REPA projector (repa_dim) the encoder's tokens."""
    return [*model_fields(cfg), *(AUGMENT_FIELDS if augment_p else []), *([REPA_FIELD] if cfg.repa_dim else [])]


def check_compatible(
    manifest: ShardSetManifest, cfg: DiTConfig, *, data_where: str, model_where: str, augment_p: float = 0.0
) -> None:
    """One-line DataMismatchError naming both sides when the shards cannot feed this model (trained with
    train.augment_p `augment_p`)."""
    fields = manifest.fields
    for name in training_fields(cfg, augment_p):
        if name not in fields:
            why = (
                f"train.augment_p={augment_p}; prepare with data.augment.copies >= 1"
                if name in AUGMENT_FIELDS
                else f"repa_dim={cfg.repa_dim}; prepare with expert.repa_dim set"
                if name == REPA_FIELD
                else f"conditioning={cfg.conditioning}"
            )
            raise DataMismatchError(f"{data_where}: has no {name!r} field, which {model_where} ({why}) needs")
    if augment_p and tuple(fields["aug_latents"]["shape"][1:]) != tuple(fields["latents"]["shape"]):
        raise DataMismatchError(
            f"{data_where}: aug_latents are {'x'.join(map(str, fields['aug_latents']['shape'][1:]))} but latents "
            f"{'x'.join(map(str, fields['latents']['shape']))}; prepare the run again"
        )
    if cfg.repa_dim and tuple(fields[REPA_FIELD]["shape"]) != (cfg.num_tokens, cfg.repa_dim):
        raise DataMismatchError(
            f"{data_where}: repa_tokens are {'x'.join(map(str, fields[REPA_FIELD]['shape']))} per item, but "
            f"{model_where} aligns {cfg.num_tokens} tokens with repa_dim {cfg.repa_dim}"
        )
    want = (cfg.in_channels, *cfg.input_size)
    have = tuple(fields["latents"]["shape"])
    if have != want:
        raise DataMismatchError(
            f"{data_where}: latents are {'x'.join(map(str, have))} but {model_where} "
            f"expects {'x'.join(map(str, want))} (in_channels x input_size)"
        )
    if "text_tokens" in model_fields(cfg):
        length, width = fields["text_tokens"]["shape"]
        if (length, width) != (cfg.text_len, cfg.text_dim):
            raise DataMismatchError(
                f"{data_where}: text tokens are {length}x{width} but {model_where} "
                f"expects {cfg.text_len}x{cfg.text_dim} (text_len x text_dim)"
            )
    if "text_pooled" in model_fields(cfg):
        (width,) = fields["text_pooled"]["shape"]
        if width != cfg.text_dim:
            raise DataMismatchError(
                f"{data_where}: pooled text width is {width} but {model_where} expects text_dim {cfg.text_dim}"
            )


class InMemoryData:
    """Fields of every item of a shard set (or several), indexable by item number."""

    def __init__(self, tensors: dict[str, torch.Tensor], captions: list[str], where: str):
        counts = {name: t.shape[0] for name, t in tensors.items()}
        if len(set(counts.values())) > 1:
            raise FlowfleetError(f"{where}: fields have different item counts {counts}")
        self.tensors = tensors
        self.captions = captions
        self.where = where

    @classmethod
    def load(cls, shards: ShardSet, fields: Iterable[str]) -> "InMemoryData":
        if not shards.exists():
            raise FlowfleetError(f"{shards.url}: no shard set (manifest.json missing)")
        tensors, captions = shards.load(list(fields), with_captions=True)
        data = cls(tensors, captions, shards.url)
        if len(data) == 0:
            raise FlowfleetError(f"{shards.url}: holds no items")
        return data

    def __len__(self) -> int:
        return next(iter(self.tensors.values())).shape[0]

    @classmethod
    def concat(cls, parts: list["InMemoryData"]) -> "InMemoryData":
        """The items of every part, in order (the parts hold the same fields)."""
        if len(parts) == 1:
            return parts[0]
        tensors = {name: torch.cat([p.tensors[name] for p in parts]) for name in parts[0].tensors}
        return cls(tensors, [c for p in parts for c in p.captions], " + ".join(p.where for p in parts))

    def select(self, keep: torch.Tensor) -> "InMemoryData":
        """Only the items where `keep` [N] bool is true (a copy; captions too)."""
        items = keep.nonzero(as_tuple=True)[0]
        captions = [self.captions[i] for i in items.tolist()] if self.captions else []
        return InMemoryData({name: t.index_select(0, items) for name, t in self.tensors.items()}, captions, self.where)

    def gather(self, items: torch.Tensor, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """The given items as a batch: float32 latents/text, bool mask, int64 labels, on `device`."""
        return {name: batch_field(name, t.index_select(0, items), device) for name, t in self.tensors.items()}


def batch_field(name: str, x: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """One field of a batch as the models read it: float32 (latents, text), bool (text_mask), int64 labels."""
    if name == "text_mask":
        x = x.bool()
    elif x.is_floating_point():
        x = x.float()
    return x.to(device, non_blocking=True)


class ResumableSampler:
    """Maps global sample numbers to item numbers: epoch-wise seeded permutations without replacement."""

    def __init__(self, num_items: int, seed: int):
        if num_items < 1:
            raise ValueError("cannot sample from an empty data set")
        self.num_items = num_items
        self.seed = seed
        self._perms: dict[int, torch.Tensor] = {}  # epoch -> its permutation, at most two

    def _permutation(self, epoch: int) -> torch.Tensor:
        # two cached: positions move forward, but a step's batches read ahead (train.prefetch) may lie in the next
        # epoch while the step's own lie in this one
        if epoch not in self._perms:
            gen = torch.Generator().manual_seed(derive_seed(self.seed, epoch))
            self._perms[epoch] = torch.randperm(self.num_items, generator=gen)
            while len(self._perms) > 2:  # (the one asked for stays)
                del self._perms[min(e for e in self._perms if e != epoch)]
        return self._perms[epoch]

    def take(self, position: int, count: int) -> torch.Tensor:
        """Item numbers of samples position .. position + count - 1 (crossing epochs as needed)."""
        out = []
        while count > 0:
            epoch, offset = divmod(position, self.num_items)
            n = min(count, self.num_items - offset)
            out.append(self._permutation(epoch)[offset : offset + n])
            position, count = position + n, count - n
        return torch.cat(out) if out else torch.empty(0, dtype=torch.long)
