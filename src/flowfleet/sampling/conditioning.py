"""What a fleet's samples are conditioned on: the text encoder (each distinct prompt encoded once) and the latent
decoder, built from the model folder's references where not given, and the prompts or labels of a call turned into a
per-sample Condition after they are checked against the fleet's conditioning."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from flowfleet.errors import FlowfleetError, ParameterError
from flowfleet.layout import MODEL_VAE
from flowfleet.sampling.index import ModelIndex
from flowfleet.sampling.prompts import PromptEmbeddings
from flowfleet.sampling.routing import Condition
from flowfleet.storage import RunRoot

TEXT_CONDITIONING = ("pooled", "cross_attn")


class FleetConditioning:
    """FleetPipeline's encoders and conditions. It reads what the pipeline sets: conditioning, num_classes, index
    (the folder's model_index.json, or None), folder, device, dtype and latent_decoder."""

    conditioning: str
    num_classes: int
    index: ModelIndex | None
    folder: str | None
    device: torch.device
    dtype: torch.dtype
    latent_decoder: Any

    @property
    def text_encoder(self) -> Any:
        return self._text_encoder

    @text_encoder.setter
    def text_encoder(self, encoder: Any) -> None:
        self._text_encoder = encoder
        # each distinct prompt encoded once, alone (flowfleet.sampling.prompts)
        self.prompts = PromptEmbeddings(encoder) if encoder is not None else None

    def share_prompts(self, other: "FleetConditioning") -> None:
        """Keep prompt embeddings with another pipeline of the same text encoder (an evaluation's fleet and its
        monolith): a prompt both sample is encoded once. The embeddings are the same either way."""
        if other.text_encoder is not self.text_encoder:
            raise ValueError("share_prompts: the pipelines have different text encoders")
        self.prompts = other.prompts

    def load_encoders(self) -> None:
        """Build the text encoder and latent decoder from the folder's references, where not given."""
        if self.index is None:
            return
        if self.text_encoder is None and self.conditioning in TEXT_CONDITIONING:
            self.text_encoder = build_text_encoder_from(self.index, self.device)
        if self.latent_decoder is None:
            self.latent_decoder = build_latent_decoder_from(self.index, self.device, self.folder)

    def check_condition(self, prompts: Sequence[str] | None, labels: Sequence[int] | None) -> None:
        """Validate prompts / labels for this fleet's conditioning (before any encoder is loaded)."""
        check_condition(self.conditioning, self.num_classes, prompts, labels)

    def encode_condition(
        self, prompts: Sequence[str] | None, labels: Sequence[int] | None, n: int
    ) -> tuple[Condition, list[str]]:
        """Per-sample Condition for n samples, cycling through the prompts (or labels)."""
        self.check_condition(prompts, labels)
        if self.conditioning in TEXT_CONDITIONING:
            width = self.index.text_width if self.index is not None else None
            return _text_condition(self.prompts, list(prompts or []), width, n, self.device, self.dtype)
        if self.conditioning == "class":
            labels = list(labels or [])
            which = torch.arange(n) % len(labels)
            return Condition(labels=torch.tensor(labels, device=self.device)[which]), [""] * n
        return Condition(), [""] * n


def check_condition(
    conditioning: str, num_classes: int, prompts: Sequence[str] | None, labels: Sequence[int] | None
) -> None:
    """Prompts for a text-conditioned fleet (none empty), labels in 0..num_classes-1 for a class-conditioned one."""
    if conditioning in TEXT_CONDITIONING:
        if not prompts:
            raise ParameterError("prompt", "required (the experts are text-conditioned)")
        if any(not p.strip() for p in prompts):
            raise ParameterError("prompt", "empty prompt")
    elif conditioning == "class":
        if not labels:
            raise ParameterError("label", "required (the experts are class-conditioned)")
        bad = [y for y in labels if not 0 <= y < num_classes]
        if bad:
            raise ParameterError("label", f"{bad[0]} outside 0..{num_classes - 1}")


def _text_condition(
    embeddings: PromptEmbeddings | None,
    prompts: list[str],
    width: int | None,
    n: int,
    device: torch.device,
    dtype: torch.dtype,
) -> tuple[Condition, list[str]]:
    """n samples' text condition, cycling through the prompts, each encoded once; the encoder's width checked
    against the experts' (`width`; None: not known)."""
    if embeddings is None:
        raise FlowfleetError("text encoder: none loaded for this text-conditioned fleet")
    emb = embeddings(prompts)  # tokens [P, L, T], mask [P, L], pooled [P, T]
    if width is not None and emb.tokens.shape[-1] != width:
        raise FlowfleetError(f"text encoder: width {emb.tokens.shape[-1]} differs from the experts' text width {width}")
    which = torch.arange(n) % len(prompts)
    cond = Condition(
        text_tokens=emb.tokens[which].to(device, dtype),
        text_mask=emb.mask[which].to(device).bool(),
        text_pooled=emb.pooled[which].to(device, dtype),
    )
    return cond, [prompts[i] for i in which.tolist()]


def _encoders_module():
    try:
        from flowfleet.data import encoders
    except ImportError:
        raise FlowfleetError(
            "encoders: flowfleet.data.encoders is not available in this install "
            "(pass text_encoder= / latent_decoder= objects instead)"
        ) from None
    return encoders


def build_text_encoder_from(index: ModelIndex, device: torch.device | str) -> Any:
    """The text encoder the fleet was trained with, from its reference (never copied into the folder)."""
    cfg = index.text_config()
    if cfg is None or cfg.name == "none":
        raise FlowfleetError("model_index.json: text-conditioned experts but no text encoder reference")
    return _encoders_module().build_text_encoder(cfg, device)


def build_latent_decoder_from(index: ModelIndex, device: torch.device | str, folder: str | None = None) -> Any:
    """The latent encoder (for .decode). Pixel-space fleets need none: their 'latents' are images. A
    run-trained autoencoder's weights are in the model folder's vae/."""
    cfg = index.latent_config()
    if cfg.name == "pixels":
        return None
    weights = RunRoot(folder).url_of(MODEL_VAE) if folder is not None else None
    return _encoders_module().build_latent_encoder(cfg, index.image_channels, device, weights)
