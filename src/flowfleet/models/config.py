"""Typed configuration of a DiT backbone (expert or router), with the DiT paper's size presets."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from flowfleet.flow.path import TIME_CONVENTION

# DiT paper, Table 1: (depth, hidden size, heads). `tiny` is flowfleet's CPU test size.
DIT_SIZES: dict[str, tuple[int, int, int]] = {
    "tiny": (4, 128, 4),
    "S": (12, 384, 6),
    "B": (12, 768, 12),
    "L": (24, 1024, 16),
    "XL": (28, 1152, 16),
}

Conditioning = Literal["none", "class", "pooled", "cross_attn"]
AdaLN = Literal["zero", "single"]
# The MLP's activation: DiT's and PixArt's tanh-approximated GELU, or the exact (erf) GELU, the same curve to
# within 1e-3 and a cheaper op on a CPU.
MlpAct = Literal["gelu_tanh", "gelu"]
# What an expert was trained to predict: the flow-matching velocity, or DDPM's noise on a variance-preserving
# schedule (DiT's linear or cosine betas), which flowfleet.flow.path converts into the velocity at inference.
Objective = Literal["fm", "ddpm"]
Schedule = Literal["linear", "cosine"]


def parse_size(size: str) -> tuple[int, int, int, int | None]:
    """'B/2' -> (depth, hidden, heads, patch); 'tiny' -> (..., None)."""
    name, _, patch = size.partition("/")
    if name not in DIT_SIZES:
        raise ValueError(f"unknown DiT size {size!r} (expected one of {', '.join(DIT_SIZES)} with /2, /4 or /8)")
    if patch and patch not in ("1", "2", "4", "8"):
        raise ValueError(f"unknown patch size in {size!r} (expected /1, /2, /4 or /8)")
    depth, hidden, heads = DIT_SIZES[name]
    return depth, hidden, heads, int(patch) if patch else None


REPA_HIDDEN = 4  # REPA's projector: its hidden width in multiples of the model's (REPA's: 2048 for every SiT)


class DiTConfig(BaseModel):
    """Everything needed to build a DiT; saved beside its weights as config.json."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    size: str | None = Field(None, description="preset such as 'B/2'; fills depth/hidden/heads/patch")
    input_size: tuple[int, int] = (32, 32)  # latent (H, W)
    in_channels: int = Field(4, ge=1)
    out_channels: int | None = Field(None, ge=1)  # None = in_channels (velocity); 2*in = learned sigma
    patch_size: int = Field(2, ge=1)
    hidden_size: int = Field(384, ge=8)
    depth: int = Field(12, ge=1)
    num_heads: int = Field(6, ge=1)
    mlp_ratio: float = Field(4.0, gt=0)
    mlp_act: MlpAct = "gelu_tanh"
    adaln: AdaLN = "zero"
    conditioning: Conditioning = "none"
    num_classes: int = Field(0, ge=0)  # for conditioning == "class"
    text_dim: int = Field(0, ge=0)  # width of the text encoder's tokens / pooled vector
    text_len: int = Field(0, ge=0)  # token sequence length (cross_attn)
    add_pooled: bool = False  # cross_attn: also add the pooled text vector to the timestep embedding
    # cross_attn: a LayerNorm before cross-attention in every block. PixArt-alpha has none; an expert without
    # it exports to diffusers' PixArtTransformer2DModel exactly (flowfleet.models.pixart).
    cross_norm: bool = True
    cond_dropout: float = Field(0.1, ge=0.0, lt=1.0)  # null-condition probability for CFG training
    # Dropout on each block's attention and MLP outputs while training (ADM's and EDM's regulariser for
    # small datasets; diffusers' transformer blocks call it `dropout`). Off at inference.
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    # Non-leaking augmentation (EDM, Karras et al. 2022, appendix C): the width of the augmentation parameters
    # the model is conditioned on while training on augmented copies (train.augment_p, flowfleet.data.augment).
    # Sampling passes none, which is the unaugmented data's distribution. 0: no augmentation input.
    augment_dim: int = Field(0, ge=0)
    num_outputs: int = Field(0, ge=0)  # > 0: classification head over this many classes (router)
    # REPA (Yu et al. 2025): the width of a frozen encoder's tokens that a projector (an MLP on one block's hidden
    # tokens, trained with the model and unused at sampling) is aligned with (train.repa_*; prepare stores the
    # tokens). 0: no projector.
    repa_dim: int = Field(0, ge=0)
    objective: Objective = "fm"
    schedule: Schedule | None = None  # the VP schedule of a "ddpm" model (required there, refused elsewhere)
    time_convention: str = TIME_CONVENTION

    @model_validator(mode="before")
    @classmethod
    def _fill_from_size(cls, data: Any) -> Any:
        """A size fills depth / hidden_size / num_heads (/ patch_size); a field given as well must agree."""
        if isinstance(data, dict) and data.get("size"):
            depth, hidden, heads, patch = parse_size(data["size"])
            data = dict(data)
            implied = {"depth": depth, "hidden_size": hidden, "num_heads": heads}
            if patch is not None:
                implied["patch_size"] = patch
            for name, value in implied.items():
                given = data.get(name)
                if given is None:
                    data[name] = value
                elif given != value:
                    raise ValueError(
                        f"{name}: {given} contradicts size {data['size']!r} ({name} {value}); give one or the other"
                    )
        return data

    @model_validator(mode="after")
    def _check(self) -> "DiTConfig":
        h, w = self.input_size
        if h < 1 or w < 1:
            raise ValueError(f"input_size: must be positive, got {self.input_size}")
        if h % self.patch_size or w % self.patch_size:
            raise ValueError(f"input_size: {self.input_size} is not divisible by patch_size {self.patch_size}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size: {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        if (self.hidden_size // self.num_heads) % 2:
            raise ValueError("hidden_size: head dimension must be even")
        if self.hidden_size % 4:
            raise ValueError("hidden_size: must be divisible by 4 for the 2-D sin-cos position embedding")
        if self.conditioning == "class" and self.num_classes < 1:
            raise ValueError("num_classes: must be >= 1 with class conditioning")
        if self.conditioning in ("pooled", "cross_attn") and self.text_dim < 1:
            raise ValueError(f"text_dim: must be >= 1 with {self.conditioning} conditioning")
        if self.conditioning == "cross_attn" and self.text_len < 1:
            raise ValueError("text_len: must be >= 1 with cross_attn conditioning")
        if self.objective == "ddpm" and self.schedule is None:
            raise ValueError("schedule: a ddpm model needs its VP schedule (linear or cosine)")
        if self.objective == "fm" and self.schedule is not None:
            raise ValueError(f"schedule: {self.schedule!r} is for a ddpm model; this one is objective fm")
        if self.objective == "ddpm" and self.num_outputs:
            raise ValueError("objective: a classifier (num_outputs > 0, the router) predicts no noise; must be fm")
        if self.objective == "ddpm" and self.out_ch not in (self.in_channels, 2 * self.in_channels):
            raise ValueError(
                f"out_channels: a ddpm model predicts the noise (and optionally sigma): {self.in_channels} or "
                f"{2 * self.in_channels}"
            )
        if self.repa_dim and self.num_outputs:
            raise ValueError("repa_dim: a classifier (num_outputs > 0, the router) aligns no tokens; must be 0")
        if self.time_convention != TIME_CONVENTION:
            raise ValueError(f"time_convention: {self.time_convention!r} differs from flowfleet's {TIME_CONVENTION!r}")
        return self

    @property
    def grid_size(self) -> tuple[int, int]:
        return self.input_size[0] // self.patch_size, self.input_size[1] // self.patch_size

    @property
    def num_tokens(self) -> int:
        gh, gw = self.grid_size
        return gh * gw

    @property
    def out_ch(self) -> int:
        return self.out_channels or self.in_channels

    @property
    def uses_text(self) -> bool:
        return self.conditioning in ("pooled", "cross_attn")
