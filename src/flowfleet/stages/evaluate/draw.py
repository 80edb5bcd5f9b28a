"""One draw of an evaluation: its shared inputs (data, prompts or labels, the held-out split's reference and real
floor, the FID and judge references) and what the models drew on it (EvaluationDraw); stage.py's `evaluate` makes a
test draw and a validation draw of them."""

from __future__ import annotations

import logging
import posixpath
import time
from dataclasses import replace
from typing import Any, Sequence

import torch

from flowfleet.config import RunConfig
from flowfleet.data.shards import ShardSetUnion
from flowfleet.device import resolve_device
from flowfleet.errors import FlowfleetError, ParameterError
from flowfleet.evaluate.adherence import prompt_adherence
from flowfleet.evaluate.diagnostics import SemanticFeatures, disagreement, dominant_experts, usage_shares
from flowfleet.evaluate.fid import FID, FeatureStats
from flowfleet.evaluate.reference import (
    TEST,
    VALIDATION,
    VALIDATION_SEED,
    HeldOutSplits,
    ReferenceSplit,
    held_out_data,
    open_reference,
)
from flowfleet.evaluate.views import captioned_grid_png
from flowfleet.flow import Strategy
from flowfleet.layout import (
    MONOLITH,
    REPORTS,
    SAMPLES,
    evaluation_folder,
)
from flowfleet.sampling.folder import read_model_index
from flowfleet.sampling.views import routing_heatmap
from flowfleet.stages.evaluate.models import check_other_fleet
from flowfleet.stages.evaluate.options import EvaluateOptions, ModelRun
from flowfleet.stages.evaluate.pieces import generated_features, samples_npz
from flowfleet.stages.evaluate.sweep import GuidanceSweep, Sweep
from flowfleet.storage import RunRoot
from flowfleet.train.specs import router_of_folder
from flowfleet.train.status import job_finished

log = logging.getLogger(__name__)


class EvaluationDraw(GuidanceSweep):
    """The shared inputs of one evaluation (data, prompts, FID reference) and what the models produced."""

    def __init__(
        self,
        model_url: str,
        root: RunRoot,
        cfg: RunConfig,
        data: ShardSetUnion,
        options: EvaluateOptions,
        device: torch.device,
        conditioning: str,
        split: str | None = TEST,
    ):
        """split: which of the held-out splits (HeldOutSplits) this draw's reference and floor come from: TEST (the
        figures'), VALIDATION (the choices'), or None: all of the reference set."""
        self.model_url, self.root, self.cfg, self.data, self.options = model_url, root, cfg, data, options
        self.device = device
        # reports/ for the run's model/, reports/<folder>/ for another model folder of the run
        # (both as url_of() spells them: a relative run root, as `make demo` gives, and the absolute model
        # folder that assemble returns name the same place)
        self.out = evaluation_folder(RunRoot(model_url).url_of(), root.url_of())
        fields, captions = data.load(["latents", "labels"], with_captions=True)
        self.latents = fields["latents"]
        count = self.latents.shape[0]
        gen = torch.Generator().manual_seed(options.seed)
        self.order = torch.randperm(count, generator=gen)  # data/'s items in a seeded order (router accuracy)
        picks = torch.randint(0, count, (options.n,), generator=gen)  # the prompts' items (with replacement)
        # The reference and the real floor: the held-out items when prepare kept some out of training.
        self.ref_data = held_out_data(root, cfg) or data
        self.ref_latents = self.latents if self.ref_data is data else self.ref_data.load(["latents"])["latents"]
        # a latent-space run's eval/ keeps the real images: the reference is never the decoder's reconstruction
        self.ref_images = self.ref_data.load(["images"]).get("images") if self.ref_data is not data else None
        held = self.ref_data is not data
        self.splits = HeldOutSplits.of(cfg, self.ref_latents.shape[0] if held else None)
        self.split_name = TEST if split is None or self.splits.shared else split
        pool = None if split is None else self.splits.items(split)
        self.split = ReferenceSplit.draw(self.ref_latents.shape[0], options.n, options.ref_n, options.seed, held, pool)
        self.ref_n = int(self.split.reference.numel())
        self.floor: dict[str, Any] = {"n": int(self.split.floor.numel())}  # the real floor's scores
        text = conditioning in ("pooled", "cross_attn")
        self.prompts = [captions[i] for i in picks.tolist()] if text and captions else None
        self.labels = fields["labels"][picks].tolist() if conditioning == "class" else None
        self.fid: FID | None = None
        self.ref: FeatureStats | None = None
        self.semantic: SemanticFeatures | None = None
        self.judge: Any = None  # prompt accuracy: --judge, or the digit classifier on the MNIST source
        # the judge's feature space: its FD, and the reference's features (precision and recall)
        self.judge_fd: tuple[FID, FeatureStats, torch.Tensor] | None = None
        self.prompt_accuracy: dict[str, Any] = {}
        self.runs: dict[str, ModelRun] = {}
        self.settings: Any = None
        self.adherence: dict[str, Any] = {}
        self.diagnostics: dict[str, Any] = {"usage": {}, "alignment": {}, "disagreement": {}}
        self.timings: dict[str, float] = {}
        self.draws: dict[str, Any] | None = None  # options.repeats > 1: every draw's scores (_redraw)
        self.validation: dict[str, Any] | None = None  # the validation draw the choices were made on (describe_split)

    @classmethod
    def open(
        cls,
        model_dir: str,
        reference: str | None,
        options: EvaluateOptions,
        extractor: torch.nn.Module | None,
        inception: bool = True,
        split: str = TEST,
    ) -> "EvaluationDraw":
        """inception False: no Inception reference or floor FID (a draw scored by the judge alone); split: the
        held-out split of its reference images (TEST or VALIDATION)."""
        options.validate()
        model_root = RunRoot(model_dir)
        index = read_model_index(model_root)  # one-line error when DIR is not an assembled fleet
        if reference is None:
            url = model_root.url.rstrip("/")
            reference = url.rsplit("/", 1)[0] if "/" in url else "."
        root, cfg, data = open_reference(reference)
        if tuple(index.latent_shape) != tuple(cfg.latent_shape):
            raise FlowfleetError(
                f"{model_root.url}: latent shape {tuple(index.latent_shape)} differs from the "
                f"reference run's {tuple(cfg.latent_shape)} ({root.url_of('run.yaml')})"
            )
        for s in options.strategy_values:
            try:
                s.resolve_k(len(index.present_experts))
            except ValueError as err:
                raise ParameterError("strategies", f"{err}") from None
        if options.monolith:
            done, why, _ = job_finished(root, MONOLITH)
            if not done:
                raise ParameterError("monolith", f"{why}")
        for router in options.routers:
            done, why, _ = job_finished(root, router_of_folder(cfg, router).dir)
            if not done:
                raise ParameterError("routers", f"{why}")
        for _, folder in options.fleets:
            check_other_fleet(model_root, index, RunRoot(folder), options.strategy_values)
        ev = cls(model_root.url, root, cfg, data, options, resolve_device(options.device), index.conditioning, split)
        ev._open_fid(extractor, inception)
        return ev

    def choice_draw(
        self, model_dir: str, reference: str | None, extractor: torch.nn.Module | None
    ) -> "EvaluationDraw | None":
        """The draw the guidance sweep chooses on: the validation split's, with prompts and noise of its own (seed +
        VALIDATION_SEED); this draw itself where the run has no validation split (said in one line); None when the
        evaluation has nothing to choose (one scale or none)."""
        o = self.options
        if len(o.guidance_sweep) < 2:
            return None
        if self.splits.shared:
            why = (
                "has no validation split (run.yaml data.validation)"
                if self.split.held_out
                else "holds no items out of training (run.yaml data.holdout)"
            )
            log.warning(f"evaluate: {self.root.url} {why}: the guidance scale is chosen on the images it reports")
            return self
        # every item of the split is the choice's reference: a choice needs no real floor
        pool = self.splits.items(VALIDATION)
        ref_n = None if pool is None else min(o.ref_n or int(pool.numel()), int(pool.numel()))
        drawn = replace(
            o, seed=o.seed + VALIDATION_SEED, ref_n=ref_n, repeats=1, diagnostics=False, save_guidance_scale=False
        )
        # Inception only where no judge's features choose
        return EvaluationDraw.open(model_dir, reference, drawn, extractor, self.judge_fd is None, VALIDATION)

    def describe_split(self) -> dict[str, Any]:
        """evaluation.json's record of this draw's split: its items, reference, floor and seed."""
        pool = self.splits.items(self.split_name)
        return {
            "split": self.split_name,
            "items": None if pool is None else int(pool.numel()),
            "seed": self.options.seed,
            "reference_images": self.ref_n,
            "floor": self.floor,
        }

    def _report_path(self, file: str) -> str:
        """A sample file's path relative to reports/, as evaluation.json records it."""
        return posixpath.join(self.out, SAMPLES, file)

    def run_model(self, name: str, kind: str, pipe, strategy: Strategy, sweep: "Sweep | None" = None, **choices: Any):
        """Sample options.n images from one model (a strategy of the fleet, or the monolith) at its scale (the
        sweep's choice, else the one scale asked for) and score them; keep the samples for the grid, routing
        heatmap, usage, adherence and diagnostics. A sweep made on this very draw (a run without a validation
        split) gives its chosen samples. choices: the row's own settings (its guidance rule)."""
        o = self.options
        run = ModelRun(name, kind)
        if sweep is not None and sweep.chosen_on == self.split_name and sweep.chosen is not None:
            settings, out, images, scores = sweep.chosen
        else:
            scale = (
                sweep.cfg
                if sweep is not None
                else (o.guidance_sweep[0] if o.guidance_sweep else o.sampling.get("guidance_scale"))
            )
            settings, out, images, scores = self._draw(name, pipe, strategy, scale, True, run, **choices)
        if "fid" not in scores:  # (a judge chose on this draw: Inception FID, the costlier network, only now)
            t0 = time.perf_counter()
            fid, ref = self._fid_reference()
            stats, scores["_fid_features"] = generated_features(fid, images, name)
            scores["fid"] = fid.score(stats, ref)
            run.fid_s += time.perf_counter() - t0
            if sweep is not None:  # the chosen record is this draw's: it gets the FID too
                next(r for r in sweep.records if r["cfg"] == settings.guidance_scale)["fid"] = scores["fid"]
        if sweep is not None:
            run.sweep, run.chosen_on, run.sweep_stop = sweep.records, sweep.chosen_on, sweep.stop
            run.sampling_s += sweep.sampling_s
            run.fid_s += sweep.fid_s
        self.settings = settings
        run.cfg, run.fid, feats = settings.guidance_scale, scores["fid"], scores["_fid_features"]
        run.cache_saved = scores["cache_saved"]
        run.classifier_fd, run.precision, run.recall = (scores.get(k) for k in ("classifier_fd", "precision", "recall"))
        run.subcategory_accuracy = scores.get("subcategory_accuracy")
        if "_accuracy" in scores:
            acc = self.prompt_accuracy[name] = scores["_accuracy"]
            run.prompt_accuracy, run.confidence = acc["accuracy"], acc.get("confidence")
        run.samples = self._report_path(f"{name}.npz")
        self.root.write_bytes(samples_npz(images, out.prompts, o.seed), REPORTS, run.samples)

        self._write_grid(run, images, out.prompts)
        if kind == "fleet":
            run.heatmap = self._report_path(f"{name}.routing.png")
            self.root.write_bytes(routing_heatmap(out.trace), REPORTS, run.heatmap)
            run.usage = self.diagnostics["usage"][name] = usage_shares(out.trace)
        if self.cfg.data.source == "shapes" and images.shape[1] == 3 and self.prompts:
            self.adherence[name] = prompt_adherence(images, out.prompts)
        if kind == "fleet" and self.semantic is not None and self.semantic.available:
            t0 = time.perf_counter()
            sem = feats if self.semantic.same_as_fid else self.semantic.encode(images[: min(o.n, 256)])
            dominant = dominant_experts(out.trace)[: sem.shape[0]]
            self.diagnostics["alignment"][name] = self.semantic.alignment(sem, dominant)
            self.diagnostics["disagreement"][name] = disagreement(
                pipe, self.prompts, self.labels, settings, min(o.diagnostic_n, o.n), o.seed
            )
            self.timings[f"{name}_diagnostics_s"] = time.perf_counter() - t0
        self.timings[f"{name}_sampling_s"] = run.sampling_s
        self.timings[f"{name}_fid_s"] = run.fid_s
        self.runs[name] = run
        return run

    def _write_grid(self, run: ModelRun, images: torch.Tensor, prompts: Sequence[str]) -> None:
        """The report's grid of a model's first samples, each under its prompt, titled with its scores: the
        judge's distance beside the real images' of the same draw (else Inception FID), and prompt accuracy."""
        shown = min(self.options.grid, self.options.n)
        run.prompts, run.grid = list(prompts[:shown]), self._report_path(f"{run.name}.png")
        title = f"{run.name}  Inception FID {run.fid:.2f}"
        if run.classifier_fd is not None:
            floor = self.floor.get("classifier_fd")
            title = f"{run.name}  classifier FD {run.classifier_fd:.1f}" + (
                f" (real images {floor:.1f})" if floor is not None else ""
            )
        if run.prompt_accuracy is not None:
            title += f"  prompt accuracy {run.prompt_accuracy:.3f}"
        self.root.write_bytes(captioned_grid_png(images[:shown], run.prompts, title=title), REPORTS, run.grid)

    def same_model(self, name: str, earlier: str) -> ModelRun:
        """Record strategy `name` as the model already evaluated as `earlier` (its samples would be
        identical), without sampling it again."""
        run = self.runs[name] = replace(self.runs[earlier], name=name, same_as=earlier, sampling_s=0.0, fid_s=0.0)
        for table in (
            self.prompt_accuracy,
            self.adherence,
            self.diagnostics["usage"],
            self.diagnostics["alignment"],
            self.diagnostics["disagreement"],
        ):
            if earlier in table:
                table[name] = table[earlier]
        log.info(f"evaluate: {name} uses the same experts with the same weights as {earlier}: not sampled twice")
        return run
