"""Sources of table rows: parquet files, and a dataset written by `datasets.Dataset.save_to_disk`."""

from __future__ import annotations

import posixpath
from typing import Any, Iterator

import numpy as np

from flowfleet.data.sources.base import RawItem, Source, SourceError, content_digest, open_fs


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
        fs, root = open_fs(path)
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
        return {"kind": self.kind, "path": self.path, "count": len(self), "digest": content_digest(self.infos)}

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
