"""Two-stage k-means (faiss and torch), balancing, the random baseline, and the `cluster` stage's files:
assignments aligned with data/, centroids, report, previews, and partitions that hold exactly their items."""

from __future__ import annotations

import io
import math
from pathlib import Path

import pytest
import safetensors.torch
import torch
from fixtures.tolerances import gamma
from PIL import Image
from sklearn.metrics import normalized_mutual_info_score

from flowfleet.cli import main
from flowfleet.cluster import (
    assign_nearest,
    balance_fine_to_coarse,
    l2_normalize_,
    lift_to_floor,
    random_partition,
    two_stage_kmeans,
)
from flowfleet.cluster import kmeans as km
from flowfleet.cluster.assignments import read_assignments
from flowfleet.config import RunConfig
from flowfleet.data.shards import FIELDS, ShardSet, ShardSetManifest
from flowfleet.errors import FlowfleetError
from flowfleet.presets import preset
from flowfleet.stages.cluster import cluster
from flowfleet.stages.cluster_parts import cluster_in_parts
from flowfleet.storage import RunRoot


@pytest.fixture(autouse=True)
def _one_thread():
    """These problems are tiny: on a shared 2-core box, extra OpenMP/torch threads only spin-wait
    for each other (measured 0.03 s with one thread, 5.7 s with two under load)."""
    import faiss

    threads, omp = torch.get_num_threads(), faiss.omp_get_max_threads()
    torch.set_num_threads(1)
    faiss.omp_set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    faiss.omp_set_num_threads(omp)


def blobs(sizes: list[int], dim: int = 16, spread: float = 0.05, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Points around len(sizes) random unit directions; returns (x [N, dim] unit rows, labels [N])."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.nn.functional.normalize(torch.randn(len(sizes), dim, generator=g), dim=1)
    labels = torch.cat([torch.full((n,), i) for i, n in enumerate(sizes)])
    x = centres[labels] + spread * torch.randn(len(labels), dim, generator=g)
    perm = torch.randperm(len(labels), generator=g)
    return l2_normalize_(x[perm].contiguous()), labels[perm]


def nmi(a: torch.Tensor, b: torch.Tensor) -> float:
    return normalized_mutual_info_score(a.numpy(), b.numpy())


# ------------------------------------------------------------------------------------------------
#                                          k-means
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["faiss", "torch"])
def test_two_stage_recovers_separated_clusters_deterministically(backend):
    x, labels = blobs([60] * 8)
    res = two_stage_kmeans(x, 8, fine_k=32, sample_size=300, iters=20, seed=1, backend=backend)
    assert res.backend == backend and res.sample_size == 300
    assert res.fine.shape == (32, 16) and res.coarse.shape == (8, 16) and res.fine_to_coarse.shape == (32,)
    assert nmi(labels, res.assign) > 0.95
    # every item goes through its nearest fine centroid (brute force)
    nearest = torch.cdist(x, res.fine).argmin(1)
    assert torch.equal(res.fine_assign, nearest)
    assert torch.equal(res.assign, res.fine_to_coarse[nearest])
    assert 0 < res.inertia_fine <= res.inertia_coarse
    again = two_stage_kmeans(x, 8, fine_k=32, sample_size=300, iters=20, seed=1, backend=backend)
    assert torch.equal(again.assign, res.assign) and torch.equal(again.fine, res.fine)


def test_faiss_and_torch_agree_and_fine_k_is_capped():
    x, labels = blobs([40] * 4, seed=3)
    a = two_stage_kmeans(x, 4, fine_k=500, sample_size=100, backend="faiss")
    b = two_stage_kmeans(x, 4, fine_k=500, sample_size=100, backend="torch")
    assert a.fine.shape[0] == b.fine.shape[0] == 100  # capped at the sample size, and said so
    assert any("capped" in n for n in a.notes)
    # NMI of identical partitions: a float64 ratio of entropies summed over the 150 points' cells
    rel = gamma(2 * labels.numel())
    assert nmi(a.assign, b.assign) == pytest.approx(1.0, rel=rel) and nmi(labels, a.assign) == pytest.approx(
        1.0, rel=rel
    )


@pytest.mark.parametrize("backend", ["faiss", "torch"])
def test_weighted_kmeans_centroid_is_the_weighted_mean(backend):
    x = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 1.0], [10.0, 10.0], [11.0, 10.0]])
    w = torch.tensor([1.0, 1.0, 2.0, 3.0, 1.0])
    res = km.kmeans(x, 2, weights=w, iters=10, restarts=3, backend=backend)
    order = res.centroids[:, 0].argsort()
    # a float32 weighted mean of <= 3 points of size <= 11 (weights summing to <= 4): gamma_8 of 11 x 4
    tol = gamma(8, torch.float32) * 11 * 4
    torch.testing.assert_close(res.centroids[order], torch.tensor([[0.25, 0.5], [10.25, 10.0]]), atol=tol, rtol=0)
    # squared distances expanded as |x|^2 + |c|^2 - 2 x.c (faiss) cancel terms up to 2 x 221: each of the 5
    # weighted terms (weights <= 3) is within gamma_6 of that
    assert res.inertia == pytest.approx(
        1 * (0.25**2 + 0.5**2) + 1 * (0.75**2 + 0.5**2) + 2 * (0.25**2 + 0.5**2) + 3 * 0.25**2 + 1 * 0.75**2,
        abs=5 * 3 * gamma(6, torch.float32) * 2 * 221,
    )


def test_assign_nearest_backends_agree():
    x, _ = blobs([50, 50, 50], dim=8, spread=0.3)
    c = x[:7]
    i1, d1 = assign_nearest(x, c, backend="faiss")
    i2, d2 = assign_nearest(x, c, backend="torch")
    assert torch.equal(i1, i2)
    # per row: |x|^2 + |c|^2 - 2 x.c over dim 8 cancels terms of size |x|^2 + |c|^2 (gamma_{dim+2} of it),
    # the direct sum of 8 squares is within gamma_8 of the result
    scale = x.pow(2).sum(1) + c[i1].pow(2).sum(1)
    tol = 2 * gamma(x.shape[1] + 2, torch.float32) * scale
    direct = ((x - c[i1]) ** 2).sum(1)
    assert ((d1 - direct).abs() <= tol).all() and ((d1 - d2).abs() <= tol).all()


def test_impossible_requests_are_clear_errors():
    x, _ = blobs([5, 5])
    with pytest.raises(FlowfleetError, match="cluster.k: 20 partitions for only 10 prepared items"):
        two_stage_kmeans(x, 20, fine_k=4, sample_size=10)
    with pytest.raises(FlowfleetError, match="cluster.fine_k: 3 fine clusters .* cannot make 4 coarse"):
        two_stage_kmeans(x, 4, fine_k=3, sample_size=10)
    with pytest.raises(FlowfleetError, match="cluster.fine_k: 5 fine clusters \\(capped at the 5-item sample\\)"):
        two_stage_kmeans(x, 6, fine_k=64, sample_size=5)


def test_empty_partition_is_reseeded_then_refused(monkeypatch):
    x, labels = blobs([50] * 4)
    real = km.kmeans
    seeds = []

    def collapsing(points, k, **kw):  # the coarse stage (k = 4) puts everything in cluster 0 for seed 0
        res = real(points, k, **kw)
        if k == 4:
            seeds.append(kw["seed"])
            if kw["seed"] == 0:
                res.assign = torch.zeros_like(res.assign)
        return res

    monkeypatch.setattr(km, "kmeans", collapsing)
    res = km.two_stage_kmeans(x, 4, fine_k=16, sample_size=200, seed=0)
    assert res.reseeds == 1 and seeds == [0, 1000] and min(res.sizes) > 0
    assert nmi(labels, res.assign) > 0.95

    def always_empty(points, k, **kw):
        res = real(points, k, **kw)
        if k == 4:
            res.assign = torch.zeros_like(res.assign)
        return res

    monkeypatch.setattr(km, "kmeans", always_empty)
    with pytest.raises(FlowfleetError, match=r"partition\(s\) \[1, 2, 3\] stay empty after 2 re-seeded"):
        km.two_stage_kmeans(x, 4, fine_k=16, sample_size=200, max_reseeds=2)


def test_balance_caps_partition_sizes():
    fine = torch.nn.functional.normalize(torch.randn(40, 8, generator=torch.Generator().manual_seed(0)), dim=1)
    coarse = fine[:4] + 0.01  # four coarse centres, most fine clusters nearest to a few of them
    sizes = torch.full((40,), 10)
    f2c = balance_fine_to_coarse(fine, coarse, sizes, slack=0.1)
    loads = torch.zeros(4, dtype=torch.int64).index_add_(0, f2c, sizes)
    assert loads.sum() == 400 and loads.max() <= math.ceil(1.1 * 100)

    x, _ = blobs([500, 40, 30, 30], seed=2, spread=0.3)
    plain = two_stage_kmeans(x, 4, fine_k=40, sample_size=600, seed=0)
    even = two_stage_kmeans(x, 4, fine_k=40, sample_size=600, seed=0, balance=0.1)
    assert max(plain.sizes) > 1.5 * 600 / 4
    assert max(even.sizes) - min(even.sizes) < max(plain.sizes) - min(plain.sizes)
    assert max(even.sizes) <= math.ceil(1.1 * 600 / 4) + int(torch.bincount(even.fine_assign).max())


def test_balance_within_a_share_bounds_every_partition_from_both_sides():
    """cluster.balance with balance_within 0.2: each partition within 20 % of N / K, up to one fine cluster (the
    granularity the balancing moves)."""
    x, _ = blobs([500, 40, 30, 30], seed=2, spread=0.3)
    n, k, w = 600, 4, 0.2
    even = two_stage_kmeans(x, k, fine_k=60, sample_size=600, seed=0, balance=w, min_size=(1 - w) * n / k)
    grain = int(torch.bincount(even.fine_assign).max())
    assert all((1 - w) * n / k - grain <= size <= (1 + w) * n / k + grain for size in even.sizes), even.sizes
    assert max(even.sizes) / (n / k) <= 1 + w + grain / (n / k)


def test_a_partition_under_the_floor_takes_the_fine_clusters_nearest_it():
    # fine clusters on a line; coarse centres at 0 (one fine cluster of 5) and 10 (the rest, 10 items each)
    fine = torch.tensor([[0.0], [4.0], [5.0], [6.0], [9.0], [10.0], [11.0]])
    coarse = torch.tensor([[0.0], [10.0]])
    sizes = torch.tensor([5, 10, 10, 10, 10, 10, 10])
    f2c = torch.tensor([0, 1, 1, 1, 1, 1, 1])
    lifted = lift_to_floor(fine, coarse, sizes, f2c, floor=20)
    assert lifted.tolist() == [0, 0, 0, 1, 1, 1, 1]  # the two nearest the small centre, and no more
    loads = torch.zeros(2, dtype=torch.int64).index_add_(0, lifted, sizes)
    assert loads.tolist() == [25, 40]
    # a floor no move can reach without taking the donor under it: the map stops short, the donors intact
    assert lift_to_floor(fine, coarse, sizes, f2c, floor=33).tolist() == [0, 0, 0, 1, 1, 1, 1]
    assert torch.equal(lift_to_floor(fine, coarse, sizes, f2c, floor=5), f2c)  # nothing under it: unchanged
    # through the two-stage k-means: a tiny blob's partition lifted to the floor, the rest keeps its shape
    x, _ = blobs([500, 40, 30, 30], seed=2, spread=0.3)
    floor = two_stage_kmeans(x, 4, fine_k=40, sample_size=600, seed=0, min_size=0.1 * 600)
    assert min(floor.sizes) >= 60 and any("took the fine clusters nearest them" in n for n in floor.notes)


def test_random_partition_is_even_and_seeded():
    a = random_partition(103, 4, seed=0)
    sizes = torch.bincount(a, minlength=4)
    assert sizes.max() - sizes.min() <= 1 and sizes.sum() == 103
    assert torch.equal(a, random_partition(103, 4, seed=0)) and not torch.equal(a, random_partition(103, 4, seed=1))


def test_l2_normalize_is_in_place():
    x = torch.randn(10, 3) * 5
    y = l2_normalize_(x, chunk=3)
    assert y.data_ptr() == x.data_ptr()
    # x / |x| then |.| again over 3 float32 terms: two 3-term sums of squares, two square roots, one division
    torch.testing.assert_close(x.norm(dim=1), torch.ones(10), rtol=0, atol=gamma(10, torch.float32))


# ------------------------------------------------------------------------------------------------
#                                       the cluster stage
# ------------------------------------------------------------------------------------------------


def write_run(
    root,
    image_features: torch.Tensor,
    labels: torch.Tensor,
    shard_size: int = 64,
    text: torch.Tensor | None = None,
    latents: torch.Tensor | None = None,
    **cluster_cfg,
) -> RunRoot:
    """A run.yaml (mnist-tiny with the given cluster section) and a complete data/ of synthetic items."""
    cfg = preset("mnist-tiny").to_dict()
    cfg["cluster"].update({"features": "semantic", "balance": False, **cluster_cfg})
    cfg["router"]["num_outputs"] = cfg["cluster"]["k"]
    run = RunRoot(root)
    RunConfig.from_dict(cfg).save(run)
    n = image_features.shape[0]
    g = torch.Generator().manual_seed(0)
    data = ShardSet(run, "data")
    manifest = ShardSetManifest(extra={"source": {"kind": "synthetic"}, "encoders": {"latent": {"name": "pixels"}}})
    for lo in range(0, n, shard_size):
        hi = min(lo + shard_size, n)
        m = hi - lo
        tensors = {
            "latents": latents[lo:hi] if latents is not None else torch.rand(m, 1, 16, 16, generator=g) * 2 - 1,
            "features": image_features[lo:hi] * 3.0,
            "text_tokens": torch.randn(m, 8, 384, generator=g).half(),
            "text_mask": torch.ones(m, 8, dtype=torch.uint8),
            "text_pooled": text[lo:hi] if text is not None else torch.randn(m, 384, generator=g),
            "labels": labels[lo:hi],
            "index": torch.arange(lo, hi),
        }
        data.append(manifest, tensors, [f"item {i}" for i in range(lo, hi)])
    manifest.complete = True
    data.write_manifest(manifest)
    return run


def test_cluster_stage_writes_aligned_files_and_complete_partitions(run_root):
    x, labels = blobs([50, 70, 60, 40], seed=4)
    run = write_run(run_root, x, labels, k=4, fine_k=24, iters=20)
    report = cluster(run, progress=False)
    n = 220
    assign = read_assignments(run, num_clusters=4)
    assert assign.dtype == torch.int64 and assign.shape == (n,)
    assert report["sizes"] == torch.bincount(assign, minlength=4).tolist() and sum(report["sizes"]) == n
    assert report["nmi"] > 0.95 and report["nmi_random_same_sizes"] < 0.2
    assert len(report["fine_to_coarse"]) == 24 and report["inertia"]["fine"] <= report["inertia"]["coarse"]
    assert sorted(report["label_mix"][0].values(), reverse=True)[0] == report["sizes"][0]  # pure clusters
    cents = safetensors.torch.load(run.read_bytes("clusters", "centroids.safetensors"))
    assert cents["fine"].shape == (24, 16) and cents["coarse"].shape == (4, 16)
    assert torch.equal(
        cents["fine_to_coarse"][safetensors.torch.load(run.read_bytes("clusters", "assignments.safetensors"))["fine"]],
        assign,
    )
    assert run.read_json("clusters", "report.json")["sizes"] == report["sizes"]

    full, captions = ShardSet(run, "data").load(FIELDS, with_captions=True)
    total = 0
    for k in range(4):
        Image.open(io.BytesIO(run.read_bytes("clusters", f"preview-{k}.png"))).verify()
        part = ShardSet(run, f"partitions/{k}")
        m = part.manifest()
        assert m.complete and m.count == report["sizes"][k] and m.extra["partition"] == k
        assert m.extra["num_partitions"] == 4 and m.extra["data_count"] == n
        assert m.extra["partition_counts"] == report["sizes"]  # what a by-size expert job reads
        assert all(s["count"] <= 128 for s in m.shards)  # data.shard_size of mnist-tiny
        got, caps = part.load(FIELDS, with_captions=True)
        rows = (assign == k).nonzero().flatten()
        assert torch.equal(got["index"], rows)
        for name in FIELDS:
            assert torch.equal(got[name], full[name][rows]), name
        assert caps == [captions[i] for i in rows.tolist()]
        total += m.count
    assert total == n


def _written(root: Path) -> dict[str, bytes]:
    """Every file `cluster` writes but its report (which records seconds): partitions/ and clusters/."""
    return {
        str(f.relative_to(root)): f.read_bytes()
        for folder in ("partitions", "clusters")
        for f in sorted((root / folder).rglob("*"))
        if f.is_file() and f.name != "report.json"
    }


def test_cluster_in_parts_writes_what_one_process_writes(tmp_path, capsys):
    """`cluster --parts 3`: three processes write the partitions at once, each a run of data/'s shards, the shards
    that straddle two parts joined by the merge: every file byte for byte one process's, the same report but its
    timings, the parts' pieces gone after; a part before the clustering, or a merge before its parts, refused."""
    x, labels = blobs([150, 210, 180, 120], seed=4)
    runs = []
    for name in ("one", "parts"):
        run = write_run(str(tmp_path / name), x, labels, shard_size=50, k=4, fine_k=24, iters=20)
        raw = run.read_yaml("run.yaml")
        raw["data"]["shard_size"] = 16  # partitions of 120-210 items: shards within one part and across two
        RunConfig.from_dict(raw).save(run)
        runs.append(run)
    assert main(["cluster", runs[1].url, "--part", "0/3"]) == 1
    assert "cluster-parts/fit.json: missing; `flowfleet cluster" in capsys.readouterr().err
    one = cluster(runs[0], progress=False)
    done = cluster_in_parts(runs[1], 3, parallel=3, progress=False)
    assert _written(tmp_path / "parts") == _written(tmp_path / "one") and len(_written(tmp_path / "one")) > 40
    timings = ("seconds", "seconds_clustering", "seconds_per_phase")
    assert {k: v for k, v in done.report.items() if k not in timings} == {
        k: v for k, v in one.items() if k not in timings
    }
    starts, ends = zip(*done.spans.values())
    assert len(done.spans) == 3 and max(starts) < min(ends)  # the three parts ran at once
    assert sorted(p.name for p in (tmp_path / "parts" / "cluster-parts").iterdir()) == [
        f"{i}-of-3.log" for i in range(3)
    ]
    # by hand, as another scheduler runs them: the fit, the parts, then the merge, which needs all of them
    capsys.readouterr()
    assert main(["cluster", runs[1].url, "--fit-only", "--quiet"]) == 0
    assert f"partitions decided: sizes {one['sizes']}" in capsys.readouterr().out
    assert runs[1].read_json("cluster-parts", "fit.json")["sizes"] == one["sizes"]
    assert main(["cluster", runs[1].url, "--part", "2/3", "--quiet"]) == 0
    assert main(["cluster", runs[1].url, "--merge", "3", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "cluster-parts/0-of-3/done.json: missing; run `flowfleet cluster" in err and "--part 0/3" in err
    for i in (0, 1):
        assert main(["cluster", runs[1].url, "--part", f"{i}/3", "--quiet"]) == 0
    assert "pieces of shards written" in capsys.readouterr().out
    assert main(["cluster", runs[1].url, "--merge", "3", "--quiet"]) == 0
    assert _written(tmp_path / "parts") == _written(tmp_path / "one")


def test_label_coherence_is_the_mean_majority_share():
    from flowfleet.stages.cluster import label_coherence

    labels = torch.tensor([0, 0, 0, 0, 1, 1, 2, 2, -1])
    assign = torch.tensor([0, 0, 0, 1, 1, 1, 0, 1, 1])
    assert label_coherence(labels, assign) == pytest.approx((3 / 4 + 1 + 1 / 2) / 3, rel=gamma(4))  # 3 ratios, a mean
    assert label_coherence(labels, torch.zeros(9, dtype=torch.long)) == 1.0
    assert label_coherence(torch.full((3,), -1), torch.zeros(3, dtype=torch.long)) is None


def test_one_point_per_caption_joins_items_that_say_the_same():
    from flowfleet.stages.cluster import one_point_per_caption

    x = torch.nn.functional.normalize(torch.tensor([[1.0, 0.0], [1.0, 1e-4], [0.0, 1.0]]), dim=1)
    y, distinct = one_point_per_caption(x.clone(), ["a seven", "a seven", "a two"])
    # a lone caption's point is re-normalised: a 2-term norm and a division, gamma_4 in float32
    tol = gamma(4, torch.float32)
    assert distinct == 2 and torch.equal(y[0], y[1]) and torch.allclose(y[2], x[2], atol=tol, rtol=0)
    assert torch.allclose(y.norm(dim=1), torch.ones(3), atol=2 * tol, rtol=0)
    with pytest.raises(FlowfleetError, match="2 captions"):
        one_point_per_caption(x, ["a", "b"])


@pytest.mark.parametrize("features", ["semantic", "text", "both"])
def test_cluster_features_choose_what_is_clustered(run_root, features):
    # Image features separate A|B, the captions separate C|D: each choice finds its own partition.
    n = 120
    g = torch.Generator().manual_seed(3)
    image_group, text_group = torch.arange(n) % 2, (torch.arange(n) // 2) % 2
    dirs = torch.nn.functional.normalize(torch.randn(4, 384, generator=g), dim=1)
    image = dirs[image_group, :16] * 10 + 0.01 * torch.randn(n, 16, generator=g)
    text = dirs[2 + text_group] + 0.01 * torch.randn(n, 384, generator=g)
    labels = image_group if features == "semantic" else text_group
    run = write_run(run_root, image, labels, text=text, k=2, fine_k=4, features=features)
    report = cluster(run, progress=False)
    assert report["features"]["kind"] == features
    if features == "both":  # both halves count: four groups, two partitions, each group whole
        groups = image_group * 2 + text_group
        assign = read_assignments(run, num_clusters=4)
        assert all(len(torch.unique(assign[groups == j])) == 1 for j in range(4))
    else:
        assert report["label_coherence"] == 1.0 and report["nmi"] > 0.99


def test_cluster_features_latent_clusters_the_latents_the_router_reads(run_root):
    """cluster.features latent: the images' latents (the run's own image encoder), flattened, not the semantic
    features: here the latents separate E|F while the semantic features and captions say otherwise."""
    n = 120
    g = torch.Generator().manual_seed(4)
    image_group, latent_group = torch.arange(n) % 2, (torch.arange(n) // 4) % 2
    image = torch.nn.functional.one_hot(image_group, 16).float() * 10 + 0.01 * torch.randn(n, 16, generator=g)
    latents = torch.rand(n, 1, 16, 16, generator=g) * 0.2 - 0.1
    latents[:, :, :8] += (latent_group * 2 - 1).float().view(n, 1, 1, 1)  # top half bright or dark
    run = write_run(run_root, image, latent_group, latents=latents, k=2, fine_k=4, features="latent")
    report = cluster(run, progress=False)
    assert report["features"] == {"kind": "latent", "latent": {"name": "pixels"}}
    assert report["label_coherence"] == 1.0 and report["nmi"] > 0.99
    assign = read_assignments(run, num_clusters=2)
    assert len(torch.unique(assign[image_group == 0])) == 2  # the semantic features' split is not it


@pytest.mark.numerics  # a float64 solve against plain means, within a derived tolerance
def test_caption_residual_removes_each_captions_mean():
    from flowfleet.cluster.features import caption_residual

    g = torch.Generator().manual_seed(6)
    x = torch.nn.functional.normalize(torch.randn(40, 8, generator=g), dim=1)
    caption = torch.arange(40) % 3  # three captions, one embedding each (a text encoder's 384-d vector)
    text = torch.randn(3, 384, generator=g)[caption]
    x64 = x.double()
    means = torch.stack([x64[caption == c].mean(0) for c in range(3)])
    expected = torch.nn.functional.normalize(x64 - means[caption], dim=1)
    got = caption_residual(x.clone(), text)
    # solved in float64, then rounded to float32 and normalised there (an 8-term norm, a division): gamma_16 of
    # float32 on unit rows bounds it; float64's own error is ~1e-13, far below
    assert torch.allclose(got.double(), expected, atol=gamma(16, torch.float32), rtol=0)


def test_cluster_caption_residual_clusters_what_the_caption_does_not_tell(run_root):
    """cluster.caption_residual: the features' strongest direction is the caption's (two captions), a weaker one
    is the style; plain k-means cuts the captions apart, the residual cuts the styles and every cluster holds
    both captions in equal shares."""
    n = 160
    g = torch.Generator().manual_seed(7)
    caption, style = torch.arange(n) % 2, (torch.arange(n) // 2) % 2
    dirs = torch.nn.functional.normalize(torch.randn(4, 16, generator=g), dim=1)
    image = dirs[caption] * 10 + dirs[2 + style] * 2 + 0.05 * torch.randn(n, 16, generator=g)
    text = torch.randn(2, 384, generator=g)[caption]
    plain = write_run(run_root / "plain", image, caption, text=text, k=2, fine_k=4)
    assert cluster(plain, progress=False)["nmi"] > 0.99  # the captions' split
    run = write_run(run_root / "residual", image, style, text=text, k=2, fine_k=4, caption_residual=True)
    report = cluster(run, progress=False)
    assert report["config"]["caption_residual"] is True and report["nmi"] > 0.99  # the styles' split
    assign = read_assignments(run, num_clusters=2)
    for k in range(2):
        assert torch.bincount(caption[assign == k], minlength=2).tolist() == [40, 40]


def test_caption_residual_needs_image_features():
    from flowfleet.config import ClusterConfig

    with pytest.raises(ValueError, match="caption_residual: the captions' own embedding"):
        ClusterConfig(features="text", caption_residual=True)
    assert ClusterConfig(features="latent", caption_residual=True).caption_residual


def test_rerun_replaces_partitions_and_random_mode(run_root):
    x, labels = blobs([30] * 4, seed=5)
    run = write_run(run_root, x, labels, k=4, fine_k=16)
    assert cluster(run, backend="torch", progress=False)["backend"] == "torch"
    assert run.exists("partitions", "3", "manifest.json")
    write_run(run_root, x, labels, k=2, fine_k=16, mode="random")
    report = cluster(run, progress=False)
    assert run.ls("partitions") == ["0", "1"] and not run.exists("clusters", "preview-3.png")
    assert report["mode"] == "random" and report["sizes"] == [60, 60] and report["nmi"] < 0.2
    assert sum(ShardSet(run, f"partitions/{k}").manifest().count for k in range(2)) == 120


def test_cluster_refuses_missing_or_unfinished_data(run_root):
    x, labels = blobs([10, 10])
    cfg = preset("mnist-tiny")
    cfg.save(RunRoot(run_root))
    with pytest.raises(FlowfleetError, match="data/manifest.json: missing; run `flowfleet prepare"):
        cluster(str(run_root), progress=False)
    run = write_run(run_root, x, labels, k=3, fine_k=8)
    m = ShardSet(run, "data").manifest()
    m.complete = False
    ShardSet(run, "data").write_manifest(m)
    with pytest.raises(FlowfleetError, match=r"data/manifest.json: incomplete .* finish `flowfleet prepare"):
        cluster(run, progress=False)
    write_run(run_root, x[:2], labels[:2], k=3, fine_k=8)
    with pytest.raises(FlowfleetError, match="cluster.k: 3 partitions for only 2 prepared items"):
        cluster(run, progress=False)


# ------------------------------------------------------------------------------------------------
#                                   end to end through the CLI
# ------------------------------------------------------------------------------------------------


def test_mnist_tiny_init_prepare_cluster_cli(tmp_path, capsys):
    """The preset exactly as `flowfleet init` writes it: MNIST digits, downsampled-pixel image features,
    MiniLM text; clusters of the images (Paris), not of the captions."""
    from flowfleet.cli import main

    run = str(tmp_path / "run")
    assert main(["init", run, "--preset", "mnist-tiny"]) == 0
    assert main(["prepare", run, "--quiet"]) == 0
    assert main(["cluster", run, "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "prepared 384 items in 3 shards" in out and "kmeans on semantic features: 3 partitions" in out
    root = RunRoot(run)
    data = ShardSet(root, "data").manifest()
    assert data.count == 384 and data.fields["features"]["shape"] == [768]  # 3 x 16 x 16 pixels (grey as RGB)
    assert data.extra["encoders"]["semantic"]["name"] == "pixels"
    report = root.read_json("clusters", "report.json")
    counts = [ShardSet(root, f"partitions/{k}").manifest().count for k in range(3)]
    assert all(c > 0 for c in counts) and sum(counts) == data.count == sum(report["sizes"])
    assert counts == report["sizes"] and report["nmi"] is not None
    # image clusters are made without labels: each holds a mixture of digits, more coherent than chance
    assert report["features"]["kind"] == "semantic" and 0.1 < report["nmi"] < 1.0
    assert report["label_coherence"] < 1.0
