"""Prompt accuracy by a classifier: does a generated image show the class its prompt names?

    judge = ClassifierJudge(classify, classes=[["cat", "cats"], ["dog", "dogs"]])
    judge.prompt_accuracy(images, prompts)   # {"accuracy", "confidence", "per_class", "n", "skipped", ...}

A prompt's class is the first class whose name (or an alias) appears in it as a whole word; prompts
naming none are counted and left out. `classify` maps images [B, C, H, W] in [-1, 1] to logits [B, K].
Built in: the MNIST digit classifier (flowfleet.evaluate.digits.DigitJudge). For your own data,
`flowfleet evaluate --judge MODULE:FACTORY` imports FACTORY (from an importable module or a .py file)
and calls it with the reference RunRoot; it returns a ClassifierJudge (or anything with the same
`prompt_accuracy`, and optionally `extractor()` for a Fréchet distance in its features and `record`).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import logging
import re
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import safetensors.torch
import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from flowfleet.errors import FlowfleetError, ParameterError
from flowfleet.storage import RunRoot
from flowfleet.threads import ThreadGovernor

log = logging.getLogger(__name__)


class PromptClasses:
    """Which of K named classes a prompt asks for: the first class whose name (or an alias) appears in it
    as a whole word, case-insensitively; None when it names none."""

    def __init__(self, classes: Sequence[Sequence[str]]):
        if not classes or any(not names for names in classes):
            raise FlowfleetError("judge: every class needs at least one name")
        self.labels = [names[0] for names in classes]  # how a class is shown
        self._words = {name.lower(): k for k, names in enumerate(classes) for name in names}
        alternatives = "|".join(sorted(map(re.escape, self._words), key=len, reverse=True))
        self._pattern = re.compile(r"\b(" + alternatives + r")\b")

    def target(self, prompt: str) -> int | None:
        m = self._pattern.search(prompt.lower())
        return None if m is None else self._words[m.group(1)]


class ClassifierJudge:
    """A classifier over named classes, and the share of images it reads as their prompt's class."""

    def __init__(
        self,
        classify: Callable[[torch.Tensor], torch.Tensor],
        classes: Sequence[Sequence[str]],
        record: dict[str, Any] | None = None,
        features: nn.Module | None = None,
        batch: int = 500,
    ):
        self.classes = PromptClasses(classes)
        self.labels = self.classes.labels
        self.classify, self.batch, self._features = classify, batch, features
        self.record = dict(record or {})

    def target(self, prompt: str) -> int | None:
        """The class the prompt names (first match), or None."""
        return self.classes.target(prompt)

    @torch.no_grad()
    def probabilities(self, images: torch.Tensor) -> torch.Tensor:
        """images [B, C, H, W] in [-1, 1] -> class probabilities [B, K]."""
        if images.ndim != 4:
            raise FlowfleetError(f"judge: expected images [B, C, H, W], got shape {tuple(images.shape)}")
        probs = torch.cat(
            [
                self.classify(images[i : i + self.batch]).float().softmax(1)
                for i in range(0, images.shape[0], self.batch)
            ]
        )
        if probs.shape != (images.shape[0], len(self.labels)):
            raise FlowfleetError(
                f"judge: the classifier gave {tuple(probs.shape)} for {images.shape[0]} images "
                f"and {len(self.labels)} classes"
            )
        return probs

    def prompt_accuracy(self, images: torch.Tensor, prompts: Sequence[str]) -> dict[str, Any]:
        """Share of images read as their prompt's class, mean probability of that class, per class."""
        if len(prompts) != images.shape[0]:
            raise FlowfleetError(f"prompt accuracy: {images.shape[0]} images but {len(prompts)} prompts")
        targets = [self.target(p) for p in prompts]
        keep = [i for i, c in enumerate(targets) if c is not None]
        if not keep:
            raise FlowfleetError(f"prompt accuracy: no prompt names a class ({', '.join(self.labels[:10])}...)")
        probs = self.probabilities(images[keep])  # [n, K]
        want = torch.tensor([targets[i] for i in keep])
        hit = probs.argmax(1) == want
        # Shares as exact ratios of counts: a float32 mean reads 285 of 300 as 0.94999999, below a 0.95 bar
        per_class = {
            self.labels[c]: round(int(hit[want == c].sum()) / int((want == c).sum()), 4)
            for c in range(len(self.labels))
            if bool((want == c).any())
        }
        return {
            "accuracy": int(hit.sum()) / len(keep),
            "confidence": float(probs.gather(1, want[:, None]).mean()),
            "n": len(keep),
            "skipped": len(prompts) - len(keep),
            "per_class": per_class,
            "predicted": [self.labels[c] for c in probs.argmax(1).tolist()],
        }

    def extractor(self) -> nn.Module | None:
        """torchmetrics' custom-extractor module for a Fréchet distance in the classifier's features, or None."""
        return self._features


@dataclass(frozen=True)
class FitSettings:
    """A built-in judge's training settings, as the training loop reads them (the digits' defaults; each judge's
    TrainSettings adds its own fields and sets its defaults)."""

    epochs: int = 6
    batch_size: int = 64
    lr: float = 2e-3
    shift: int = 2  # random translation in pixels (augmentation)
    seed: int = 0
    # The loop's CPU threads, fixed: a CPU's sums, and so the judge's weights and every figure it scores, follow the
    # thread count, which would otherwise be the box's cores (two: the count BENCHMARKS.md's judges trained at)
    threads: int = 2


def shifted(x: torch.Tensor, shift: int, gen: torch.Generator, fill: float = -1.0) -> torch.Tensor:
    """Each image translated by up to `shift` pixels (padded with the background `fill`, randomly cropped): the
    built-in judges' augmentation."""
    b, _, h, w = x.shape
    padded = F.pad(x, (shift,) * 4, value=fill)
    dx = torch.randint(0, 2 * shift + 1, (b,), generator=gen).tolist()
    dy = torch.randint(0, 2 * shift + 1, (b,), generator=gen).tolist()
    return torch.stack([padded[i, :, dy[i] : dy[i] + h, dx[i] : dx[i] + w] for i in range(b)])


def fit_classifier(
    net: nn.Module,
    n: int,
    loss_of: Callable[[torch.Tensor], torch.Tensor],
    settings: FitSettings,
    gen: torch.Generator,
    desc: str,
    progress: bool = True,
) -> None:
    """The built-in judges' training loop: settings.epochs passes over n items in a seeded order (`gen`), AdamW
    (weight decay 1e-4) under a one-cycle schedule, at settings.threads CPU threads (the caller's count restored
    after: the trainer's ThreadGovernor, pinned); loss_of(indices [b]) gives a batch's loss. Leaves `net` in eval
    mode."""
    governor = ThreadGovernor(follow=False, fixed=settings.threads)
    opt = torch.optim.AdamW(net.parameters(), lr=settings.lr, weight_decay=1e-4)
    steps = settings.epochs * ((n + settings.batch_size - 1) // settings.batch_size)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, settings.lr, total_steps=steps)
    bar = tqdm(total=steps, desc=desc, unit="step", disable=not progress, leave=False)
    try:
        for _ in range(settings.epochs):
            net.train()
            perm = torch.randperm(n, generator=gen)
            for i in range(0, n, settings.batch_size):
                loss = loss_of(perm[i : i + settings.batch_size])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                sched.step()
                bar.update(1)
    finally:
        governor.restore()
    bar.close()
    net.eval()


def cached_classifier(
    store: RunRoot,
    folder: tuple[str, ...],
    record_name: str,
    recipe: tuple[str, dict[str, Any]],
    build: Callable[[], nn.Module],
    train: Callable[[], tuple[nn.Module, dict[str, Any]]],
) -> tuple[nn.Module, dict[str, Any]]:
    """A built-in judge's network, cached in store/folder (model.safetensors and its record `record_name`): the
    cached one when its record names this `recipe` (network, settings) and its weights load (and match the sha256
    the record keeps); else train() -> (net, record), written atomically with the weights' sha256 in the record."""
    weights, meta = (*folder, "model.safetensors"), (*folder, record_name)
    if store.exists(*weights) and store.exists(*meta):
        record = store.read_json(*meta)
        made = (record.get("network", "an older network"), record.get("settings"))
        if made != recipe:  # made by another flowfleet version's network or recipe
            log.info(
                "%s: a %s classifier trained with %s, not %s with %s; training it again",
                store.url_of(*meta),
                *made,
                *recipe,
            )
        else:
            net = build()
            data = store.read_bytes(*weights)
            digest = hashlib.sha256(data).hexdigest()
            try:
                if record.get("sha256", digest) != digest:
                    raise ValueError("not the weights its record names (sha256)")
                net.load_state_dict(safetensors.torch.load(data))
            except Exception as err:  # damaged cache: say so and train again below
                log.warning(
                    "%s: unreadable (%s); training it again", store.url_of(*weights), str(err).splitlines()[0][:120]
                )
            else:
                return net.eval(), record
    net, record = train()
    data = safetensors.torch.save(net.state_dict())
    record = {**record, "sha256": hashlib.sha256(data).hexdigest()}
    store.write_bytes(data, *weights)
    store.write_json(record, *meta)
    return net, record


class JudgeFeatures(nn.Module):
    """torchmetrics' custom-extractor contract (uint8 [B, C, H, W] -> [B, D], `num_features`) around a judge's
    network's `features` (images in [-1, 1]), so the Fréchet distance in its features is torchmetrics' own."""

    def __init__(self, net: nn.Module, key: str, num_features: int):
        super().__init__()
        self.net = net.eval()
        self.key = key  # names the features in cache files and results
        self.num_features = num_features

    @torch.no_grad()
    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.net.features(images.float() / 127.5 - 1.0).double()  # type: ignore[operator]  # the judge's net


def load_judge(spec: str, root: RunRoot) -> Any:
    """'package.module:factory' or 'path/to/file.py:factory' -> factory(root)."""
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise ParameterError("judge", f"{spec!r} is not MODULE:FACTORY (e.g. mypkg.judges:make or judge.py:make)")
    try:
        if where.endswith(".py"):
            loader = importlib.util.spec_from_file_location("flowfleet_user_judge", where)
            if loader is None or loader.loader is None:
                raise FileNotFoundError(where)
            module = importlib.util.module_from_spec(loader)
            loader.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except (ImportError, FileNotFoundError, OSError, SyntaxError) as err:
        raise ParameterError("judge", f"cannot import {where} ({type(err).__name__}: {err})") from None
    factory = getattr(module, name, None)
    if not callable(factory):
        raise ParameterError("judge", f"{where} has no callable {name!r}")
    judge = factory(root)
    if not callable(getattr(judge, "prompt_accuracy", None)):
        raise ParameterError("judge", f"{spec} returned {type(judge).__name__}, which has no prompt_accuracy()")
    return judge
