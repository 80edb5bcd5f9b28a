"""A probe of a data setting the product does not have: A augmented copies of every training digit (a random
shift, rotation and scale, each copy encoded by the run's autoencoder), added to a prepared run's data/ as items
of their own that share their original's caption, image features and text. Is the fleet short of data per
expert (a quarter of 4000 digits each), so that more of it helps the fleet more than the monolith?

    python benchmarks/augment_probe.py --run runs/demo --out runs/bench/aug4 --copies 4 --shift 2 --rotate 10
    flowfleet cluster runs/bench/aug4 && flowfleet train-all runs/bench/aug4 && flowfleet assemble runs/bench/aug4
    flowfleet evaluate runs/bench/aug4/model --n 300 --batch-size 300 --strategies top2 --monolith \
        --cfg-sweep 1.25,1.5,2,3,3.5,4.5 --fid-resize 75 --no-diagnostics

The copies are clustered with their originals' features (the cluster stage runs afresh on the larger data/);
the evaluation's reference stays the held-out, unaugmented digits.
"""

from __future__ import annotations

import argparse
import math
import shutil
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True, help="a prepared run of the built-in digits in the autoencoder's latent")
    p.add_argument("--out", required=True)
    p.add_argument("--copies", type=int, default=4)
    p.add_argument("--shift", type=float, default=2.0, help="pixels, uniform in +-shift on each axis")
    p.add_argument("--rotate", type=float, default=10.0, help="degrees, uniform in +-rotate")
    p.add_argument("--scale", type=float, default=0.1, help="uniform in 1 +- scale")
    a = p.parse_args()

    import torch
    import torch.nn.functional as F

    from flowfleet.config import load_run_config
    from flowfleet.data.encoders import run_latent_encoder
    from flowfleet.data.shards import ShardSet, ShardSetManifest, open_complete
    from flowfleet.evaluate.digits import mnist_tensors
    from flowfleet.storage import RunRoot

    src, out = Path(a.run), Path(a.out)
    out.mkdir(parents=True)
    for name in ("autoencoder", "eval", "reports/digit_classifier"):
        shutil.copytree(src / name, out / name)
    shutil.copy(src / "run.yaml", out / "run.yaml")
    root = RunRoot(str(out))
    data = open_complete(RunRoot(str(src)), "data", f"flowfleet prepare {src}")
    manifest = data.manifest()
    tensors, captions = data.load(list(manifest.fields), with_captions=True)
    images, labels = mnist_tensors()
    n = tensors["index"].shape[0]
    if not torch.equal(labels[:n], tensors["labels"]):
        raise SystemExit(f"{src}/data is not the first {n} digits of MNIST-5k")
    encoder = run_latent_encoder(root, load_run_config(root), "cpu")
    gen = torch.Generator().manual_seed(0)

    def augment(x: torch.Tensor) -> torch.Tensor:
        """[B, 1, S, S] in [-1, 1] -> the same digits shifted, rotated and scaled (background stays -1)."""
        b, side = x.shape[0], x.shape[-1]
        angle = (torch.rand(b, generator=gen) * 2 - 1) * a.rotate * math.pi / 180
        scale = 1 + (torch.rand(b, generator=gen) * 2 - 1) * a.scale
        tx, ty = ((torch.rand(b, generator=gen) * 2 - 1) * a.shift * 2 / side for _ in range(2))
        theta = torch.stack(
            [
                torch.stack([torch.cos(angle) / scale, -torch.sin(angle) / scale, tx], dim=1),
                torch.stack([torch.sin(angle) / scale, torch.cos(angle) / scale, ty], dim=1),
            ],
            dim=1,
        )  # [B, 2, 3]
        grid = F.affine_grid(theta, list(x.shape), align_corners=False)
        return F.grid_sample(x + 1, grid, align_corners=False, padding_mode="zeros") - 1

    parts = {name: [t] for name, t in tensors.items()}
    with torch.no_grad():
        for _ in range(a.copies):
            latents = torch.cat([encoder.encode(b).float() for b in augment(images[:n]).split(500)])
            for name, t in tensors.items():
                parts[name].append(latents if name == "latents" else t)
    joined = {name: torch.cat(ts) for name, ts in parts.items()}
    joined["index"] = torch.arange(joined["index"].shape[0])
    all_captions = captions * (a.copies + 1)
    shards = ShardSet(root, "data")
    made = ShardSetManifest(extra=dict(manifest.extra))
    size = 1000
    for lo in range(0, len(all_captions), size):
        shards.append(made, {k: v[lo : lo + size] for k, v in joined.items()}, all_captions[lo : lo + size])
    made.complete = True
    shards.write_manifest(made)
    print(f"{out}/data: {len(all_captions)} items ({n} digits and {a.copies} augmented copies of each)")


if __name__ == "__main__":
    main()
