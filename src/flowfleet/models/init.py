"""Where an expert's weights start (run.yaml expert_init): a pretrained transformer folder, either a diffusers
PixArtTransformer2DModel (flowfleet.models.pixart maps its names) or a flowfleet DiT of the expert's own
architecture, such as a seed model trained on all the data before the experts branch (c-BTM's seed phase).
"""

from __future__ import annotations

import json

import torch

from flowfleet.errors import FlowfleetError
from flowfleet.models.config import DiTConfig
from flowfleet.models.dit import DiTExpert
from flowfleet.models.files import load_model
from flowfleet.models.pixart import PIXART_CLASS, load_pixart_into
from flowfleet.storage import RunRoot

# What a starting point may differ in from the expert: training settings, not the network.
TRAINING_ONLY = ("size", "cond_dropout", "dropout")


def init_class(folder: str) -> str:
    """The `_class_name` of a model folder's config.json (what kind of transformer it holds)."""
    root = RunRoot(folder)
    try:
        raw = json.loads(root.read_bytes("config.json"))
    except (OSError, ValueError) as err:
        why = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise FlowfleetError(f"expert_init {root.url}: no readable config.json ({why})") from None
    return str(raw.get("_class_name", "")) if isinstance(raw, dict) else ""


def load_dit_into(model: torch.nn.Module, cfg: DiTConfig, folder: str) -> None:
    """Copy a flowfleet DiT folder's weights into `model` (an expert of config `cfg`); one line naming the
    first architecture field that differs."""
    source = load_model(DiTExpert, folder)
    theirs, mine = source.cfg.model_dump(), cfg.model_dump()
    for name, value in mine.items():
        if name not in TRAINING_ONLY and theirs.get(name) != value:
            where = RunRoot(folder).url
            raise FlowfleetError(
                f"expert_init {where}: {name} is {theirs.get(name)!r}, run.yaml expert.{name} is {value!r}"
            )
    model.load_state_dict(source.state_dict(), strict=True)


def load_expert_init(model: torch.nn.Module, cfg: DiTConfig, folder: str) -> None:
    """Start `model` from the transformer in `folder` (PixArt or a flowfleet DiT, told by its config.json)."""
    if init_class(folder) == PIXART_CLASS:
        load_pixart_into(model, cfg, folder)
    else:
        load_dit_into(model, cfg, folder)
