"""Probes of expert selections the product does not have, against Paris' top-k of the trained router:

  prior    no router: every sample draws one expert from the clusters' prior p(k) (their share of the
           training items) and that expert alone draws it, from noise to image. When the clusters are
           independent of the captions this samples the fleet's mixture exactly, so it measures the experts
           without any routing error: what a perfect router could reach at best.
  gumbel   top-k drawn from the router's distribution instead of its k largest probabilities (Gumbel-top-k:
           one Gumbel vector per sample, kept for the whole trajectory), weights the router's probabilities
           renormalised over the drawn k. At high t, where the router only knows the prior, samples spread
           over the experts as the prior says instead of all starting on the largest clusters' experts.

Evaluated with `flowfleet evaluate`'s own code (held-out reference, the digit judge, classifier FD,
precision/recall) on an evaluated run's fleet:

    python benchmarks/probes/routing_probe.py --run runs/copy --mode prior --cfg 1.25,1.5,2
    python benchmarks/probes/routing_probe.py --run runs/copy --mode gumbel --strategies top1,top2 --cfg 1.25,1.5,2

The run's reports/evaluation.json is overwritten: point --run at a copy. flowfleet.sampling.pipeline's
select_experts is replaced for this process only; nothing of the product changes. All n samples are drawn in
one batch, so that the per-sample draw follows the sample through every step.
"""

from __future__ import annotations

import argparse


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True, help="a copy of an evaluated run (its model/, clusters/ and reports/)")
    p.add_argument("--mode", choices=("prior", "gumbel"), required=True)
    p.add_argument("--cfg", default="1.25,1.5,2", help="the guidance sweep")
    p.add_argument("--strategies", default="top1", help="gumbel: the k of each top-k (prior is always one expert)")
    p.add_argument("--n", type=int, default=300)
    p.add_argument("--seed", type=int, default=7, help="the draw's seed (the noise is evaluate's own)")
    a = p.parse_args()

    import torch

    from flowfleet.cluster.assignments import read_assignments
    from flowfleet.evaluate.fid import FIDSettings
    from flowfleet.sampling import pipeline
    from flowfleet.sampling.routing import Selection
    from flowfleet.stages.evaluate import EvaluateOptions, evaluate
    from flowfleet.storage import RunRoot

    gen = torch.Generator().manual_seed(a.seed)
    prior = torch.bincount(read_assignments(RunRoot(a.run))).double()
    prior /= prior.sum()
    drawn = torch.multinomial(prior, a.n, replacement=True, generator=gen)  # [n] prior: one expert per sample
    gumbel = -torch.log(-torch.log(torch.rand(a.n, prior.numel(), generator=gen).clamp_min(1e-12)))  # [n, K]

    def select(probs, present, num_experts, k):
        """probs [n, P] over the present experts -> Selection (the product's select_experts contract)."""
        if probs.shape[0] != a.n:
            raise SystemExit(f"the probe needs all {a.n} samples in one batch, got {probs.shape[0]}")
        if a.mode == "prior":
            local = drawn.unsqueeze(1)  # [n, 1]
        else:
            local = (probs.double().clamp_min(1e-30).log() + gumbel[:, : probs.shape[1]]).topk(k, dim=1).indices
        weights = probs.gather(1, local) if a.mode == "gumbel" else torch.ones(a.n, 1, dtype=probs.dtype)
        weights = weights / weights.sum(dim=1, keepdim=True)
        full = probs.new_zeros(a.n, num_experts)
        full[:, list(present)] = probs
        return Selection(torch.as_tensor(present)[local], weights, full)

    pipeline.select_experts = select
    strategies = ("top1",) if a.mode == "prior" else tuple(a.strategies.split(","))
    options = EvaluateOptions(
        n=a.n,
        batch_size=a.n,
        strategies=strategies,
        diagnostics=False,
        cfg_sweep=tuple(float(c) for c in a.cfg.split(",")),
        fid=FIDSettings(resize=75),
        device="cpu",
    )
    result = evaluate(f"{a.run}/model", a.run, options)
    print(f"\nmode {a.mode}; prior {[round(float(q), 3) for q in prior]}")
    print("| model | cfg | classifier FD | prompt accuracy | precision | recall |")
    print("|---|---|---|---|---|---|")
    for name, r in result["runs"].items():
        label = f"{a.mode} ({name})"
        for s in r["sweep"]:
            print(
                f"| {label} | {s['cfg']} | {s['classifier_fd']:.1f} | {s['prompt_accuracy']:.3f} "
                f"| {s['precision']:.3f} | {s['recall']:.3f} |"
            )


if __name__ == "__main__":
    main()
