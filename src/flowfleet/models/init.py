"""Where an expert's weights start (run.yaml expert_init): a pretrained transformer folder, either a diffusers
PixArtTransformer2DModel (flowfleet.models.pixart maps its names) or a flowfleet DiT of the expert's own
architecture, such as a seed model trained on all the data before the experts branch (c-BTM's seed phase); or a
checkpoint of the DiT reference model (facebookresearch/DiT: its `DiT_models` state dict, as a .safetensors file;
a .pt is refused with the command that converts it), as DDPM weights for a ddpm expert or the start of a
flow-matching expert's fine-tuning (Heterogeneous DDM's checkpoint conversion).
"""

from __future__ import annotations

import json
import posixpath

import safetensors.torch
import torch

from flowfleet.errors import FlowfleetError
from flowfleet.models.config import DiTConfig
from flowfleet.models.dit import DiTExpert
from flowfleet.models.embeddings import sincos_2d
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


CHECKPOINT_SUFFIXES = (".pt", ".pth", ".safetensors")  # a DiT reference checkpoint, not a folder
CONDITION_EMBEDDERS = ("y_embedder.",)  # in a DiT checkpoint, used only by an expert conditioned the same way


def _beyond_dit(name: str) -> bool:
    """An expert weight the reference DiT has no counterpart of (text conditioning, augmentation, adaLN-single):
    it keeps its initialisation."""
    own = ("pooled_embedder.", "text_projector.", "augment_embedder.", "t_block.")
    return name.startswith(own) or ".cross_attn." in name or ".norm_cross." in name


def read_dit_checkpoint(path: str) -> dict[str, torch.Tensor]:
    """The reference DiT's state dict from a .safetensors file (local or fsspec URL). A .pt file is refused, naming
    where the command that converts it is: a pickle is code, and flowfleet never unpickles (tests/test_safety.py)."""
    name = posixpath.basename(path.rstrip("/"))
    if not name.endswith(".safetensors"):
        raise FlowfleetError(
            f"expert_init {path}: a pickle, which flowfleet does not load; convert it once to .safetensors where you "
            "trust it (docs/heterogeneous-experts.md has the command)"
        )
    root = RunRoot(posixpath.dirname(path.rstrip("/")) or ".")
    try:
        state = safetensors.torch.load(root.read_bytes(name))
    except Exception as err:  # a missing file, a truncated or foreign one: one line
        why = str(err).splitlines()[0][:200] if str(err) else type(err).__name__
        raise FlowfleetError(f"expert_init {path}: not a readable DiT checkpoint ({why})") from None
    return dict(state)


def load_dit_checkpoint_into(model: torch.nn.Module, cfg: DiTConfig, path: str) -> None:
    """Copy a reference DiT checkpoint into `model` (an expert of config `cfg`, whose names follow the reference's,
    flowfleet.models.dit). Its fixed position table must be the expert's; a learned-sigma head (2C outputs) keeps
    its noise half for an expert of C outputs; a label embedder loads only into a class expert. One line naming the
    first weight that does not fit."""
    state = read_dit_checkpoint(path)
    pos = state.pop("pos_embed", None)
    if pos is not None:
        gh, gw = cfg.grid_size
        if pos.shape[-2:] != (gh * gw, cfg.hidden_size) or not torch.allclose(
            pos.reshape(gh * gw, -1).float(), sincos_2d(cfg.hidden_size, gh, gw), atol=1e-5
        ):
            raise FlowfleetError(f"expert_init {path}: pos_embed is not the expert's {gh} x {gw} sin-cos table")
    c, p = cfg.in_channels, cfg.patch_size
    for name in ("final_layer.linear.weight", "final_layer.linear.bias"):
        w = state.get(name)
        if w is not None and w.shape[0] == p * p * 2 * c and cfg.out_ch == c:  # learned sigma: keep the noise
            state[name] = w.reshape(p * p, 2 * c, *w.shape[1:])[:, :c].reshape(p * p * c, *w.shape[1:])
    mine = model.state_dict()
    for name, tensor in state.items():
        if name not in mine:
            if name.startswith(CONDITION_EMBEDDERS):
                continue  # an expert conditioned otherwise (text) learns its own
            raise FlowfleetError(f"expert_init {path}: {name} has no counterpart in the expert (expert: {cfg.size})")
        if tensor.shape != mine[name].shape:
            raise FlowfleetError(
                f"expert_init {path}: {name} is {tuple(tensor.shape)}, the expert's {tuple(mine[name].shape)}"
            )
    missing = [n for n in mine if n not in state and not _beyond_dit(n)]
    if missing:
        raise FlowfleetError(f"expert_init {path}: no {missing[0]} in the checkpoint")
    model.load_state_dict({k: v for k, v in state.items() if k in mine}, strict=False)


def load_expert_init(model: torch.nn.Module, cfg: DiTConfig, folder: str) -> None:
    """Start `model` from `folder`: a DiT reference checkpoint file, or a folder holding a PixArt transformer or a
    flowfleet DiT (told by its config.json)."""
    if folder.rstrip("/").endswith(CHECKPOINT_SUFFIXES):
        load_dit_checkpoint_into(model, cfg, folder)
    elif init_class(folder) == PIXART_CLASS:
        load_pixart_into(model, cfg, folder)
    else:
        load_dit_into(model, cfg, folder)
