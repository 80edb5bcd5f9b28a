"""Two-stage hierarchical k-means (DDM / Paris §2.6, after MetaCLIP's MoDE recipe).

    1. fine k-means: F centroids fitted on a seeded sample of the L2-normalised features
    2. coarse k-means: the F fine centroids clustered into K, each weighted by the items it holds
    3. every item goes to its nearest fine centroid, and through it to that centroid's coarse cluster

Stage 1 sees at most `sample_size` items and stage 3 is one nearest-neighbour search, so the cost is
dominated by N x F distance products, not by K. faiss runs both k-means and the search when it is
installed; otherwise a plain Lloyd's k-means in torch (hand-written: torch has none, and it runs on a
GPU when there is one). Both are deterministic for a seed: faiss's own seeded initialisation, and
in torch a seeded random choice of the first centroids with empty clusters re-seeded by the items
farthest from their centroid.

Weighting the coarse stage by fine-cluster size is our choice (the papers do not say): it makes the
coarse objective the item-level k-means objective with every item moved onto its fine centroid,
so a fine cluster of 3 outliers cannot claim a partition of its own (on MNIST it follows the digits a little
better than the unweighted stage).

faiss is optional and imported only by the faiss backend.
"""

from __future__ import annotations

import importlib.util
import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from tqdm.auto import tqdm

from flowfleet.errors import FlowfleetError

CHUNK = 32768  # rows per distance block: CHUNK x k floats
# The coarse k-means clusters only F points, so it is cheap to run it from several seeded random starts
# and keep the best: one random start often puts two centroids in one group and none in another.
COARSE_RESTARTS = 10


def faiss_available() -> bool:
    return importlib.util.find_spec("faiss") is not None


def resolve_backend(backend: str = "auto") -> str:
    if backend == "auto":
        return "faiss" if faiss_available() else "torch"
    if backend not in ("faiss", "torch"):
        raise ValueError(f"k-means backend: unknown {backend!r} (expected auto, faiss or torch)")
    if backend == "faiss" and not faiss_available():
        raise FlowfleetError("k-means backend 'faiss' is not installed (pip install faiss-cpu)")
    return backend


def l2_normalize_(x: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """Scale every row of a float32 [N, D] tensor to unit length, in place (no second N x D copy)."""
    for i in range(0, x.shape[0], chunk):
        block = x[i : i + chunk]
        block /= block.norm(dim=1, keepdim=True).clamp_min(1e-12)
    return x


# ------------------------------------------------------------------------------------------------
#                                     One k-means
# ------------------------------------------------------------------------------------------------


@dataclass
class KMeansResult:
    centroids: torch.Tensor  # [k, D] float32
    assign: torch.Tensor  # [n] int64
    inertia: float  # sum of squared distances to the assigned centroid


def assign_nearest(
    x: torch.Tensor,
    centroids: torch.Tensor,
    *,
    backend: str = "auto",
    device: torch.device | str = "cpu",
    progress: bool = False,
    desc: str = "assign",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Nearest centroid of each row: (index [N] int64, squared distance [N] float32)."""
    backend = resolve_backend(backend)
    n = x.shape[0]
    idx = torch.empty(n, dtype=torch.int64)
    dist = torch.empty(n, dtype=torch.float32)
    bar = tqdm(total=n, desc=desc, unit="item", disable=not progress, dynamic_ncols=True)
    if backend == "faiss":
        import faiss

        index = faiss.IndexFlatL2(centroids.shape[1])
        index.add(np.ascontiguousarray(centroids.cpu().numpy(), dtype=np.float32))
        for i in range(0, n, CHUNK):
            found_d2, found = index.search(np.ascontiguousarray(x[i : i + CHUNK].numpy(), dtype=np.float32), 1)
            idx[i : i + CHUNK] = torch.from_numpy(found[:, 0])
            dist[i : i + CHUNK] = torch.from_numpy(found_d2[:, 0])
            bar.update(min(CHUNK, n - i))
    else:
        c = centroids.to(device, torch.float32)  # [k, D]
        c2 = (c * c).sum(1)  # [k]
        for i in range(0, n, CHUNK):
            block = x[i : i + CHUNK].to(device, torch.float32)  # [b, D]
            d2 = (block * block).sum(1, keepdim=True) - 2 * block @ c.T + c2  # [b, k]
            best, j = d2.min(dim=1)
            idx[i : i + CHUNK] = j.cpu()
            dist[i : i + CHUNK] = best.clamp_min(0).cpu()
            bar.update(block.shape[0])
    bar.close()
    return idx, dist


def _torch_kmeans(
    x: torch.Tensor, k: int, iters: int, seed: int, device: torch.device | str, weights: torch.Tensor
) -> torch.Tensor:
    """Lloyd's algorithm on weighted points; returns the centroids [k, D]."""
    gen = torch.Generator().manual_seed(seed)
    c = x[torch.randperm(x.shape[0], generator=gen)[:k]].to(device, torch.float32).clone()  # [k, D]
    w = weights.double()  # [n]
    for _ in range(iters):
        a, d2 = assign_nearest(x, c, backend="torch", device=device)
        sums = torch.zeros(k, x.shape[1], dtype=torch.float64).index_add_(0, a, x.double() * w[:, None])  # [k, D]
        counts = torch.zeros(k, dtype=torch.float64).index_add_(0, a, w)  # [k] total weight
        new = (sums / counts.clamp_min(1e-12).unsqueeze(1)).float()
        empty = counts == 0
        if empty.any():  # re-seed with the items worst served by their centroid
            new[empty] = x[d2.topk(int(empty.sum())).indices].float()
        new = new.to(device)
        if torch.equal(new, c):
            break
        c = new
    return c.cpu()


def kmeans(
    x: torch.Tensor,
    k: int,
    *,
    iters: int = 25,
    seed: int = 0,
    restarts: int = 1,
    weights: torch.Tensor | None = None,
    backend: str = "auto",
    device: torch.device | str = "cpu",
) -> KMeansResult:
    """k-means of the rows of x [n, D] (n >= k), each row counting `weights[i]` times (default 1);
    with restarts > 1, the lowest-inertia of that many seeded runs. Inertia is weighted."""
    n = x.shape[0]
    if k > n:
        raise ValueError(f"k-means: {k} clusters for {n} points")
    backend = resolve_backend(backend)
    x = x.float().contiguous()
    w = torch.ones(n) if weights is None else weights.float()
    if backend == "faiss":
        import faiss

        # max_points_per_centroid = all: the caller already chose the sample (cluster.sample_size).
        km = faiss.Kmeans(
            x.shape[1],
            k,
            niter=iters,
            seed=seed,
            nredo=restarts,
            verbose=False,
            min_points_per_centroid=1,
            max_points_per_centroid=math.ceil(n / k) + 1,
        )
        km.train(x.numpy(), weights=None if weights is None else np.ascontiguousarray(w.numpy()))
        centroids = torch.from_numpy(np.array(km.centroids, dtype=np.float32))
        assign, d2 = assign_nearest(x, centroids, backend=backend, device=device)
        return KMeansResult(centroids, assign, float((d2.double() * w.double()).sum()))
    best: KMeansResult | None = None
    for r in range(restarts):
        centroids = _torch_kmeans(x, k, iters, seed + r, device, w)
        assign, d2 = assign_nearest(x, centroids, backend=backend, device=device)
        inertia = float((d2.double() * w.double()).sum())
        if best is None or inertia < best.inertia:
            best = KMeansResult(centroids, assign, inertia)
    assert best is not None
    return best


# ------------------------------------------------------------------------------------------------
#                                     Two stages
# ------------------------------------------------------------------------------------------------


@dataclass
class TwoStageResult:
    fine: torch.Tensor  # [F, D] fine centroids
    coarse: torch.Tensor  # [K, D] coarse centroids
    fine_to_coarse: torch.Tensor  # [F] int64
    fine_assign: torch.Tensor  # [N] int64 nearest fine centroid
    assign: torch.Tensor  # [N] int64 partition = fine_to_coarse[fine_assign]
    inertia_fine: float  # sum over items of |x - fine centroid|^2
    inertia_coarse: float  # sum over items of |x - coarse centroid|^2
    sample_size: int
    backend: str
    reseeds: int = 0  # coarse k-means re-runs caused by an empty partition
    notes: list[str] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)  # wall time per phase: fine, assign, coarse

    @property
    def sizes(self) -> list[int]:
        return torch.bincount(self.assign, minlength=self.coarse.shape[0]).tolist()


def balance_fine_to_coarse(
    fine: torch.Tensor, coarse: torch.Tensor, fine_sizes: torch.Tensor, slack: float = 0.1
) -> torch.Tensor:
    """Size-balanced fine -> coarse map: each coarse cluster holds at most (1 + slack) N / K items.

    Greedy, hand-written (no library does capacity-constrained assignment of weighted points): fine
    clusters, largest first, go to the nearest coarse centroid with room left, or to the emptiest one
    when none has room. Balance is therefore only as fine as the fine clusters."""
    k = coarse.shape[0]
    cap = math.ceil((1 + slack) * float(fine_sizes.sum()) / k)
    d2 = torch.cdist(fine.double(), coarse.double())  # [F, K]
    load = torch.zeros(k, dtype=torch.int64)
    out = torch.empty(fine.shape[0], dtype=torch.int64)
    for f in torch.argsort(fine_sizes, descending=True, stable=True).tolist():
        size = int(fine_sizes[f])
        fits = (load + size <= cap).nonzero().flatten()
        j = int(fits[d2[f, fits].argmin()]) if len(fits) else int(load.argmin())
        out[f] = j
        load[j] += size
    return out


def lift_to_floor(
    fine: torch.Tensor, coarse: torch.Tensor, fine_sizes: torch.Tensor, fine_to_coarse: torch.Tensor, floor: float
) -> torch.Tensor:
    """The fine -> coarse map with every coarse cluster lifted to at least `floor` items where it can be: the
    smallest one under it takes, one at a time, the fine cluster nearest its centroid among those whose own
    cluster stays at or above the floor without it. Clusters already above the floor keep their k-means shape
    (cluster.balance evens every size instead). Hand-written: no library does a floor-constrained reassignment of
    weighted points. Where the fine clusters are too coarse to reach the floor, the map stops short of it (the
    caller says so)."""
    out = fine_to_coarse.clone()
    k = coarse.shape[0]
    d = torch.cdist(fine.double(), coarse.double())  # [F, K]
    sizes = fine_sizes.double()
    load = torch.zeros(k, dtype=torch.float64).index_add_(0, out, sizes)
    while True:
        j = int(load.argmin())
        if load[j] >= floor:
            return out
        movable = ((load[out] - sizes >= floor) & (out != j) & (sizes > 0)).nonzero().flatten()
        if len(movable) == 0:
            return out
        f = int(movable[d[movable, j].argmin()])
        load[out[f]] -= sizes[f]
        load[j] += sizes[f]
        out[f] = j


def _weighted_means(fine: torch.Tensor, fine_to_coarse: torch.Tensor, weights: torch.Tensor, k: int) -> torch.Tensor:
    w = weights.double().unsqueeze(1)  # [F, 1]
    sums = torch.zeros(k, fine.shape[1], dtype=torch.float64).index_add_(0, fine_to_coarse, fine.double() * w)
    tot = torch.zeros(k, dtype=torch.float64).index_add_(0, fine_to_coarse, weights.double())
    return (sums / tot.clamp_min(1e-12).unsqueeze(1)).float()  # [K, D]


def _coarse_inertia(x: torch.Tensor, coarse: torch.Tensor, assign: torch.Tensor) -> float:
    total = 0.0
    for i in range(0, x.shape[0], CHUNK):
        diff = x[i : i + CHUNK] - coarse[assign[i : i + CHUNK]]
        total += float((diff.double() ** 2).sum())
    return total


def two_stage_kmeans(
    x: torch.Tensor,
    k: int,
    *,
    fine_k: int,
    sample_size: int,
    iters: int = 25,
    seed: int = 0,
    balance: float | None = None,
    min_size: float = 0.0,
    backend: str = "auto",
    device: torch.device | str = "cpu",
    max_reseeds: int = 5,
    progress: bool = False,
) -> TwoStageResult:
    """Partition the rows of x [N, D] (L2-normalised by the caller) into k clusters; see the module doc. balance:
    each partition at most (1 + balance) N / K items (None: as k-means has them); min_size: none under it.

    An empty partition triggers the coarse k-means again with the next seed (at most `max_reseeds`
    times); a partition that stays empty is an error, never a silent empty expert."""
    backend = resolve_backend(backend)
    n = x.shape[0]
    if k > n:
        raise FlowfleetError(f"cluster.k: {k} partitions for only {n} prepared items")
    s = min(sample_size, n)
    f = min(fine_k, s)
    notes = []
    if f < fine_k:
        notes.append(f"fine_k {fine_k} capped at the sample size {s}")
    if f < k:
        raise FlowfleetError(
            f"cluster.fine_k: {f} fine clusters (capped at the {s}-item sample) cannot make {k} "
            f"coarse clusters; raise cluster.fine_k or cluster.sample_size"
        )
    seconds: dict[str, float] = {}
    t = time.perf_counter()
    gen = torch.Generator().manual_seed(seed)
    sample = torch.sort(torch.randperm(n, generator=gen)[:s]).values  # [S]
    xs = x[sample] if s < n else x
    fine = kmeans(xs, f, iters=iters, seed=seed, backend=backend, device=device).centroids  # [F, D]
    del xs
    seconds["fine"] = time.perf_counter() - t
    t = time.perf_counter()
    fine_assign, d2 = assign_nearest(
        x, fine, backend=backend, device=device, progress=progress, desc="assign to fine centroids"
    )  # [N], [N]
    seconds["assign"] = time.perf_counter() - t
    t = time.perf_counter()
    fine_sizes = torch.bincount(fine_assign, minlength=f)  # [F]
    fine_to_coarse, coarse, assign, attempt, lifted = _coarse_stage(
        fine, fine_sizes, fine_assign, k, iters, seed, balance, min_size, backend, device, max_reseeds
    )
    seconds["coarse"] = time.perf_counter() - t
    if lifted:
        notes.append(f"partitions under {min_size:g} items took the fine clusters nearest them (cluster.min_share)")
    return TwoStageResult(
        fine,
        coarse,
        fine_to_coarse,
        fine_assign,
        assign,
        float(d2.double().sum()),
        _coarse_inertia(x, coarse, assign),
        s,
        backend,
        attempt,
        notes,
        {k: round(v, 3) for k, v in seconds.items()},
    )


def _coarse_stage(
    fine: torch.Tensor,
    fine_sizes: torch.Tensor,
    fine_assign: torch.Tensor,
    k: int,
    iters: int,
    seed: int,
    balance: float | None,
    min_size: float,
    backend: str,
    device: torch.device | str,
    max_reseeds: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, bool]:
    """The fine centroids clustered into k, weighted by their items (balanced, and partitions under min_size
    lifted), re-seeded while a partition stays empty. -> (fine_to_coarse [F], coarse [K, D], assign [N], the
    re-seeds it took, whether a partition was lifted)."""
    for attempt in range(max_reseeds + 1):
        coarse_fit = kmeans(
            fine,
            k,
            iters=iters,
            seed=seed + 1000 * attempt,
            restarts=COARSE_RESTARTS,
            weights=fine_sizes.float(),
            backend=backend,
            device=device,
        )
        fine_to_coarse = coarse_fit.assign  # [F]
        coarse = coarse_fit.centroids  # [K, D]
        if balance is not None:
            fine_to_coarse = balance_fine_to_coarse(fine, coarse, fine_sizes, slack=balance)
            coarse = _weighted_means(fine, fine_to_coarse, fine_sizes, k)
        lifted = bool(torch.bincount(fine_to_coarse, weights=fine_sizes.double(), minlength=k).min() < min_size)
        if lifted:  # a partition under the floor takes the fine clusters nearest it
            fine_to_coarse = lift_to_floor(fine, coarse, fine_sizes, fine_to_coarse, min_size)
            coarse = _weighted_means(fine, fine_to_coarse, fine_sizes, k)
        assign = fine_to_coarse[fine_assign]  # [N]
        empty = (torch.bincount(assign, minlength=k) == 0).nonzero().flatten().tolist()
        if not empty:
            return fine_to_coarse, coarse, assign, attempt, lifted
    raise FlowfleetError(
        f"cluster: partition(s) {empty} stay empty after {max_reseeds} re-seeded coarse k-means "
        f"runs; lower cluster.k or raise cluster.fine_k"
    )


def random_partition(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """The baseline: a seeded random split into k parts whose sizes differ by at most one."""
    if k > n:
        raise FlowfleetError(f"cluster.k: {k} partitions for only {n} prepared items")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    assign = torch.empty(n, dtype=torch.int64)
    assign[perm] = torch.arange(n) % k
    return assign
