"""The stage itself: open the fleet, the monolith and the reference; choose every model's guidance scale by a sweep on
the validation split; score it at that scale on the test split, draw by draw (evaluate --repeats); write
reports/evaluation.json and the sample files."""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Sequence

import torch

from flowfleet.data.shards import ShardSetUnion
from flowfleet.device import resolve_device
from flowfleet.errors import ParameterError
from flowfleet.evaluate.fid import FID
from flowfleet.evaluate.reference import (
    VALIDATION,
    VALIDATION_SEED,
    held_out_data,
    open_reference,
)
from flowfleet.evaluate.report import EVALUATION_FILE
from flowfleet.flow import Strategy
from flowfleet.layout import (
    ASSIGNMENTS,
    CENTROIDS,
    MONOLITH,
    MONOLITH_MODEL,
    REPORTS,
)
from flowfleet.sampling.folder import set_default_guidance_scale
from flowfleet.sampling.pipeline import FleetPipeline
from flowfleet.stages.evaluate.draw import EvaluationDraw
from flowfleet.stages.evaluate.models import comparison_router, monolith_pipeline
from flowfleet.stages.evaluate.options import EvaluateOptions, ModelRun
from flowfleet.stages.evaluate.probes import generalization_probe, router_accuracy_heldout, router_accuracy_probe
from flowfleet.stages.evaluate.record import evaluation_record
from flowfleet.storage import RunRoot

log = logging.getLogger(__name__)

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
    ev = EvaluationDraw.open(model_dir, reference, options, extractor)  # every check before heavy work; the test split
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
                log.info(f"evaluate: {folder}: default guidance scale now {chosen:g} ({name})")
    ev.timings["total_s"] = time.perf_counter() - t_start
    result = evaluation_record(ev)
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

    def __init__(self, ev: "EvaluationDraw"):
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
        ev = EvaluationDraw(root.url, root, cfg, data or own, options, device, conditioning, split=None)
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


class ValidationDraw:
    """The validation split's own draw (its prompts, noise and reference images, as evaluate's choices read them), on
    which models are sampled and scored, nothing written: a choice made after training (the EMA's length,
    stages/posthoc_ema.py) reads it and never the test split. Scored by the judge where the run's prompts have one
    (its Fréchet distance, precision, recall, prompt accuracy), else by FID.

        draw = ValidationDraw.open("runs/r/model", EvaluateOptions(n=300, diagnostics=False))
        draw.score("top2", FleetPipeline.from_pretrained("runs/r/model"))  # {"classifier_fd": ..., ...}"""

    def __init__(self, ev: "EvaluationDraw"):
        self.ev = ev

    @classmethod
    def open(
        cls, model_dir: str, options: EvaluateOptions, extractor: torch.nn.Module | None = None
    ) -> "ValidationDraw":
        """A run without a validation split (run.yaml data.holdout and data.validation) is a one-line error."""
        drawn = replace(
            options, seed=options.seed + VALIDATION_SEED, repeats=1, diagnostics=False, save_guidance_scale=False
        )
        ev = EvaluationDraw.open(model_dir, None, drawn, extractor, inception=False, split=VALIDATION)
        if not ev.split.held_out or ev.splits.shared:
            raise ParameterError(
                "data.validation",
                f"{ev.root.url} has no validation split: a choice made on its test split reads its figures' images",
            )
        if ev.judge_fd is None:  # no judge's features: Inception FID scores
            ev.fid = FID(ev.options.fid, ev.device, extractor=extractor)
            ev._inception_reference(ev.fid)
        return cls(ev)

    def score(self, name: str, pipe: FleetPipeline, strategy: Strategy | None = None) -> dict[str, Any]:
        """A model's samples of this draw (its default strategy and settings but options.sampling's), scored."""
        ev = self.ev
        scale = ev.options.sampling.get("guidance_scale")
        _, _, _, scores = ev._draw(name, pipe, strategy, scale, ev.judge_fd is None, ModelRun(name, "fleet"))
        return {k: v for k, v in scores.items() if not k.startswith("_")}


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


JUDGED = ("classifier_fd", "precision", "recall", "prompt_accuracy")  # what a draw records with a judge (else FID)


def _redraw(
    ev: EvaluationDraw,
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
        again = EvaluationDraw.open(model_dir, reference, drawn, extractor, inception=ev.judge_fd is None)
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
