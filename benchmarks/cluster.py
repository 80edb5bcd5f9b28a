"""Two-stage k-means at Paris scale, and the MNIST NMI check.

    .venv/bin/python benchmarks/cluster.py                       # 1M x 1024 synthetic, fine k 1024, K 8
    .venv/bin/python benchmarks/cluster.py --n 100000 --dim 256  # quick
    .venv/bin/python benchmarks/cluster.py --mnist runs/mnist-k10 # init (mnist, K=10) -> prepare -> cluster
    .venv/bin/python benchmarks/cluster.py --levers runs/demo-emoji --lever power=1,fine_k=32,min_share=0 \
        --lever power=0.5,fine_k=128,min_share=0 --lever ''    # a prepared run's NMI under cluster levers

Synthetic part. N features of dimension D drawn around --modes random Gaussian centres (so k-means
has structure to find), generated in chunks into one float32 tensor, L2-normalised in place, then
flowfleet.cluster.two_stage_kmeans: fine k-means (--fine-k) on a seeded sample of --sample items,
every item assigned to its nearest fine centroid, the fine centroids clustered into K. Reported: wall
time per phase, the peak resident memory of the process (ru_maxrss) and how much of it is the
feature matrix itself (N x D x 4 bytes), the backend, and the load average before and after (the
machine is shared; see BENCHMARKS.md).

MNIST part. `flowfleet init DIR --preset mnist`, cluster.k and router.num_outputs set to 10 (one
partition per digit would be perfect), fine_k 64, then the prepare and cluster stages; prints the
report's NMI between partitions and digit labels (written to DIR/clusters/report.json).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time

import torch


def synthetic(n: int, dim: int, modes: int, seed: int, chunk: int = 65536) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(modes, dim, generator=g)  # [M, D]
    x = torch.empty(n, dim)  # [N, D] float32, filled in place (no second copy)
    for lo in range(0, n, chunk):
        hi = min(lo + chunk, n)
        labels = torch.randint(0, modes, (hi - lo,), generator=g)
        x[lo:hi] = centres[labels] + 0.8 * torch.randn(hi - lo, dim, generator=g)
    return x


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB


def run_synthetic(args: argparse.Namespace) -> dict:
    from flowfleet.cluster import l2_normalize_, two_stage_kmeans

    load_before = os.getloadavg()
    t0 = time.perf_counter()
    x = synthetic(args.n, args.dim, args.modes, args.seed)
    t_gen = time.perf_counter() - t0
    rss_data = peak_rss_gib()
    t0 = time.perf_counter()
    l2_normalize_(x)
    t_norm = time.perf_counter() - t0
    t0 = time.perf_counter()
    res = two_stage_kmeans(
        x,
        args.k,
        fine_k=args.fine_k,
        sample_size=args.sample,
        iters=args.iters,
        seed=args.seed,
        backend=args.backend,
        progress=True,
    )
    t_cluster = time.perf_counter() - t0
    out = {
        "n": args.n,
        "dim": args.dim,
        "fine_k": res.fine.shape[0],
        "k": args.k,
        "sample": res.sample_size,
        "iters": args.iters,
        "backend": res.backend,
        "threads": torch.get_num_threads(),
        "seconds": {
            "generate": round(t_gen, 1),
            "normalise": round(t_norm, 1),
            **res.seconds,
            "two_stage_total": round(t_cluster, 1),
        },
        "peak_rss_gib": round(peak_rss_gib(), 2),
        "rss_after_generating_gib": round(rss_data, 2),
        "features_gib": round(args.n * args.dim * 4 / 2**30, 2),
        "sizes": res.sizes,
        "load_before": [round(v, 2) for v in load_before],
        "load_after": [round(v, 2) for v in os.getloadavg()],
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    return out


def run_mnist(path: str) -> dict:
    from flowfleet.config import RunConfig, load_run_config
    from flowfleet.stages.cluster import cluster
    from flowfleet.stages.init import init_run
    from flowfleet.stages.prepare import prepare
    from flowfleet.storage import RunRoot

    root = RunRoot(path)
    if not root.exists("run.yaml"):
        init_run(path, "mnist")
    raw = load_run_config(root).to_dict()
    raw["cluster"].update(k=10, fine_k=64)
    raw["router"]["num_outputs"] = 10
    RunConfig.from_dict(raw).save(root)
    t0 = time.perf_counter()
    m = prepare(root)
    t_prepare = time.perf_counter() - t0
    t0 = time.perf_counter()
    report = cluster(root)
    t_cluster = time.perf_counter() - t0
    return {
        "count": m.count,
        "features": m.extra["encoders"]["semantic"],
        "k": report["k"],
        "nmi": report["nmi"],
        "nmi_random_same_sizes": report["nmi_random_same_sizes"],
        "sizes": report["sizes"],
        "prepare_seconds_this_call": round(t_prepare, 1),
        "prepare_seconds_recorded": m.extra.get("seconds"),
        "cluster_seconds": round(t_cluster, 1),
        "load_after": [round(v, 2) for v in os.getloadavg()],
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def run_levers(path: str, levers: list[str], seeds: int) -> list[dict]:
    """On a prepared run (its data/), `flowfleet cluster`'s own features and partition under each lever set (the
    cluster section's KEY=VALUE pairs, comma-separated, over the run's own; '' for none): NMI with the source's
    labels and the smallest partition's share, mean and sd over cluster seeds 0 .. seeds - 1."""
    import statistics

    import torch

    from flowfleet.config import ClusterConfig, load_run_config, set_dotted
    from flowfleet.data.shards import open_complete
    from flowfleet.stages.cluster import clustered_features, nmi, partition_items
    from flowfleet.storage import RunRoot

    root = RunRoot(path)
    base = load_run_config(root).cluster.model_dump()
    data = open_complete(root, "data", "flowfleet prepare")
    rows = []
    for lever in levers:
        raw = {"cluster": dict(base)}
        for part in filter(None, lever.split(",")):
            set_dotted(raw, f"cluster.{part}")
        c = ClusterConfig(**raw["cluster"])
        x, labels, _, fine_k = clustered_features(data, c)
        nmis, smallest = [], []
        for seed in range(seeds):
            run = c.model_copy(update={"seed": seed})
            assign = partition_items(x.clone(), run, fine_k, "auto", torch.device("cpu"), False, {})[0]
            nmis.append(nmi(labels, assign))
            smallest.append(int(torch.bincount(assign, minlength=c.k).min()) / len(labels))
        rows.append(
            {
                "lever": lever or "(the run's)",
                "nmi": statistics.fmean(nmis),
                "nmi_sd": statistics.stdev(nmis) if seeds > 1 else 0.0,
                "smallest_share": [round(v, 3) for v in smallest],
            }
        )
        print(
            f"| {rows[-1]['lever']} | {rows[-1]['nmi']:.3f} ± {rows[-1]['nmi_sd']:.3f} | {rows[-1]['smallest_share']} |"
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--modes", type=int, default=64, help="Gaussian modes the synthetic features are drawn from")
    p.add_argument("--fine-k", type=int, default=1024)
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--sample", type=int, default=262_144, help="items the fine k-means is fitted on (256 per centroid)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--backend", default="auto", choices=["auto", "faiss", "torch"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mnist", metavar="DIR", help="instead: the MNIST K=10 NMI run in this run root")
    p.add_argument("--out", help="also write the result JSON here")
    p.add_argument("--levers", metavar="RUN", help="instead: NMI of RUN's clusters under each --lever set")
    p.add_argument("--lever", action="append", default=[], help="cluster KEY=VALUE[,KEY=VALUE] ('' the run's own)")
    p.add_argument("--seeds", type=int, default=5, help="cluster seeds per lever set (--levers)")
    args = p.parse_args()
    if args.levers:
        print("| cluster levers | NMI with the labels (mean ± sd over seeds) | smallest partition's share per seed |")
        print("|---|---|---|")
        result = run_levers(args.levers, args.lever or [""], args.seeds)
    else:
        result = run_mnist(args.mnist) if args.mnist else run_synthetic(args)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
