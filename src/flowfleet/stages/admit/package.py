"""The package as the gate reads it: bounded reads from where the contributor left it (a folder or any fsspec URL),
and one private copy that every check after `who`, and the install, read.

From the source only regular files are read, at the names the signed manifest lists (and its own three), each up to
its cap: a symlink is never followed (on a local disk the file is opened with O_NOFOLLOW and O_NONBLOCK, so that a
link swapped in after the listing, a FIFO or a device fails at once), and nothing beyond a cap is read. Each file is
hashed as it is copied, so the bytes checked are the bytes installed: changing the package in its bucket after the
copy changes nothing the gate sees.
"""

from __future__ import annotations

import hashlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from flowfleet.layout import PACKAGE_EXPERT, PACKAGE_MANIFEST, PACKAGE_SIGNATURE, PACKAGE_SIGNER
from flowfleet.stages.admit.refusal import Refused, shown
from flowfleet.storage import RunRoot

PACKAGE_OWN = (PACKAGE_MANIFEST, PACKAGE_SIGNATURE, PACKAGE_SIGNER)  # the files the manifest cannot list
MAX_ENTRIES = 64  # files and folders a package may hold: an expert's four files, its own three, its one folder
CHUNK = 1 << 20


@dataclass(frozen=True)
class Entry:
    """One thing at a package's top level or in its expert/ folder, as listed without following links."""

    rel: str
    kind: str  # "file" | "directory" | "link" | "other" (a FIFO, a device, a socket)
    size: int


def list_entries(pkg: RunRoot) -> list[Entry]:
    """Everything in the package, its expert/ folder's contents included, without following a link; refused past
    MAX_ENTRIES (a package of a million files is not an expert's)."""
    if pkg.is_local:
        return _local_entries(Path(pkg.path()))
    out: list[Entry] = []
    for name, info in sorted(pkg.fs.find(pkg.path(), withdirs=True, detail=True, maxdepth=2).items()):
        rel = name.removeprefix(pkg.path().rstrip("/") + "/")
        kind = info.get("type") if info.get("type") in ("file", "directory") else "other"
        out.append(Entry(rel, kind, int(info.get("size") or 0)))
        if len(out) > MAX_ENTRIES:
            raise Refused("signature", f"{pkg.url}: more than {MAX_ENTRIES} files, not an expert's package")
    return out


def _local_entries(folder: Path) -> list[Entry]:
    out: list[Entry] = []
    try:
        top = list(os.scandir(folder))
    except OSError as err:
        raise Refused("signature", f"{folder}: cannot list the package ({err.strerror})") from None
    for entry in top:
        out.append(_entry(entry, entry.name))
        if entry.name == PACKAGE_EXPERT and entry.is_dir(follow_symlinks=False):
            out += [_entry(inner, f"{entry.name}/{inner.name}") for inner in os.scandir(entry.path)]
        if len(out) > MAX_ENTRIES:
            raise Refused("signature", f"{folder}: more than {MAX_ENTRIES} files, not an expert's package")
    return sorted(out, key=lambda e: e.rel)


def _entry(entry: os.DirEntry, rel: str) -> Entry:
    info = entry.stat(follow_symlinks=False)
    if stat.S_ISLNK(info.st_mode):
        return Entry(rel, "link", 0)
    if stat.S_ISDIR(info.st_mode):
        return Entry(rel, "directory", 0)
    return Entry(rel, "file" if stat.S_ISREG(info.st_mode) else "other", info.st_size)


def read_capped(pkg: RunRoot, rel: str, cap: int, check: str = "signature") -> bytes:
    """A regular file of the package, whole, at most `cap` bytes; a link, a FIFO, a device, a folder or a larger
    file is refused without reading past the cap."""
    return b"".join(_chunks(pkg, rel, cap, check))


def copy_capped(pkg: RunRoot, rel: str, dest: Path, cap: int) -> str:
    """Copy a regular file of the package to `dest` (at most `cap` bytes, as read_capped refuses) -> its sha256."""
    digest = hashlib.sha256()
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest, "wb") as out:
        for chunk in _chunks(pkg, rel, cap, "signature"):
            digest.update(chunk)
            out.write(chunk)
    return digest.hexdigest()


def _chunks(pkg: RunRoot, rel: str, cap: int, check: str):
    """The file's bytes in chunks; Refused once more than `cap` arrive, or where it is not a regular file."""
    read = 0
    with _open_regular(pkg, rel, check) as f:
        while chunk := f.read(min(CHUNK, cap + 1 - read)):
            read += len(chunk)
            if read > cap:
                raise Refused(check, f"{shown(rel)}: over its cap of {cap:,} bytes")
            yield chunk


def _open_regular(pkg: RunRoot, rel: str, check: str):
    """A binary reader of the package's regular file `rel`: on a local disk opened without following a link and
    without blocking (a FIFO fails at once), then checked to be a regular file."""
    if not pkg.is_local:
        try:
            info = pkg.fs.info(pkg.path(rel))
        except FileNotFoundError:
            raise Refused(check, f"{shown(rel)}: missing") from None
        if info.get("type") != "file":
            raise Refused(check, f"{shown(rel)}: not a regular file")
        return pkg.fs.open(pkg.path(rel), "rb")
    try:
        fd = os.open(pkg.path(rel), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        raise Refused(check, f"{shown(rel)}: missing") from None
    except OSError as err:  # ELOOP: a symlink; ENXIO: a FIFO without a writer
        raise Refused(check, f"{shown(rel)}: not a regular file (a link is never followed: {err.strerror})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise Refused(check, f"{shown(rel)}: not a regular file (a FIFO, a device or a folder is never read)")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")
