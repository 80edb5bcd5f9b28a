"""Can a prompt-blind router serve every prompt? For clusterings of a prepared run's features, the digit
(label) that Paris' router p(k | x_t, t) serves worst at high t, where x_t says nothing and the router
can only follow the clusters' prior: the share of top-2's weight on experts holding < 2 % of that label's
items, and the share of its items in the largest cluster (what top-1 starts every sample with).

    python benchmarks/probes/cluster_coverage.py --run runs/demo --seeds 0,1,2

Prints one line per clustering (features x balance x seed), with its NMI and sizes; the cluster stage's
own two-stage k-means (flowfleet.cluster.two_stage_kmeans), fine k 32, K from --k.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from safetensors.torch import load_file


def worst_label(labels: torch.Tensor, assign: torch.Tensor, k: int) -> tuple[int, float, float]:
    """(label, top-2 weight at high t on experts holding < 2 % of it, its share in the largest cluster)."""
    sizes = torch.bincount(assign, minlength=k).double()
    mix = torch.zeros(k, int(labels.max()) + 1, dtype=torch.float64)
    mix.index_put_((assign, labels), torch.ones(len(labels), dtype=torch.float64), accumulate=True)
    share = mix / mix.sum(0)  # [K, L]: share of label l's items in cluster k
    prior = sizes / sizes.sum()
    top = prior.argsort(descending=True)[:2]
    weight = torch.zeros(k, dtype=torch.float64)
    weight[top] = prior[top] / prior[top].sum()  # top-2's renormalised weights when p(k | x_t, t) = p(k)
    blind = (weight[:, None] * (share < 0.02)).sum(0)  # [L]
    worst = int(blind.argmax())
    return worst, float(blind[worst]), float(share[top[0], worst])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", default="runs/demo", help="a prepared run (its data/ shards)")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--seeds", default="0,1,2")
    a = p.parse_args()

    from flowfleet.cluster import two_stage_kmeans
    from flowfleet.cluster.features import clustering_features
    from flowfleet.layout import DATA
    from flowfleet.stages.cluster import nmi

    shards = [load_file(f) for f in sorted((Path(a.run) / DATA).glob("shard-*.safetensors"))]
    fields = {name: torch.cat([s[name] for s in shards]) for name in ("features", "labels", "latents")}
    labels = fields["labels"]
    latents = fields["latents"].flatten(1)
    features = {
        "semantic": clustering_features(fields, "semantic"),
        "latent": latents / latents.norm(dim=1, keepdim=True),
    }
    for name, x in features.items():
        for balance in (False, True):
            for seed in [int(s) for s in a.seeds.split(",")]:
                assign = two_stage_kmeans(x, a.k, fine_k=32, sample_size=100_000, seed=seed, balance=balance).assign
                label, blind, largest = worst_label(labels, assign, a.k)
                sizes = torch.bincount(assign, minlength=a.k).tolist()
                print(
                    f"{name:8s} balance={balance!s:5s} seed={seed}  NMI {nmi(labels, assign):.3f}  sizes {sizes}  "
                    f"worst label {label}: top-2 weight at high t on experts without it {blind:.2f}, "
                    f"its share in the largest cluster {largest:.3f}"
                )


if __name__ == "__main__":
    main()
