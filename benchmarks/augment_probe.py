"""A probe of augmented training data: is each expert (a quarter of the digits) short of data, so that
augmented copies help the fleet more than the monolith?

Every training digit gets A augmented copies (a random shift, rotation and scale, each copy encoded by the
run's autoencoder) that share their original's caption, text and image features.

  leaking (default)  the copies are items of their own in OUT/data/; `flowfleet cluster` then clusters the
                     larger data/ afresh. The models learn the augmented distribution.
  --conditioned      EDM's non-leaking augmentation (Karras et al. 2022, appendix C): every item carries its
                     augmentation's parameters in an `augment` field (dx, dy, angle, scale, each scaled to
                     [-1, 1]; zeros for the originals) and the experts and the monolith are conditioned on them
                     (expert.augment_dim = 4); sampling passes none, i.e. the unaugmented distribution. The
                     copies keep their original's cluster (the run's assignments, no re-clustering), and each
                     original is listed --original-copies times, so that a training draw is augmented with
                     probability A / (A + R). With --train the script then trains every job with the product's
                     `train-all` at the run's own steps (the same FLOPs), assembles, and scores top-2 and the
                     monolith with `flowfleet evaluate` over --cfg.

    python benchmarks/augment_probe.py --run runs/demo --out runs/bench/aug4 --copies 4 --shift 2 --rotate 10
    flowfleet cluster runs/bench/aug4 && flowfleet train-all runs/bench/aug4 && flowfleet assemble runs/bench/aug4
    flowfleet evaluate runs/bench/aug4/model --n 300 --batch-size 300 --strategies top2 --monolith \
        --cfg-sweep 1.25,1.5,2,3,3.5,4.5 --fid-resize 75 --no-diagnostics

    HF_HUB_OFFLINE=1 python benchmarks/augment_probe.py --run runs/demo --out runs/bench/augc4 --copies 4 \
        --original-copies 4 --conditioned --train --cfg 1.25,1.5,2

The evaluation's reference stays the held-out, unaugmented digits.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from pathlib import Path

import yaml

AUGMENT_DIM = 4  # dx, dy, angle, scale


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True, help="a prepared run of the built-in digits in the autoencoder's latent")
    p.add_argument("--out", required=True)
    p.add_argument("--copies", type=int, default=4)
    p.add_argument("--shift", type=float, default=2.0, help="pixels, uniform in +-shift on each axis")
    p.add_argument("--rotate", type=float, default=10.0, help="degrees, uniform in +-rotate")
    p.add_argument("--scale", type=float, default=0.1, help="uniform in 1 +- scale")
    p.add_argument("--conditioned", action="store_true", help="non-leaking: condition the models on the augmentation")
    p.add_argument("--original-copies", type=int, default=1, help="--conditioned: times each original is listed")
    p.add_argument("--seed", type=int, default=0, help="--conditioned: every job's training seed")
    p.add_argument("--train", action="store_true", help="--conditioned: train, assemble and score")
    p.add_argument("--cfg", default="1.25,1.5,2", help="--train: the guidance sweep")
    p.add_argument("--n", type=int, default=300)
    p.add_argument("--parallel", type=int, default=2)
    a = p.parse_args()

    src, out = Path(a.run), Path(a.out)
    if not (out / "data" / "manifest.json").exists():
        build(a, src, out)
    if a.train:
        if not a.conditioned:
            raise SystemExit("--train needs --conditioned (the leaking copies are clustered afresh first)")
        train_and_score(a, out)


def build(a: argparse.Namespace, src: Path, out: Path) -> None:
    import torch
    import torch.nn.functional as F

    from flowfleet.cluster.assignments import write_assignments
    from flowfleet.config import load_run_config
    from flowfleet.data.encoders import run_latent_encoder
    from flowfleet.data.shards import ShardSet, ShardSetManifest, open_complete
    from flowfleet.evaluate.digits import mnist_tensors
    from flowfleet.stages.cluster import write_partitions
    from flowfleet.storage import RunRoot

    out.mkdir(parents=True, exist_ok=True)
    kept = ["autoencoder", "eval", "reports/digit_classifier"] + (["clusters"] if a.conditioned else [])
    for name in kept:
        if not (out / name).exists():
            shutil.copytree(src / name, out / name)
    raw = yaml.safe_load((src / "run.yaml").read_text())
    if a.conditioned:
        raw["expert"]["augment_dim"] = AUGMENT_DIM
        raw["train"]["seed"] = raw["router_train"]["seed"] = a.seed
    (out / "run.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
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

    def augment(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, 1, S, S] in [-1, 1] -> the same digits shifted, rotated and scaled (background stays -1), and
        their parameters [B, 4] scaled to [-1, 1]."""
        b, side = x.shape[0], x.shape[-1]
        u = torch.rand(b, AUGMENT_DIM, generator=gen) * 2 - 1  # [B, 4] dx, dy, angle, scale in [-1, 1]
        angle, scale = u[:, 2] * a.rotate * math.pi / 180, 1 + u[:, 3] * a.scale
        tx, ty = (u[:, i] * a.shift * 2 / side for i in range(2))
        theta = torch.stack(
            [
                torch.stack([torch.cos(angle) / scale, -torch.sin(angle) / scale, tx], dim=1),
                torch.stack([torch.sin(angle) / scale, torch.cos(angle) / scale, ty], dim=1),
            ],
            dim=1,
        )  # [B, 2, 3]
        grid = F.affine_grid(theta, list(x.shape), align_corners=False)
        return F.grid_sample(x + 1, grid, align_corners=False, padding_mode="zeros") - 1, u

    originals = a.original_copies if a.conditioned else 1
    parts = {name: [t] * originals for name, t in tensors.items()}
    params = [torch.zeros(n, AUGMENT_DIM)] * originals
    with torch.no_grad():
        for _ in range(a.copies):
            moved, u = augment(images[:n])
            latents = torch.cat([encoder.encode(b).float() for b in moved.split(500)])
            params.append(u)
            for name, t in tensors.items():
                parts[name].append(latents if name == "latents" else t)
    joined = {name: torch.cat(ts) for name, ts in parts.items()}
    if a.conditioned:
        joined["augment"] = torch.cat(params)
    total = joined["index"].shape[0]
    joined["index"] = torch.arange(total)
    copies = originals + a.copies
    all_captions = captions * copies
    shards = ShardSet(root, "data")
    made = ShardSetManifest(extra=dict(manifest.extra))
    size = 1000
    for lo in range(0, total, size):
        shards.append(made, {k: v[lo : lo + size] for k, v in joined.items()}, all_captions[lo : lo + size])
    made.complete = True
    shards.write_manifest(made)
    print(f"{out}/data: {total} items ({n} digits x {originals} and {a.copies} augmented copies of each)")
    if a.conditioned:  # row c * n + i is a copy of item i: it keeps item i's cluster
        from safetensors.torch import load_file

        own = load_file(src / "clusters/assignments.safetensors")
        write_assignments(root, own["assign"].repeat(copies), own["fine"].repeat(copies))
        cfg = load_run_config(root)
        write_partitions(root, cfg, ShardSet(root, "data"), made, own["assign"].repeat(copies), progress=False)


def train_and_score(a: argparse.Namespace, out: Path) -> None:
    from fleet_runs import keep_record, score_fleet  # benchmarks/ is the script's folder

    from flowfleet.stages.assemble import assemble
    from flowfleet.stages.train import train_all

    t0 = time.perf_counter()
    train_all(str(out), parallel=a.parallel, progress=False)
    train_s = time.perf_counter() - t0
    assemble(str(out), progress=False)
    rec = {
        "copies": a.copies,
        "original_copies": a.original_copies,
        "augment_p": a.copies / (a.copies + a.original_copies),
        "shift": a.shift,
        "rotate": a.rotate,
        "scale": a.scale,
        "seed": a.seed,
        "train_all_s": round(train_s, 1),
    }
    rec.update(score_fleet(out, ("top2",), a.cfg, a.n))
    keep_record(rec, out.parent / "augment.jsonl")
    chosen = {m: (rec[m]["cfg"], round(rec[m]["classifier_fd"], 2), rec[m]["accuracy"]) for m in ("top2", "monolith")}
    print(json.dumps(chosen))


if __name__ == "__main__":
    main()
