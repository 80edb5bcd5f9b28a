"""Check 5, no harm: the grown fleet (the addition installed from the private copy, the router trained warm-started
as add-expert does, assembled into model-candidate/): its routed flow-matching loss on the fleet's held-out data
within `harm` of the fleet's before, and lower than the fleet's before on the contribution's held-out slice; where a
judge reads the fleet's prompts (the built-in digits' or emoji's, or --judge), the images too: on the fleet's
held-out prompts its prompt accuracy falls by at most `accuracy_drop` and its judge's Fréchet distance rises by at
most `fd_rise`; on the contribution's held-out prompts (those the judge names) both are better than the fleet's
before. On a refusal, or any failure, everything installed is taken back."""

from __future__ import annotations

import logging
import tempfile
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from flowfleet.data.shards import ShardSet, ShardSetUnion
from flowfleet.errors import FlowfleetError
from flowfleet.evaluate.views import captioned_grid_png
from flowfleet.layout import CANDIDATE, DATA, MODEL, PACKAGE_HELDOUT, PACKAGE_SAMPLE, RUN_FILE
from flowfleet.sampling.folder import read_model_index
from flowfleet.sampling.pipeline import FleetPipeline
from flowfleet.stages.admit.install import Installed, write_shards
from flowfleet.stages.admit.losses import fleet_velocity, flow_loss, subset
from flowfleet.stages.admit.refusal import Refused
from flowfleet.stages.assemble import assemble
from flowfleet.stages.evaluate import EvaluateOptions, JudgedDraw
from flowfleet.stages.train import train_job
from flowfleet.storage import RunRoot
from flowfleet.train.loop import TrainOptions
from flowfleet.train.specs import run_routers

if TYPE_CHECKING:
    from flowfleet.stages.admit.gate import Gate

log = logging.getLogger(__name__)
GRID_ROW = 8  # samples per row of the judged comparison's picture


def check_no_harm(gate: Gate, source: str, progress: bool) -> int:
    """Install the contribution, train the grown fleet's router, compare; on refusal undo it all. -> its expert."""
    root = gate.root
    with tempfile.TemporaryDirectory() as tmp:
        draws = _judged_draws(gate, tmp)  # before anything is installed: the fleet's own items as they are
    before_yaml = root.read_bytes(RUN_FILE)
    installed = Installed(root, gate.cfg)
    try:
        assert gate.expert_cfg is not None
        k = installed.add(source, gate.staged_root(), gate.items(PACKAGE_SAMPLE), gate.sign, gate.expert_cfg)
        for spec in run_routers(installed.cfg):
            installed.jobs.append(spec.dir)
            status = train_job(root, spec, options=TrainOptions(progress=progress))
            if status.state != "done":
                raise FlowfleetError(f"{spec.dir}: {status.state} at step {status.step}; re-run admit")
        assemble(root.url, root.url_of(CANDIDATE), progress=progress)
        # the fleet before and the grown fleet, opened once for both comparisons (encoders where judged: shared)
        before = FleetPipeline.from_pretrained(root.url_of(MODEL), device=gate.device, load_encoders=bool(draws))
        after = FleetPipeline.from_pretrained(
            root.url_of(CANDIDATE),
            device=gate.device,
            text_encoder=before.text_encoder,
            latent_decoder=before.latent_decoder,
            load_encoders=False,
        )
        _compare(gate, before, after)
        if draws is not None:
            _judged(gate, before, after, *draws, progress=progress)
    except BaseException:
        root.write_bytes(before_yaml, RUN_FILE)
        installed.undo()
        raise
    root.remove(CANDIDATE, recursive=True)
    return k


def _compare(gate: Gate, before: FleetPipeline, after: FleetPipeline) -> None:
    """The fleet before and the grown fleet by their routed flow-matching loss (no image, no judge)."""
    s, f = gate.settings, gate.figures
    old = subset(gate.fleet_heldout, s.items, s.seed)
    new = subset(gate.items(PACKAGE_HELDOUT)[0], s.items, s.seed)
    f["fleet_old_before"] = flow_loss(fleet_velocity(before), old, s, gate.device)
    f["fleet_old_after"] = flow_loss(fleet_velocity(after), old, s, gate.device)
    f["fleet_new_before"] = flow_loss(fleet_velocity(before), new, s, gate.device)
    f["fleet_new_after"] = flow_loss(fleet_velocity(after), new, s, gate.device)
    rise = f["fleet_old_after"] / f["fleet_old_before"] - 1
    if rise > s.harm:
        raise Refused(
            "no harm",
            f"the grown fleet's loss on the fleet's held-out data rises from {f['fleet_old_before']:.4f} to "
            f"{f['fleet_old_after']:.4f} ({rise:+.1%}; at most {s.harm:+.0%}): its router sends the fleet's "
            f"prompts to the new expert{router_hint(gate)}",
        )
    if not f["fleet_new_after"] < f["fleet_new_before"]:
        raise Refused(
            "no harm",
            f"{PACKAGE_HELDOUT}: the grown fleet's loss ({f['fleet_new_after']:.4f}) is not below the "
            f"fleet's before ({f['fleet_new_before']:.4f}): the contribution adds nothing there",
        )


def router_hint(gate: Gate) -> str:
    """What a refusal for harm to the fleet's own prompts adds when the fleet's router is prompt-blind (Paris'): a
    grown fleet under such a router sends a prompt by its noisy image alone, e.g. a four to the nines' expert."""
    if gate.cfg.router.uses_text or gate.cfg.encoders.text.name == "none":
        return ""
    return "; its router does not read the prompt (a router with run.yaml router.conditioning: pooled may take it)"


def _judged_draws(gate: Gate, tmp: str) -> tuple[JudgedDraw, JudgedDraw | None] | None:
    """The judged comparison's two draws: the fleet's held-out items (their prompts and images; data/'s when it
    holds none out), and the contribution's held-out slice (written to `tmp` as a shard set; None when the judge
    names none of its prompts). None: no judge reads the fleet's prompts."""
    s = gate.settings
    if s.judge is None:
        return None
    conditioning = read_model_index(RunRoot(gate.root.url_of(MODEL))).conditioning
    options = EvaluateOptions(
        n=s.judge_n, seed=s.seed, diagnostics=False, device=s.device, judge=None if s.judge == "auto" else s.judge
    )
    own = JudgedDraw.open(gate.root.url, options, conditioning, held_out=True)
    if own is None:
        log.info("admit: no judge reads the fleet's prompts: no harm is judged by the loss alone")
        return None
    slice_root = RunRoot(tmp)
    write_shards(slice_root, DATA, *gate.items(PACKAGE_HELDOUT), {})
    data = ShardSetUnion([ShardSet(slice_root, DATA)])
    new = JudgedDraw.open(gate.root.url, replace(options, judge=own.judge), conditioning, data=data)
    return own, new


def _judged(
    gate: Gate, before: FleetPipeline, after: FleetPipeline, own: JudgedDraw, new: JudgedDraw | None, progress: bool
) -> None:
    """The fleet before and the grown fleet, sampled as they serve on the same prompts and noise, judged."""
    s, f = gate.settings, gate.figures
    fleets = {"fleet before": before, "grown fleet": after}
    got = {
        which: tuple(draw.score(pipe, name=name, progress=progress, keep=True) for name, pipe in fleets.items())
        for which, draw in (("old", own), ("new", new))
        if draw is not None
    }
    for which, pair in got.items():
        for when, scores in zip(("before", "after"), pair):
            for key in ("prompt_accuracy", "classifier_fd"):
                if scores.get(key) is not None:
                    f[f"judged_{which}_{key}_{when}"] = float(scores[key])
    gate.grid = _grid(got, own.judge)  # (before any verdict: a refusal's picture shows why)
    (b, a) = got["old"]
    hint = router_hint(gate)
    if a["prompt_accuracy"] < b["prompt_accuracy"] - s.accuracy_drop:
        worst = min(a["per_class"], key=lambda c: a["per_class"][c] - b["per_class"].get(c, 0.0))
        raise Refused(
            "no harm",
            f"the grown fleet's prompt accuracy on the fleet's held-out prompts falls from "
            f"{b['prompt_accuracy']:.3f} to {a['prompt_accuracy']:.3f} (at most {s.accuracy_drop} lower; "
            f"{worst!r}: {b['per_class'].get(worst, 0.0):.3f} -> {a['per_class'][worst]:.3f}), by {own.judge}{hint}",
        )
    if b.get("classifier_fd") is not None and a["classifier_fd"] > (1 + s.fd_rise) * b["classifier_fd"]:
        raise Refused(
            "no harm",
            f"the grown fleet's classifier FD on the fleet's held-out prompts rises from {b['classifier_fd']:.2f} "
            f"to {a['classifier_fd']:.2f} (at most {s.fd_rise:+.0%}), by {own.judge}{hint}",
        )
    if new is None:
        return
    (b, a) = got["new"]
    if not a["prompt_accuracy"] > b["prompt_accuracy"]:
        raise Refused(
            "no harm",
            f"{PACKAGE_HELDOUT}: the grown fleet's prompt accuracy on the contribution's prompts "
            f"({a['prompt_accuracy']:.3f}) is not above the fleet's before ({b['prompt_accuracy']:.3f}), by "
            f"{own.judge}: the contribution adds nothing there",
        )
    if b.get("classifier_fd") is not None and not a["classifier_fd"] < b["classifier_fd"]:
        raise Refused(
            "no harm",
            f"{PACKAGE_HELDOUT}: the grown fleet's classifier FD on the contribution's prompts "
            f"({a['classifier_fd']:.2f}) is not below the fleet's before ({b['classifier_fd']:.2f}), by "
            f"{own.judge}: the contribution adds nothing there",
        )


def changed_first(before: list[bool | None], after: list[bool | None], n: int) -> list[int]:
    """n sample indices: those the judge read differently before and after, then the first others, in order."""
    changed = [i for i, (x, y) in enumerate(zip(before, after)) if x != y]
    same = [i for i in range(len(before)) if before[i] == after[i]]
    return (changed + same)[:n]


def _grid(got: dict[str, tuple[dict[str, Any], ...]], judge: str) -> bytes:
    """The judged comparison's samples, a row each: the fleet before and the grown fleet on the fleet's held-out
    prompts, then (where judged) on the contribution's. Each pair of rows shows the same prompts and noise: first
    those the judge read differently before and after (what the contribution changed), then the first others. The
    title gives each pair's prompt accuracy."""
    images, prompts = [], []
    for b, a in got.values():
        pick = changed_first(b["hits"], a["hits"], GRID_ROW)
        for scores in (b, a):
            images.append(scores["images"][pick])
            prompts += [scores["prompts"][i] for i in pick]
    names = {"old": "fleet's prompts", "new": "new prompts"}
    accuracy = ", ".join(
        f"{names[which]} {b['prompt_accuracy']:.2f} -> {a['prompt_accuracy']:.2f}" for which, (b, a) in got.items()
    )
    return captioned_grid_png(
        torch.cat(images), prompts, cols=GRID_ROW, title=f"before/after: {accuracy} (by {judge}), changed first"
    )
