"""Sources of image files: a folder of images with captions, and tar shards in the webdataset layout."""

from __future__ import annotations

import csv
import io
import json
import posixpath
import tarfile
from typing import Any, Iterator

from flowfleet.data.images import IMAGE_EXTENSIONS
from flowfleet.data.sources.base import RawItem, Source, SourceError, content_digest, open_fs

CAPTION_FILES = ("captions.jsonl", "captions.csv")


def _is_image(name: str) -> bool:
    return posixpath.splitext(name)[1].lower() in IMAGE_EXTENSIONS


def _caption_table(
    rows: list[dict[str, Any]], where: str, image_column: str, text_column: str
) -> tuple[dict[str, tuple[str | None, int]], tuple[str, ...] | None]:
    """{relative file: (caption, label)} from captions.jsonl / captions.csv rows, and the label names when the
    labels are names ("Flags", "cat"): label i is the i-th name in sorted order. Labels are integers or names,
    not both."""
    files, texts, labels = [], [], []
    for n, row in enumerate(rows, 1):
        file = next((row[c] for c in (image_column, "file", "image", "path") if row.get(c)), None)
        if not isinstance(file, str):
            raise SourceError(f"{where}: row {n} has no file name (column 'file' or {image_column!r})")
        text = next((row[c] for c in (text_column, "caption", "text") if c in row), None)
        files.append(file.removeprefix("./"))
        texts.append(None if text is None else str(text))
        labels.append(row.get("label"))
    given = [(n, lab) for n, lab in enumerate(labels, 1) if lab not in (None, "")]
    numbers = [
        n for n, lab in given if isinstance(lab, int) or (isinstance(lab, str) and lab.strip().lstrip("-").isdigit())
    ]
    names: tuple[str, ...] | None = None
    if numbers and len(numbers) < len(given):  # some integers, some names: say where the first name is
        n, lab = next((n, lab) for n, lab in given if n not in set(numbers))
        raise SourceError(f"{where}: row {n}: label {lab!r} is a name where other rows give integers")
    if given and not numbers:
        names = tuple(sorted({str(lab) for _, lab in given}))
        index = {name: i for i, name in enumerate(names)}
        ids = [index[str(lab)] if lab not in (None, "") else -1 for lab in labels]
    else:
        ids = [int(lab) if lab not in (None, "") else -1 for lab in labels]
    return {f: (t, i) for f, t, i in zip(files, texts, ids)}, names


class FolderSource(Source):
    """Images under a folder (recursively, sorted by path) with captions beside them or in a table."""

    kind = "folder"

    def __init__(self, path: str, image_column: str = "image", text_column: str = "text") -> None:
        self.path = path
        self.fs, root = open_fs(path)
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
                self.table, self.label_names = _caption_table(
                    self._read_table(name), f"{path}/{name}", image_column, text_column
                )
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
            "digest": content_digest([f"{f}:{self.sizes[f]}" for f in files]),
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
            fs, _ = open_fs(url)
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
            fs, p = open_fs(url)
            if not fs.isfile(p):
                raise SourceError(f"data.path: {url}: no such file")
            self.infos.append(f"{posixpath.basename(p)}:{fs.size(p)}")
        self.has_labels = False  # not knowable without reading; labels come from `key.cls` when present

    def fingerprint(self) -> dict[str, Any]:
        return {"kind": self.kind, "path": self.pattern, "files": len(self.urls), "digest": content_digest(self.infos)}

    def items(self, start: int = 0) -> Iterator[RawItem]:
        pos = 0
        for url in self.urls:
            for item in self._tar_items(url):
                if pos >= start:
                    yield item
                pos += 1

    def _tar_items(self, url: str) -> Iterator[RawItem]:
        fs, p = open_fs(url)
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
