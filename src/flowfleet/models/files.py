"""Model folders in diffusers' layout: config.json + diffusion_pytorch_model.safetensors.

save_model/load_model go through diffusers' ModelMixin (safetensors only, never pickles) and add
what a run root needs: fsspec URLs, and a one-line error naming the folder and field when a config
is corrupted or does not match the weights.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import TypeVar

import safetensors.torch
from diffusers.models.modeling_utils import ModelMixin

from flowfleet.errors import FlowfleetError, validated
from flowfleet.models.config import DiTConfig
from flowfleet.models.dit import DiTModel
from flowfleet.storage import RunRoot

M = TypeVar("M", bound=DiTModel)
WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"


class ModelFileError(FlowfleetError):
    """A model folder that cannot be loaded; the message is one line naming the folder and field."""


def read_dit_config(folder: RunRoot | str | Path, *parts: str) -> DiTConfig:
    """Parse and validate a model folder's config.json without loading weights."""
    root = folder if isinstance(folder, RunRoot) else RunRoot(folder)
    where = root.url_of(*parts, "config.json")
    if not root.exists(*parts, "config.json"):
        raise ModelFileError(f"{where}: missing (not a model folder)")
    try:
        raw = json.loads(root.read_bytes(*parts, "config.json"))
    except json.JSONDecodeError as err:
        raise ModelFileError(f"{where}: corrupted JSON ({err.msg} at line {err.lineno})") from None
    if isinstance(raw, dict):
        raw = {k: v for k, v in raw.items() if not k.startswith("_")}  # diffusers' own keys (_class_name, ...)
    return validated(DiTConfig, raw, where, ModelFileError)


def save_model(model: ModelMixin, folder: RunRoot | str | Path, *parts: str) -> None:
    """Write config.json + safetensors weights; weights land before the config that names them."""
    root = folder if isinstance(folder, RunRoot) else RunRoot(folder)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tmp_path = Path(tmp)
        root.write_bytes((tmp_path / WEIGHTS_NAME).read_bytes(), *parts, WEIGHTS_NAME)
        root.write_bytes((tmp_path / "config.json").read_bytes(), *parts, "config.json")


def load_model(cls: type[M], folder: RunRoot | str | Path, *parts: str) -> M:
    """Load a model folder as `cls`, refusing a corrupted or mismatched one with a one-line error."""
    root = folder if isinstance(folder, RunRoot) else RunRoot(folder)
    cfg = read_dit_config(root, *parts)
    where = root.url_of(*parts)
    if not root.exists(*parts, WEIGHTS_NAME):
        raise ModelFileError(f"{where}: missing {WEIGHTS_NAME}")
    # Strict load (diffusers only warns on missing keys): every tensor present, with its shape.
    try:
        state = safetensors.torch.load(root.read_bytes(*parts, WEIGHTS_NAME))
    except Exception as err:  # safetensors raises its own error type on a truncated header
        raise ModelFileError(f"{where}: {WEIGHTS_NAME} is unreadable ({str(err).splitlines()[0][:200]})") from None
    model = cls.from_dit_config(cfg)
    expected = model.state_dict()
    for key, tensor in expected.items():
        if key not in state:
            raise ModelFileError(f"{where}: weights lack {key!r} that config.json requires")
        if tuple(state[key].shape) != tuple(tensor.shape):
            raise ModelFileError(
                f"{where}: {key!r} has shape {tuple(state[key].shape)}, config.json implies {tuple(tensor.shape)}"
            )
    extra = sorted(set(state) - set(expected))
    if extra:
        raise ModelFileError(f"{where}: weights hold {extra[0]!r} that config.json does not describe")
    model.load_state_dict(state, strict=True)
    return model.eval()
