"""Check 3, compatibility: the fleet's latent channels and size, text width and length, time convention, an accepted
objective, only what an expert may change (EXPERT_OVERRIDABLE); the kit it was made from still this run's contract
(the run recomputed with the issued kit's caps: the fleet's latent space has not changed since); a sample and a
held-out slice of the fleet's latent shape, within the kit's rows, that are not the fleet's own data."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from flowfleet.config import EXPERT_OVERRIDABLE
from flowfleet.flow.path import TIME_CONVENTION
from flowfleet.layout import PACKAGE_HELDOUT, PACKAGE_MANIFEST, PACKAGE_SAMPLE
from flowfleet.stages.admit.files import CONFIG
from flowfleet.stages.admit.gate import row_digest
from flowfleet.stages.admit.refusal import Refused
from flowfleet.stages.kit import run_kit

if TYPE_CHECKING:
    from flowfleet.stages.admit.gate import Gate


def check_compatibility(gate: Gate) -> None:
    cfg, kit = gate.expert_cfg, gate.sign.kit
    assert cfg is not None
    c, h, w = kit.latent_shape
    if cfg.in_channels != c:
        raise Refused(
            "compatibility", f"{CONFIG}: in_channels {cfg.in_channels}, the fleet's latents have {c} channels"
        )
    if tuple(cfg.input_size) != (h, w):
        raise Refused("compatibility", f"{CONFIG}: input_size {list(cfg.input_size)}, the fleet's latents are {h}x{w}")
    if cfg.objective not in kit.objectives:
        raise Refused("compatibility", f"{CONFIG}: objective {cfg.objective!r}; the fleet takes {kit.objectives}")
    declared = gate.sign.manifest.time_convention
    if cfg.time_convention != TIME_CONVENTION or declared != TIME_CONVENTION:
        raise Refused(
            "compatibility", f"{PACKAGE_MANIFEST}: time convention {declared!r}, the fleet's is {TIME_CONVENTION!r}"
        )
    base = kit.expert_config().model_dump(exclude={"size"})
    mine = cfg.model_dump(exclude={"size"})
    for key, value in base.items():
        if key not in EXPERT_OVERRIDABLE and mine.get(key) != value:
            raise Refused(
                "compatibility",
                f"{CONFIG}: {key} {mine.get(key)!r}, the fleet's is {value!r} (not an expert's to change)",
            )
    now = run_kit(gate.root, gate.cfg, kit.max_params, kit.sample_rows)
    if now.fingerprint != kit.fingerprint:
        raise Refused(
            "compatibility",
            f"{PACKAGE_MANIFEST}: kit {kit.fingerprint[:16]}... is not this fleet's contract now "
            f"({now.fingerprint[:16]}...): the fleet changed its latent space or architecture since it was issued",
        )
    for rel in (PACKAGE_SAMPLE, PACKAGE_HELDOUT):
        tensors = gate.items(rel)[0]
        _not_copied(gate, rel, tensors)
        lat = tensors.get("latents")
        if lat is None or tuple(lat.shape[1:]) != kit.latent_shape or lat.shape[0] < 2:
            shape = None if lat is None else list(lat.shape)
            raise Refused("compatibility", f"{rel}: latents {shape}, expected [N >= 2, {c}, {h}, {w}]")
        if cfg.conditioning == "cross_attn":
            tok = tensors.get("text_tokens")
            if tok is None or tuple(tok.shape[1:]) != (cfg.text_len, cfg.text_dim):
                raise Refused(
                    "compatibility",
                    f"{rel}: text_tokens {None if tok is None else list(tok.shape)}, expected "
                    f"[N, {cfg.text_len}, {cfg.text_dim}]",
                )


def _not_copied(gate: Gate, rel: str, tensors: dict[str, torch.Tensor]) -> None:
    """Refuse a sample or held-out slice that is largely the fleet's own data, byte for byte: its router would learn
    to send the fleet's prompts to the newcomer (the poisoned contribution's lure)."""
    lat = tensors.get("latents")
    if lat is None or not lat.numel():
        return
    copies = sum(row_digest(row) in gate.own_rows for row in lat)
    gate.figures[f"copied_share_{rel.split('.')[0]}"] = copies / lat.shape[0]
    if copies > gate.settings.copied * lat.shape[0]:
        raise Refused(
            "compatibility",
            f"{rel}: {copies} of its {lat.shape[0]} items are copies of the fleet's own data "
            f"(at most {gate.settings.copied:.0%}): data the fleet has is not a contribution",
        )
