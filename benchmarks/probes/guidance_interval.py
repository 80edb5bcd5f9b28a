"""A probe of a sampler the product does not have yet: guidance scale HIGH while t > TAU (the early, noisy
steps, where Paris' prompt-blind router can only follow the clusters' prior) and the swept scale below it.
HIGH above the swept scales guides the noisy steps harder; HIGH = 1 leaves them unguided, as Kynkäänniemi et
al. (2024, "Applying guidance in a limited interval") do for the high-noise steps; --low T_LO also leaves the
steps at t < T_LO unguided (their interval's lower end). Evaluated with `flowfleet
evaluate`'s own code (held-out reference, the digit judge, classifier FD, precision/recall), on an evaluated
run's fleet and, with --monolith, its monolith.

    python benchmarks/probes/guidance_interval.py --run runs/demo --high 4.5 --tau 0.7 --cfg 1.5,2,3
    python benchmarks/probes/guidance_interval.py --run COPY --high 1 --tau 0.8 --low 0.2 --cfg 1.5,2,3 --monolith
    python benchmarks/probes/guidance_interval.py --run COPY --high 3 --tau 0.8 --cfg 1,1.25,1.5 --monolith \
        --repeats 5 \
        --json out.jsonl        # each model again at its chosen scale with seeds 1-4 (evaluate --repeats)

The run's reports/evaluation.json is overwritten: point --run at a copy. The routed velocity's guidance
scale is replaced for this process only (a subclass of flowfleet.sampling.pipeline.RoutedVelocity);
nothing of the product changes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the helpers the probes share


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True, help="a copy of an evaluated run (its model/ and reports/)")
    p.add_argument("--high", type=float, required=True, help="guidance scale while t > --tau")
    p.add_argument("--tau", type=float, required=True, help="t above which --high applies (t = 1: noise)")
    p.add_argument("--low", type=float, default=0.0, help="t below which no step is guided (0: none)")
    p.add_argument("--cfg", default="1.5,2,3", help="the swept scale used for t <= --tau")
    p.add_argument("--strategies", default="top2")
    p.add_argument("--monolith", action="store_true")
    p.add_argument("--n", type=int, default=300)
    p.add_argument("--repeats", type=int, default=1, help="evaluation draws at each model's chosen scale")
    p.add_argument("--json", default=None, help="append one JSON line per model (its sweep and its draws)")
    a = p.parse_args()

    from fleet_runs import evaluate_probe  # benchmarks/ is the script's folder

    from flowfleet.sampling import pipeline
    from flowfleet.sampling.routing import run_selected

    class IntervalVelocity(pipeline.RoutedVelocity):
        def __call__(self, x, t, step):
            selection = self.select(x, t, step)
            tt = float(t[0])
            scale = a.high if tt > a.tau else 1.0 if tt < a.low else self.cfg
            guided = self.pipe.guidance_applies(scale)
            return run_selected(self.pipe.experts, x, t, self.cond, selection, scale, guided, self.trace.stats)

    pipeline.FleetPipeline.velocity_fn = lambda self, cond, settings, trace: IntervalVelocity(
        self, cond, settings, trace
    )
    result = evaluate_probe(
        a.run, a.n, a.strategies, a.cfg, a.repeats, {"high": a.high, "tau": a.tau, "low": a.low}, monolith=a.monolith
    )
    draws = result.get("draws") or {}
    if a.json:
        import json

        with open(a.json, "a") as f:
            line = {"high": a.high, "tau": a.tau, "low": a.low, "runs": result["runs"], "draws": draws}
            f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
