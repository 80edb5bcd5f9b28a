"""A lever for the fleet: overlapping clusters, each training item in its M nearest clusters.

Paris and DDM partition the data: each expert sees 1/K of it. With overlap M every item also joins the
M - 1 coarse clusters whose centroids lie nearest its features after its own, so each expert sees about
M/K of the data at the same training steps (the same FLOPs). Every item then counts M times in the
union, so the mixture of the experts' distributions, weighted by their sizes, is still the data's: the
marginal-flow identity the fleet rests on holds, provided the router learns p(k | x_t, t) of that
mixture. Here it does: data/ lists every item M times, the m-th copy labelled with its m-th cluster, so
the router's cross-entropy has the soft target 1/M on each of an item's clusters.

Not a product setting: this script builds OUT from a clustered run (its data, features, centroids),
trains the experts and the router with the product's `train-all`, reuses the run's own monolith (the
same data distribution, architecture and steps), and evaluates top-2 with `flowfleet evaluate`:

    HF_HUB_OFFLINE=1 python benchmarks/probes/cluster_overlap.py --run runs/demo --out runs/bench/overlap2 --overlap 2
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import safetensors.torch
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the helpers the probes share

# the run's prepared parts this one keeps; data/, clusters/assignments and partitions/ are rewritten
KEPT = ("eval", "autoencoder", "clusters", "reports/digit_classifier", "monolith", "run.yaml")
FIELDS = ("latents", "features", "labels", "index", "text_pooled", "text_tokens", "text_mask")


def memberships(x: torch.Tensor, coarse: torch.Tensor, assign: torch.Tensor, m: int) -> torch.Tensor:
    """[N, m]: each item's own cluster, then the m - 1 other clusters nearest its clustering features x
    (normalised rows, the space the run's k-means worked in)."""
    from flowfleet.cluster.kmeans import l2_normalize_

    d = torch.cdist(x.float(), l2_normalize_(coarse.float()))  # [N, K]
    d[torch.arange(len(d)), assign] = -1.0  # its own cluster first
    return d.argsort(dim=1)[:, :m]


def build(src: Path, out: Path, m: int) -> dict:
    from flowfleet.cluster.assignments import write_assignments
    from flowfleet.cluster.features import FEATURE_FIELDS, caption_residual, clustering_features
    from flowfleet.config import load_run_config
    from flowfleet.data.shards import ShardSet, ShardSetManifest, open_complete
    from flowfleet.layout import DATA, partition
    from flowfleet.storage import RunRoot

    out.mkdir(parents=True, exist_ok=True)
    for name in KEPT:
        if (src / name).is_dir() and not (out / name).exists():
            shutil.copytree(src / name, out / name)
        elif (src / name).is_file():
            shutil.copy(src / name, out / name)
    sroot, root = RunRoot(str(src)), RunRoot(str(out))
    cfg = load_run_config(sroot)
    data = open_complete(sroot, DATA, "flowfleet prepare")
    fields, captions = data.load(FIELDS, with_captions=True)
    n, k_total, size = len(captions), cfg.cluster.k, cfg.data.shard_size
    assign = safetensors.torch.load_file(src / "clusters/assignments.safetensors")["assign"]
    coarse = safetensors.torch.load_file(src / "clusters/centroids.safetensors")["coarse"]

    x = clustering_features(fields, cfg.cluster.features)  # what `cluster` clustered, caption residual included
    if cfg.cluster.caption_residual:
        x = caption_residual(x, fields["text_pooled"])
    assert set(FEATURE_FIELDS[cfg.cluster.features]) <= set(FIELDS)
    member = memberships(x, coarse, assign, m)  # [N, m]
    counts = [int((member == k).any(dim=1).sum()) for k in range(k_total)]  # train.expert_steps: by_size reads them
    own = json.loads((src / partition(0) / "manifest.json").read_text())  # the extras sit beside the shard list
    base = {key: v for key, v in own.items() if key not in ("count", "complete", "shards", "fields")}

    def write(folder: str, rows: torch.Tensor, extra: dict, index: torch.Tensor | None = None) -> None:
        shards, manifest = ShardSet(root, folder), ShardSetManifest(extra=extra)
        for i in range(0, len(rows), size):
            r = rows[i : i + size]
            part = {f: v[r % n] for f, v in fields.items()}
            if index is not None:
                part["index"] = index[i : i + size]
            shards.append(manifest, part, [captions[j] for j in (r % n).tolist()])
        manifest.complete = True
        shards.write_manifest(manifest)

    mix = {}
    for k in range(k_total):
        rows = (member == k).any(dim=1).nonzero().flatten()
        extra = {**base, "partition": k, "num_partitions": k_total, "overlap": m, "partition_counts": counts}
        write(partition(k), rows, extra)
        mix[k] = torch.bincount(fields["labels"][rows], minlength=10).tolist()
    copies = torch.arange(m * n)  # copy c of item i is row c * n + i, labelled with its c-th cluster
    write(DATA, copies, data.manifest().extra, index=copies)
    write_assignments(root, member.T.reshape(-1), torch.zeros(m * n, dtype=torch.long))
    return mix


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", default="runs/demo", help="a clustered and trained run (the demo's)")
    p.add_argument("--out", default="runs/bench/overlap2")
    p.add_argument("--overlap", type=int, default=2, help="clusters per item (1: the run's own partition)")
    p.add_argument("--n", type=int, default=300)
    p.add_argument("--cfg", default="1.5,2,3,3.5,4.5")
    p.add_argument("--parallel", type=int, default=2)
    a = p.parse_args()

    from fleet_runs import score_fleet  # benchmarks/ is the script's folder

    from flowfleet.stages.assemble import assemble
    from flowfleet.stages.train import train_all

    out = Path(a.out)
    mix = build(Path(a.run), out, a.overlap) if not (out / "partitions").exists() else None
    if mix:
        print("digits per expert:", json.dumps(mix))
    t0 = time.perf_counter()
    train_all(str(out), parallel=a.parallel, progress=False)
    train_s = time.perf_counter() - t0
    assemble(str(out), progress=False)
    rec = {"overlap": a.overlap, "train_all_s": round(train_s, 1), "digits_per_expert": mix}
    rec.update(score_fleet(out, ("top2",), a.cfg, a.n))
    print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
