"""A digit classifier that judges generated MNIST digits: prompt accuracy and a Fréchet distance in its
feature space.

    judge = DigitJudge.load_or_train(root)                 # RUN_ROOT/reports/digit_classifier/, trained once a machine
    judge.prompt_accuracy(images, prompts)                 # {"accuracy", "confidence", "per_class", ...}
    FID(settings, extractor=judge.extractor())             # Fréchet distance in its 128-d features

Inception FID at MNIST's size cannot tell a digit from a blob (both are far from ImageNet); a small
CNN trained on the digits themselves can. The network is written here, not taken from a library,
because no package ships MNIST weights and none is needed: a two-convolution CNN with batch norm
reaches >= 0.97 on the held-out 1000 of MNIST-5k in seconds on a CPU. It is trained by flowfleet on the
first 4000 digits of MNIST-5k (interleaved 0..9, so both splits are balanced; they are the first 4000 of the
10,000-digit set too, flowfleet.data.sources.mnist) with random shifts, and validated on MNIST-5k's last 1000:
one fixed judge for every run on the built-in digits, whichever set and size it trains on. Images are taken in
[-1, 1] at any size and resized to 28 x 28.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from flowfleet.data.images import resize_batch
from flowfleet.data.sources.fetched import cache_dir
from flowfleet.data.sources.mnist.digits import DIGIT_WORDS, Digits, load_mnist_5k
from flowfleet.errors import FlowfleetError
from flowfleet.evaluate.judge import (
    ClassifierJudge,
    FitSettings,
    JudgeFeatures,
    PromptClasses,
    cached_classifier,
    fit_classifier,
    shifted,
)
from flowfleet.storage import RunRoot

log = logging.getLogger(__name__)

FOLDER = ("reports", "digit_classifier")  # the run's copy: a run carries the judge of its figures
MACHINE_FOLDER = "digit-classifier"  # CACHE/digit-classifier/<MNIST-5k digest>/: trained once a machine, as the emoji's
SIDE = 28
FEATURES = 128
NETWORK = "digitnet-2"  # the architecture's name in the cached record: a cache of another one is retrained
DIGIT_CLASSES = [[str(d), word] for d, word in enumerate(DIGIT_WORDS)]  # a prompt names a digit by numeral or word
_DIGITS = PromptClasses(DIGIT_CLASSES)


class DigitNet(nn.Module):
    """[B, 1 or 3, H, W] in [-1, 1] -> logits [B, 10] (colour is read as grey); `features` gives the 128-d
    penultimate layer."""

    def __init__(self) -> None:
        super().__init__()
        self.convs = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1, bias=False),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            nn.MaxPool2d(2),  # 14 x 14
            nn.Conv2d(32, 64, 3, padding=1, bias=False),
            nn.BatchNorm2d(64),
            nn.ReLU(),
            nn.MaxPool2d(2),  # 7 x 7
        )
        self.fc = nn.Linear(64 * 7 * 7, FEATURES)
        self.dropout = nn.Dropout(0.3)
        self.out = nn.Linear(FEATURES, 10)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        if x.ndim != 4 or x.shape[1] not in (1, 3):
            raise FlowfleetError(f"digit classifier: expected images [B, 1 or 3, H, W], got {tuple(x.shape)}")
        x = resize_batch(x.float().mean(dim=1, keepdim=True), SIDE)  # grey [B, 1, 28, 28]
        return F.relu(self.fc(self.convs(x).flatten(1)))  # [B, 128]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.dropout(self.features(x)))  # [B, 10]


@dataclass(frozen=True)
class TrainSettings(FitSettings):
    train_items: int = 4000  # the rest of MNIST-5k is the validation set


def mnist_tensors(digits: Digits | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """MNIST-5k (`digits`, or read now) as images [5000, 1, 28, 28] in [-1, 1] and labels [5000] (the judge's data
    whichever built-in set a run uses: its first 4000 are the first 4000 of the 10,000 too)."""
    digits = digits if digits is not None else load_mnist_5k()
    x = torch.from_numpy(digits.images).float().unsqueeze(1) / 127.5 - 1.0
    return x, torch.from_numpy(digits.labels)


@torch.no_grad()
def accuracy(net: DigitNet, x: torch.Tensor, y: torch.Tensor, batch: int = 500) -> float:
    net.eval()
    hits = sum(int((net(x[i : i + batch]).argmax(1) == y[i : i + batch]).sum()) for i in range(0, len(y), batch))
    return hits / len(y)


def train_classifier(
    x: torch.Tensor, y: torch.Tensor, settings: TrainSettings = TrainSettings(), progress: bool = True
) -> tuple[DigitNet, dict[str, Any]]:
    """Train on the first `train_items` of (x, y), validate on the rest; returns the net and its record."""
    torch.manual_seed(settings.seed)
    gen = torch.Generator().manual_seed(settings.seed)
    n = settings.train_items
    xt, yt, xv, yv = x[:n], y[:n], x[n:], y[n:]
    net = DigitNet()
    t0 = time.perf_counter()

    def loss_of(idx: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(net(shifted(xt[idx], settings.shift, gen)), yt[idx])

    fit_classifier(net, n, loss_of, settings, gen, "digit classifier", progress)
    record = {
        "network": NETWORK,
        "val_accuracy": accuracy(net, xv, yv),
        "val_items": int(len(yv)),
        "train_items": n,
        "train_s": round(time.perf_counter() - t0, 1),
        "settings": asdict(settings),
    }
    return net, record


class DigitJudge(ClassifierJudge):
    """A trained DigitNet as a ClassifierJudge over the digits (a prompt names a digit by word or numeral)."""

    def __init__(self, net: DigitNet, record: dict[str, Any]):
        self.net = net.eval()
        super().__init__(self.net, DIGIT_CLASSES, record, JudgeFeatures(self.net, "digits-128", FEATURES))

    @property
    def val_accuracy(self) -> float:
        return float(self.record["val_accuracy"])

    @classmethod
    def load_or_train(
        cls, root: RunRoot, progress: bool = True, settings: TrainSettings = TrainSettings()
    ) -> "DigitJudge":
        """The run's classifier (FOLDER); where the run has none of this network and recipe, this machine's (the
        fetched data's cache, MACHINE_FOLDER, as the emoji judge) copied into the run; where neither has, one trained
        now on MNIST-5k with `settings` and written to both. Atomic writes, each with its weights' sha256; a copy of
        another network or recipe is replaced. The judge's weights are the same on every machine (its fixed threads
        and seed), so a judge trained on this machine scores a run as one trained in the run."""
        recipe = (NETWORK, asdict(settings))

        def from_machine() -> tuple[nn.Module, dict[str, Any]]:
            digits = load_mnist_5k()
            cache = RunRoot(str(cache_dir()))
            folder = (MACHINE_FOLDER, digits.digest)

            def train() -> tuple[nn.Module, dict[str, Any]]:
                log.info("training the digit classifier on MNIST-5k (cached in %s)", cache.url_of(*folder))
                return train_classifier(*mnist_tensors(digits), settings, progress=progress)

            return cached_classifier(cache, folder, "classifier.json", recipe, DigitNet, train)

        net, record = cached_classifier(root, FOLDER, "classifier.json", recipe, DigitNet, from_machine)
        assert isinstance(net, DigitNet)
        return cls(net, record)


def prompted_digit(prompt: str) -> int | None:
    """'a handwritten digit seven' -> 7 (words or numerals as whole words); None when it names none."""
    return _DIGITS.target(prompt)
