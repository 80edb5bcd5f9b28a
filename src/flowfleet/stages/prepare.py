"""Stage `prepare`: stream the source through the three encoders into RUN_ROOT/data/ (a ShardSet), and
its last `data.holdout` items into RUN_ROOT/eval/: the held-out evaluation set no training job reads.

paris §2.1 steps (i)-(ii): latents for the denoisers, semantic features for clustering, text embeddings for
conditioning, all computed once. Items are read in order, decoded, encoded in batches of data.batch_size and written
in shards of data.shard_size items; each shard records where in the source it ends (`source_end`), so an interrupted
run restarts after the last shard that the manifest names. A run whose manifest was made from another source or
other encoders is never silently mixed: it is refused unless `restart` discards it.

Bad input never stops the run: an unreadable image is skipped and listed (key + reason) in the
manifest, a missing caption becomes "" and is counted. A missing or empty source is one error line.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm

from flowfleet.config import AugmentConfig, RunConfig, load_run_config
from flowfleet.data.augment import draw_params, transform
from flowfleet.data.autoencoder import save_autoencoder, train_autoencoder
from flowfleet.data.decoding import MAX_LISTED, BadInput, decode_items
from flowfleet.data.encoders import (
    LatentEncoder,
    SemanticEncoder,
    TextEncoder,
    build_latent_encoder,
    build_semantic_encoder,
    build_text_encoder,
    encode_meaning,
    run_latent_encoder,
)
from flowfleet.data.images import to_uint8
from flowfleet.data.shards import ShardSet, ShardSetManifest
from flowfleet.data.sources import Source, build_source
from flowfleet.data.sources.mnist import switch_hint
from flowfleet.device import resolve_device
from flowfleet.errors import FlowfleetError, ParameterError
from flowfleet.layout import AUTOENCODER, AUTOENCODER_RECIPE, DATA, EVAL_DATA, MANIFEST, NOTICE, data_part
from flowfleet.sampling.views import image_grid, png_bytes
from flowfleet.stages.prepare_beside import EncodersBeside, Found, Span
from flowfleet.storage import RunRoot
from flowfleet.threads import CpuTopology, MachineLoad, loops_follow_load, read_quota, usable_cpus

log = logging.getLogger(__name__)

PREVIEW = "preview.png"  # data/preview.png
# The shortest autoencoder training beside which the semantic and text encoders run in a process of their own (its
# start costs a few seconds of imports; the demos train 1600 or 2400 steps, their quick runs a quarter)
BESIDE_MIN_STEPS = 100


@dataclass
class Encoders:
    latent: LatentEncoder
    semantic: SemanticEncoder
    text: TextEncoder | None

    def describe(self) -> dict[str, Any]:
        return {
            "latent": self.latent.describe(),
            "semantic": self.semantic.describe(),
            "text": self.text.describe() if self.text else None,
        }


def build_encoders(cfg: RunConfig, device: torch.device | str = "cpu", root: RunRoot | None = None) -> Encoders:
    """The run's encoders, checked against what run.yaml promises the models (text width). `root`: the run,
    whose autoencoder/ a run-trained latent space loads from."""
    weights = root.url_of(AUTOENCODER) if root is not None else None
    enc = Encoders(
        build_latent_encoder(cfg.encoders.latent, cfg.data.channels, device, weights),
        build_semantic_encoder(cfg.encoders.semantic, device, cfg.repa_grid),
        build_text_encoder(cfg.encoders.text, device),
    )
    if enc.text is not None and enc.text.width != cfg.encoders.text.width:
        raise FlowfleetError(
            f"encoders.text.path: the {cfg.encoders.text.name} model gives {enc.text.width}-d "
            f"tokens, run.yaml expects {cfg.encoders.text.width}"
        )
    return enc


@dataclass
class _Rows:
    """Encoded items waiting to fill a shard."""

    tensors: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    captions: list[str] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)  # source position after each item

    def __len__(self) -> int:
        return len(self.captions)

    def add(self, tensors: dict[str, torch.Tensor], captions: list[str], ends: list[int]) -> None:
        for k, v in tensors.items():
            self.tensors.setdefault(k, []).append(v)
        self.captions += captions
        self.ends += ends

    def take(self, n: int) -> tuple[dict[str, torch.Tensor], list[str], list[int]]:
        """The first n rows (removed from the buffer) and the source position after each of them."""
        cat = {k: torch.cat(v) for k, v in self.tensors.items()}
        head = {k: v[:n] for k, v in cat.items()}
        self.tensors = {k: [v[n:]] for k, v in cat.items()}
        captions, self.captions = self.captions[:n], self.captions[n:]
        ends, self.ends = self.ends[:n], self.ends[n:]
        return head, captions, ends


def encode_batch(
    enc: Encoders,
    images: torch.Tensor,
    captions: list[str],
    labels: list[int],
    keep_images: bool = False,
    known: dict[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """One batch through the encoders, as the shard fields (CPU tensors in the shard dtypes). keep_images:
    also the images themselves as uint8 (eval/ of a latent-space run: the reference stays real images, not
    the latent decoder's reconstructions). known: the batch's encode_meaning fields, encoded already (beside the
    autoencoder's training: flowfleet.stages.prepare_beside)."""
    out = {
        "latents": enc.latent.encode(images).float().cpu(),  # [b, c, h, w]
        "labels": torch.tensor(labels, dtype=torch.int64),  # [b]
    }
    out.update(known if known is not None else encode_meaning(enc.semantic, enc.text, images, captions))
    if keep_images:
        out["images"] = to_uint8(images).cpu()  # [b, C, S, S]
    return out


def encode_copies(enc: Encoders, images: torch.Tensor, positions: list[int], augment: AugmentConfig):
    """data.augment's copies of one batch (images [b, C, S, S], the source position of each) as the shard
    fields aug_latents [b, A, c, h, w] and aug_params [b, A, AUGMENT_DIM] (flowfleet.data.augment)."""
    params = draw_params(positions, augment.copies, augment.seed)  # [b, A, P]
    latents = [
        enc.latent.encode(transform(images, params[:, a], augment.shift, augment.rotate, augment.scale)).float().cpu()
        for a in range(augment.copies)
    ]
    return {"aug_latents": torch.stack(latents, 1), "aug_params": params}


# How the autoencoder's loop uses the CPU's threads is not what it was trained on: a run prepared before the setting
# existed, or under the other one, keeps its prepared bytes
NOT_RECIPE: dict[str, Any] = {"latent": {"autoencoder": {"follow_load"}}}


def _recipe(cfg: RunConfig, source: Source) -> dict[str, Any]:
    """Everything that decides the prepared bytes; a manifest with another recipe is not resumed."""
    d = cfg.data
    return {
        "source": source.fingerprint(),
        "image_size": d.image_size,
        "channels": d.channels,
        "limit": d.limit,
        **({"holdout": d.holdout} if d.holdout else {}),  # (absent: runs prepared before it existed)
        **({"labels": d.labels} if d.labels is not None else {}),  # (absent: runs prepared before it existed)
        "encoders": cfg.encoders.model_dump(mode="json", exclude=NOT_RECIPE),
        **({"augment": d.augment.model_dump(mode="json")} if d.augment.copies else {}),
        **({"repa_grid": list(cfg.repa_grid)} if cfg.repa_grid else {}),  # REPA's tokens (expert.repa_dim)
    }


def _first_difference(a: dict[str, Any], b: dict[str, Any], prefix: str = "") -> str:
    for k in sorted(set(a) | set(b)):
        if a.get(k) != b.get(k):
            if isinstance(a.get(k), dict) and isinstance(b.get(k), dict):
                return _first_difference(a[k], b[k], f"{prefix}{k}.")
            return f"{prefix}{k}"
    return ""


def parse_part(text: str) -> tuple[int, int]:
    """'i/N' (0 <= i < N) -> (i, N); a one-line error otherwise."""
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise ParameterError("part", f"expected i/N (e.g. 0/3), got {text!r}") from None
    if not (n >= 1 and 0 <= i < n):
        raise ParameterError("part", f"{text}: expected 0 <= i < N")
    return i, n


def part_range(total: int, i: int, n: int, batch_size: int) -> tuple[int, int]:
    """Source positions [start, stop) of part i of n: contiguous slices cut at multiples of the encoding
    batch, so that each batch holds the items it holds in a one-machine prepare."""
    batches = -(-total // batch_size)
    per = -(-batches // n)
    return min(i * per * batch_size, total), min((i + 1) * per * batch_size, total)


def prepare(
    run_root: str | RunRoot,
    *,
    device: str | None = None,
    restart: bool = False,
    progress: bool = True,
    part: tuple[int, int] | None = None,
    beside: bool | None = None,
) -> ShardSetManifest:
    """Encode the run's source into RUN_ROOT/data/ (and its held-out items into eval/ when data.holdout is
    set); resumes an interrupted run. Returns data/'s manifest.

    beside: where the run's autoencoder trains first, run the semantic and text encoders beside it in a process of
    their own (flowfleet.stages.prepare_beside); None: on a CPU of two or more cores, for BESIDE_MIN_STEPS or more.

    part=(i, N): encode only slice i of N of the training items into data-parts/<i>-of-<N>/ (resumable the
    same way), for N machines or jobs; `merge_parts(run_root, N)` then writes data/ (and eval/) from them."""
    root = run_root if isinstance(run_root, RunRoot) else RunRoot(run_root)
    cfg = load_run_config(root)
    source = build_source(cfg.data, cfg.storage.options)
    recipe = _recipe(cfg, source)
    split = _Split.of(cfg, source)
    encoders = _LazyEncoders(
        root, cfg, source, split, device, restart=restart, progress=progress, part=part, beside=beside
    )
    if part is None:
        manifest = _Encoding(
            root, cfg, source, recipe, encoders, DATA, 0, split.train_stop, None, restart, progress
        ).run()
        split.encode_eval(root, cfg, source, recipe, encoders, restart, progress)
        _write_notice(root, source)
        return manifest
    if split.size is None:
        raise ParameterError(
            "part", f"data.source {cfg.data.source} has no known length to split; prepare it on one machine"
        )
    part_start, stop = part_range(split.train_stop or split.size, part[0], part[1], cfg.data.batch_size)
    recipe = {**recipe, "part": [part[0], part[1], part_start, stop]}
    folder = data_part(*part)
    return _Encoding(root, cfg, source, recipe, encoders, folder, part_start, stop, part, restart, progress).run()


@dataclass(frozen=True)
class _Split:
    """Source positions: training items [0, train_stop), held-out evaluation items [train_stop, size)."""

    size: int | None  # items within data.limit; None: unknown (tar streams)
    train_stop: int | None  # None: to the end of the source

    @classmethod
    def of(cls, cfg: RunConfig, source: Source) -> "_Split":
        d = cfg.data
        size = source.length()
        if d.limit is not None:
            size = min(size, d.limit) if size is not None else d.limit
        if not d.holdout:
            return cls(size, size)
        if size is None:
            raise FlowfleetError(
                f"data.holdout: data.source {d.source} has no known length; give data.limit to hold out its last items"
            )
        if d.holdout >= size:
            raise FlowfleetError(f"data.holdout: {d.holdout} held-out items leave none of the {size} to train on")
        return cls(size, size - d.holdout)

    @property
    def eval_span(self) -> tuple[int, int] | None:
        """Source positions [train_stop, size) of the held-out items; None without data.holdout."""
        if self.size is None or self.train_stop is None or self.train_stop >= self.size:
            return None
        return self.train_stop, self.size

    def encode_eval(self, root, cfg, source, recipe, encoders, restart: bool, progress: bool) -> None:
        """eval/: the held-out items, prepared like data/ (no training job reads them)."""
        if self.eval_span is not None:
            recipe = {**{k: v for k, v in recipe.items() if k != "augment"}, "split": "eval"}  # (no copies)
            eval_items = (EVAL_DATA, *self.eval_span)
            _Encoding(root, cfg, source, recipe, encoders, *eval_items, restart=restart, progress=progress).run()


class _LazyEncoders:
    """The run's encoders, built on first use (a complete data/ and eval/ need none); a run-trained
    latent space is trained first when RUN_ROOT/autoencoder/ does not hold it yet, on a CPU with the semantic and
    text encoders beside it (flowfleet.stages.prepare_beside: `found`, what they finished)."""

    def __init__(self, root: RunRoot, cfg: RunConfig, source: Source, split: "_Split", device: str | None, **kw):
        self.root, self.cfg, self.source, self.split, self.device = root, cfg, source, split, device
        self.beside: bool | None = kw.pop("beside", None)  # None: where it pays (BESIDE_MIN_STEPS, two CPUs)
        self.train_kw = kw  # restart, progress, part
        self._built: Encoders | None = None
        self.found: Found | None = None

    def get(self) -> Encoders:
        if self._built is None:
            if self.cfg.encoders.latent.name == "autoencoder":
                beside = self._start_beside()
                # beside the encoders' process, a fixed-count loop leaves it its threads (the same count whatever the
                # load: a repeatable run); a loop that follows the load gives them up by itself
                threads = beside.training_threads if beside is not None else None
                try:
                    ensure_autoencoder(self.root, self.cfg, self.source, self.split, threads=threads, **self.train_kw)
                finally:
                    if beside is not None:
                        self.found = beside.finish()
                        log.info(
                            "prepare: %d items' features and captions encoded beside the autoencoder", len(self.found)
                        )
            self._built = build_encoders(self.cfg, resolve_device(self.device), self.root)
        return self._built

    def _start_beside(self) -> EncodersBeside | None:
        """The encoders' process beside an autoencoder about to train here, on a CPU of two or more cores, for a
        training long enough to repay the process's start (a few seconds of imports)."""
        trained = self.root.exists(AUTOENCODER, AUTOENCODER_RECIPE) and not self.train_kw.get("restart")
        if trained or self.train_kw.get("part") is not None or self.beside is False:
            return None
        usable = usable_cpus(CpuTopology.read(), MachineLoad(quota=read_quota()))
        if self.beside is None and (
            usable < 2
            or self.cfg.encoders.latent.autoencoder.steps < BESIDE_MIN_STEPS
            or resolve_device(self.device).type != "cpu"
            # a loop that follows the load where the policy reads none would keep every thread beside the process
            or (self.cfg.encoders.latent.autoencoder.follow_load and not loops_follow_load(os.environ))
        ):
            return None
        spans: list[Span] = [(0, self.split.train_stop)]
        if self.split.eval_span is not None:
            spans.append(self.split.eval_span)  # eval/'s items
        return EncodersBeside.start(self.root.url_of(), spans, max(1, usable // 2), usable)


def _autoencoder_recipe(cfg: RunConfig, source: Source, split: "_Split") -> dict[str, Any]:
    return {
        "source": source.fingerprint(),
        "image_size": cfg.data.image_size,
        "channels": cfg.data.channels,
        "labels": cfg.data.labels,
        "train_stop": split.train_stop,
        "autoencoder": cfg.encoders.latent.autoencoder.model_dump(
            mode="json", exclude=NOT_RECIPE["latent"]["autoencoder"]
        ),
    }


KIT_LATENT = "kit"  # recipe.json of a latent space copied from a kit: {"kit": its fingerprint}


def ensure_autoencoder(
    root: RunRoot,
    cfg: RunConfig,
    source: Source,
    split: "_Split",
    *,
    restart: bool = False,
    progress: bool = True,
    part: tuple[int, int] | None = None,
    threads: int | None = None,
) -> None:
    """RUN_ROOT/autoencoder/: the run's latent space, trained on the first `train_items` training images
    (never eval/'s) unless it is there with this recipe, or came from a kit (then it is the fleet's). Written
    atomically (weights, then config, then recipe.json): an interrupted training starts over (it takes minutes,
    not hours). `threads`: its CPU loop's fixed thread count (None: the process's on an idle machine)."""
    ae = cfg.encoders.latent.autoencoder
    recipe = _autoencoder_recipe(cfg, source, split)
    where = root.url_of(AUTOENCODER)
    if root.exists(AUTOENCODER, AUTOENCODER_RECIPE):
        if restart and part is None:  # a part's restart is its slice's: the N parts share this latent space
            root.remove(AUTOENCODER, recursive=True)
        else:
            old = json.loads(root.read_bytes(AUTOENCODER, AUTOENCODER_RECIPE))
            if KIT_LATENT in old:  # a kit's latent space (flowfleet contribute): the fleet's, frozen
                return
            if old != recipe:
                diff = switch_hint(old.get("source") or {}, recipe["source"]) or (
                    f"trained with a different {_first_difference(old, recipe) or 'recipe'}"
                )
                raise FlowfleetError(f"{where}: {diff}; `flowfleet prepare {root.url} --restart` retrains it")
            return
    if part is not None:  # N machines must share one latent space: train it once, before the parts
        raise FlowfleetError(
            f"{where}: missing; train the run's autoencoder once first (`flowfleet prepare {root.url} "
            "--autoencoder-only`), then run the parts"
        )
    images = autoencoder_images(cfg, source, split)
    vae = train_autoencoder(images, ae, progress=progress, threads=threads)
    save_autoencoder(vae, root, AUTOENCODER)
    root.write_json(recipe, AUTOENCODER, AUTOENCODER_RECIPE)


def autoencoder_images(cfg: RunConfig, source: Source, split: "_Split") -> torch.Tensor:
    """The images the run's autoencoder trains on, [N, C, S, S] in [-1, 1]: the first `train_items` training items
    (never eval/'s) that decode; none is a one-line error."""
    ae, d = cfg.encoders.latent.autoencoder, cfg.data
    stop = min(split.train_stop, ae.train_items) if split.train_stop is not None else ae.train_items
    bad = BadInput([], 0, 0)
    items = itertools.islice(source.items(0), stop)
    images = [image for _, image, _, _ in decode_items(items, 0, d.image_size, d.channels, bad, d.labels)]
    if not images:
        raise FlowfleetError(f"data.source: {d.source} {d.path or ''} gave no usable image to train the autoencoder")
    log.info("autoencoder: training on %d images (%d skipped)", len(images), len(bad.skipped_pos))
    return torch.stack(images)


def prepare_autoencoder(run_root: str | RunRoot, *, restart: bool = False, progress: bool = True) -> str:
    """Only train (or check) the run's autoencoder: the step before `prepare --part i/N` on N machines."""
    root = run_root if isinstance(run_root, RunRoot) else RunRoot(run_root)
    cfg = load_run_config(root)
    if cfg.encoders.latent.name != "autoencoder":
        name = cfg.encoders.latent.name
        raise ParameterError("autoencoder_only", f"encoders.latent.name is {name!r}, not 'autoencoder'")
    source = build_source(cfg.data, cfg.storage.options)
    ensure_autoencoder(root, cfg, source, _Split.of(cfg, source), restart=restart, progress=progress)
    return root.url_of(AUTOENCODER)


@dataclass
class _Encoding:
    """One shard set to write: source positions [first, stop) through the run's encoders into `folder` (data/,
    eval/ or a part of data/), resumed after its last shard."""

    root: RunRoot
    cfg: RunConfig
    source: Source
    recipe: dict[str, Any]
    encoders: _LazyEncoders
    folder: str
    first: int
    stop: int | None
    part: tuple[int, int] | None = None  # prepare --part i/N
    restart: bool = False
    progress: bool = True

    def run(self) -> ShardSetManifest:
        shards = ShardSet(self.root, self.folder)
        manifest = self._resumed(shards)
        if manifest.complete:
            return manifest
        start = manifest.shards[-1]["source_end"] if manifest.shards else self.first
        bad = self._bad_input(manifest, start)
        enc = self.encoders.get()
        d = self.cfg.data
        manifest.extra.update(
            recipe=self.recipe,
            source=self.recipe["source"],
            encoders=enc.describe(),
            has_labels=self.source.has_labels,
            label_names=list(self.source.label_names) if self.source.label_names else None,
            image_size=d.image_size,
            channels=d.channels,
        )
        t0 = time.perf_counter()
        self._encode_items(shards, manifest, enc, bad, start)
        return self._finish(shards, manifest, enc, bad, time.perf_counter() - t0)

    def _resumed(self, shards: ShardSet) -> ShardSetManifest:
        """The shard set's manifest to continue (complete: nothing to do), or a new one; another recipe's is
        refused unless `restart` discards it."""
        if not shards.exists():
            return ShardSetManifest()
        old = shards.manifest()
        if self.restart:
            self.root.remove(self.folder, recursive=True)
            return ShardSetManifest()
        if old.extra.get("recipe") != self.recipe:
            made = old.extra.get("recipe") or {}
            diff = switch_hint(made.get("source") or {}, self.recipe["source"]) or (
                f"prepared with a different {_first_difference(made, self.recipe) or 'recipe'}"
            )
            raise FlowfleetError(
                f"{self.root.url_of(self.folder, MANIFEST)}: {diff}; `flowfleet prepare {self.root.url} --restart` "
                "discards it"
            )  # (a part's recipe names its slice: another --part i/N is another folder)
        return old

    def _bad_input(self, manifest: ShardSetManifest, start: int) -> BadInput:
        """The skipped items and missing captions the manifest records before source position `start`."""
        bad = BadInput(
            [s for s in manifest.extra.get("skipped", []) if s["pos"] < start],
            int(manifest.extra.get("skipped_count", 0)),
            int(manifest.extra.get("missing_captions", 0)),
        )
        if self.part is not None:  # a part keeps every position (merge counts them per shard of data/)
            bad.skipped_before = bad.missing_before = 0
            bad.skipped_pos = [p for p in manifest.extra.get("skipped_pos", []) if p < start]
            bad.missing_pos = [p for p in manifest.extra.get("missing_pos", []) if p < start]
        return bad

    def _encode_items(
        self, shards: ShardSet, manifest: ShardSetManifest, enc: Encoders, bad: BadInput, start: int
    ) -> None:
        """Decode, encode in batches of data.batch_size and write shards of data.shard_size, from `start` on."""
        d, stop = self.cfg.data, self.stop
        keep_images = self.folder == EVAL_DATA and self.cfg.encoders.latent.name != "pixels"
        augment = d.augment if d.augment.copies and self.folder != EVAL_DATA else None  # training items only
        items = self.source.items(start)
        if stop is not None:
            items = itertools.islice(items, max(stop - start, 0))

        def write(rows: _Rows, n: int) -> None:
            tensors, captions, ends = rows.take(n)
            if self.part is None:
                tensors["index"] = torch.arange(manifest.count, manifest.count + n, dtype=torch.int64)
                manifest.extra.update(bad.record(ends[-1]))
            else:  # a part: where each row ends in the source, for --merge to cut data/'s shards
                tensors["source_end"] = torch.tensor(ends, dtype=torch.int64)
                manifest.extra.update(bad.positions())
            shards.append(manifest, tensors, captions, {"source_end": ends[-1]})  # the shard, then the manifest

        rows = _Rows()
        batch: list[tuple[int, torch.Tensor, str, int]] = []
        desc = "prepare" if self.folder == DATA else f"prepare {self.folder}"
        bar = tqdm(total=stop, initial=start, unit="img", desc=desc, disable=not self.progress, dynamic_ncols=True)
        last_pos = start
        checked_shape = False
        for entry in decode_items(items, start, d.image_size, d.channels, bad, d.labels):
            batch.append(entry)
            if len(batch) == d.batch_size:  # (the encoders' large operations keep every thread: flowfleet.threads)
                checked_shape = _encode_into(
                    rows, enc, batch, self.cfg, checked_shape, keep_images, augment, self.encoders.found
                )
                batch = []
                while len(rows) >= d.shard_size:
                    write(rows, d.shard_size)
            bar.update(entry[0] - last_pos)
            last_pos = entry[0]
            bar.set_postfix(skipped=bad.skipped_before + len(bad.skipped_pos), refresh=False)
        if batch:
            _encode_into(rows, enc, batch, self.cfg, checked_shape, keep_images, augment, self.encoders.found)
        while len(rows):
            write(rows, min(d.shard_size, len(rows)))
        bar.close()

    def _finish(
        self, shards: ShardSet, manifest: ShardSetManifest, enc: Encoders, bad: BadInput, seconds: float
    ) -> ShardSetManifest:
        """The manifest marked complete, with what was skipped; data/ and eval/ also get their preview. A set with
        no usable item is an error naming the first skipped one."""
        if self.part is not None:
            manifest.extra.update(bad.positions(), seconds=round(seconds, 2))
            manifest.complete = True
            shards.write_manifest(manifest)
            return manifest
        record = bad.record()
        if manifest.count == 0:
            d = self.cfg.data
            listed = record["skipped"]
            first_bad = f" (first: {listed[0]['key']}: {listed[0]['reason']})" if listed else ""
            which = "" if self.folder == DATA else f" (for {self.folder}/, the held-out items)"
            raise FlowfleetError(
                f"data.source: {d.source} {d.path or ''} gave no usable item{which}; "
                f"{record['skipped_count']} skipped{first_bad}".replace("  ", " ")
            )
        manifest.extra.update(record, seconds=round(seconds, 2))
        manifest.complete = True
        shards.write_manifest(manifest)
        write_preview(shards, enc.latent)
        return manifest


def merge_parts(run_root: str | RunRoot, n: int, *, progress: bool = True) -> ShardSetManifest:
    """data/ from the N parts of `prepare --part i/N`: their rows in source order, cut into shards of
    data.shard_size with the global index and the bad-input records a one-machine prepare writes, so the
    shards are byte for byte the same. Every part must be complete and made with this run's recipe.
    Rewrites data/ shard by shard (each atomic; the manifest is complete only at the end); merging
    again after an interruption starts over, which costs no encoding."""
    root = run_root if isinstance(run_root, RunRoot) else RunRoot(run_root)
    cfg = load_run_config(root)
    d = cfg.data
    source = build_source(d, cfg.storage.options)
    recipe = _recipe(cfg, source)
    parts = []
    for i in range(n):
        sset = ShardSet(root, data_part(i, n))
        where = root.url_of(data_part(i, n), MANIFEST)
        if not sset.exists() or not sset.manifest().complete:
            raise FlowfleetError(f"{where}: missing or incomplete; run `flowfleet prepare {root.url} --part {i}/{n}`")
        m = sset.manifest()
        made = {k: v for k, v in (m.extra.get("recipe") or {}).items() if k != "part"}
        if made != recipe:
            diff = _first_difference(made, recipe) or "recipe"
            raise FlowfleetError(f"{where}: prepared with a different {diff} than run.yaml says")
        parts.append((sset, m))
    bad = BadInput([], 0, 0)
    for _, m in parts:
        bad.listed += m.extra.get("skipped", [])
        bad.skipped_pos += m.extra.get("skipped_pos", [])
        bad.missing_pos += m.extra.get("missing_pos", [])
    bad.listed = bad.listed[:MAX_LISTED]

    root.remove(DATA, recursive=True)
    shards = ShardSet(root, DATA)
    first = parts[0][1]
    manifest = ShardSetManifest(
        extra={
            k: first.extra.get(k) for k in ("source", "encoders", "has_labels", "label_names", "image_size", "channels")
        }
    )
    manifest.extra["recipe"] = recipe
    t0 = time.perf_counter()
    rows = _Rows()

    def write(count: int) -> None:
        tensors, captions, ends = rows.take(count)
        tensors["index"] = torch.arange(manifest.count, manifest.count + count, dtype=torch.int64)
        manifest.extra.update(bad.record(ends[-1]))
        shards.append(manifest, tensors, captions, {"source_end": ends[-1]})

    total = sum(m.count for _, m in parts)
    with tqdm(total=total, unit="item", desc="prepare --merge", disable=not progress) as bar:
        for sset, m in parts:
            for entry in m.shards:
                tensors, captions = sset.read_shard(entry["name"])
                ends = tensors.pop("source_end").tolist()
                rows.add(tensors, captions, ends)
                while len(rows) >= d.shard_size:
                    write(d.shard_size)
                bar.update(len(captions))
        while len(rows):
            write(min(d.shard_size, len(rows)))
    if manifest.count == 0:
        raise FlowfleetError(f"data.source: the {n} parts hold no usable item")
    manifest.extra.update(bad.record(), seconds=round(time.perf_counter() - t0, 2), merged_parts=n)
    manifest.complete = True
    shards.write_manifest(manifest)
    write_preview(shards, run_latent_encoder(root, cfg))
    split = _Split.of(cfg, source)
    split.encode_eval(root, cfg, source, recipe, _LazyEncoders(root, cfg, source, split, None), False, progress)
    _write_notice(root, source)
    return manifest


def _write_notice(root: RunRoot, source: Source) -> None:
    """The source's licences and attribution into data/NOTICE.md, where it asks for them: they travel with the run
    whether data/ was prepared whole or merged from parts."""
    notice = source.notice()
    if notice is not None:
        root.write_bytes(notice.encode(), DATA, NOTICE)


def _encode_into(
    rows: _Rows,
    enc: Encoders,
    batch: list,
    cfg: RunConfig,
    checked_shape: bool,
    keep_images: bool = False,
    augment: AugmentConfig | None = None,
    found: Found | None = None,
) -> bool:
    ends, images, captions, labels = zip(*batch)
    known = found.take(list(ends)) if found is not None else None
    tensors = encode_batch(enc, torch.stack(images), list(captions), list(labels), keep_images, known)
    if augment is not None:
        tensors.update(encode_copies(enc, torch.stack(images), [end - 1 for end in ends], augment))
    if not checked_shape and tuple(tensors["latents"].shape[1:]) != cfg.latent_shape:
        raise FlowfleetError(
            f"encoders.latent: {cfg.encoders.latent.name} gives latents of shape "
            f"{tuple(tensors['latents'].shape[1:])}, run.yaml expects {cfg.latent_shape}"
        )
    rows.add(tensors, list(captions), list(ends))
    return True


def write_preview(shards: ShardSet, latent: LatentEncoder, n: int = 64) -> None:
    """data/preview.png: the first n prepared items decoded back to images (what the experts will see)."""
    first = shards.manifest().shards[0]["name"]
    tensors, _ = shards.read_shard(first)
    images = latent.decode(tensors["latents"][:n]).cpu()  # [n, C, H, W]
    shards.root.write_bytes(png_bytes(image_grid(images)), shards.folder, PREVIEW)
