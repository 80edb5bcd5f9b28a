"""The run root: a local folder or any fsspec URL (s3://, gs://, memory://) that jobs meet through.

All writes are atomic: on a local disk a temp file is fsynced and renamed over the target; on an
object store a single PUT is already all-or-nothing, and multi-file artefacts (checkpoints, model
folders) become visible only through a small manifest written last. Transient storage errors are
retried with exponential backoff.
"""

from __future__ import annotations

import functools
import io
import json
import os
import posixpath
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, TypeVar

import fsspec
import yaml

from flowfleet.errors import FlowfleetError
from flowfleet.layout import MANIFEST, RUN_FILE, addition

T = TypeVar("T")

# What never heals by waiting: a missing path, a refused permission, a path of the wrong kind. Every other
# OSError (timeouts, throttling, connection resets, a store that is briefly unreachable) is retried.
PERMANENT: tuple[type[OSError], ...] = (
    FileNotFoundError,
    PermissionError,
    IsADirectoryError,
    NotADirectoryError,
    FileExistsError,
)
TRANSIENT: tuple[type[BaseException], ...] = (ConnectionError, TimeoutError, OSError)


def is_transient(err: BaseException) -> bool:
    """True for an error that a retry can cure (see PERMANENT / TRANSIENT)."""
    return isinstance(err, TRANSIENT) and not isinstance(err, PERMANENT)


def with_retries(fn: Callable[[], T], *, what: str, attempts: int = 5, base_delay: float = 0.2) -> T:
    """Run fn, retrying transient errors with exponential backoff; permanent ones are raised at once,
    naming `what` (the path) when the error itself does not."""
    for i in range(attempts):
        try:
            return fn()
        except TRANSIENT as err:  # noqa: PERF203
            if not is_transient(err):
                if isinstance(err, FileNotFoundError) or what in str(err):
                    raise  # callers test for a missing path by its type
                raise type(err)(f"{what}: {err}") from err
            if i == attempts - 1:
                raise OSError(f"{what}: failed after {attempts} attempts: {err}") from err
            time.sleep(base_delay * 2**i)
    raise AssertionError("unreachable")


def _temp_beside(path: str, data: bytes) -> str:
    """`data` in a new hidden file in `path`'s folder, flushed to disk: -> its path (removed again if writing fails)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-" + os.path.basename(path))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        os.unlink(tmp)
        raise
    return tmp


def _machine_options(url: str, options: dict[str, Any]) -> dict[str, Any]:
    """`options` plus what this machine's environment adds: AWS_ENDPOINT_URL for s3:// (passed on
    explicitly: older botocore releases do not read that variable themselves)."""
    options = dict(options)
    endpoint = os.environ.get("AWS_ENDPOINT_URL")
    if url.startswith("s3://") and endpoint and "endpoint_url" not in options:
        options["endpoint_url"] = endpoint
    return options


class RunRoot:
    """A folder-like view of a run root. Paths given to methods are relative to the root.

    Storage options, highest precedence first: `storage_options` given here; the `storage` block of
    the run's run.yaml (`endpoint_url`, `options`: any keyword of the fsspec filesystem, e.g. s3fs's
    `client_kwargs` or `s3_additional_kwargs`); the machine's own settings (the standard AWS
    environment including AWS_ENDPOINT_URL, or fsspec's config files). run.yaml itself is read with
    the machine's settings, so the block can carry a run's shared options but not the only way in.
    A remote root looks for run.yaml in itself and in its parent (a run's `model/` folder).
    """

    def __init__(self, url: str | os.PathLike, storage_options: dict[str, Any] | None = None):
        url = str(url)
        self.url = url
        # run.yaml as read for its storage block when a remote root opens: the next read of it is served from here
        # (a stage reads its configuration right after), so opening a run costs one request for it, not two
        self._opened: dict[str, bytes] = {}
        self._connect(_machine_options(url, storage_options or {}))
        if storage_options is None and not self.is_local:
            block = self._run_storage_block()
            if block:
                self._connect(_machine_options(url, block))

    def _connect(self, options: dict[str, Any]) -> None:
        self.storage_options = options
        self.fs, path = fsspec.core.url_to_fs(self.url, **options)
        self.root = path.rstrip("/") if path != "/" else path
        self.is_local = self.fs.protocol in ("file", ("file", "local")) or "file" in self.fs.protocol

    def _run_storage_block(self) -> dict[str, Any]:
        """Options from the `storage` block of run.yaml here or one folder up; {} if none.

        Only the two documented keys are taken; a malformed block is left to load_run_config,
        which names the bad key when the stage reads its configuration.
        """
        for folder in (self.root, posixpath.dirname(self.root)):
            candidate = posixpath.join(folder, RUN_FILE)
            if not with_retries(functools.partial(self.fs.exists, candidate), what=f"exists {candidate}"):
                continue
            data = with_retries(functools.partial(self.fs.cat_file, candidate), what=f"read {candidate}")
            if folder == self.root:
                self._opened[candidate] = data
            try:
                raw = yaml.safe_load(io.BytesIO(data))
            except yaml.YAMLError:
                return {}
            block = raw.get("storage") if isinstance(raw, dict) else None
            if not isinstance(block, dict):
                return {}
            options = block.get("options") or {}
            options = dict(options) if isinstance(options, dict) else {}
            if block.get("endpoint_url"):
                options["endpoint_url"] = block["endpoint_url"]
            return options
        return {}

    def __repr__(self) -> str:
        return f"RunRoot({self.url!r})"

    # -- paths ---------------------------------------------------------------------------------------

    def path(self, *parts: str) -> str:
        """Absolute path inside the filesystem (what fs methods take)."""
        return posixpath.join(self.root, *parts) if parts else self.root

    def url_of(self, *parts: str) -> str:
        """A URL a user can pass on the command line."""
        if self.is_local:
            return self.path(*parts)
        return self.fs.unstrip_protocol(self.path(*parts))

    def origin(self, n: int) -> "RunRoot":
        """The run root that holds the data of origin n: this run's (n = 0), or addition n's (`add-expert`:
        a run root of its own, with run.yaml, data/, clusters/, partitions/, inside this one)."""
        return self if n == 0 else RunRoot(self.url_of(addition(n)))

    def local_path(self, *parts: str) -> Path | None:
        return Path(self.path(*parts)) if self.is_local else None

    # -- queries -------------------------------------------------------------------------------------

    def exists(self, *parts: str) -> bool:
        return with_retries(lambda: self.fs.exists(self.path(*parts)), what=f"exists {self.url_of(*parts)}")

    def ls(self, *parts: str) -> list[str]:
        """Names (not paths) directly under a folder; [] if it does not exist."""
        p = self.path(*parts)
        if not self.exists(*parts):
            return []
        self.fs.invalidate_cache(p)
        entries = with_retries(lambda: self.fs.ls(p, detail=False), what=f"list {self.url_of(*parts)}")
        return sorted(posixpath.basename(e.rstrip("/")) for e in entries)

    # -- bytes ---------------------------------------------------------------------------------------

    def read_bytes(self, *parts: str) -> bytes:
        p = self.path(*parts)
        if p in self._opened:  # run.yaml, read a moment ago when this root opened
            return self._opened.pop(p)
        return with_retries(lambda: self.fs.cat_file(p), what=f"read {self.url_of(*parts)}")

    def write_bytes(self, data: bytes, *parts: str) -> None:
        """Atomic write: readers see the old file or the whole new one, never a prefix."""
        p = self.path(*parts)
        self._opened.pop(p, None)
        if self.is_local:
            tmp = _temp_beside(p, data)
            try:
                os.replace(tmp, p)
            except BaseException:
                os.unlink(tmp)
                raise
            return
        with_retries(lambda: self.fs.pipe_file(p, data), what=f"write {self.url_of(*parts)}")

    def create_bytes(self, data: bytes, *parts: str) -> bool:
        """Write the file only where none is: -> True if this call created it, False if one was there (its bytes
        untouched). Of writers racing on one name exactly one wins: a hard link on a local disk, a conditional PUT
        (If-None-Match) on S3. Elsewhere the check and the write are two requests, and the race is not excluded."""
        p = self.path(*parts)
        self._opened.pop(p, None)
        if self.is_local:
            tmp = _temp_beside(p, data)
            try:
                os.link(tmp, p)  # atomic, and refused where the name exists
                return True
            except FileExistsError:
                return False
            finally:
                os.unlink(tmp)
        if "s3" in self.fs.protocol:
            try:
                with_retries(lambda: self.fs.pipe_file(p, data, mode="create"), what=f"write {self.url_of(*parts)}")
                return True
            except FileExistsError:
                return False
        if self.exists(*parts):
            return False
        self.write_bytes(data, *parts)
        return True

    def remove(self, *parts: str, recursive: bool = False) -> None:
        self._opened.clear()
        if self.exists(*parts):
            with_retries(
                lambda: self.fs.rm(self.path(*parts), recursive=recursive), what=f"remove {self.url_of(*parts)}"
            )

    # -- structured ----------------------------------------------------------------------------------

    def read_json(self, *parts: str) -> Any:
        raw = self.read_bytes(*parts)
        try:
            return json.loads(raw)
        except json.JSONDecodeError as err:
            raise ValueError(f"{self.url_of(*parts)}: not valid JSON ({err.msg} at line {err.lineno})") from None

    def write_json(self, obj: Any, *parts: str) -> None:
        self.write_bytes(json.dumps(obj, indent=2, sort_keys=False, default=str).encode(), *parts)

    def read_yaml(self, *parts: str) -> Any:
        try:
            return yaml.safe_load(io.BytesIO(self.read_bytes(*parts)))
        except yaml.YAMLError as err:
            raise ValueError(f"{self.url_of(*parts)}: not valid YAML ({str(err).splitlines()[0]})") from None

    def read_document(
        self, *parts: str, missing: str | None = None, error: type[FlowfleetError] = FlowfleetError
    ) -> Any:
        """A JSON or YAML file (by its suffix) -> its data; `error`, one line naming the file, when it does not
        parse or, with `missing` (what to do about it), when it does not exist (without: None)."""
        if not self.exists(*parts):
            if missing is None:
                return None
            raise error(f"{self.url_of(*parts)}: {missing}")
        read = self.read_yaml if parts[-1].endswith((".yaml", ".yml")) else self.read_json
        try:
            return read(*parts)
        except ValueError as err:
            raise error(str(err)) from None

    def write_yaml(self, obj: Any, *parts: str) -> None:
        self.write_bytes(yaml.safe_dump(obj, sort_keys=False).encode(), *parts)

    def append_line(self, line: str, *parts: str) -> None:
        """Append one line to a log file (metrics.jsonl). Local: a real append; remote: rewrite."""
        if self.is_local:
            p = self.path(*parts)
            os.makedirs(os.path.dirname(p), exist_ok=True)
            with open(p, "a") as f:
                f.write(line.rstrip("\n") + "\n")
            return
        old = self.read_bytes(*parts) if self.exists(*parts) else b""
        self.write_bytes(old + line.rstrip("\n").encode() + b"\n", *parts)

    # -- folders -------------------------------------------------------------------------------------

    def copy_folder(self, source: "RunRoot", *parts: str) -> None:
        """Copy source's folder `parts` to the same place here, file by file (each written atomically), every
        shard set's manifest.json last: an interrupted copy is an incomplete shard set, never a complete one
        that lacks shards."""
        files: list[tuple[str, ...]] = []

        def walk(rel: tuple[str, ...]) -> None:
            for name in source.ls(*rel):
                if source.fs.isdir(source.path(*rel, name)):
                    walk((*rel, name))
                else:
                    files.append((*rel, name))

        walk(parts)
        for rel in sorted(files, key=lambda r: (r[-1] == MANIFEST, r)):
            self.write_bytes(source.read_bytes(*rel), *rel)

    def put_dir(self, local_dir: str | os.PathLike, *parts: str) -> None:
        """Copy a local folder's files into the run root (each file written atomically)."""
        local_dir = Path(local_dir)
        for f in sorted(local_dir.rglob("*")):
            if f.is_file():
                rel = f.relative_to(local_dir).as_posix()
                self.write_bytes(f.read_bytes(), *parts, rel)
