"""The emoji judge: a classifier that reads a generated emoji's category (and subcategory), for prompt accuracy and a
Fréchet distance in its features on runs of the built-in emoji (data.source emoji).

    judge = EmojiJudge.load_or_train()                     # trained once, cached beside the emoji set
    judge.prompt_accuracy(images, prompts)                 # {"accuracy", "subcategory_accuracy", ...}
    FID(settings, extractor=judge.extractor())             # Fréchet distance in its 128-d features

A prompt's class is the category of the emoji whose caption it is ("Santa Claus: dark skin tone, Noto style" ->
People & Body; "pizza, Twemoji style" -> Food & Drink): the judge knows every caption of the set, and a prompt that
is none of them is left out (counted as skipped). Beside the category (10 classes) it reads the subcategory (99:
face-smiling, hand-fingers-open, country-flag, ...), reported as subcategory accuracy.

The network is written here, as the digit judge's is (flowfleet.evaluate.digits): no package ships emoji weights,
and a small CNN trained on the set itself is what can tell a flag from a face at 32 px, where Inception sees two
blurred blobs. It trains on the set's training images only (never its held-out 1000, the evaluation's reference),
with random shifts, once per machine and set: the weights are cached in the data cache
(CACHE/emoji-judge/<set digest>/), with their sha256 recorded, so every emoji run is scored by the same judge.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from flowfleet.data.images import resize_batch
from flowfleet.data.sources.emoji import EmojiSet, load_emoji
from flowfleet.data.sources.fetched import cache_dir
from flowfleet.errors import FlowfleetError
from flowfleet.evaluate.judge import (
    ClassifierJudge,
    FitSettings,
    JudgeFeatures,
    cached_classifier,
    fit_classifier,
    shifted,
)
from flowfleet.storage import RunRoot

log = logging.getLogger(__name__)

SIDE = 32
FEATURES = 128
NETWORK = "emojinet-1"  # the architecture's name in the cached record: a cache of another one is retrained
FOLDER = "emoji-judge"  # CACHE/emoji-judge/<set digest>/


class EmojiNet(nn.Module):
    """[B, 3, H, W] in [-1, 1] -> (category logits [B, C], subcategory logits [B, S]); `features` gives the 128-d
    layer both heads read."""

    def __init__(self, categories: int, subcategories: int) -> None:
        super().__init__()

        def block(c_in: int, c_out: int) -> nn.Sequential:
            return nn.Sequential(
                nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(), nn.MaxPool2d(2)
            )

        self.convs = nn.Sequential(block(3, 32), block(32, 64), block(64, 64))  # 32 -> 16 -> 8 -> 4
        self.fc = nn.Linear(64 * 4 * 4, FEATURES)
        self.dropout = nn.Dropout(0.3)
        self.category = nn.Linear(FEATURES, categories)
        self.subcategory = nn.Linear(FEATURES, subcategories)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        if x.ndim != 4 or x.shape[1] != 3:
            raise FlowfleetError(f"emoji judge: expected colour images [B, 3, H, W], got {tuple(x.shape)}")
        x = resize_batch(x.float(), SIDE)  # [B, 3, 32, 32]
        return F.relu(self.fc(self.convs(x).flatten(1)))  # [B, 128]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.dropout(self.features(x))
        return self.category(h), self.subcategory(h)  # [B, C], [B, S]


@dataclass(frozen=True)
class TrainSettings(FitSettings):
    epochs: int = 10
    lr: float = 3e-3
    subcategory_weight: float = 0.5  # the subcategory head's share of the loss


def set_tensors(s: EmojiSet) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The set's images [N, 3, 32, 32] in [-1, 1], categories [N], subcategories [N]."""
    x = torch.from_numpy(s.images).permute(0, 3, 1, 2).float() / 127.5 - 1.0
    return x, torch.from_numpy(s.category), torch.from_numpy(s.subcategory)


@torch.no_grad()
def accuracy(
    net: EmojiNet, x: torch.Tensor, y: torch.Tensor, sub: torch.Tensor, batch: int = 500
) -> tuple[float, float]:
    """(category accuracy, subcategory accuracy) of `net` on images x."""
    net.eval()
    hits = [0, 0]
    for i in range(0, len(y), batch):
        cat, fine = net(x[i : i + batch])
        hits[0] += int((cat.argmax(1) == y[i : i + batch]).sum())
        hits[1] += int((fine.argmax(1) == sub[i : i + batch]).sum())
    return hits[0] / len(y), hits[1] / len(y)


def train_judge(s: EmojiSet, settings: TrainSettings = TrainSettings(), progress: bool = True) -> tuple[EmojiNet, dict]:
    """Train on the set's training images, validate on its held-out ones; the net and its record."""
    torch.manual_seed(settings.seed)
    gen = torch.Generator().manual_seed(settings.seed)
    x, y, sub = set_tensors(s)
    n = s.train_stop
    net = EmojiNet(len(s.categories), len(s.subcategories))
    t0 = time.perf_counter()

    def loss_of(idx: torch.Tensor) -> torch.Tensor:
        cat, fine = net(shifted(x[idx], settings.shift, gen, fill=1.0))  # white margins, as the images have
        return F.cross_entropy(cat, y[idx]) + settings.subcategory_weight * F.cross_entropy(fine, sub[idx])

    fit_classifier(net, n, loss_of, settings, gen, "emoji judge", progress)
    held = slice(n, len(s))
    val, val_sub = accuracy(net, x[held], y[held], sub[held])
    record = {
        "network": NETWORK,
        "set": s.digest,
        "val_accuracy": val,
        "val_subcategory_accuracy": val_sub,
        "val_items": len(s) - n,
        "train_items": n,
        "train_s": round(time.perf_counter() - t0, 1),
        "settings": asdict(settings),
    }
    return net, record


class EmojiJudge(ClassifierJudge):
    """A trained EmojiNet as a ClassifierJudge over the categories; a prompt names the class of its caption."""

    def __init__(self, net: EmojiNet, record: dict[str, Any], emoji_set: EmojiSet):
        self.net = net.eval()
        super().__init__(
            lambda images: self.net(images)[0],
            [[c] for c in emoji_set.categories],
            record,
            JudgeFeatures(net, "emoji-128", FEATURES),
        )
        self.subcategories = emoji_set.subcategories
        # every caption of the set -> (category, subcategory)
        self._caption = {
            str(c): (int(k), int(j)) for c, k, j in zip(emoji_set.captions, emoji_set.category, emoji_set.subcategory)
        }

    @property
    def val_accuracy(self) -> float:
        return float(self.record["val_accuracy"])

    def target(self, prompt: str) -> int | None:
        """The category of the emoji whose caption `prompt` is; None for any other prompt."""
        hit = self._caption.get(prompt.strip())
        return None if hit is None else hit[0]

    def prompt_accuracy(self, images: torch.Tensor, prompts: Sequence[str]) -> dict[str, Any]:
        """ClassifierJudge's, with `subcategory_accuracy`: the share whose subcategory is the prompted emoji's."""
        out = super().prompt_accuracy(images, prompts)
        keep = [i for i, p in enumerate(prompts) if p.strip() in self._caption]
        kept = images[keep]  # [n, 3, H, W]
        with torch.no_grad():
            fine = torch.cat([self.net(kept[i : i + self.batch])[1] for i in range(0, len(keep), self.batch)])
        want = torch.tensor([self._caption[prompts[i].strip()][1] for i in keep])
        out["subcategory_accuracy"] = int((fine.argmax(1) == want).sum()) / len(keep)
        return out

    @classmethod
    def load_or_train(
        cls, emoji_set: EmojiSet | None = None, progress: bool = True, settings: TrainSettings = TrainSettings()
    ) -> "EmojiJudge":
        """The judge of the set (the cached one, or one trained now and cached, atomically, with its weights'
        sha256). A cache made by another network or recipe is trained again."""
        s = emoji_set if emoji_set is not None else load_emoji()
        cache = RunRoot(str(cache_dir()))
        folder = (FOLDER, s.digest)

        def train() -> tuple[nn.Module, dict[str, Any]]:
            log.info(
                "training the emoji judge on the set's %d training images (cached in %s)",
                s.train_stop,
                cache.url_of(*folder),
            )
            return train_judge(s, settings, progress=progress)

        def build() -> nn.Module:
            return EmojiNet(len(s.categories), len(s.subcategories))

        net, record = cached_classifier(cache, folder, "judge.json", (NETWORK, asdict(settings)), build, train)
        assert isinstance(net, EmojiNet)
        return cls(net, record, s)
