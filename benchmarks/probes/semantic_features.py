"""Which image features are semantic on MNIST-5k: k-means of each candidate, NMI with the digit labels.

    .venv/bin/python benchmarks/probes/semantic_features.py            # K = 4 and 8, three k-means seeds each
    .venv/bin/python benchmarks/probes/semantic_features.py --k 4 --seeds 0

Paris clusters the images' DINOv2 features, which are semantic on its data: each cluster holds related
content. The demo needs an encoder that is semantic on digits in the same sense (a cluster holds a few
digits, not every digit in one stroke style). Candidates, all unsupervised (no digit label is used to
make a feature; the labels only score the clusters):

    inception-75   the run's default semantic encoder, Inception pool3 at 75 px (2048-d)
    inception-299  the same at its native 299 px
    pixels-16      the image resized to 16 x 16 (256-d)
    pca-32         the 28 x 28 pixels projected on their first 32 principal components

Every feature is L2-normalised (as the cluster stage does) and clustered by flowfleet's k-means; printed
per feature and K: NMI with the digits (mean and sd over seeds) and the seconds to compute the features.
"""

from __future__ import annotations

import argparse
import time

import torch

from flowfleet.cluster.kmeans import kmeans
from flowfleet.config import SemanticEncoderConfig
from flowfleet.data.encoders import build_semantic_encoder
from flowfleet.evaluate.digits import mnist_tensors
from flowfleet.stages.cluster import nmi


def encoded(name: str, x: torch.Tensor) -> torch.Tensor:
    """Features [N, D] of images x [N, 1, 28, 28] in [-1, 1]."""
    if name.startswith("inception"):
        size = int(name.split("-")[1])
        enc = build_semantic_encoder(SemanticEncoderConfig(name="inception", image_size=size))
        with torch.no_grad():
            return torch.cat([enc.encode(x[i : i + 250]) for i in range(0, len(x), 250)])
    if name == "pixels-16":
        return torch.nn.functional.interpolate(x, size=16, mode="area").flatten(1)
    if name == "pca-32":
        flat = x.flatten(1)
        centred = flat - flat.mean(0)
        _, _, v = torch.pca_lowrank(centred, q=32, center=False, niter=4)
        return centred @ v  # [N, 32]
    raise ValueError(name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--features", nargs="+", default=["inception-75", "inception-299", "pixels-16", "pca-32"])
    ap.add_argument("--k", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = ap.parse_args()
    x, labels = mnist_tensors()
    print(f"{'features':<14} {'dim':>5} {'encode s':>9}  " + "  ".join(f"NMI K={k:<2} (sd)" for k in args.k))
    for name in args.features:
        t0 = time.perf_counter()
        f = encoded(name, x)
        seconds = time.perf_counter() - t0
        f = torch.nn.functional.normalize(f.float(), dim=1)
        cells = []
        for k in args.k:
            scores = torch.tensor([nmi(labels, kmeans(f, k, seed=s, iters=50).assign) for s in args.seeds])
            sd = float(scores.std()) if len(scores) > 1 else 0.0
            cells.append(f"{float(scores.mean()):.3f} ({sd:.3f})  ")
        print(f"{name:<14} {f.shape[1]:>5} {seconds:>9.1f}  " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
