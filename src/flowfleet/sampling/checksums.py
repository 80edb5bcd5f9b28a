"""A model folder's weight checksums: SHA256SUMS beside model_index.json, in sha256sum's own format (so
`cd DIR && sha256sum -c SHA256SUMS` checks a folder by hand), written by `assemble` for every weight file
(*.safetensors: experts, router, vae) and verified whenever the folder is opened, so a flipped byte in an
expert's file is a one-line error naming the expert, never different images.

Hashing streams each file in 1 MiB reads. A match is remembered in .verified.json by the file's size and
modification time, so a folder opened again (a restarted server) is not read twice; `flowfleet verify`
always hashes everything.
"""

from __future__ import annotations

import hashlib
import json
import logging

from flowfleet.errors import FlowfleetError
from flowfleet.layout import CHECKSUMS, CONTRIBUTION, PACKAGE_EXPERT, VERIFIED
from flowfleet.storage import RunRoot

log = logging.getLogger(__name__)

WEIGHTS_SUFFIX = ".safetensors"
CHUNK = 1 << 20


class CorruptWeights(FlowfleetError):
    """A weight file of a model folder whose sha256 differs from SHA256SUMS, or one that is missing."""


def weight_files(root: RunRoot) -> list[str]:
    """The files SHA256SUMS lists, relative paths: the weights at the top level and one folder down (expert_k/,
    router/...), and a contributed expert's signed manifest (its provenance)."""
    found = []
    for name in root.ls():
        if name.endswith(WEIGHTS_SUFFIX):
            found.append(name)
        elif root.fs.isdir(root.path(name)):
            found += [f"{name}/{inner}" for inner in root.ls(name) if _listed(inner)]
    return sorted(found)


def _listed(name: str) -> bool:
    return name.endswith(WEIGHTS_SUFFIX) or name == CONTRIBUTION


def sha256_of(root: RunRoot, rel: str) -> str:
    digest = hashlib.sha256()
    with root.fs.open(root.path(rel), "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def write_checksums(root: RunRoot) -> dict[str, str]:
    """Hash every weight file of the folder into SHA256SUMS (atomic); its old cache goes."""
    sums = {rel: sha256_of(root, rel) for rel in weight_files(root)}
    root.write_bytes("".join(f"{sha}  {rel}\n" for rel, sha in sums.items()).encode(), CHECKSUMS)
    root.remove(VERIFIED)
    return sums


def read_checksums(root: RunRoot) -> dict[str, str] | None:
    """SHA256SUMS as {relative path: sha256}, or None for a folder assembled before it existed."""
    if not root.exists(CHECKSUMS):
        return None
    sums = {}
    for n, line in enumerate(root.read_bytes(CHECKSUMS).decode("utf-8", "replace").splitlines(), 1):
        sha, sep, rel = line.partition("  ")
        if not sep or len(sha) != 64 or not rel:
            raise CorruptWeights(f"{root.url_of(CHECKSUMS)}: line {n} is not '<sha256>  <file>'")
        sums[rel.strip()] = sha.lower()
    return sums


def _owner(rel: str) -> str:
    """Whose weights a file holds, in words."""
    folder = rel.split("/")[0]
    if folder.startswith("expert_"):
        return f"expert {folder.removeprefix('expert_')}"
    return {"router": "the router", "vae": "the autoencoder (vae/)"}.get(folder, rel)


def _stamp(root: RunRoot, rel: str) -> list | None:
    """What identifies this version of a file without reading it: size and modification time (None: unknown)."""
    info = root.fs.info(root.path(rel))
    mtime = info.get("mtime") or info.get("LastModified") or info.get("ETag")
    return None if mtime is None else [int(info["size"]), str(mtime)]


def verify_weights(root: RunRoot, *, use_cache: bool = True) -> int:
    """Check every file SHA256SUMS lists; -> how many. CorruptWeights (one line, naming the file and whose
    weights it holds) on the first mismatch or missing file. A folder without SHA256SUMS is opened with a
    warning (assembled before checksums existed: re-assemble it to have them)."""
    sums = read_checksums(root)
    if sums is None:
        log.warning("%s: no %s (an older assembly): its weights are not verified", root.url, CHECKSUMS)
        return 0
    cache = {}
    if use_cache and root.exists(VERIFIED):
        try:
            cache = root.read_json(VERIFIED)
        except ValueError:
            cache = {}
    remembered = {}
    for rel, want in sums.items():
        if not root.exists(rel):
            raise CorruptWeights(f"{root.url_of(rel)}: missing ({_owner(rel)}'s weights, listed in {CHECKSUMS})")
        stamp = _stamp(root, rel)
        if stamp is not None and cache.get(rel) == [*stamp, want]:
            remembered[rel] = cache[rel]
            continue
        got = sha256_of(root, rel)
        if got != want:
            raise CorruptWeights(
                f"{root.url_of(rel)}: sha256 {got[:12]}... differs from {CHECKSUMS}'s {want[:12]}...: "
                f"{_owner(rel)}'s weights are corrupted or were replaced (restore the file or assemble again)"
            )
        if stamp is not None:
            remembered[rel] = [*stamp, want]
    if use_cache and remembered != cache:
        try:
            root.write_json(remembered, VERIFIED)
        except OSError as err:  # a read-only folder is verified every time
            log.debug("%s: cannot remember verified weights (%s)", root.url, err)
    return len(sums)


def verify_contributions(root: RunRoot) -> int:
    """Every contributed expert's installed files (expert_k/ beside its signed manifest, contribution.json) against the
    sha256 the manifest signed for them (its expert/ entries); -> how many contributions. CorruptWeights (one line,
    naming the file and the expert) where a file differs or is missing: the bytes serving are not the bytes signed."""
    count = 0
    for name in root.ls():
        if not (name.startswith("expert_") and root.exists(name, CONTRIBUTION)):
            continue
        count += 1
        try:
            signed = json.loads(root.read_bytes(name, CONTRIBUTION)).get("files") or {}
        except (ValueError, AttributeError):
            raise CorruptWeights(f"{root.url_of(name, CONTRIBUTION)}: not a signed manifest") from None
        expected = {rel.split("/", 1)[1]: sha for rel, sha in signed.items() if rel.startswith(PACKAGE_EXPERT + "/")}
        for file, want in sorted(expected.items()):
            if not root.exists(name, file):
                raise CorruptWeights(f"{root.url_of(name, file)}: missing ({_owner(name)}'s signed file)")
            got = sha256_of(root, f"{name}/{file}")
            if got != want:
                raise CorruptWeights(
                    f"{root.url_of(name, file)}: sha256 {got[:12]}... is not the {want[:12]}... its signed manifest "
                    f"({CONTRIBUTION}) gives: {_owner(name)}'s installed bytes are not the contributor's"
                )
    return count
