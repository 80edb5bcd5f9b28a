"""The models an evaluation opens beside the fleet: another fleet (--fleet, checked to share its latent space),
a comparison router (--routers), the run's monolith (--monolith, assembled when stale)."""

from __future__ import annotations

import logging
from typing import Sequence

import torch

from flowfleet.config import RunConfig
from flowfleet.errors import FlowfleetError, ParameterError
from flowfleet.flow import Strategy
from flowfleet.layout import FINAL, MODEL_VAE, MONOLITH, MONOLITH_MODEL
from flowfleet.models.dit import DiTRouter
from flowfleet.models.files import load_model
from flowfleet.sampling.folder import ModelIndex, read_checksums, read_model_index
from flowfleet.sampling.pipeline import FleetPipeline
from flowfleet.stages.assemble import assemble
from flowfleet.storage import RunRoot
from flowfleet.train.specs import router_of_folder
from flowfleet.train.status import job_finished

log = logging.getLogger(__name__)


def check_other_fleet(model: RunRoot, index: ModelIndex, other: RunRoot, strategies: Sequence[Strategy]) -> None:
    """--fleet: `other` must be an assembled fleet that decodes and reads prompts exactly as `model` does (the
    same latent space and encoder settings, the same decoder weights by checksum), and have the experts each
    strategy needs; otherwise a one-line error naming the folder and what differs."""
    theirs = read_model_index(other)  # one-line error when FOLDER is not an assembled fleet
    for field_name in ("latent_shape", "latent_encoder", "text_encoder_config", "conditioning", "text_width"):
        mine, its = getattr(index, field_name), getattr(theirs, field_name)
        if mine != its:
            raise ParameterError(
                f"fleet {other.url}",
                f"{field_name} {its!r} differs from {model.url}'s {mine!r}: "
                "another fleet must share the model's latent space and text encoder",
            )
    mine_sums, its_sums = read_checksums(model) or {}, read_checksums(other) or {}
    for rel in sorted(r for r in mine_sums if r.startswith(MODEL_VAE + "/")):
        if its_sums.get(rel) != mine_sums[rel]:
            raise ParameterError(
                f"fleet {other.url}",
                f"{rel} is not {model.url}'s (checksum): another fleet must decode with the same autoencoder",
            )
    for s in strategies:
        try:
            s.resolve_k(len(theirs.present_experts))
        except ValueError as err:
            raise ParameterError(f"fleet {other.url}", f"{err}") from None


def comparison_router(root: RunRoot, cfg: RunConfig, router: str, device: torch.device) -> DiTRouter:
    """A comparison router of the run (its job's final weights), for the fleet's experts."""
    return load_model(DiTRouter, root, router_of_folder(cfg, router).dir, FINAL).to(device)


def monolith_pipeline(root: RunRoot, fleet: FleetPipeline, device: torch.device) -> FleetPipeline:
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
    pipe.share_prompts(fleet)
    if tuple(pipe.latent_shape) != tuple(fleet.latent_shape):
        raise FlowfleetError(
            f"{folder.url}: latent shape {tuple(pipe.latent_shape)} differs from the fleet's "
            f"{tuple(fleet.latent_shape)}"
        )
    return pipe
