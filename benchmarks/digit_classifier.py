"""The digit judge's network: validation accuracy against training time, for the shipped network and
the alternatives it was chosen from.

Trains flowfleet.evaluate.digits' classifier recipe (first 4000 of MNIST-5k, random shifts, AdamW with
one-cycle lr, batch 64) with each network and seed and reports the accuracy on the held-out 1000 and
the training seconds, on all cores (what `evaluate` uses).

    digitnet-2   the shipped DigitNet: conv 32 + BN, pool, conv 64 + BN, pool, fc 128
    digitnet-1   the earlier one: conv 16, conv 32, pool, conv 32, conv 64, pool, fc 128 (no BN)
    two-conv     digitnet-2 without batch norm

    .venv/bin/python benchmarks/digit_classifier.py --networks digitnet-2,digitnet-1 --epochs 6,8 --seeds 0,1
"""

from __future__ import annotations

import argparse
import json

from torch import nn


def conv_stack(name: str) -> nn.Sequential:
    if name == "digitnet-1":
        return nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 32, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
    if name == "two-conv":
        return nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
    raise ValueError(f"unknown network {name!r}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--networks", default="digitnet-2,digitnet-1,two-conv")
    p.add_argument("--epochs", default="6,8")
    p.add_argument("--seeds", default="0,1")
    a = p.parse_args()

    import flowfleet.evaluate.digits as digits

    x, y = digits.mnist_tensors()
    for name in a.networks.split(","):
        for epochs in map(int, a.epochs.split(",")):
            for seed in map(int, a.seeds.split(",")):
                settings = digits.TrainSettings(epochs=epochs, seed=seed)
                if name == digits.NETWORK:
                    _, record = digits.train_classifier(x, y, settings, progress=False)
                else:  # the same recipe with another convolution stack
                    original = digits.DigitNet.__init__

                    def init(self, name=name, original=original):
                        original(self)
                        self.convs = conv_stack(name)

                    digits.DigitNet.__init__ = init
                    try:
                        _, record = digits.train_classifier(x, y, settings, progress=False)
                    finally:
                        digits.DigitNet.__init__ = original
                print(
                    json.dumps(
                        {
                            "network": name,
                            "epochs": epochs,
                            "seed": seed,
                            "val_accuracy": record["val_accuracy"],
                            "train_s": record["train_s"],
                        }
                    ),
                    flush=True,
                )


if __name__ == "__main__":
    main()
