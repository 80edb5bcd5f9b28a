"""Per-digit prompt accuracy of two MNIST model folders on the same prompts and the same noise.

`evaluate` draws its prompts from the run's data, so two runs with different data (before and after
`add-expert`) see different prompts; this compares them paired: for every digit, N samples of "a
handwritten digit <word>" with one seed, read by the run's digit judge. A difference is then the
models' alone, not the prompts' or the noise's.

    .venv/bin/python benchmarks/probes/paired_digits.py runs/bench/add-89/model-before runs/bench/add-89/model \\
        --judge runs/bench/add-89 --digits 0,1,2,3,4,5,6,7 --n 300
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("models", nargs=2, help="model folders A and B")
    p.add_argument("--judge", required=True, help="run root whose reports/digit_classifier/ reads the samples")
    p.add_argument("--digits", default="0,1,2,3,4,5,6,7,8,9")
    p.add_argument("--n", type=int, default=300, help="samples per digit")
    p.add_argument("--strategies", default="top1,full")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON file for the table")
    a = p.parse_args()

    import torch

    from flowfleet.evaluate.digits import DigitJudge
    from flowfleet.sampling import FleetPipeline
    from flowfleet.storage import RunRoot

    torch.set_num_threads(2)
    judge = DigitJudge.load_or_train(RunRoot(a.judge), progress=False)
    digits = [int(d) for d in a.digits.split(",")]
    strategies = [s for s in a.strategies.split(",") if s]
    table: dict = {}
    for model in a.models:
        pipe = FleetPipeline.from_pretrained(model)
        for s in strategies:
            for d in digits:
                prompt = f"a handwritten digit {WORDS[d]}"
                out = pipe([prompt], n=a.n, strategy=s, seed=a.seed + d)
                acc = judge.prompt_accuracy(out.images.float().cpu(), out.prompts)["accuracy"]
                table.setdefault(s, {}).setdefault(d, []).append(acc)
                print(f"{model:40} {s:5} digit {d}: {acc:.3f}", flush=True)
    print(f"{'strategy':8} {'digit':>5} {'A':>7} {'B':>7} {'B - A':>7}")
    for s, per in table.items():
        for d, (acc_a, acc_b) in per.items():
            print(f"{s:8} {d:5d} {acc_a:7.3f} {acc_b:7.3f} {acc_b - acc_a:+7.3f}")
        print(f"{s:8} largest drop {max(x - y for x, y in per.values()):+.3f}")
    if a.out:
        Path(a.out).write_text(json.dumps({"models": a.models, "n": a.n, "seed": a.seed, "table": table}, indent=2))


if __name__ == "__main__":
    main()
