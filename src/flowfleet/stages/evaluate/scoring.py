"""How an evaluation draw scores a set of images: the Inception FID against the reference statistics (cached in the
run) and the real floor, and the judge (--judge, or the built-in digits or emoji classifier) with its prompt
accuracy and, in its own feature space, the classifier FD, precision and recall."""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Sequence

import torch

from flowfleet.config import RunConfig
from flowfleet.data.shards import ShardSetUnion
from flowfleet.errors import ParameterError
from flowfleet.evaluate.diagnostics import SemanticFeatures
from flowfleet.evaluate.digits import DigitJudge, prompted_digit
from flowfleet.evaluate.emoji import EmojiJudge
from flowfleet.evaluate.fid import FID, FeatureStats, FIDSettings
from flowfleet.evaluate.judge import load_judge
from flowfleet.evaluate.precision_recall import precision_recall
from flowfleet.evaluate.reference import ReferenceSplit, data_fingerprint, features_are_fid_features, reference_images
from flowfleet.layout import DATA, EVAL_DATA
from flowfleet.stages.evaluate.options import EvaluateOptions
from flowfleet.stages.evaluate.pieces import generated_features, stats_of
from flowfleet.storage import RunRoot

log = logging.getLogger(__name__)
JUDGE_NAMES = {"digits": "mnist digit classifier", "emoji": "emoji category classifier"}  # evaluation.json's words
PR_REFERENCE = 2000  # reference rows for precision/recall (prdc holds the [N, N] distances in memory)


class DrawScoring:
    """The scoring half of an evaluation draw (draw.py `EvaluationDraw`), which sets what it reads: its options, run,
    data, prompts, reference split and floor."""

    options: EvaluateOptions
    root: RunRoot
    cfg: RunConfig
    data: ShardSetUnion
    device: torch.device
    prompts: list[str] | None
    split: ReferenceSplit
    ref_data: Any
    ref_latents: torch.Tensor
    ref_images: torch.Tensor | None
    ref_n: int
    floor: dict[str, Any]
    timings: dict[str, float]
    fid: FID | None
    ref: FeatureStats | None
    semantic: SemanticFeatures | None
    judge: Any
    judge_fd: tuple[FID, FeatureStats, torch.Tensor] | None

    def _open_fid(self, extractor: torch.nn.Module | None, inception: bool = True, named: bool = True) -> None:
        """The feature network and the (cached) reference statistics; the real floor's FID (inception False:
        neither, the judge only). named: a judge of --judge must name a class in some prompt."""
        t0 = time.perf_counter()
        if inception:  # (a draw scored by the judge alone never loads the Inception)
            fid = self.fid = FID(self.options.fid, self.device, extractor=extractor)
            self._inception_reference(fid)
        self.timings["reference_s"] = time.perf_counter() - t0
        if self.options.judge or (self.prompts and self.builtin_judge() is not None):
            self._open_judge(named)
        if self.options.diagnostics and self.fid is not None:
            self.semantic = SemanticFeatures(self.root, self.cfg, self.fid.key, self.device)

    def _inception_reference(self, fid: FID) -> None:
        """The reference's Inception statistics (cached in the run) and the real floor's FID."""
        name = EVAL_DATA if self.split.held_out else DATA
        fingerprint = self.split.key(data_fingerprint(self.ref_data))
        ref_n, picked = self.ref_n, self.split.reference
        if features_are_fid_features(self.cfg, fid.key):
            # prepare stored exactly these Inception features for clustering: no second pass over the data.
            feats = self.ref_data.load(["features"])["features"]
            self.ref = fid.reference_from_features(
                self.root, name, lambda: [feats[picked]], n=ref_n, fingerprint=fingerprint
            )
        else:
            images = self._real_images(picked, self.options.fid.batch_size)
            self.ref = fid.reference(self.root, name, images, n=ref_n, fingerprint=fingerprint)
        if self.floor["n"]:
            floor = self._real_images(self.split.floor, self.options.fid.batch_size)
            self.floor["fid"] = fid.score(fid.statistics(floor(), desc="fid features (real floor)"), self.ref)

    def _real_images(self, items: torch.Tensor, batch: int) -> Callable[[], Any]:
        """A generator factory of the reference set's `items`, decoded, batch by batch."""
        n = int(items.numel())
        return reference_images(self.root, self.cfg, self.ref_latents, items, n, batch, self.device, self.ref_images)

    def _fid_reference(self) -> tuple[FID, FeatureStats]:
        if self.fid is None or self.ref is None:
            raise RuntimeError("the FID reference is not open (open() has not run)")
        return self.fid, self.ref

    def builtin_judge(self) -> str | None:
        """The built-in judge asked for by name (--judge digits|emoji), else that of data/'s source (as prepare
        recorded it), where its prompts are that judge's: "digits" (the built-in digits, prompts naming a digit) or
        "emoji" (the built-in emoji); None for any other data."""
        if self.options.judge:
            return self.options.judge if self.options.judge in JUDGE_NAMES else None
        source = self.data.manifest().extra.get("source") or {}
        kind = source.get("kind") if isinstance(source, dict) else None
        if kind == "mnist" and any(prompted_digit(p) is not None for p in self.prompts or []):
            return "digits"
        return "emoji" if kind == "emoji" else None

    def _open_judge(self, named: bool = True) -> None:
        """The prompt-accuracy judge (--judge, or the MNIST digit classifier, trained once and cached in
        reports/) and, when it has features, their reference statistics for the classifier FD."""
        if not self.prompts:
            raise ParameterError("judge", "the model is not text-conditioned; prompt accuracy needs prompts")
        t0 = time.perf_counter()
        if self.options.judge and self.builtin_judge() is None:
            self.judge = load_judge(self.options.judge, self.root)
            if named and not self.judge_names_a_prompt():
                raise ParameterError(
                    "judge",
                    f"none of the {len(self.prompts)} prompts names one of the judge's "
                    f"classes (e.g. {self.prompts[0]!r})",
                )
        elif self.builtin_judge() == "emoji":
            self.judge = EmojiJudge.load_or_train()
            log.info(f"evaluate: emoji judge (category accuracy {self.judge.val_accuracy:.3f} on the held-out emoji)")
        else:
            self.judge = DigitJudge.load_or_train(self.root)
            log.info(f"evaluate: digit classifier (validation accuracy {self.judge.val_accuracy:.3f})")
        extractor = self.judge.extractor() if callable(getattr(self.judge, "extractor", None)) else None
        if extractor is not None:
            # The judge's features of the reference (kept: precision and recall need the rows) and the floor.
            judge_fd = FID(FIDSettings(batch_size=500), self.device, extractor=extractor)
            ref_feats = torch.cat([judge_fd.features(b) for b in self._real_images(self.split.reference, 500)()])
            self.judge_fd = judge_fd, stats_of(ref_feats, judge_fd.key), ref_feats
            if self.floor["n"]:
                floor_feats = torch.cat([judge_fd.features(b) for b in self._real_images(self.split.floor, 500)()])
                self.floor.update(self._judge_scores(floor_feats))
        self.timings["judge_s"] = time.perf_counter() - t0

    def judge_names_a_prompt(self) -> bool:
        """Whether the judge names the class of one of the prompts at least (a judge without `target`: assumed)."""
        target = getattr(self.judge, "target", None)
        return not callable(target) or any(target(p) is not None for p in self.prompts or [])

    def _score(self, images: torch.Tensor, prompts: Sequence[str], name: str, with_fid: bool = True) -> dict[str, Any]:
        """FID against the reference (with_fid); with a judge: prompt accuracy, and with its features the
        classifier FD, precision and recall. Keys starting with _ are kept out of the sweep's records."""
        scores: dict[str, Any] = {}
        if with_fid:
            fid, ref = self._fid_reference()
            stats, feats = generated_features(fid, images, name)
            scores.update(fid=fid.score(stats, ref), _fid_features=feats)
        if self.judge is not None:
            acc = scores["_accuracy"] = self.judge.prompt_accuracy(images, prompts)
            scores["prompt_accuracy"] = acc["accuracy"]
            if "subcategory_accuracy" in acc:  # the emoji judge's finer reading
                scores["subcategory_accuracy"] = acc["subcategory_accuracy"]
            if self.judge_fd is not None:
                scores.update(self._judge_scores(self.judge_fd[0].features(images)))
        return scores

    def _judge_scores(self, features: torch.Tensor) -> dict[str, float]:
        """Classifier FD, precision and recall of a set's judge features [n, D] against the reference's."""
        if self.judge_fd is None:
            raise RuntimeError("the judge's reference features are not open")
        judge_fd, judge_ref, ref_feats = self.judge_fd
        pr = precision_recall(ref_feats[:PR_REFERENCE], features)
        fd = judge_fd.score(stats_of(features, judge_fd.key), judge_ref)
        return {"classifier_fd": fd, "precision": pr["precision"], "recall": pr["recall"]}
