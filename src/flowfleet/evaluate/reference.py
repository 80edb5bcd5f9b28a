"""The real images a generated set is scored against (the evaluate stage's reference): the run's prepared
items, which of them form the reference and which the real floor (ReferenceSplit), what identifies them in
cache files, and their images batch by batch."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Callable

import torch

from flowfleet.config import RunConfig, load_run_config
from flowfleet.data.shards import ShardSetUnion, open_complete
from flowfleet.errors import FlowfleetError, ParameterError
from flowfleet.layout import DATA, EVAL_DATA
from flowfleet.storage import RunRoot


def open_reference(reference: str) -> tuple[RunRoot, RunConfig, ShardSetUnion]:
    """The run's prepared items: data/, then the data of each addition (add-expert), in expert order."""
    root = RunRoot(reference)
    cfg = load_run_config(root)
    sets = [open_complete(root, DATA, f"flowfleet prepare {root.url}")]
    sets += [open_complete(root.origin(n), DATA, "flowfleet add-expert") for n in range(1, len(cfg.added) + 1)]
    return root, cfg, ShardSetUnion(sets)


VALIDATION, TEST = "validation", "test"  # the held-out splits: evaluate's choices, and the figures it reports
SPLIT_SEED = 0  # the draw of eval/'s items into the two splits: fixed, so that every evaluation of a run agrees
VALIDATION_SEED = 1_000_003  # added to an evaluation's seed for its validation draw: prompts and noise of its own


@dataclass(frozen=True)
class HeldOutSplits:
    """Which of eval/'s items form the validation split (what evaluate's choices read: the guidance scale) and
    which the test split (what its figures are computed on): a seeded draw of data.validation's share of them for
    validation, the rest for test, disjoint, each in eval/'s order. `shared`: data.validation is 0 or nothing is
    held out, so the choices and the figures read one set (runs prepared before the two splits existed)."""

    validation: torch.Tensor | None  # [v] eval/ item indices; None: the whole reference set (shared)
    test: torch.Tensor | None

    @classmethod
    def of(cls, cfg: RunConfig, count: int | None) -> "HeldOutSplits":
        """count: eval/'s items (None: the run holds none out)."""
        share = cfg.data.validation
        if not share or not count:
            return cls(None, None)
        size = round(share * count)
        if size < 2 or count - size < 2:
            raise FlowfleetError(
                f"data.validation: {share} of the {count} held-out items (data.holdout) leaves a split of fewer "
                "than 2 items"
            )
        order = torch.randperm(count, generator=torch.Generator().manual_seed(SPLIT_SEED))
        return cls(order[:size].sort().values, order[size:].sort().values)

    @property
    def shared(self) -> bool:
        return self.validation is None

    def items(self, split: str) -> torch.Tensor | None:
        """The reference set's items of `split` (VALIDATION or TEST); None: all of them."""
        if split not in (VALIDATION, TEST):
            raise ValueError(f"split: expected {VALIDATION!r} or {TEST!r}, got {split!r}")
        return self.validation if split == VALIDATION else self.test


def held_out_data(root: RunRoot, cfg: RunConfig) -> ShardSetUnion | None:
    """eval/: the items prepare held out of training (data.holdout), or None when the run has none."""
    if not cfg.data.holdout:
        return None
    return ShardSetUnion([open_complete(root, EVAL_DATA, f"flowfleet prepare {root.url}")])


@dataclass(frozen=True)
class ReferenceSplit:
    """Which real items a generated set of n is compared with: `reference` (FID, classifier FD, precision
    and recall) and, disjoint from it, `floor` — n real items scored exactly like a model, the distance a
    perfect model would still show at this n. Both are drawn (seeded) from eval/ when the run holds items
    out of training, else from data/ (then the reference includes training items: `held_out` False); `pool`: only
    from these items of it (one of HeldOutSplits)."""

    held_out: bool
    floor: torch.Tensor  # [floor_n] item indices of the reference set
    reference: torch.Tensor  # [ref_n]

    @classmethod
    def draw(
        cls, count: int, n: int, ref_n: int | None, seed: int, held_out: bool, pool: torch.Tensor | None = None
    ) -> "ReferenceSplit":
        where = "eval/ (the held-out items)" if held_out else "data/"
        if pool is not None:
            where, count = f"the {int(pool.numel())} items of its split in eval/", int(pool.numel())
        if ref_n is None:  # the floor set first (n items, at most half), the rest is the reference
            floor_n = min(n, count // 2)
            ref_n = min(count - floor_n, 10_000)
        elif ref_n > count:
            raise ParameterError("ref_n", f"{ref_n} reference images requested, {where} holds {count}")
        else:  # a reference size asked for: the floor gets what is left (none under 2 items)
            floor_n = min(n, count - ref_n)
            floor_n = floor_n if floor_n >= 2 else 0
        order = torch.randperm(count, generator=torch.Generator().manual_seed(seed))
        if pool is not None:
            order = pool[order]
        return cls(held_out, order[:floor_n], order[floor_n : floor_n + ref_n])

    def key(self, data_key: str) -> str:
        """Names this choice of reference items in cache files."""
        picked = hashlib.sha256(self.reference.numpy().tobytes()).hexdigest()[:8]
        return f"{data_key}-{picked}"


def data_fingerprint(data: ShardSetUnion) -> str:
    """What identifies the reference data: each part's source fingerprint recorded by prepare, and item count."""
    records = [
        {"count": m.count, "source": m.extra.get("source"), "encoders": m.extra.get("encoders")}
        for m in data.manifests()
    ]
    record = records[0] if len(records) == 1 else records  # (the same key as before additions existed)
    return hashlib.sha256(json.dumps(record, sort_keys=True, default=str).encode()).hexdigest()[:16]


def semantic_is_fid_extractor(cfg: RunConfig, fid_key: str) -> bool:
    """True when the run's clustering encoder is the FID extractor: fid-helper's default_1 Inception at the
    FID's input size (so an image's clustering features are its FID features)."""
    sem = cfg.encoders.semantic
    return sem.name == "inception" and not sem.path and fid_key == f"default_1-{sem.image_size or 299}"


def features_are_fid_features(cfg: RunConfig, fid_key: str) -> bool:
    """True when data/'s clustering features are the FID features of its images: the clustering encoder is
    the FID extractor and prepare ran it on the same uint8 images (pixel space; a VAE's decoded images
    differ from the source images, so latent runs always re-extract)."""
    return cfg.encoders.latent.name == "pixels" and semantic_is_fid_extractor(cfg, fid_key)


def reference_images(
    root: RunRoot,
    cfg: RunConfig,
    latents: torch.Tensor,
    order: torch.Tensor,
    n: int,
    batch: int,
    device: torch.device,
    images: torch.Tensor | None = None,
) -> Callable[[], Any]:
    """A generator factory of n data images (in `order`), batch by batch: `images` (uint8, what prepare kept
    of eval/ in a latent space) as they are, else the latents decoded (pixel space: the images themselves)."""
    from flowfleet.data.encoders import run_latent_encoder

    def batches():
        if images is not None:
            for i in range(0, n, batch):
                yield images[order[i : min(i + batch, n)]].float() / 127.5 - 1.0
            return
        decoder = run_latent_encoder(root, cfg, device)
        for i in range(0, n, batch):
            yield decoder.decode(latents[order[i : min(i + batch, n)]]).cpu()

    return batches
