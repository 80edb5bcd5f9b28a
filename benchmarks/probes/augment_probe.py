"""A probe of augmented training data: is each expert (a quarter of the digits) short of data, so that
augmented copies help the fleet more than the monolith?

Every training digit gets A augmented copies (a random shift, rotation and scale: flowfleet.data.augment's
transform, each copy encoded by the run's autoencoder) that share their original's caption, text and image
features. The copies are items of their own in OUT/data/ (a *leaking* augmentation: the models learn the
augmented distribution); `flowfleet cluster` then clusters the larger data/ afresh.

    python benchmarks/probes/augment_probe.py --run runs/demo --out runs/bench/aug4 --copies 4 --shift 2 --rotate 10
    flowfleet cluster runs/bench/aug4 && flowfleet train-all runs/bench/aug4 && flowfleet assemble runs/bench/aug4
    flowfleet evaluate runs/bench/aug4/model --n 300 --batch-size 300 --strategies top2 --monolith \
        --cfg-sweep 1.25,1.5,2,3,3.5,4.5 --fid-resize 75 --no-diagnostics

The non-leaking variant (EDM's: the models conditioned on each copy's parameters, sampling the unaugmented
distribution) is the product's own since 2026-11-27: run.yaml data.augment.copies, train.augment_p and
expert.augment_dim. The --conditioned figures of 2026-11-27 ("Regularisers for data-limited experts" in
BENCHMARKS.md) were measured with this script at 72c6414.

The evaluation's reference stays the held-out, unaugmented digits.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import yaml


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True, help="a prepared run of the built-in digits in the autoencoder's latent")
    p.add_argument("--out", required=True)
    p.add_argument("--copies", type=int, default=4)
    p.add_argument("--shift", type=float, default=2.0, help="pixels, uniform in +-shift on each axis")
    p.add_argument("--rotate", type=float, default=10.0, help="degrees, uniform in +-rotate")
    p.add_argument("--scale", type=float, default=0.1, help="uniform in 1 +- scale")
    a = p.parse_args()
    src, out = Path(a.run), Path(a.out)
    if not (out / "data" / "manifest.json").exists():
        build(a, src, out)


def build(a: argparse.Namespace, src: Path, out: Path) -> None:
    import torch

    from flowfleet.config import AUGMENT_DIM, load_run_config
    from flowfleet.data.augment import transform
    from flowfleet.data.encoders import run_latent_encoder
    from flowfleet.data.shards import ShardSet, ShardSetManifest, open_complete
    from flowfleet.evaluate.digits import mnist_tensors
    from flowfleet.storage import RunRoot

    out.mkdir(parents=True, exist_ok=True)
    for name in ["autoencoder", "eval", "reports/digit_classifier"]:
        if not (out / name).exists():
            shutil.copytree(src / name, out / name)
    raw = yaml.safe_load((src / "run.yaml").read_text())
    (out / "run.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    root = RunRoot(str(out))
    data = open_complete(RunRoot(str(src)), "data", f"flowfleet prepare {src}")
    manifest = data.manifest()
    fields = [f for f in manifest.fields if not f.startswith("aug_")]
    tensors, captions = data.load(fields, with_captions=True)
    images, labels = mnist_tensors()
    n = tensors["index"].shape[0]
    if not torch.equal(labels[:n], tensors["labels"]):
        raise SystemExit(f"{src}/data is not the first {n} digits of MNIST-5k")
    encoder = run_latent_encoder(root, load_run_config(root), "cpu")
    gen = torch.Generator().manual_seed(0)
    parts = {name: [t] for name, t in tensors.items()}
    with torch.no_grad():
        for _ in range(a.copies):
            params = torch.rand(n, AUGMENT_DIM, generator=gen) * 2 - 1  # [N, 4] dx, dy, angle, scale
            moved = transform(images[:n], params, a.shift, a.rotate, a.scale)
            latents = torch.cat([encoder.encode(b).float() for b in moved.split(500)])
            for name, t in tensors.items():
                parts[name].append(latents if name == "latents" else t)
    joined = {name: torch.cat(ts) for name, ts in parts.items()}
    total = joined["index"].shape[0]
    joined["index"] = torch.arange(total)
    all_captions = captions * (1 + a.copies)
    shards = ShardSet(root, "data")
    made = ShardSetManifest(extra=dict(manifest.extra))
    size = 1000
    for lo in range(0, total, size):
        shards.append(made, {k: v[lo : lo + size] for k, v in joined.items()}, all_captions[lo : lo + size])
    made.complete = True
    shards.write_manifest(made)
    print(f"{out}/data: {total} items ({n} digits and {a.copies} augmented copies of each)")


if __name__ == "__main__":
    main()
