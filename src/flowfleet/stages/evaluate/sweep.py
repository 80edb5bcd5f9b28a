"""An evaluation draw sampling a model at a guidance scale, and its guidance sweep: every scale of the sweep, one
scale further while the best sits at an edge (pieces.extend_sweep), each scored and the best chosen
(pieces.choose_scale)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from flowfleet.flow import Strategy
from flowfleet.sampling.pipeline import FleetPipeline
from flowfleet.stages.evaluate.options import ModelRun
from flowfleet.stages.evaluate.pieces import choose_scale, describe_scores, extend_sweep
from flowfleet.stages.evaluate.scoring import DrawScoring

log = logging.getLogger(__name__)


@dataclass
class Sweep:
    """One model's guidance sweep on one draw: every scale's scores (sorted by scale), the chosen scale, why it
    stopped at an edge (None: the best lies inside), the chosen scale's samples, the time it took."""

    chosen_on: str  # the split of the draw: VALIDATION, or TEST where the run has no validation split
    records: list[dict[str, Any]] = field(default_factory=list)
    stop: str | None = None
    chosen: tuple[Any, Any, torch.Tensor, dict[str, Any]] | None = None  # (settings, output, images, scores)
    sampling_s: float = 0.0
    fid_s: float = 0.0

    @property
    def cfg(self) -> float | None:
        """The chosen scale."""
        return None if self.chosen is None else self.chosen[0].guidance_scale


class GuidanceSweep(DrawScoring):
    """An evaluation draw's sampling (draw.py `EvaluationDraw` sets what it reads: its options, prompts or labels, the
    name of its split) and its guidance sweep; DrawScoring scores what it samples."""

    labels: list[int] | None
    split_name: str

    def settings_for(self, pipe: FleetPipeline, strategy: Strategy | None, **choices: Any) -> Any:
        """The fleet's settings for this draw: options.sampling, then `choices` (guidance_scale), with the draw's
        seed."""
        return pipe.settings(strategy, **{**self.options.sampling, **choices, "seed": self.options.seed})

    def sample(self, pipe: Any, settings: Any, progress: bool | str) -> Any:
        """The draw's n prompts (or labels) sampled by a fleet or the monolith with `settings`, in batches."""
        n, batch = self.options.n, self.options.batch_size
        return pipe(self.prompts, n, labels=self.labels, settings=settings, batch_size=batch, progress=progress)

    def sweep(self, name: str, pipe: Any, strategy: Strategy, **choices: Any) -> "Sweep":
        """Sample this draw at every scale of the guidance sweep, and one scale further while the best sits at an
        edge (pieces.extend_sweep); score each and choose (pieces.choose_scale). With a judge its classifier FD
        chooses (no Inception); without one, FID. choices: the row's own settings (its guidance rule)."""
        o = self.options
        fid_each = self.judge_fd is None
        drawn: dict[float, tuple[Any, Any, torch.Tensor, dict[str, Any]]] = {}  # (settings, output, images, scores)
        sweep = Sweep(self.split_name)
        todo: list[float] = list(o.guidance_sweep)
        while todo:
            scale = todo.pop(0)
            drawn[scale] = self._draw(name, pipe, strategy, scale, fid_each, sweep, **choices)
            if todo:
                continue
            scales = sorted(drawn)
            sweep.records = [
                {"cfg": settings.guidance_scale, **{k: v for k, v in scores.items() if not k.startswith("_")}}
                for settings, _, _, scores in (drawn[c] for c in scales)
            ]
            chosen = scales[choose_scale(sweep.records, o.min_accuracy)]
            further, sweep.stop = extend_sweep(
                scales, chosen, o.guidance_bounds, len(drawn) - len(o.guidance_sweep), o.guidance_extend
            )
            if further is not None and further not in drawn:
                log.info(
                    f"evaluate: {name}: the best scale {chosen:g} is the sweep's edge on the {self.split_name} split"
                )
                todo.append(further)
        if sweep.stop:
            log.warning(f"evaluate: {name}: {sweep.stop} ({self.split_name} split)")
        sweep.chosen = drawn[chosen]
        return sweep

    def _draw(
        self,
        name: str,
        pipe: Any,
        strategy: Strategy | None,
        scale: float | None,
        with_fid: bool,
        timed: "Sweep | ModelRun",
        **choices: Any,
    ) -> tuple[Any, Any, torch.Tensor, dict[str, Any]]:
        """One model's samples of this draw at one guidance scale, scored: (settings, output, images, scores); the
        time it took added to `timed`'s sampling_s and fid_s."""
        settings = self.settings_for(pipe, strategy, **choices, guidance_scale=scale)
        log.info(f"evaluate: {name}: sampling {self.options.n} images ({settings.describe()}, {self.split_name} split)")
        t0 = time.perf_counter()
        out = self.sample(pipe, settings, name)
        timed.sampling_s += time.perf_counter() - t0
        images = out.images.float().cpu()  # [n, C, H, W] in [-1, 1]
        t0 = time.perf_counter()
        scores = self._score(images, out.prompts, name, with_fid=with_fid)
        timed.fid_s += time.perf_counter() - t0
        scores["cache_saved"] = out.trace.stats.cache.saved  # blocks skipped by --cache (0 without it)
        log.info(f"evaluate: {name}: guidance {settings.guidance_scale:g}: " + describe_scores(scores))
        return settings, out, images, scores
