"""Stage `evaluate`: FID per routing strategy (and the monolith), prompt adherence, diagnostics.

    evaluate("runs/r/model", "runs/r", EvaluateOptions(n=1000, strategies=("top1", "top2", "full"), monolith=True))

On the built-in MNIST source every model is also judged by a digit classifier trained on MNIST-5k
(flowfleet.evaluate.digits): prompt accuracy (share of samples read as the prompted digit, with the
mean probability of that digit) and the Fréchet distance in the classifier's features ("classifier
FD"), which, unlike Inception FID at this size, tells a digit from a blob.

Every model samples the same n prompts (drawn from data/'s captions, seeded) from the same noise, so
the strategies are compared on identical inputs. The reference is the run's own prepared data/
(decoded from latents; a seeded random subset of `ref_n` items), its Inception statistics cached in
RUN_ROOT/reports/. Writes, under the reference run root:

    reports/evaluation.json             everything below, read by `flowfleet report`
    reports/samples/<name>.png          the first `grid` samples with their prompts
    reports/samples/<name>.npz          every scored sample: images uint8 [n, H, W, C], prompts, seed
    reports/digit_classifier/           (MNIST) the digit classifier behind prompt accuracy and classifier FD
    reports/samples/<name>.routing.png  router probabilities over the sampling steps (fleet strategies)
    reports/fid_ref_*.safetensors       the cached reference statistics

The stage's pieces live in flowfleet.evaluate: the reference items and the real floor (reference.py), FID
(fid.py), precision/recall, the judges, the diagnostics' probes (diagnostics.py) and the terminal table
(table.py). Options are validated (strategies parsed, the monolith finished, shapes matched) before anything
heavy is loaded. The encoders (transformers, the diffusers VAE) are imported only where one is built.
"""

from __future__ import annotations

import io
import logging
import posixpath
import re
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Sequence

import numpy as np
import safetensors.torch
import torch
from tqdm.auto import tqdm

from flowfleet.config import RunConfig
from flowfleet.data.images import to_uint8
from flowfleet.data.shards import ShardSetUnion
from flowfleet.device import resolve_device
from flowfleet.errors import FlowfleetError
from flowfleet.evaluate.adherence import prompt_adherence
from flowfleet.evaluate.diagnostics import (
    SemanticFeatures,
    disagreement,
    dominant_experts,
    router_accuracy,
    usage_shares,
)
from flowfleet.evaluate.digits import DigitJudge, prompted_digit
from flowfleet.evaluate.fid import FID, FeatureStats, FIDSettings, fid_metadata
from flowfleet.evaluate.generalization import clustering_fields, fields_for, generalization, held_out_clusters
from flowfleet.evaluate.judge import load_judge
from flowfleet.evaluate.precision_recall import precision_recall
from flowfleet.evaluate.reference import (
    ReferenceSplit,
    data_fingerprint,
    features_are_fid_features,
    held_out_data,
    open_reference,
    reference_images,
)
from flowfleet.evaluate.report import EVALUATION_FILE
from flowfleet.evaluate.views import captioned_grid_png
from flowfleet.flow import parse_strategy, same_as_earlier
from flowfleet.layout import (
    ASSIGNMENTS,
    CENTROIDS,
    DATA,
    EVAL_DATA,
    FINAL,
    MODEL_VAE,
    MONOLITH,
    MONOLITH_MODEL,
    REPORTS,
    ROUTERS,
    SAMPLES,
    evaluation_folder,
)
from flowfleet.models.dit import DiTModel, DiTRouter
from flowfleet.models.files import load_model
from flowfleet.sampling.checksums import read_checksums
from flowfleet.sampling.index import ModelIndex, read_model_index, set_default_cfg
from flowfleet.sampling.pipeline import FleetPipeline
from flowfleet.sampling.views import routing_heatmap
from flowfleet.stages.assemble import assemble
from flowfleet.storage import RunRoot
from flowfleet.train.data import InMemoryData, model_fields
from flowfleet.train.preview import condition_kwargs
from flowfleet.train.specs import router_of_folder
from flowfleet.train.status import job_finished
from flowfleet.train.tasks import clustered_data

log = logging.getLogger(__name__)

FLEET_NAME = re.compile(r"[A-Za-z0-9_-]+")
PR_REFERENCE = 2000  # reference rows for precision/recall (prdc holds the [N, N] distances in memory)


@dataclass(frozen=True)
class EvaluateOptions:
    n: int = 1000  # generated images per model
    strategies: tuple[str, ...] = ("top1", "top2", "full")
    monolith: bool = False  # also evaluate RUN_ROOT/monolith/final (same sampler, no routing)
    # Comparison routers of the reference run (router-prompt, router-paris): each strategy again with the same
    # experts routed by that router instead, as the row "<strategy>+<router>" (the demo's "beyond Paris" row).
    routers: tuple[str, ...] = ()
    # Other fleets that share the run's latent space and text encoder, as (NAME, model folder): each strategy
    # again sampled by that fleet, as the row "<strategy>@<NAME>" (e.g. a fleet of caption clusters).
    fleets: tuple[tuple[str, str], ...] = ()
    seed: int = 0
    batch_size: int = 250  # samples per sampling batch
    steps: int | None = None  # None: the fleet's model_index.json
    sampler: str | None = None
    cfg: float | None = None
    shift: float | None = None
    route_every: int | None = None
    cache: float = 0.0  # first-block cache threshold (flowfleet.sampling.cache)
    cfg_max_t: float | None = None  # guidance only while t <= this (None: the fleet's)
    ref_n: int | None = None  # reference images; None: all of the reference set up to 10,000 (floor set apart)
    # Guidance sweep: each model is sampled at every scale; its row is the scale with the best classifier
    # FD (FID without a judge) among those with prompt accuracy >= min_accuracy (the most accurate if none).
    cfg_sweep: tuple[float, ...] = ()
    min_accuracy: float = 0.95
    # Evaluation draws: after the sweep, every model is sampled again at its chosen scale repeats - 1 times,
    # draw r with seed + r (other prompts and noise, and another split of the reference and the real floor).
    # At a few hundred samples a Fréchet distance moves by several points from draw to draw; the report gives
    # each figure's mean and sd over the draws, and the fleet's ratio to the monolith draw by draw.
    repeats: int = 1
    save_cfg: bool = False  # write each model folder's chosen scale into its model_index.json (the default)
    fid: FIDSettings = FIDSettings()
    grid: int = 32  # samples shown per model in the report
    diagnostics: bool = True
    diagnostic_n: int = 32  # samples whose trajectories probe expert disagreement (K passes per step)
    device: str = "auto"
    judge: str | None = None  # MODULE:FACTORY of a prompt-accuracy judge (flowfleet.evaluate.judge); MNIST: built in

    def validate(self) -> None:
        if self.n < 2:
            raise FlowfleetError(f"--n: FID needs at least 2 samples, got {self.n}")
        if self.batch_size < 1:
            raise FlowfleetError(f"--batch-size: must be >= 1, got {self.batch_size}")
        if self.repeats < 1:
            raise FlowfleetError(f"--repeats: must be >= 1, got {self.repeats}")
        if self.ref_n is not None and self.ref_n < 2:
            raise FlowfleetError(f"--ref-n: must be >= 2, got {self.ref_n}")
        if not self.strategies and not self.monolith:
            raise FlowfleetError("--strategies: nothing to evaluate (give strategies or --monolith)")
        for s in self.strategies:
            try:
                parse_strategy(s)
            except ValueError as err:
                raise FlowfleetError(f"--strategies: {err}") from None
        if self.routers and not self.strategies:
            raise FlowfleetError("--routers: a comparison router needs --strategies to route")
        for name in self.routers:
            if name not in ROUTERS[1:]:
                known = ", ".join(ROUTERS[1:])
                raise FlowfleetError(f"--routers: {name!r} is not a comparison router (one of {known})")
        if self.fleets and not self.strategies:
            raise FlowfleetError("--fleet: another fleet needs --strategies to sample it by")
        names = [name for name, _ in self.fleets]
        for name in names:
            if not FLEET_NAME.fullmatch(name):
                raise FlowfleetError(f"--fleet: name {name!r} must be letters, digits, '-' or '_' (NAME=FOLDER)")
        if len(set(names)) != len(names):
            raise FlowfleetError(f"--fleet: repeated names in {','.join(names)}")
        if len(set(self.strategies)) != len(self.strategies):
            raise FlowfleetError(f"--strategies: repeated names in {','.join(self.strategies)}")
        if self.cfg_sweep and self.cfg is not None:
            raise FlowfleetError("--cfg-sweep: give either a sweep or one --cfg, not both")
        if any(c < 0 for c in self.cfg_sweep) or len(set(self.cfg_sweep)) != len(self.cfg_sweep):
            raise FlowfleetError(f"--cfg-sweep: scales must be distinct and >= 0, got {list(self.cfg_sweep)}")
        if self.save_cfg and not self.cfg_sweep:
            raise FlowfleetError("--save-cfg: needs --cfg-sweep (the scale it saves is the sweep's choice)")


@dataclass
class ModelRun:
    """What one evaluated model (a strategy of the fleet, or the monolith) produced."""

    name: str
    kind: str  # "fleet" | "monolith"
    fid: float = float("nan")
    grid: str = ""
    heatmap: str | None = None
    prompts: list[str] = field(default_factory=list)
    usage: list[float] = field(default_factory=list)
    sampling_s: float = 0.0
    fid_s: float = 0.0
    prompt_accuracy: float | None = None  # MNIST: share of samples the digit classifier reads as prompted
    confidence: float | None = None  # MNIST: mean classifier probability of the prompted digit
    classifier_fd: float | None = None  # MNIST: Fréchet distance in the digit classifier's features
    samples: str = ""  # reports/<samples>: every scored sample (npz)
    same_as: str | None = None  # the same model as this earlier run (top-k with k >= K is the full ensemble)
    cfg: float | None = None  # the guidance scale of this row (the sweep's choice when there is a sweep)
    precision: float | None = None  # in the judge's feature space (Kynkäänniemi et al.), vs the reference
    recall: float | None = None
    sweep: list[dict[str, Any]] = field(default_factory=list)  # one score record per guidance scale
    cache_saved: float = 0.0  # share of block evaluations the first-block cache skipped (--cache)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


# --------------------------------------------------------------------------------------------------
#                                        The stage
# --------------------------------------------------------------------------------------------------


def evaluate(
    model_dir: str,
    reference: str | None = None,
    options: EvaluateOptions = EvaluateOptions(),
    *,
    extractor: torch.nn.Module | None = None,
) -> dict[str, Any]:
    """Evaluate an assembled fleet against its run's data; returns (and writes) evaluation.json.

    extractor: any uint8 [B, C, H, W] -> [B, D] module with `num_features` to use instead of the
    Inception (torchmetrics' custom-extractor contract; tests use a cheap one)."""
    t_start = time.perf_counter()
    ev = _Evaluation.open(model_dir, reference, options, extractor)  # every check before heavy work
    pipe = FleetPipeline.from_pretrained(model_dir, device=ev.device)
    models = [(s, "fleet", pipe, s) for s in options.strategies]
    monolith = _monolith_pipeline(ev.root, pipe, ev.device) if options.monolith else None
    if monolith is not None:
        models.insert(0, (MONOLITH, "monolith", monolith, "top1"))
    for router in options.routers:  # the same experts, another of the run's routers
        routed = pipe.with_router(_comparison_router(ev.root, ev.cfg, router, ev.device))
        models += [(f"{s}+{router}", "fleet", routed, s) for s in options.strategies]
    for name, folder in options.fleets:  # another fleet in the same latent space, the same encoders shared
        other = FleetPipeline.from_pretrained(
            folder, device=ev.device, text_encoder=pipe.text_encoder, latent_decoder=pipe.latent_decoder
        )
        models += [(f"{s}@{name}", "fleet", other, s) for s in options.strategies]
    same = same_as_earlier(options.strategies, len(pipe.present))  # e.g. top2 of 2 experts IS full
    for name, kind, p, strategy in models:
        if kind == "fleet" and name in same:  # same weights, same prompts and noise: same samples
            ev.same_model(name, same[name])
        else:
            ev.run_model(name, kind, p, strategy)
    if options.repeats > 1:
        t0 = time.perf_counter()
        ev.draws = _redraw(ev, model_dir, reference, extractor, models, same)
        ev.timings["repeats_s"] = time.perf_counter() - t0
    if options.diagnostics and root_has_clusters(ev.root):
        t0 = time.perf_counter()
        ev.diagnostics["router_accuracy"] = _router_accuracy(ev, pipe)
        held_out_rule = (
            ev.split.held_out
            and ev.cfg.cluster.mode != "random"  # random shards: no rule assigns a held-out item
            and ev.root.exists(*CENTROIDS)
        )
        if held_out_rule:
            ev.diagnostics["router_accuracy_heldout"] = _router_accuracy_heldout(ev, pipe)
        ev.timings["router_accuracy_s"] = time.perf_counter() - t0
        if monolith is not None and held_out_rule:
            t0 = time.perf_counter()
            ev.diagnostics["generalization"] = _generalization(ev, pipe, monolith)
            ev.timings["generalization_s"] = time.perf_counter() - t0
    if options.save_cfg:  # the sweep's choice becomes each folder's default scale
        default = pipe.scheduler.strategy
        for name, folder in ((default, model_dir), (MONOLITH, ev.root.url_of(MONOLITH_MODEL))):
            chosen = ev.runs[name].cfg if name in ev.runs else None
            if chosen is not None:
                set_default_cfg(folder, chosen)
                log.info(f"evaluate: {folder}: default guidance scale now {chosen} ({name})")
    ev.timings["total_s"] = time.perf_counter() - t_start
    result = ev.result()
    ev.root.write_json(result, REPORTS, ev.out, EVALUATION_FILE)  # (an empty ev.out joins to nothing)
    return result


def root_has_clusters(root: RunRoot) -> bool:
    return root.exists(*ASSIGNMENTS)


class _Evaluation:
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
    ):
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
        self.split = ReferenceSplit.draw(
            self.ref_latents.shape[0], options.n, options.ref_n, options.seed, self.ref_data is not data
        )
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

    @classmethod
    def open(
        cls,
        model_dir: str,
        reference: str | None,
        options: EvaluateOptions,
        extractor: torch.nn.Module | None,
        inception: bool = True,
    ) -> "_Evaluation":
        """inception False: no Inception reference or floor FID (a draw scored by the judge alone)."""
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
        for s in options.strategies:
            try:
                parse_strategy(s).resolve_k(len(index.present_experts))
            except ValueError as err:
                raise FlowfleetError(f"--strategies: {err}") from None
        if options.monolith:
            done, why, _ = job_finished(root, MONOLITH)
            if not done:
                raise FlowfleetError(f"--monolith: {why}")
        for router in options.routers:
            done, why, _ = job_finished(root, router_of_folder(cfg, router).dir)
            if not done:
                raise FlowfleetError(f"--routers: {why}")
        for _, folder in options.fleets:
            _check_other_fleet(model_root, index, RunRoot(folder), options.strategies)
        ev = cls(model_root.url, root, cfg, data, options, resolve_device(options.device), index.conditioning)
        ev._open_fid(extractor, inception)
        return ev

    def _open_fid(self, extractor: torch.nn.Module | None, inception: bool = True) -> None:
        """The feature network and the (cached) reference statistics; the real floor's FID (inception False:
        neither, the judge only)."""
        fid = self.fid = FID(self.options.fid, self.device, extractor=extractor)
        t0 = time.perf_counter()
        if inception:
            self._inception_reference(fid)
        self.timings["reference_s"] = time.perf_counter() - t0
        if self.options.judge or (
            self.prompts and self.data_is_mnist() and any(prompted_digit(p) is not None for p in self.prompts)
        ):
            self._open_judge()
        if self.options.diagnostics:
            self.semantic = SemanticFeatures(self.root, self.cfg, fid.key, self.device)

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

    def _report_path(self, file: str) -> str:
        """A sample file's path relative to reports/, as evaluation.json records it."""
        return posixpath.join(self.out, SAMPLES, file)

    def _fid_reference(self) -> tuple[FID, FeatureStats]:
        if self.fid is None or self.ref is None:
            raise RuntimeError("the FID reference is not open (open() has not run)")
        return self.fid, self.ref

    def data_is_mnist(self) -> bool:
        """data/ was prepared from the built-in digits (as prepare recorded it), the digit judge's domain."""
        source = self.data.manifest().extra.get("source") or {}
        return isinstance(source, dict) and source.get("kind") == "mnist"

    def _open_judge(self) -> None:
        """The prompt-accuracy judge (--judge, or the MNIST digit classifier, trained once and cached in
        reports/) and, when it has features, their reference statistics for the classifier FD."""
        if not self.prompts:
            raise FlowfleetError("--judge: the model is not text-conditioned; prompt accuracy needs prompts")
        t0 = time.perf_counter()
        if self.options.judge:
            self.judge = load_judge(self.options.judge, self.root)
            target = getattr(self.judge, "target", None)
            if callable(target) and all(target(p) is None for p in self.prompts):
                raise FlowfleetError(
                    f"--judge: none of the {len(self.prompts)} prompts names one of the judge's "
                    f"classes (e.g. {self.prompts[0]!r})"
                )
        else:
            self.judge = DigitJudge.load_or_train(self.root)
            log.info(f"evaluate: digit classifier (validation accuracy {self.judge.val_accuracy:.3f})")
        extractor = self.judge.extractor() if callable(getattr(self.judge, "extractor", None)) else None
        if extractor is not None:
            # The judge's features of the reference (kept: precision and recall need the rows) and the floor.
            judge_fd = FID(FIDSettings(batch_size=500), self.device, extractor=extractor)
            ref_feats = torch.cat([judge_fd.features(b) for b in self._real_images(self.split.reference, 500)()])
            self.judge_fd = judge_fd, _stats_of(ref_feats, judge_fd.key), ref_feats
            if self.floor["n"]:
                floor_feats = torch.cat([judge_fd.features(b) for b in self._real_images(self.split.floor, 500)()])
                self.floor.update(self._judge_scores(floor_feats))
        self.timings["judge_s"] = time.perf_counter() - t0

    def run_model(self, name: str, kind: str, pipe, strategy: str) -> ModelRun:
        """Sample options.n images from one model (a strategy of the fleet, or the monolith) at each scale of
        the guidance sweep (or the one scale asked for); score each; keep the chosen scale's samples for the
        grid, routing heatmap, usage, adherence and diagnostics."""
        o = self.options
        run = ModelRun(name, kind)
        drawn = []  # (settings, pipeline output, images, scores) per scale
        scales = o.cfg_sweep or (o.cfg,)
        # With a judge the sweep chooses by its classifier FD: Inception FID (the costlier network) only for the
        # chosen scale. Without one, FID is what chooses, at every scale.
        fid_each = self.judge_fd is None or len(scales) == 1
        for scale in scales:
            settings = pipe.settings(
                strategy, o.steps, o.sampler, scale, o.shift, o.route_every, o.seed, o.cache, o.cfg_max_t
            )
            how = f"{settings.steps} {settings.sampler} steps, cfg {settings.cfg}"
            how += f" at t <= {settings.cfg_max_t:g}" if settings.cfg_max_t < 1 else ""
            log.info(f"evaluate: {name}: sampling {o.n} images ({how})")
            t0 = time.perf_counter()
            out = pipe(self.prompts, o.n, labels=self.labels, settings=settings, batch_size=o.batch_size, progress=name)
            run.sampling_s += time.perf_counter() - t0
            images = out.images.float().cpu()  # [n, C, H, W] in [-1, 1]
            t0 = time.perf_counter()
            scores = self._score(images, out.prompts, name, with_fid=fid_each)
            run.fid_s += time.perf_counter() - t0
            cache = out.trace.stats.cache  # blocks skipped by --cache (0 without it)
            scores["cache_saved"] = cache.saved
            run.sweep.append({"cfg": settings.cfg, **{k: v for k, v in scores.items() if not k.startswith("_")}})
            log.info(f"evaluate: {name}: cfg {settings.cfg}: " + _describe(scores))
            drawn.append((settings, out, images, scores))
        chosen = choose_scale(run.sweep, o.min_accuracy)
        settings, out, images, scores = drawn[chosen]
        if not fid_each:
            t0 = time.perf_counter()
            fid, ref = self._fid_reference()
            stats, scores["_fid_features"] = _features(fid, images, name)
            scores["fid"] = run.sweep[chosen]["fid"] = fid.score(stats, ref)
            run.fid_s += time.perf_counter() - t0
        self.settings = settings
        if len(drawn) == 1:
            run.sweep = []  # one scale: nothing was swept
        run.cfg, run.fid, feats = settings.cfg, scores["fid"], scores["_fid_features"]
        run.cache_saved = scores["cache_saved"]
        run.classifier_fd, run.precision, run.recall = (scores.get(k) for k in ("classifier_fd", "precision", "recall"))
        if "_accuracy" in scores:
            acc = self.prompt_accuracy[name] = scores["_accuracy"]
            run.prompt_accuracy, run.confidence = acc["accuracy"], acc.get("confidence")
        run.samples = self._report_path(f"{name}.npz")
        self.root.write_bytes(samples_npz(images, out.prompts, o.seed), REPORTS, run.samples)

        shown = min(o.grid, o.n)
        run.prompts, run.grid = list(out.prompts[:shown]), self._report_path(f"{name}.png")
        title = (
            f"{name}  prompt accuracy {run.prompt_accuracy:.3f}  FID {run.fid:.2f}"
            if run.prompt_accuracy is not None
            else f"{name}  FID {run.fid:.2f}"
        )
        self.root.write_bytes(captioned_grid_png(images[:shown], run.prompts, title=title), REPORTS, run.grid)
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

    def _score(self, images: torch.Tensor, prompts: Sequence[str], name: str, with_fid: bool = True) -> dict[str, Any]:
        """FID against the reference (with_fid); with a judge: prompt accuracy, and with its features the
        classifier FD, precision and recall. Keys starting with _ are kept out of the sweep's records."""
        scores: dict[str, Any] = {}
        if with_fid:
            fid, ref = self._fid_reference()
            stats, feats = _features(fid, images, name)
            scores.update(fid=fid.score(stats, ref), _fid_features=feats)
        if self.judge is not None:
            acc = scores["_accuracy"] = self.judge.prompt_accuracy(images, prompts)
            scores["prompt_accuracy"] = acc["accuracy"]
            if self.judge_fd is not None:
                scores.update(self._judge_scores(self.judge_fd[0].features(images)))
        return scores

    def _judge_scores(self, features: torch.Tensor) -> dict[str, float]:
        """Classifier FD, precision and recall of a set's judge features [n, D] against the reference's."""
        if self.judge_fd is None:
            raise RuntimeError("the judge's reference features are not open")
        judge_fd, judge_ref, ref_feats = self.judge_fd
        pr = precision_recall(ref_feats[:PR_REFERENCE], features)
        fd = judge_fd.score(_stats_of(features, judge_fd.key), judge_ref)
        return {"classifier_fd": fd, "precision": pr["precision"], "recall": pr["recall"]}

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

    def result(self) -> dict[str, Any]:
        """evaluation.json (docs/contracts.md, "Evaluation outputs")."""
        o = self.options
        sampling = {k: v for k, v in self.settings.to_json().items() if k not in ("strategy", "k")}
        return {
            "model": self.model_url,
            "reference": self.root.url,
            "created": time.time(),
            "n": o.n,
            "seed": o.seed,
            "sampling": sampling,
            "fid": {
                **fid_metadata(o.fid, self._fid_reference()[0].key, self.ref_n, o.n),
                "scores": {name: r.fid for name, r in self.runs.items()},
            },
            # What a perfect model would score at this n: real items, disjoint from the reference.
            "reference_split": {
                "set": EVAL_DATA if self.split.held_out else DATA,
                "held_out": self.split.held_out,
                "source": self.data.manifest().extra.get("source"),  # what prepare read (flowfleet.data.sources)
                "reference_images": self.ref_n,
                "floor": self.floor,
            },
            "guidance": {"sweep": list(o.cfg_sweep), "min_accuracy": o.min_accuracy} if o.cfg_sweep else None,
            "runs": {name: r.to_json() for name, r in self.runs.items()},
            "fleets": {name: RunRoot(folder).url for name, folder in o.fleets} or None,
            "adherence": self.adherence or None,
            "prompt_accuracy": (
                {
                    "classifier": {"judge": o.judge or "mnist digit classifier", **getattr(self.judge, "record", {})},
                    "scores": self.prompt_accuracy,
                }
                if self.judge is not None
                else None
            ),
            "draws": self.draws,
            "diagnostics": self.diagnostics,
            "timings": self.timings,
        }


JUDGED = ("classifier_fd", "precision", "recall", "prompt_accuracy")  # what a draw records with a judge (else FID)


def _redraw(
    ev: _Evaluation,
    model_dir: str,
    reference: str | None,
    extractor: torch.nn.Module | None,
    models: list[tuple[str, str, Any, str]],
    same: dict[str, str],
) -> dict[str, Any]:
    """Every model again at its chosen scale in draws 1 .. repeats - 1 (seed + r: other prompts and noise,
    another reference and floor), beside draw 0, the evaluation above. -> {"seeds": [...], "floor": {metric:
    [per draw]}, "runs": {name: {metric: [per draw]}}}: plain lists, which the report summarises. With a judge
    the metrics are its distance, precision, recall and prompt accuracy (Inception FID, the costlier network,
    is not drawn again); without one, Inception FID."""
    o = ev.options
    metrics = JUDGED if ev.judge_fd is not None else ("fid",)

    def values(scores: dict[str, Any]) -> dict[str, Any]:
        return {k: scores.get(k) for k in metrics}

    out: dict[str, Any] = {
        "seeds": [o.seed + r for r in range(o.repeats)],
        "floor": {k: [v] for k, v in values(ev.floor).items() if k != "prompt_accuracy"},
        "runs": {name: {k: [v] for k, v in values(asdict(run)).items()} for name, run in ev.runs.items()},
    }
    for r in range(1, o.repeats):
        drawn = replace(o, seed=o.seed + r, cfg_sweep=(), save_cfg=False, diagnostics=False, repeats=1)
        # a judge scores the draws: the Inception reference of each draw's split is not needed
        again = _Evaluation.open(model_dir, reference, drawn, extractor, inception=ev.judge_fd is None)
        for k in out["floor"]:
            out["floor"][k].append(again.floor.get(k))
        scored: dict[str, dict[str, Any]] = {}
        for name, _, pipe, strategy in models:
            if name in same:  # the same weights as an earlier row: the same samples
                scored[name] = scored[same[name]]
            else:
                cfg = ev.runs[name].cfg
                settings = pipe.settings(
                    strategy, o.steps, o.sampler, cfg, o.shift, o.route_every, drawn.seed, o.cache, o.cfg_max_t
                )
                log.info(f"evaluate: {name}: draw {r + 1} of {o.repeats} (seed {drawn.seed}, cfg {cfg})")
                got = pipe(
                    again.prompts,
                    o.n,
                    labels=again.labels,
                    settings=settings,
                    batch_size=o.batch_size,
                    progress=f"{name} draw {r + 1}",
                )
                scores = again._score(got.images.float().cpu(), got.prompts, name, with_fid=again.judge_fd is None)
                scored[name] = values(scores)
            for k, v in scored[name].items():
                out["runs"][name][k].append(v)
    return out


# --------------------------------------------------------------------------------------------------
#                                          Pieces
# --------------------------------------------------------------------------------------------------


def samples_npz(images: torch.Tensor, prompts: Sequence[str], seed: int) -> bytes:
    """Every scored sample as a compressed npz: images uint8 [n, H, W, C], prompts [n], seed."""
    buf = io.BytesIO()
    np.savez_compressed(
        buf,
        images=to_uint8(images).permute(0, 2, 3, 1).numpy(),
        prompts=np.array(list(prompts), dtype=str),
        seed=np.array(seed),
    )
    return buf.getvalue()


def choose_scale(records: Sequence[dict[str, Any]], min_accuracy: float) -> int:
    """The index of the guidance scale a model is compared at: the lowest classifier FD (FID when there is
    none) among the scales whose prompt accuracy reaches min_accuracy; when none does, the most accurate
    (ties: the lower distance). Without prompt accuracy (no judge), the lowest distance."""

    def distance(r: dict[str, Any]) -> float:
        return r["classifier_fd"] if r.get("classifier_fd") is not None else r["fid"]

    accurate = [i for i, r in enumerate(records) if r.get("prompt_accuracy", 1.0) >= min_accuracy]
    if accurate:
        return min(accurate, key=lambda i: distance(records[i]))
    return min(range(len(records)), key=lambda i: (-records[i]["prompt_accuracy"], distance(records[i])))


def _describe(scores: dict[str, Any]) -> str:
    parts = [f"FID {scores['fid']:.2f}"] if "fid" in scores else []
    if "prompt_accuracy" in scores:
        parts.append(f"prompt accuracy {scores['prompt_accuracy']:.3f}")
    if "classifier_fd" in scores:
        parts.append(f"classifier FD {scores['classifier_fd']:.2f}")
        parts.append(f"precision {scores['precision']:.3f} recall {scores['recall']:.3f}")
    return ", ".join(parts)


def _stats_of(features: torch.Tensor, key: str) -> FeatureStats:
    stats = FeatureStats.empty(features.shape[1], {"extractor": key})
    stats.update(features)
    return stats


def _features(fid: FID, images: torch.Tensor, name: str) -> tuple[FeatureStats, torch.Tensor]:
    """FID statistics of the generated images, keeping the per-image features (for the diagnostics)."""
    stats = FeatureStats.empty(fid.dim, {"extractor": fid.key, "name": name})
    parts = []
    bs = fid.settings.batch_size
    for i in tqdm(range(0, images.shape[0], bs), desc=f"fid features ({name})", unit="batch", leave=False):
        f = fid.features(images[i : i + bs])
        stats.update(f)
        parts.append(f)
    return stats, torch.cat(parts)


def _check_other_fleet(model: RunRoot, index: ModelIndex, other: RunRoot, strategies: Sequence[str]) -> None:
    """--fleet: `other` must be an assembled fleet that decodes and reads prompts exactly as `model` does (the
    same latent space and encoder settings, the same decoder weights by checksum), and have the experts each
    strategy needs; otherwise a one-line error naming the folder and what differs."""
    theirs = read_model_index(other)  # one-line error when FOLDER is not an assembled fleet
    for field_name in ("latent_shape", "latent_encoder", "text_encoder_config", "conditioning", "text_width"):
        mine, its = getattr(index, field_name), getattr(theirs, field_name)
        if mine != its:
            raise FlowfleetError(
                f"--fleet {other.url}: {field_name} {its!r} differs from {model.url}'s {mine!r}: "
                "another fleet must share the model's latent space and text encoder"
            )
    mine_sums, its_sums = read_checksums(model) or {}, read_checksums(other) or {}
    for rel in sorted(r for r in mine_sums if r.startswith(MODEL_VAE + "/")):
        if its_sums.get(rel) != mine_sums[rel]:
            raise FlowfleetError(
                f"--fleet {other.url}: {rel} is not {model.url}'s (checksum): another fleet must decode "
                "with the same autoencoder"
            )
    for s in strategies:
        try:
            parse_strategy(s).resolve_k(len(theirs.present_experts))
        except ValueError as err:
            raise FlowfleetError(f"--fleet {other.url}: {err}") from None


def _comparison_router(root: RunRoot, cfg: RunConfig, router: str, device: torch.device) -> DiTRouter:
    """A comparison router of the run (its job's final weights), for the fleet's experts."""
    return load_model(DiTRouter, root, router_of_folder(cfg, router).dir, FINAL).to(device)


def _monolith_pipeline(root: RunRoot, fleet: FleetPipeline, device: torch.device) -> FleetPipeline:
    """The run's monolith opened the one way a model is opened: as the assembled one-expert folder
    RUN_ROOT/model-monolith (what `assemble --monolith` writes; assembled here when it is missing or
    older than monolith/final), sharing the fleet's text encoder and decoder."""
    folder = RunRoot(root.url_of(MONOLITH_MODEL))
    _, _, status = job_finished(root, MONOLITH)
    trained = {"step": status.step, "samples_seen": status.samples_seen} if status is not None else None
    try:
        built = read_model_index(folder).source.get("monolith")
    except FlowfleetError:  # not assembled yet
        built = None
    if built != trained:
        log.info(f"evaluate: assembling the monolith into {folder.url}")
        assemble(root.url, monolith=True)
    pipe = FleetPipeline.from_pretrained(
        folder.url, device=device, text_encoder=fleet.text_encoder, latent_decoder=fleet.latent_decoder
    )
    if tuple(pipe.latent_shape) != tuple(fleet.latent_shape):
        raise FlowfleetError(
            f"{folder.url}: latent shape {tuple(pipe.latent_shape)} differs from the fleet's "
            f"{tuple(fleet.latent_shape)}"
        )
    return pipe


def _generalization(ev: _Evaluation, pipe: FleetPipeline, monolith: FleetPipeline) -> dict[str, Any]:
    """Each expert of the run's own clusters (not an addition's) and the monolith on training and held-out items
    of its cluster (flowfleet.evaluate.generalization)."""
    experts = {k: _dit(pipe.experts.get(k)) for k in pipe.present if k < ev.cfg.cluster.k}
    fields = fields_for(ev.cfg, [m.cfg for m in experts.values()])
    train = ev.data.sets[0].load(fields)  # data/ (additions' items belong to their own experts)
    held = ev.ref_data.load(fields)
    centroids = safetensors.torch.load(ev.root.read_bytes(*CENTROIDS))
    return generalization(
        experts,
        _dit(monolith.experts.get(monolith.present[0])),
        train,
        clustered_data(ev.root, ev.cfg, []).tensors["cluster"][: train["latents"].shape[0]],
        held,
        held_out_clusters(ev.cfg, centroids, train, held),
        seed=ev.options.seed,
        device=ev.device,
    )


def _dit(expert: Any) -> DiTModel:
    """An expert of an opened model folder: a DiT (a store of other callables has no loss to measure)."""
    if not isinstance(expert, DiTModel):
        raise TypeError(f"expected a DiT expert, got {type(expert).__name__}")
    return expert


ROUTER_ITEMS = 512  # items per router accuracy table: each of its 10 t buckets sees every one of them


def _router(pipe: FleetPipeline) -> DiTRouter:
    """The router of an opened model folder: a DiT (a callable of another kind has no accuracy table here)."""
    if not isinstance(pipe.router, DiTRouter):
        raise TypeError(f"expected a DiT router, got {type(pipe.router).__name__}")
    return pipe.router


def _router_fields(pipe: FleetPipeline) -> list[str]:
    """The fields the router reads beside the latents: the prompt's, for a prompt-aware router."""
    return [f for f in model_fields(_router(pipe).cfg) if f != "latents"] if pipe.router_sees_prompt else []


def _prompt(data: Any, pipe: FleetPipeline, pick: torch.Tensor) -> dict[str, torch.Tensor]:
    """The picked items' prompt fields as a batch, for a router that reads them (else none)."""
    if not pipe.router_sees_prompt:
        return {}
    return InMemoryData(data.load(_router_fields(pipe)), [], data.url).gather(pick)


def _router_on(
    ev: _Evaluation, pipe: FleetPipeline, latents: torch.Tensor, clusters: torch.Tensor, prompt: dict[str, torch.Tensor]
) -> dict[str, Any]:
    """router_accuracy of the fleet's router on these items (their captions, as it was trained, when it reads them)."""
    router = _router(pipe)
    cond = condition_kwargs(prompt, router.cfg) if pipe.router_sees_prompt else None
    return router_accuracy(
        router, latents, clusters, pipe.num_experts, seed=ev.options.seed, device=ev.device, cond=cond
    )


def _router_accuracy(ev: _Evaluation, pipe: FleetPipeline) -> dict[str, Any]:
    """The fleet's router against the clusters of (up to 512 of) the data items."""
    pick = ev.order[: min(ROUTER_ITEMS, ev.order.numel())]
    clusters = clustered_data(ev.root, ev.cfg, []).tensors["cluster"][pick]
    rep = _router_on(ev, pipe, ev.latents[pick], clusters, _prompt(ev.data, pipe, pick))
    rep["note"] = "the assembled router on a seeded random subset of data/, fresh noise, t uniform per bucket"
    return rep


def _router_accuracy_heldout(ev: _Evaluation, pipe: FleetPipeline) -> dict[str, Any]:
    """The fleet's router on (up to 512 of) the held-out items, which no job trained on, each in the cluster of
    its nearest fine centroid (the clustering's rule, flowfleet.evaluate.generalization): what it reads of new
    images, where the table of data/ items also shows what it memorised of its training items."""
    rule = clustering_fields(ev.cfg)
    held = ev.ref_data.load(list(dict.fromkeys(["latents", *rule])))
    centroids = safetensors.torch.load(ev.root.read_bytes(*CENTROIDS))
    clusters = held_out_clusters(ev.cfg, centroids, ev.data.sets[0].load(rule), held)  # [M]
    count = clusters.shape[0]
    pick = torch.randperm(count, generator=torch.Generator().manual_seed(ev.options.seed))[:ROUTER_ITEMS]
    rep = _router_on(ev, pipe, held["latents"][pick], clusters[pick], _prompt(ev.ref_data, pipe, pick))
    rep["note"] = (
        "the assembled router on a seeded random subset of the held-out items, each in the cluster of its nearest "
        "fine centroid; fresh noise, t uniform per bucket"
    )
    return rep
