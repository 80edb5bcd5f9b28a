"""A probe of a routing setting the product does not have: another k while t > TAU (--above-k: 0 = every
expert, the full ensemble weighted by the router; 1 = top-1), the strategy's top-k below it. Where the router
is blind (t near 1 it knows little more than the clusters' prior), Paris' top-2 starts every sample on the
same two largest clusters; the full ensemble is the mixture the router describes there. Evaluated with
`flowfleet evaluate`'s own code (held-out reference, the digit judge, classifier FD, precision/recall), on an
evaluated run's fleet.

    python benchmarks/probes/routing_schedule.py --run COPY --above 0.8 --above-k 0 --cfg 1.5,2 --cfg-max-t 0.78 \
        --repeats 5

The run's reports/evaluation.json is overwritten: point --run at a copy. RoutedVelocity.select is replaced
for this process only; nothing of the product changes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the helpers the probes share


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True, help="a copy of an evaluated run (its model/ and reports/)")
    p.add_argument("--above", type=float, required=True, help="t above which --above-k applies")
    p.add_argument("--above-k", type=int, default=0, help="experts per sample while t > --above (0: every one)")
    p.add_argument("--cfg", default="1.5,2", help="the guidance sweep")
    p.add_argument("--cfg-max-t", type=float, default=None, help="guidance only at t <= this (the product's)")
    p.add_argument("--strategies", default="top2")
    p.add_argument("--monolith", action="store_true", help="also the run's monolith (routing does not apply)")
    p.add_argument("--n", type=int, default=300)
    p.add_argument("--repeats", type=int, default=1, help="evaluation draws at each model's chosen scale")
    a = p.parse_args()

    from fleet_runs import evaluate_probe  # benchmarks/ is the script's folder

    from flowfleet.sampling import pipeline
    from flowfleet.sampling.routing import select_experts

    planned = pipeline.RoutedVelocity.select

    def scheduled(self, x, t, step):
        if float(t[0]) <= a.above or self.pipe.router is None:
            return planned(self, x, t, step)
        probs = self.pipe.router_probs(x, t, self.cond)  # [B, P]
        k = min(a.above_k or probs.shape[1], probs.shape[1])
        selection = self._selection = select_experts(probs, self.pipe.present, self.pipe.num_experts, k)
        self.trace.router_calls += 1
        if step != self._last_step:
            self.trace.record(float(t[0]), selection, routed=True)
            self._last_step = step
        return selection

    pipeline.RoutedVelocity.select = scheduled
    label = {"k above t": f"{a.above_k or 'all'} above {a.above}"}
    evaluate_probe(a.run, a.n, a.strategies, a.cfg, a.repeats, label, monolith=a.monolith, cfg_max_t=a.cfg_max_t)


if __name__ == "__main__":
    main()
