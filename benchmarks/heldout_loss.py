"""Do the experts overfit their share of the data? Each expert's flow-matching loss on its training items and on
the held-out digits of its cluster, beside the monolith's on the same items (flowfleet.evaluate.generalization,
the diagnostic `flowfleet evaluate --monolith` writes, here with every item and more noise draws):

    HF_HUB_OFFLINE=1 python benchmarks/heldout_loss.py --run runs/demo21 --draws 4 --json out.json

A held-out loss well above the training loss, and above the monolith's on the same items, is the data-limited
regime in the loss itself. `--by-t` also prints each expert's held-out loss per noise level (for a DDPM expert, in
the velocity space its converted output is sampled in: docs/heterogeneous-experts.md), to set two runs' experts
of the same cluster side by side.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True, help="a run with model/, model-monolith/ and eval/ (the demo's)")
    p.add_argument("--t-bins", type=int, default=10)
    p.add_argument("--draws", type=int, default=4)
    p.add_argument("--max-items", type=int, default=100_000, help="per cluster and split (default: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="write the result here too")
    p.add_argument("--by-t", action="store_true", help="print each expert's held-out loss per t bin")
    a = p.parse_args()

    import safetensors.torch

    from flowfleet.config import load_run_config
    from flowfleet.data.shards import open_complete
    from flowfleet.evaluate.generalization import fields_for, generalization, held_out_clusters
    from flowfleet.layout import DATA, EVAL_DATA
    from flowfleet.models.dit import DiTExpert
    from flowfleet.storage import RunRoot

    run = Path(a.run)
    root = RunRoot(str(run))
    cfg = load_run_config(root)
    experts = {k: DiTExpert.from_pretrained(run / f"model/expert_{k}").eval() for k in range(cfg.cluster.k)}
    monolith = DiTExpert.from_pretrained(run / "model-monolith/expert_0").eval()
    fields = fields_for(cfg, [m.cfg for m in experts.values()])
    train = open_complete(root, DATA, "flowfleet prepare").load(fields)
    held = open_complete(root, EVAL_DATA, "flowfleet prepare").load(fields)
    assign = safetensors.torch.load_file(run / "clusters/assignments.safetensors")["assign"]
    centroids = safetensors.torch.load_file(run / "clusters/centroids.safetensors")
    agree = float((held_out_clusters(cfg, centroids, train, train) == assign).float().mean())
    print(f"the rule on the training items agrees with their assignments: {agree:.3f}")
    res = generalization(
        experts,
        monolith,
        train,
        assign,
        held,
        held_out_clusters(cfg, centroids, train, held),
        max_items=a.max_items,
        t_bins=a.t_bins,
        draws=a.draws,
        seed=a.seed,
    )
    for r in res["clusters"]:
        n = r["items"]
        print(
            f"cluster {r['expert']} ({n['train']} train / {n['heldout']} held out): "
            f"expert {r['expert_train']:.4f} / {r['expert_heldout']:.4f}, "
            f"monolith {r['monolith_train']:.4f} / {r['monolith_heldout']:.4f}"
        )
    for name, s in res["summary"].items():
        print(f"{name:8s} train {s['train']:.4f}  held out {s['heldout']:.4f}  gap {s['heldout'] - s['train']:+.4f}")
    for b, t in enumerate(res["t"]):
        gaps = {
            name: sum(r[f"{name}_heldout_by_t"][b] - r[f"{name}_train_by_t"][b] for r in res["clusters"])
            / len(res["clusters"])
            for name in ("expert", "monolith")
        }
        print(f"t {t:.2f}: gap expert {gaps['expert']:+.4f}  monolith {gaps['monolith']:+.4f}")
    if a.by_t:
        print("t      " + "".join(f"{t:7.2f}" for t in res["t"]))
        for r in res["clusters"]:
            objective = experts[r["expert"]].cfg.objective
            print(f"{r['expert']} {objective:4s} " + "".join(f"{v:7.3f}" for v in r["expert_heldout_by_t"]))
    if a.json:
        a.json.write_text(json.dumps({"run": str(run), "agreement": agree, **res}, indent=1))


if __name__ == "__main__":
    main()
