"""The stage itself: open the fleet, the monolith and the reference; choose every model's guidance scale by a sweep on
the validation split; score it at that scale on the test split, draw by draw (evaluate --repeats); write
reports/evaluation.json and the sample files."""

from __future__ import annotations

import logging
import posixpath
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Sequence

import torch

from flowfleet.config import RunConfig
from flowfleet.data.shards import ShardSetUnion
from flowfleet.device import resolve_device
from flowfleet.errors import FlowfleetError, ParameterError
from flowfleet.evaluate.adherence import prompt_adherence
from flowfleet.evaluate.diagnostics import (
    SemanticFeatures,
    disagreement,
    dominant_experts,
    usage_shares,
)
from flowfleet.evaluate.digits import DigitJudge, prompted_digit
from flowfleet.evaluate.emoji import EmojiJudge
from flowfleet.evaluate.fid import FID, FeatureStats, FIDSettings, fid_metadata
from flowfleet.evaluate.judge import load_judge
from flowfleet.evaluate.precision_recall import precision_recall
from flowfleet.evaluate.reference import (
    TEST,
    VALIDATION,
    VALIDATION_SEED,
    HeldOutSplits,
    ReferenceSplit,
    data_fingerprint,
    features_are_fid_features,
    held_out_data,
    open_reference,
    reference_images,
)
from flowfleet.evaluate.report import EVALUATION_FILE
from flowfleet.evaluate.views import captioned_grid_png
from flowfleet.flow import Strategy
from flowfleet.layout import (
    ASSIGNMENTS,
    CENTROIDS,
    DATA,
    EVAL_DATA,
    MONOLITH,
    MONOLITH_MODEL,
    REPORTS,
    SAMPLES,
    evaluation_folder,
)
from flowfleet.sampling.index import read_model_index, set_default_guidance_scale
from flowfleet.sampling.pipeline import FleetPipeline
from flowfleet.sampling.views import routing_heatmap
from flowfleet.stages.evaluate.models import check_other_fleet, comparison_router, monolith_pipeline
from flowfleet.stages.evaluate.options import EvaluateOptions, ModelRun
from flowfleet.stages.evaluate.pieces import (
    choose_scale,
    describe_scores,
    extend_sweep,
    generated_features,
    samples_npz,
    stats_of,
)
from flowfleet.stages.evaluate.probes import generalization_probe, router_accuracy_heldout, router_accuracy_probe
from flowfleet.storage import RunRoot
from flowfleet.train.specs import router_of_folder
from flowfleet.train.status import job_finished

log = logging.getLogger(__name__)

JUDGE_NAMES = {"digits": "mnist digit classifier", "emoji": "emoji category classifier"}  # evaluation.json's words
PR_REFERENCE = 2000  # reference rows for precision/recall (prdc holds the [N, N] distances in memory)
ONE_EXPERT = Strategy(1, "top1")  # the monolith's "routing": its one expert

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
    ev = _Evaluation.open(model_dir, reference, options, extractor)  # every check before heavy work; the test split
    choices = ev.choice_draw(model_dir, reference, extractor)  # the validation split's draw (None: nothing to choose)
    pipe = FleetPipeline.from_pretrained(model_dir, device=ev.device)
    models = [Row(s.name, "fleet", pipe, s) for s in options.strategy_values]
    monolith = monolith_pipeline(ev.root, pipe, ev.device) if options.monolith else None
    for router in options.routers:  # the same experts, another of the run's routers
        routed = pipe.with_router(comparison_router(ev.root, ev.cfg, router, ev.device))
        models += [Row(s.name, "fleet", routed, s, f"+{router}") for s in options.strategy_values]
    for name, folder in options.fleets:  # another fleet in the same latent space, the same encoders shared
        other = FleetPipeline.from_pretrained(
            folder, device=ev.device, text_encoder=pipe.text_encoder, latent_decoder=pipe.latent_decoder
        )
        other.share_prompts(pipe)
        models += [Row(s.name, "fleet", other, s, f"@{name}") for s in options.strategy_values]
    models = [row.guided(rule) for row in models for rule in options.guidance_rules or (None,)]
    if monolith is not None:
        models.insert(0, Row(MONOLITH, "monolith", monolith, ONE_EXPERT))
    same = same_models(models, options.sampling)  # e.g. top2 of 2 experts IS full; a prompt-blind router guides one way
    for row in models:
        if row.name in same:  # same weights, same prompts and noise: same samples
            ev.same_model(row.name, same[row.name])
        else:
            sweep = choices.sweep(row.name, row.pipe, row.strategy, **row.choices) if choices else None
            ev.run_model(row.name, row.kind, row.pipe, row.strategy, sweep, **row.choices)
    if choices is not None:
        ev.validation = choices.describe_split() if choices is not ev else None
    if options.repeats > 1:
        t0 = time.perf_counter()
        ev.draws = _redraw(ev, model_dir, reference, extractor, models, same)
        ev.timings["repeats_s"] = time.perf_counter() - t0
    if options.diagnostics and root_has_clusters(ev.root):
        t0 = time.perf_counter()
        ev.diagnostics["router_accuracy"] = router_accuracy_probe(ev, pipe)
        held_out_rule = (
            ev.split.held_out
            and ev.cfg.cluster.mode != "random"  # random shards: no rule assigns a held-out item
            and ev.root.exists(*CENTROIDS)
        )
        if held_out_rule:
            ev.diagnostics["router_accuracy_heldout"] = router_accuracy_heldout(ev, pipe)
        ev.timings["router_accuracy_s"] = time.perf_counter() - t0
        if monolith is not None and held_out_rule:
            t0 = time.perf_counter()
            ev.diagnostics["generalization"] = generalization_probe(ev, pipe, monolith)
            ev.timings["generalization_s"] = time.perf_counter() - t0
    if options.save_guidance_scale:  # the sweep's choice becomes each folder's default scale
        default = pipe.scheduler.strategy.name
        for name, folder in ((default, model_dir), (MONOLITH, ev.root.url_of(MONOLITH_MODEL))):
            chosen = ev.runs[name].cfg if name in ev.runs else None
            if chosen is not None:
                set_default_guidance_scale(folder, chosen)
                log.info(f"evaluate: {folder}: default guidance scale now {chosen} ({name})")
    ev.timings["total_s"] = time.perf_counter() - t_start
    result = ev.result()
    ev.root.write_json(result, REPORTS, ev.out, EVALUATION_FILE)  # (an empty ev.out joins to nothing)
    return result


class JudgedDraw:
    """One draw of n prompts and noise from a run's items, on which any number of fleets are sampled and scored by
    the judge alone: prompt accuracy, the judge's Fréchet distance, precision and recall against the items' real
    images (no Inception, nothing written). Admit's no-harm check: the fleet before and after it grows, on the same
    prompts and noise.

        draw = JudgedDraw.open("runs/r", EvaluateOptions(n=300, diagnostics=False), conditioning="pooled")
        draw.score(FleetPipeline.from_pretrained("runs/r/model"))  # {"prompt_accuracy": 0.97, "classifier_fd": ...}

    Everything is read when it opens: the run's items may change afterwards (an admission stages its sample). The
    prompts are drawn from data/'s captions as evaluate draws them, or (held_out) from the held-out items' own, when
    the run holds some out; the real images are the held-out ones. `data`: other items in the run's latent space to
    draw prompts and real images (decoded from their latents) from instead (a contribution's held-out slice), with
    the judge named in options.judge."""

    def __init__(self, ev: "_Evaluation"):
        self.ev = ev

    @classmethod
    def open(
        cls,
        reference: str,
        options: EvaluateOptions,
        conditioning: str,
        data: ShardSetUnion | None = None,
        held_out: bool = False,
    ) -> "JudgedDraw | None":
        """None when no judge reads these prompts (neither options.judge nor a built-in one of the run's source)."""
        options.validate()
        root, cfg, own = open_reference(reference)
        if data is not None:  # the items given are the reference too: not the run's eval/
            cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={"holdout": 0})})
        elif held_out:
            data = held_out_data(root, cfg)
        # every held-out item (split None): the gate's draw is neither a choice of evaluate's nor a reported figure
        device = resolve_device(options.device)
        ev = _Evaluation(root.url, root, cfg, data or own, options, device, conditioning, split=None)
        ev._open_fid(None, inception=False, named=False)
        return cls(ev) if ev.judge is not None and ev.judge_names_a_prompt() else None

    @property
    def judge(self) -> str:
        """How the judge is asked for by name: "digits", "emoji" or MODULE:FACTORY."""
        return self.ev.builtin_judge() or str(self.ev.options.judge)

    def score(
        self,
        pipe: FleetPipeline,
        strategy: Strategy | None = None,
        name: str = "fleet",
        progress: bool = True,
        keep: bool = False,
    ) -> dict[str, Any]:
        """The fleet's samples of this draw (its default strategy and settings but options.sampling's), judged:
        prompt_accuracy, classifier_fd, precision, recall (the last three with a judge that has features),
        per_class, n; keep: also the images [n, C, H, W] in [-1, 1], their prompts, and per image whether the judge
        read it as its prompt's class ("hits": None where the prompt names none, or the judge does not say)."""
        ev = self.ev
        settings = ev.settings_for(pipe, strategy)
        log.info(f"judged draw: {name}: sampling {ev.options.n} images ({settings.describe()})")
        out = ev.sample(pipe, settings, progress and name)
        scores = ev._score(out.images.float().cpu(), out.prompts, name, with_fid=False)
        accuracy = scores.pop("_accuracy")
        shown = {}
        if keep:
            hits = judged_hits(ev.judge, out.prompts, accuracy.get("predicted"))
            shown = {"images": out.images.float().cpu(), "prompts": list(out.prompts), "hits": hits}
        return {**scores, "per_class": accuracy["per_class"], "n": accuracy["n"], **shown}


@dataclass
class Row:
    """One model an evaluation samples: a strategy of a fleet (routed by its own or a comparison router, or another
    fleet's), or the monolith; `choices`: sampling settings of its own (a guidance rule). Its name: the strategy,
    .RULE when guidance rules are compared, then +ROUTER or @FLEET."""

    base: str  # the strategy (or "monolith")
    kind: str  # "fleet" | "monolith"
    pipe: FleetPipeline
    strategy: Strategy
    suffix: str = ""  # +ROUTER, @FLEET
    choices: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        rule = self.choices.get("guidance")
        return f"{self.base}{f'.{rule}' if rule else ''}{self.suffix}"

    def guided(self, rule: str | None) -> "Row":
        """This row under guidance rule `rule` (None: the settings' own)."""
        return self if rule is None else replace(self, choices={**self.choices, "guidance": rule})

    def same_key(self, sampling: dict[str, Any]) -> tuple[Any, ...]:
        """What decides this row's samples beyond the draw and the evaluation's `sampling` settings: the pipeline,
        the experts per sample, whether they are kept, and the guidance rule where it matters (a router that reads
        the prompt, a strategy that reroutes)."""
        strategy = self.strategy
        rule = {**sampling, **self.choices}.get("guidance", self.pipe.scheduler.guidance)
        matters = self.pipe.router_sees_prompt and not strategy.kept
        return (id(self.pipe), strategy.resolve_k(len(self.pipe.present)), strategy.kept, rule if matters else None)


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


def same_models(rows: Sequence[Row], sampling: dict[str, Any]) -> dict[str, str]:
    """Each fleet row that samples exactly what an earlier one does -> that earlier row's name (top-k with k >= K is
    the full ensemble; under a prompt-blind router both guidance rules are one field)."""
    first: dict[tuple[Any, ...], str] = {}
    same = {}
    for row in rows:
        if row.kind != "fleet":
            continue
        key = row.same_key(sampling)
        if key in first:
            same[row.name] = first[key]
        else:
            first[key] = row.name
    return same


def judged_hits(judge: Any, prompts: Sequence[str], predicted: Sequence[str] | None) -> list[bool | None]:
    """Per prompt: the judge's reading (`predicted`, one per prompt naming a class, as ClassifierJudge gives it) is
    the prompt's class; None where it names none, or where the judge gives no `target`, `labels` or readings."""
    target, labels = getattr(judge, "target", None), getattr(judge, "labels", None)
    if not callable(target) or labels is None or predicted is None:
        return [None] * len(prompts)
    readings = iter(predicted)
    return [None if (k := target(p)) is None else next(readings) == labels[k] for p in prompts]


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
    ) -> "_Evaluation":
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
    ) -> "_Evaluation | None":
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
        return _Evaluation.open(model_dir, reference, drawn, extractor, self.judge_fd is None, VALIDATION)

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

    def _report_path(self, file: str) -> str:
        """A sample file's path relative to reports/, as evaluation.json records it."""
        return posixpath.join(self.out, SAMPLES, file)

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
                    f"evaluate: {name}: the best scale {chosen} is the sweep's edge on the {self.split_name} split"
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
        strategy: Strategy,
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
        log.info(f"evaluate: {name}: guidance {settings.guidance_scale}: " + describe_scores(scores))
        return settings, out, images, scores

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
                "split": self.split_name if self.split.held_out else None,  # TEST: the held-out split the figures read
                "items": None if (pool := self.splits.items(self.split_name)) is None else int(pool.numel()),
                "source": self.data.manifest().extra.get("source"),  # what prepare read (flowfleet.data.sources)
                "reference_images": self.ref_n,
                "floor": self.floor,
            },
            "validation_split": self.validation,  # the choices' draw (None: no choice, or made on the figures' own)
            "guidance": (
                {
                    "sweep": list(o.guidance_sweep),
                    "min_accuracy": o.min_accuracy,
                    "bounds": list(o.guidance_bounds),
                    "extend": o.guidance_extend,
                    "chosen_on": self.validation["split"] if self.validation else self.split_name,
                }
                if o.guidance_sweep
                else None
            ),
            "runs": {name: r.to_json() for name, r in self.runs.items()},
            "fleets": {name: RunRoot(folder).url for name, folder in o.fleets} or None,
            "adherence": self.adherence or None,
            "prompt_accuracy": (
                {
                    "classifier": {
                        "judge": JUDGE_NAMES.get(self.builtin_judge() or "", o.judge or JUDGE_NAMES["digits"]),
                        **getattr(self.judge, "record", {}),
                    },
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
    models: list[Row],
    same: dict[str, str],
) -> dict[str, Any]:
    """Every model again at its chosen scale in draws 1 .. repeats - 1 (seed + r: other prompts and noise,
    another reference and floor), beside draw 0, the evaluation above. -> {"seeds": [...], "floor": {metric:
    [per draw]}, "runs": {name: {metric: [per draw]}}}: plain lists, which the report summarises. With a judge
    the metrics are its distance, precision, recall and prompt accuracy (and the emoji judge's subcategory
    accuracy; Inception FID, the costlier network, is not drawn again); without one, Inception FID."""
    o = ev.options
    metrics: tuple[str, ...] = JUDGED if ev.judge_fd is not None else ("fid",)
    if any(run.subcategory_accuracy is not None for run in ev.runs.values()):  # the emoji judge's finer reading
        metrics += ("subcategory_accuracy",)

    def values(scores: dict[str, Any]) -> dict[str, Any]:
        return {k: scores.get(k) for k in metrics}

    out: dict[str, Any] = {
        "seeds": [o.seed + r for r in range(o.repeats)],
        "floor": {k: [v] for k, v in values(ev.floor).items() if k != "prompt_accuracy"},
        "runs": {name: {k: [v] for k, v in values(asdict(run)).items()} for name, run in ev.runs.items()},
    }
    for r in range(1, o.repeats):
        drawn = replace(o, seed=o.seed + r, guidance_sweep=(), save_guidance_scale=False, diagnostics=False, repeats=1)
        # a judge scores the draws: the Inception reference of each draw's split is not needed
        again = _Evaluation.open(model_dir, reference, drawn, extractor, inception=ev.judge_fd is None)
        for k in out["floor"]:
            out["floor"][k].append(again.floor.get(k))
        scored: dict[str, dict[str, Any]] = {}
        for row in models:
            name = row.name
            if name in same:  # the same weights as an earlier row: the same samples
                scored[name] = scored[same[name]]
            else:
                cfg = ev.runs[name].cfg
                log.info(f"evaluate: {name}: draw {r + 1} of {o.repeats} (seed {drawn.seed}, cfg {cfg})")
                settings = again.settings_for(row.pipe, row.strategy, **row.choices, guidance_scale=cfg)
                got = again.sample(row.pipe, settings, f"{name} draw {r + 1}")
                scores = again._score(got.images.float().cpu(), got.prompts, name, with_fid=again.judge_fd is None)
                scored[name] = values(scores)
            for k, v in scored[name].items():
                out["runs"][name][k].append(v)
    return out
