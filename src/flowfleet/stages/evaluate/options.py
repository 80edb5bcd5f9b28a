"""What `flowfleet evaluate` is asked for (EvaluateOptions, validated before anything heavy loads) and what one
evaluated model produced (ModelRun)."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from functools import cached_property
from typing import Any, get_args

from flowfleet.config import SamplingConfig
from flowfleet.errors import FlowfleetError, ParameterError
from flowfleet.evaluate.fid import FIDSettings
from flowfleet.flow import Strategy
from flowfleet.layout import ROUTERS

FLEET_NAME = re.compile(r"[A-Za-z0-9_-]+")
MANY_EXPERTS = 2**31  # the settings are checked before the fleet is open: any strategy's k fits


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
    # Guidance rules (config.SamplingConfig.guidance: mixture, expert) to compare: every fleet row again under each,
    # as the row "<strategy>.<rule>[+<router>|@<NAME>]" (a prompt-blind router's rows are one model: sampled once).
    # Empty: the sampling settings' rule (each fleet's own), rows without the suffix.
    guidance_rules: tuple[str, ...] = ()
    seed: int = 0
    batch_size: int = 250  # samples per sampling batch
    # The sampling settings every model takes (config.SamplingSettings by name: steps, cfg, cache, ...; unset: each
    # fleet's model_index.json); not strategy, nor seed, which the evaluation sets per row and per draw.
    sampling: dict[str, Any] = field(default_factory=dict)
    ref_n: int | None = None  # reference images; None: all of the reference set up to 10,000 (floor set apart)
    # Guidance sweep: each model is sampled at every scale; its row is the scale with the best classifier
    # FD (FID without a judge) among those with prompt accuracy >= min_accuracy (the most accurate if none).
    # The sweep is sampled on the validation split where the run has one (data.validation), with prompts and noise
    # of its own; the row's figures are the test split's at the chosen scale (pieces.extend_sweep: a choice at the
    # sweep's edge samples one scale further, within guidance_bounds and at most guidance_extend more scales).
    guidance_sweep: tuple[float, ...] = ()
    min_accuracy: float = 0.95
    guidance_bounds: tuple[float, float] = (1.0, 16.0)
    guidance_extend: int = 4
    # Evaluation draws: every model is sampled at its chosen scale `repeats` times on the test split, draw r with
    # seed + r (other prompts and noise, and another split of the reference and the real floor).
    # At a few hundred samples a Fréchet distance moves by several points from draw to draw; the report gives
    # each figure's mean and sd over the draws, and the fleet's ratio to the monolith draw by draw.
    repeats: int = 1
    save_guidance_scale: bool = False  # write each model folder's chosen scale into its model_index.json (the default)
    fid: FIDSettings = FIDSettings()
    grid: int = 32  # samples shown per model in the report
    diagnostics: bool = True
    diagnostic_n: int = 32  # samples whose trajectories probe expert disagreement (K passes per step)
    device: str = "auto"
    judge: str | None = None  # MODULE:FACTORY of a prompt-accuracy judge (flowfleet.evaluate.judge); MNIST: built in

    @cached_property
    def strategy_values(self) -> tuple[Strategy, ...]:
        """`strategies` parsed, once (Strategy.parse: a one-line ValueError names the strategies there are)."""
        return tuple(Strategy.parse(s) for s in self.strategies)

    def validate(self) -> None:
        if self.n < 2:
            raise ParameterError("n", f"FID needs at least 2 samples, got {self.n}")
        if self.batch_size < 1:
            raise ParameterError("batch_size", f"must be >= 1, got {self.batch_size}")
        if self.repeats < 1:
            raise ParameterError("repeats", f"must be >= 1, got {self.repeats}")
        if self.ref_n is not None and self.ref_n < 2:
            raise ParameterError("ref_n", f"must be >= 2, got {self.ref_n}")
        if not self.strategies and not self.monolith:
            raise ParameterError("strategies", "nothing to evaluate (give strategies or --monolith)")
        try:
            self.strategy_values  # noqa: B018 (parsed once, here)
        except ValueError as err:
            raise ParameterError("strategies", f"{err}") from None
        if self.routers and not self.strategies:
            raise ParameterError("routers", "a comparison router needs --strategies to route")
        for name in self.routers:
            if name not in ROUTERS[1:]:
                known = ", ".join(ROUTERS[1:])
                raise ParameterError("routers", f"{name!r} is not a comparison router (one of {known})")
        if self.fleets and not self.strategies:
            raise ParameterError("fleet", "another fleet needs --strategies to sample it by")
        names = [name for name, _ in self.fleets]
        for name in names:
            if not FLEET_NAME.fullmatch(name):
                raise ParameterError("fleet", f"name {name!r} must be letters, digits, '-' or '_' (NAME=FOLDER)")
        if len(set(names)) != len(names):
            raise ParameterError("fleet", f"repeated names in {','.join(names)}")
        rules = get_args(SamplingConfig.model_fields["guidance"].annotation)
        for rule in self.guidance_rules:
            if rule not in rules:
                raise ParameterError("guidance_rules", f"{rule!r} is not a guidance rule (one of {', '.join(rules)})")
        if len(set(self.guidance_rules)) != len(self.guidance_rules):
            raise ParameterError("guidance_rules", f"repeated names in {','.join(self.guidance_rules)}")
        if self.guidance_rules and "guidance" in self.sampling:
            raise ParameterError("guidance_rules", "give either rules to compare or one --guidance, not both")
        if len(set(self.strategies)) != len(self.strategies):
            raise ParameterError("strategies", f"repeated names in {','.join(self.strategies)}")
        fixed = sorted(set(self.sampling) & {"strategy", "seed"})
        if fixed:
            raise FlowfleetError(f"sampling: {fixed[0]} is the evaluation's own (--strategies, --seed)")
        SamplingConfig().for_call(MANY_EXPERTS, **self.sampling)  # checked before anything loads
        if self.guidance_sweep and self.sampling.get("guidance_scale") is not None:
            raise ParameterError("guidance_sweep", "give either a sweep or one guidance_scale, not both")
        if any(c < 0 for c in self.guidance_sweep) or len(set(self.guidance_sweep)) != len(self.guidance_sweep):
            raise ParameterError("guidance_sweep", f"scales must be distinct and >= 0, got {list(self.guidance_sweep)}")
        lo, hi = self.guidance_bounds
        if not 0 <= lo <= hi:
            raise ParameterError("guidance_bounds", f"expected 0 <= LOW <= HIGH, got {lo},{hi}")
        if self.guidance_extend < 0:
            raise ParameterError("guidance_extend", f"must be >= 0, got {self.guidance_extend}")
        if self.save_guidance_scale and not self.guidance_sweep:
            raise ParameterError(
                "save_guidance_scale", "needs --guidance-sweep (the scale it saves is the sweep's choice)"
            )


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
    subcategory_accuracy: float | None = None  # emoji: share of samples the judge reads as the prompt's subcategory
    classifier_fd: float | None = None  # MNIST: Fréchet distance in the digit classifier's features
    samples: str = ""  # reports/<samples>: every scored sample (npz)
    same_as: str | None = None  # the same model as this earlier run (top-k with k >= K is the full ensemble)
    cfg: float | None = None  # the guidance scale of this row (the sweep's choice when there is a sweep)
    precision: float | None = None  # in the judge's feature space (Kynkäänniemi et al.), vs the reference
    recall: float | None = None
    # one score record per guidance scale, sorted by scale, on the split named by `chosen_on`: "validation", or
    # "test" where the run has no validation split (the choice and the figures then read the same draw)
    sweep: list[dict[str, Any]] = field(default_factory=list)
    chosen_on: str | None = None
    sweep_stop: str | None = None  # why the sweep stopped with its best scale at an edge (its bound); None: inside
    cache_saved: float = 0.0  # share of block evaluations the first-block cache skipped (--cache)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)
