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

import importlib
import importlib.util
import re
from typing import Any, Callable, Sequence

import torch
from torch import nn

from flowfleet.errors import FlowfleetError
from flowfleet.storage import RunRoot


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


def load_judge(spec: str, root: RunRoot) -> Any:
    """'package.module:factory' or 'path/to/file.py:factory' -> factory(root)."""
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise FlowfleetError(f"--judge: {spec!r} is not MODULE:FACTORY (e.g. mypkg.judges:make or judge.py:make)")
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
        raise FlowfleetError(f"--judge: cannot import {where} ({type(err).__name__}: {err})") from None
    factory = getattr(module, name, None)
    if not callable(factory):
        raise FlowfleetError(f"--judge: {where} has no callable {name!r}")
    judge = factory(root)
    if not callable(getattr(judge, "prompt_accuracy", None)):
        raise FlowfleetError(f"--judge: {spec} returned {type(judge).__name__}, which has no prompt_accuracy()")
    return judge
