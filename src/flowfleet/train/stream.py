"""Training data read from the shard files as each batch needs it (run.yaml train.loader: stream): a rank's memory
holds an index of the items, not the items, so it does not grow with the data.

StreamedData answers as InMemoryData does (len, gather, select, concat, captions, the small `tensors`), and gathers
the same batches bit for bit. The scalar fields (index, labels) and the fields a task adds (cluster) stay in memory;
every other field is read per item at its byte offset in its shard file: pread on a local file, a byte range on an
object store, a few threads at a time.

Written by hand because safetensors' own reader maps a whole file into the process (every page a batch touches then
counts as the process's memory) and reads a tensor whole or as a run of consecutive rows, while a batch's items lie
scattered over the shards.
"""

from __future__ import annotations

import json
import math
import os
import posixpath
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch

from flowfleet.data.shards import ShardSet, is_packed
from flowfleet.errors import FlowfleetError
from flowfleet.storage import RunRoot
from flowfleet.train.data import InMemoryData, batch_field

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass(frozen=True)
class Field:
    dtype: torch.dtype
    shape: tuple[int, ...]  # one item's
    begin: int  # the field's first byte after the header
    row_bytes: int


@dataclass(frozen=True)
class ShardFile:
    """Where one shard file's fields lie: its header read once. `packed`: the padded length L of its text tokens
    where they are stored unpadded (flowfleet.data.shards.pack_tokens: text_tokens' rows are then tokens, not
    items), else None; then `token_start` [n + 1]: each item's first token row, and the end."""

    root: RunRoot
    path: str  # relative to root
    data_start: int  # 8 + the header's length
    count: int
    fields: dict[str, Field]
    packed: int | None = None
    mask_dtype: torch.dtype = torch.uint8
    token_start: torch.Tensor | None = field(default=None, compare=False)

    @classmethod
    def read(cls, root: RunRoot, path: str) -> "ShardFile":
        with root.fs.open(root.path(path), "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
            header.pop("__metadata__", None)
            packed = is_packed(header)
            fields, count = {}, None
            for name, spec in header.items():
                dtype, (begin, end), shape = DTYPES[spec["dtype"]], spec["data_offsets"], tuple(spec["shape"])
                if not (packed and name in ("text_tokens", "text_mask")):
                    count = shape[0] if count is None else count
                fields[name] = Field(dtype, shape[1:], begin, (end - begin) // max(shape[0], 1))
            if not packed:
                return cls(root, path, 8 + size, count or 0, fields)
            lengths = fields["text_len"]  # [n] int32, read while the file is open
            f.seek(8 + size + lengths.begin)
            raw = f.read((count or 0) * lengths.row_bytes)
        starts = torch.frombuffer(bytearray(raw), dtype=lengths.dtype).to(torch.int64).cumsum(0)
        mask = fields["text_mask"]  # an empty [0, L]: the padded length and the mask's dtype
        token_start = torch.cat([torch.zeros(1, dtype=torch.int64), starts])
        return cls(root, path, 8 + size, count or 0, fields, mask.shape[0], mask.dtype, token_start)

    def captions(self) -> list[str]:
        with self.root.fs.open(self.root.path(self.path), "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            meta = json.loads(f.read(size)).get("__metadata__") or {}
        return json.loads(meta.get("captions", "[]"))


class _Reader:
    """Byte ranges of the shard files: pread on open descriptors of local files (safe across threads), cat_file's
    ranges elsewhere."""

    def __init__(self) -> None:
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()

    def read(self, file: ShardFile, offset: int, n: int) -> bytes:
        path = file.root.local_path(file.path)
        if path is None:
            return file.root.fs.cat_file(file.root.path(file.path), start=offset, end=offset + n)
        local = str(path)
        with self._lock:
            fd = self._fds.get(local)
            if fd is None:
                fd = self._fds[local] = os.open(local, os.O_RDONLY)
        return os.pread(fd, n, offset)

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


class StreamedData:
    """Items of one or more shard sets, each read from its file when a batch asks for it."""

    def __init__(
        self,
        files: list[ShardFile],
        file_of: torch.Tensor,
        row_of: torch.Tensor,
        streamed: list[str],
        tensors: dict[str, torch.Tensor],
        where: str,
        layout: dict[str, tuple[torch.dtype, tuple[int, ...]]],
        readers: int = 4,
    ):
        self.files, self.file_of, self.row_of = files, file_of, row_of  # [N] int32 each: an item's file and row
        self.streamed, self.tensors, self.where = streamed, tensors, where
        self.layout = layout  # a streamed field's dtype and item shape (as the manifest says, however stored)
        self.readers = readers  # threads reading a batch's rows (train.loader_workers)
        self._reader = _Reader()
        self._pool: ThreadPoolExecutor | None = None

    @classmethod
    def load(cls, shards: ShardSet, fields: Iterable[str], readers: int = 4) -> "StreamedData":
        if not shards.exists():
            raise FlowfleetError(f"{shards.url}: no shard set (manifest.json missing)")
        manifest = shards.manifest()
        fields = [f for f in fields if f in manifest.fields]
        files = [ShardFile.read(shards.root, posixpath.join(shards.folder, s["name"])) for s in manifest.shards]
        if not files or not sum(f.count for f in files):
            raise FlowfleetError(f"{shards.url}: holds no items")
        file_of = torch.cat([torch.full((f.count,), i, dtype=torch.int32) for i, f in enumerate(files)])
        row_of = torch.cat([torch.arange(f.count, dtype=torch.int32) for f in files])
        small = [f for f in fields if not manifest.fields[f]["shape"]]  # a number an item (index, labels): in memory
        streamed = [f for f in fields if f not in small]
        layout = {
            f: (getattr(torch, manifest.fields[f]["dtype"]), tuple(manifest.fields[f]["shape"])) for f in streamed
        }
        data = cls(files, file_of, row_of, streamed, {}, shards.url, layout, readers)
        data.tensors = {name: torch.cat([data._whole(file, name) for file in files]) for name in small}
        return data

    def __len__(self) -> int:
        return int(self.file_of.shape[0])

    @property
    def captions(self) -> "Captions":
        return Captions(self)

    @classmethod
    def concat(cls, parts: list["StreamedData"]) -> "StreamedData":
        """The items of every part, in order (the parts hold the same fields)."""
        if len(parts) == 1:
            return parts[0]
        files: list[ShardFile] = []
        file_of = []
        for part in parts:
            file_of.append(part.file_of + len(files))
            files += part.files
        tensors = {name: torch.cat([p.tensors[name] for p in parts]) for name in parts[0].tensors}
        where = " + ".join(p.where for p in parts)
        row_of = torch.cat([p.row_of for p in parts])
        first = parts[0]
        return cls(files, torch.cat(file_of), row_of, first.streamed, tensors, where, first.layout, first.readers)

    def select(self, keep: torch.Tensor) -> "StreamedData":
        """Only the items where `keep` [N] bool is true."""
        items = keep.nonzero(as_tuple=True)[0]
        tensors = {name: t.index_select(0, items) for name, t in self.tensors.items()}
        return StreamedData(
            self.files,
            self.file_of[items],
            self.row_of[items],
            self.streamed,
            tensors,
            self.where,
            self.layout,
            self.readers,
        )

    def gather(self, items: torch.Tensor, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """The given items as a batch, as InMemoryData.gather gives it."""
        read = self._read(self.streamed, items)
        read.update({name: t.index_select(0, items) for name, t in self.tensors.items()})
        return {name: batch_field(name, x, device) for name, x in read.items()}

    def _whole(self, file: ShardFile, name: str) -> torch.Tensor:
        """One field of every item of one file, in one read (the scalar fields a job holds in memory)."""
        spec = file.fields[name]
        raw = self._reader.read(file, file.data_start + spec.begin, file.count * spec.row_bytes)
        return torch.frombuffer(bytearray(raw), dtype=spec.dtype).reshape(file.count, *spec.shape).clone()

    def _read(self, fields: Sequence[str], items: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each field of the items [n] as stored, read from the files."""
        where = list(zip(self.file_of[items].tolist(), self.row_of[items].tolist()))
        out = {}
        for name in fields:
            dtype, shape = self.layout[name]
            size = math.prod(shape) * dtype.itemsize
            buf = bytearray(len(where) * size)  # zeros: a packed item's padding stays so

            def fetch(i: int, name: str = name, size: int = size, buf: bytearray = buf) -> None:
                f, row = where[i]
                file = self.files[f]
                if file.token_start is not None and name in ("text_tokens", "text_mask"):
                    first, end = file.token_start[row : row + 2].tolist()
                    if name == "text_mask":  # the first `end - first` tokens are real
                        real = torch.arange(file.packed) < end - first
                        buf[i * size : (i + 1) * size] = real.to(file.mask_dtype).numpy().tobytes()
                        return
                    token = file.fields[name].row_bytes
                    raw = self._reader.read(
                        file, file.data_start + file.fields[name].begin + first * token, (end - first) * token
                    )
                    buf[i * size : i * size + len(raw)] = raw
                    return
                offset = file.data_start + file.fields[name].begin + row * size
                buf[i * size : (i + 1) * size] = self._reader.read(file, offset, size)

            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.readers, thread_name_prefix="flowfleet-stream")
            list(self._pool.map(fetch, range(len(where))))
            out[name] = torch.frombuffer(buf, dtype=dtype).reshape(len(where), *shape).clone()
        return out

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
        self._reader.close()


class Captions(Sequence[str]):
    """A StreamedData's captions, read from a shard's header when asked for (a preview reads a few)."""

    def __init__(self, data: StreamedData):
        self.data = data
        self._cache: dict[int, list[str]] = {}

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i):  # (an item number; a preview asks for a few)
        f = int(self.data.file_of[i])
        if f not in self._cache:
            self._cache = {f: self.data.files[f].captions()}  # one shard's at a time
        caps = self._cache[f]
        row = int(self.data.row_of[i])
        return caps[row] if row < len(caps) else ""


Data = InMemoryData | StreamedData  # a job's data, either way (open_data)


def open_data(shards: ShardSet, fields: Iterable[str], loader: str = "memory", readers: int = 4) -> Data:
    """A job's data: every item in memory, or read from the shard files as batches ask by `readers` threads (run.yaml
    train.loader, train.loader_workers)."""
    return StreamedData.load(shards, fields, readers) if loader == "stream" else InMemoryData.load(shards, fields)
