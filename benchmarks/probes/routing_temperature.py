"""A probe of a routing setting the product does not have: the router's distribution sharpened or flattened
by a temperature, p_k^(1/T) / sum_j p_j^(1/T) (T < 1 moves top-2's weights toward its first expert, T > 1
toward equal weights; which two experts top-2 picks does not change). Evaluated with `flowfleet
evaluate`'s own code (held-out reference, the digit judge, classifier FD, precision/recall), on an
evaluated run's fleet.

    python benchmarks/probes/routing_temperature.py --run runs/cache15 --temperature 0.5 --cfg 1.5,2,3,4.5,6
    python benchmarks/probes/routing_temperature.py --run COPY --temperature 0.5 --cfg 1.5 --repeats 5

The run's reports/evaluation.json is overwritten: point --run at a copy. FleetPipeline.router_probs is
replaced for this process only; nothing of the product changes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the helpers the probes share


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True, help="a copy of an evaluated run (its model/ and reports/)")
    p.add_argument("--temperature", type=float, required=True, help="T > 0; 1 is the router as trained")
    p.add_argument("--cfg", default="1.5,2,3,4.5,6", help="the guidance sweep")
    p.add_argument("--strategies", default="top2")
    p.add_argument("--n", type=int, default=300)
    p.add_argument("--repeats", type=int, default=1, help="evaluation draws at each model's chosen scale")
    a = p.parse_args()
    if a.temperature <= 0:
        p.error("--temperature: must be > 0")

    import torch
    from fleet_runs import evaluate_probe  # benchmarks/ is the script's folder

    from flowfleet.sampling import pipeline

    trained = pipeline.FleetPipeline.router_probs

    def tempered(self, x, t, cond=None):
        probs = trained(self, x, t, cond).double().clamp_min(1e-30)  # [B, P]
        return torch.softmax(probs.log() / a.temperature, dim=1).to(x.dtype)

    pipeline.FleetPipeline.router_probs = tempered
    evaluate_probe(a.run, a.n, a.strategies, a.cfg, a.repeats, {"temperature": a.temperature})


if __name__ == "__main__":
    main()
