"""Do the experts overfit their quarter of the data? Flow-matching loss on training items against held-out items.

Each expert is scored on its own partition's training items and on the held-out digits (the run's eval/,
which no training shard contains) that fall in its cluster: the cluster of the nearest fine centroid, in the
space the run's k-means worked in (caption residual included, its regression fitted on the training items as `cluster`
fitted it). The monolith is scored on the same items, so the two gaps compare directly. The loss is the
training objective with the condition always on, at a fixed grid of t (midpoints of `--t-bins` equal bins)
and `--draws` noise draws per item and t, the same noise for every model:

    HF_HUB_OFFLINE=1 python benchmarks/heldout_loss.py --run runs/demo21

A held-out loss well above the training loss is the data-limited regime in the loss itself; a lever that
regularises (weight decay, dropout) then has something to close.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def nearest(x: torch.Tensor, centroids: dict[str, torch.Tensor]) -> torch.Tensor:
    """[N] each normalised row of x's cluster by the clustering's own rule: its nearest fine centroid's."""
    return centroids["fine_to_coarse"].long()[torch.cdist(x.double(), centroids["fine"].double()).argmin(dim=1)]


def residual_pair(train_x, train_text, eval_x, eval_text):
    """caption_residual's regression fitted on the training items, applied to both sets (normalised rows)."""
    from flowfleet.cluster.kmeans import l2_normalize_

    def design(text):
        return torch.cat([text.double().flatten(1), torch.ones(text.shape[0], 1, dtype=torch.float64)], dim=1)

    d = design(train_text)
    coef = torch.linalg.pinv(d.T @ d, rtol=1e-10, hermitian=True) @ (d.T @ train_x.double())  # [E + 1, D]
    return (
        l2_normalize_((train_x.double() - d @ coef).float()),
        l2_normalize_((eval_x.double() - design(eval_text) @ coef).float()),
    )


@torch.no_grad()
def fm_loss(model, cfg, fields: dict, t_bins: int, draws: int, seed: int, batch: int = 500) -> torch.Tensor:
    """[t_bins] mean velocity MSE per t bin, condition on, fixed noise per (item, bin, draw)."""
    from flowfleet.flow.loss import flow_matching_loss
    from flowfleet.train.preview import condition_kwargs

    x0_all = fields["latents"].float()
    n = len(x0_all)
    out = torch.zeros(t_bins, dtype=torch.float64)
    for b in range(t_bins):
        t_val = (b + 0.5) / t_bins
        for d in range(draws):
            gen = torch.Generator().manual_seed(seed * 1_000_003 + b * 1009 + d)
            eps_all = torch.randn(x0_all.shape, generator=gen)  # the same for every model scored on these items
            for i in range(0, n, batch):
                x0, eps = x0_all[i : i + batch], eps_all[i : i + batch]
                cond = condition_kwargs({k: v[i : i + batch] for k, v in fields.items()}, cfg)
                t = torch.full((len(x0),), t_val)
                loss = flow_matching_loss(lambda x_t, tt, kw=cond: model(x_t, tt, **kw), x0, t, eps)
                out[b] += float(loss) * len(x0) / (n * draws)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True, help="an assembled run with model/ and model-monolith/")
    p.add_argument("--t-bins", type=int, default=10)
    p.add_argument("--draws", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="write the table here too")
    a = p.parse_args()

    import safetensors.torch

    from flowfleet.config import load_run_config
    from flowfleet.data.shards import open_complete
    from flowfleet.layout import DATA, EVAL_DATA
    from flowfleet.models.dit import DiTExpert
    from flowfleet.stages.cluster import clustering_features
    from flowfleet.storage import RunRoot

    torch.set_grad_enabled(False)
    run = Path(a.run)
    root = RunRoot(str(run))
    cfg = load_run_config(root)
    keep = ("latents", "features", "labels", "text_pooled", "text_tokens", "text_mask")
    train = open_complete(root, DATA, "flowfleet prepare").load(keep)
    held = open_complete(root, EVAL_DATA, "flowfleet prepare").load(keep)
    assign = safetensors.torch.load_file(run / "clusters/assignments.safetensors")["assign"]
    centroids = safetensors.torch.load_file(run / "clusters/centroids.safetensors")

    xt = clustering_features(train, cfg.cluster.features)
    xe = clustering_features(held, cfg.cluster.features)
    if cfg.cluster.caption_residual:
        xt, xe = residual_pair(xt, train["text_pooled"], xe, held["text_pooled"])
    agree = float((nearest(xt, centroids) == assign).float().mean())
    held_assign = nearest(xe, centroids)
    print(f"nearest-centroid agreement with the run's assignments (training items): {agree:.3f}")

    mono = DiTExpert.from_pretrained(run / "model-monolith/expert_0").eval()
    rows = []
    for k in range(cfg.cluster.k):
        expert = DiTExpert.from_pretrained(run / f"model/expert_{k}").eval()
        tr = {f: v[assign == k] for f, v in train.items()}
        he = {f: v[held_assign == k] for f, v in held.items()}
        row = {"cluster": k, "train_items": len(tr["latents"]), "heldout_items": len(he["latents"])}
        for name, model in (("expert", expert), ("monolith", mono)):
            for split, fields in (("train", tr), ("heldout", he)):
                per_t = fm_loss(model, model.cfg, fields, a.t_bins, a.draws, a.seed)
                row[f"{name}_{split}"] = float(per_t.mean())
                row[f"{name}_{split}_by_t"] = [round(float(v), 4) for v in per_t]
        rows.append(row)
        print(
            f"cluster {k} ({row['train_items']} train / {row['heldout_items']} held out): "
            f"expert {row['expert_train']:.4f} / {row['expert_heldout']:.4f} "
            f"(gap {row['expert_heldout'] - row['expert_train']:+.4f}); "
            f"monolith {row['monolith_train']:.4f} / {row['monolith_heldout']:.4f} "
            f"(gap {row['monolith_heldout'] - row['monolith_train']:+.4f})",
            flush=True,
        )

    def weighted(key: str, n_key: str) -> float:
        return sum(r[key] * r[n_key] for r in rows) / sum(r[n_key] for r in rows)

    summary = {
        name: {split: weighted(f"{name}_{split}", f"{split}_items") for split in ("train", "heldout")}
        for name in ("expert", "monolith")
    }
    for name, s in summary.items():
        print(f"{name:8s} train {s['train']:.4f}  held out {s['heldout']:.4f}  gap {s['heldout'] - s['train']:+.4f}")
    for b in range(a.t_bins):
        e = [r["expert_heldout_by_t"][b] - r["expert_train_by_t"][b] for r in rows]
        m = [r["monolith_heldout_by_t"][b] - r["monolith_train_by_t"][b] for r in rows]
        print(f"t {(b + 0.5) / a.t_bins:.2f}: gap expert {sum(e) / len(e):+.4f}  monolith {sum(m) / len(m):+.4f}")
    if a.json:
        record = {"run": str(run), "clusters": rows, "summary": summary, "agreement": agree}
        a.json.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
