"""Re-grade saved samples with the current digit judge: every `reports/samples/<model>.npz` that
`evaluate` kept (images + prompts), read by flowfleet's MNIST digit classifier as it is now.

For comparing numbers measured with an earlier judge: the samples stay, the judge changes. The judge
is trained once (cached in OUT/reports/digit_classifier/). Prints mean ± sample sd of prompt accuracy
per model over the given run roots.

    .venv/bin/python benchmarks/probes/regrade.py runs/table2/seed-0 runs/table2/seed-1 runs/table2/seed-2 \\
        --out runs/bench/regrade
    # the same samples read by the earlier judge
    .venv/bin/python benchmarks/probes/regrade.py runs/demo-quick --network digitnet-1 --epochs 8 \
        --out runs/bench/regrade-1
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the helpers the probes share


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="run roots whose reports/samples/*.npz to re-grade")
    p.add_argument("--out", default="runs/bench/regrade", help="where the judge is cached")
    p.add_argument(
        "--network",
        default=None,
        help="an earlier judge network of benchmarks/digit_classifier.py (e.g. digitnet-1), trained "
        "with the same recipe; default: the shipped one",
    )
    p.add_argument("--epochs", type=int, default=None, help="its training epochs (digitnet-1 had 8)")
    a = p.parse_args()

    import flowfleet.evaluate.digits as digits
    from flowfleet.storage import RunRoot

    if a.network is not None and a.network != digits.NETWORK:
        from digit_classifier import conv_stack  # benchmarks/digit_classifier.py

        original = digits.DigitNet.__init__

        def init(self):
            original(self)
            self.convs = conv_stack(a.network)

        digits.DigitNet.__init__ = init
        digits.NETWORK = a.network  # names (and keys the cache of) the judge in its record
    settings = digits.TrainSettings() if a.epochs is None else digits.TrainSettings(epochs=a.epochs)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    judge = digits.DigitJudge.load_or_train(RunRoot(a.out), progress=False, settings=settings)
    scores: dict[str, list[float]] = {}
    for run in a.runs:
        for npz in sorted(Path(run, "reports", "samples").glob("*.npz")):
            z = np.load(npz)
            images = torch.from_numpy(z["images"]).permute(0, 3, 1, 2).float() / 127.5 - 1.0  # [n, C, H, W]
            acc = judge.prompt_accuracy(images, [str(p) for p in z["prompts"]])["accuracy"]
            scores.setdefault(npz.stem, []).append(acc)
            print(json.dumps({"run": run, "model": npz.stem, "n": int(images.shape[0]), "prompt_accuracy": acc}))
    print(
        json.dumps(
            {
                "judge": judge.record,
                "summary": {
                    m: {
                        "mean": round(statistics.fmean(v), 4),
                        "sd": round(statistics.stdev(v), 4) if len(v) > 1 else None,
                        "values": [round(x, 4) for x in v],
                    }
                    for m, v in scores.items()
                },
            }
        )
    )


if __name__ == "__main__":
    main()
