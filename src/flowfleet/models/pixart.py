"""A flowfleet expert as diffusers' PixArtTransformer2DModel, and back.

PixArt-alpha's transformer is the DiT with adaLN-single, cross-attention to projected text tokens and no
norm before it. A flowfleet expert with `adaln: single`, `conditioning: cross_attn`, `cross_norm: false`,
`add_pooled: false`, `mlp_ratio: 4` and a square latent holds exactly PixArt's weights, renamed (and its
fused q/k/v split): the two compute the same function. The expert's learned null-text sequence, which
PixArt does not have, ships beside it as the negative prompt embeddings for classifier-free guidance.

The timestep: flowfleet embeds 1000·t with t in [0, 1], t = 1 noise; diffusers' flow-matching scheduler
passes timestep = 1000·σ with the same σ (FlowMatchEulerDiscreteScheduler with shift 1, given the
σ grid from 1 to 0 explicitly: its default grid stops at 1/1000).
"""

from __future__ import annotations

from typing import Any

import safetensors.torch
import torch

from flowfleet.errors import FlowfleetError
from flowfleet.models.config import DiTConfig
from flowfleet.models.files import WEIGHTS_NAME
from flowfleet.storage import RunRoot

PIXART_CLASS = "PixArtTransformer2DModel"


def check_exportable(cfg: DiTConfig, who: str = "expert") -> None:
    """One line naming the first field that keeps this expert from being a PixArt transformer."""
    wanted: list[tuple[str, Any]] = [
        ("conditioning", "cross_attn"),
        ("adaln", "single"),
        ("cross_norm", False),
        ("add_pooled", False),
        ("mlp_ratio", 4.0),
        ("mlp_act", "gelu_tanh"),
        ("num_outputs", 0),
    ]
    for name, value in wanted:
        if getattr(cfg, name) != value:
            raise FlowfleetError(
                f"{who}: {name} is {getattr(cfg, name)!r}; {PIXART_CLASS} needs {value!r} "
                f"(train the expert with {name}: {value} to export it)"
            )
    if cfg.input_size[0] != cfg.input_size[1]:
        raise FlowfleetError(f"{who}: input_size {tuple(cfg.input_size)} is not square; {PIXART_CLASS} is")


def pixart_config(cfg: DiTConfig) -> dict[str, Any]:
    """PixArtTransformer2DModel's constructor arguments for this expert."""
    check_exportable(cfg)
    return {
        "sample_size": cfg.input_size[0],
        "patch_size": cfg.patch_size,
        "in_channels": cfg.in_channels,
        "out_channels": cfg.out_ch,
        "num_layers": cfg.depth,
        "num_attention_heads": cfg.num_heads,
        "attention_head_dim": cfg.hidden_size // cfg.num_heads,
        "cross_attention_dim": cfg.hidden_size,
        "caption_channels": cfg.text_dim,
        "norm_type": "ada_norm_single",
        "norm_elementwise_affine": False,
        "norm_eps": 1e-6,
        "activation_fn": "gelu-approximate",
        "attention_bias": True,
        "use_additional_conditions": False,
        "interpolation_scale": 1,  # PixArt's default grows with sample_size; flowfleet's grid is 0..n-1
    }


# flowfleet name -> PixArt name, for the tensors that are the same tensor (per block: "{i}" filled in)
_GLOBAL = {
    "x_embedder.proj.weight": "pos_embed.proj.weight",
    "x_embedder.proj.bias": "pos_embed.proj.bias",
    "t_embedder.mlp.0.weight": "adaln_single.emb.timestep_embedder.linear_1.weight",
    "t_embedder.mlp.0.bias": "adaln_single.emb.timestep_embedder.linear_1.bias",
    "t_embedder.mlp.2.weight": "adaln_single.emb.timestep_embedder.linear_2.weight",
    "t_embedder.mlp.2.bias": "adaln_single.emb.timestep_embedder.linear_2.bias",
    "t_block.1.weight": "adaln_single.linear.weight",
    "t_block.1.bias": "adaln_single.linear.bias",
    "text_projector.proj.0.weight": "caption_projection.linear_1.weight",
    "text_projector.proj.0.bias": "caption_projection.linear_1.bias",
    "text_projector.proj.2.weight": "caption_projection.linear_2.weight",
    "text_projector.proj.2.bias": "caption_projection.linear_2.bias",
    "final_layer.scale_shift_table": "scale_shift_table",
    "final_layer.linear.weight": "proj_out.weight",
    "final_layer.linear.bias": "proj_out.bias",
}
_BLOCK = {
    "scale_shift_table": "scale_shift_table",
    "attn.proj.weight": "attn1.to_out.0.weight",
    "attn.proj.bias": "attn1.to_out.0.bias",
    "cross_attn.q.weight": "attn2.to_q.weight",
    "cross_attn.q.bias": "attn2.to_q.bias",
    "cross_attn.proj.weight": "attn2.to_out.0.weight",
    "cross_attn.proj.bias": "attn2.to_out.0.bias",
    "mlp.fc1.weight": "ff.net.0.proj.weight",
    "mlp.fc1.bias": "ff.net.0.proj.bias",
    "mlp.fc2.weight": "ff.net.2.weight",
    "mlp.fc2.bias": "ff.net.2.bias",
}
# fused flowfleet tensors -> the PixArt tensors they hold, in order along dim 0
_FUSED = {
    "attn.qkv": ("attn1.to_q", "attn1.to_k", "attn1.to_v"),
    "cross_attn.kv": ("attn2.to_k", "attn2.to_v"),
}


def to_pixart(cfg: DiTConfig, state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """An expert's state dict -> (PixArt's state dict, the null text sequence [L, T] for negative prompts)."""
    check_exportable(cfg)
    out = {theirs: state[ours] for ours, theirs in _GLOBAL.items()}
    for i in range(cfg.depth):
        for ours, theirs in _BLOCK.items():
            out[f"transformer_blocks.{i}.{theirs}"] = state[f"blocks.{i}.{ours}"]
        for ours, parts in _FUSED.items():
            for kind in ("weight", "bias"):
                chunks = state[f"blocks.{i}.{ours}.{kind}"].chunk(len(parts), dim=0)
                for part, chunk in zip(parts, chunks):
                    out[f"transformer_blocks.{i}.{part}.{kind}"] = chunk.contiguous()
    return out, state["text_projector.null"]


def from_pixart(config: dict[str, Any], state: dict[str, torch.Tensor], text_len: int) -> tuple[dict[str, Any], dict]:
    """A PixArtTransformer2DModel (its config.json and state dict) -> (the DiTConfig fields of the expert that
    computes the same function, its state dict without the null text sequence, which PixArt lacks)."""
    for name, value in (("norm_type", "ada_norm_single"), ("use_additional_conditions", False)):
        if config.get(name, value) != value:
            raise FlowfleetError(f"{PIXART_CLASS} config {name} is {config.get(name)!r}; flowfleet imports {value!r}")
    heads, head_dim = config["num_attention_heads"], config["attention_head_dim"]
    fields = {
        "input_size": (config["sample_size"], config["sample_size"]),
        "in_channels": config["in_channels"],
        "out_channels": config.get("out_channels") or config["in_channels"],
        "patch_size": config["patch_size"],
        "hidden_size": heads * head_dim,
        "depth": config["num_layers"],
        "num_heads": heads,
        "mlp_ratio": 4.0,
        "adaln": "single",
        "conditioning": "cross_attn",
        "text_dim": config["caption_channels"],
        "text_len": text_len,
        "add_pooled": False,
        "cross_norm": False,
    }
    ours: dict[str, torch.Tensor] = {mine: state[theirs] for mine, theirs in _GLOBAL.items()}
    for i in range(config["num_layers"]):
        for mine, theirs in _BLOCK.items():
            ours[f"blocks.{i}.{mine}"] = state[f"transformer_blocks.{i}.{theirs}"]
        for mine, parts in _FUSED.items():
            for kind in ("weight", "bias"):
                ours[f"blocks.{i}.{mine}.{kind}"] = torch.cat(
                    [state[f"transformer_blocks.{i}.{p}.{kind}"] for p in parts]
                )
    return fields, ours


def load_pixart_into(model: torch.nn.Module, cfg: DiTConfig, folder: str) -> None:
    """Copy a PixArtTransformer2DModel folder's weights into `model` (an expert of config `cfg`); one line
    naming the field when the folder's transformer has another architecture. The expert keeps its own
    initial null text (PixArt has none)."""
    root = RunRoot(folder)
    try:
        config = root.read_json("config.json")
        state = safetensors.torch.load(root.read_bytes(WEIGHTS_NAME))
    except (OSError, ValueError) as err:
        why = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise FlowfleetError(f"expert_init {root.url}: not a {PIXART_CLASS} folder ({why})") from None
    fields, ours = from_pixart(config, state, cfg.text_len)
    for name, value in fields.items():
        mine: Any = cfg.out_ch if name == "out_channels" else getattr(cfg, name)  # (None: in_channels)
        if isinstance(value, tuple):
            mine = tuple(mine)
        if mine != value:
            raise FlowfleetError(f"expert_init {root.url}: {name} is {value!r}, run.yaml expert.{name} is {mine!r}")
    missing, unexpected = model.load_state_dict(ours, strict=False)
    missing = [key for key in missing if not key.startswith("repa_projector.")]  # (REPA's, trained from scratch)
    if unexpected or set(missing) != {"text_projector.null"}:
        odd = (missing + unexpected)[:3]
        raise FlowfleetError(f"expert_init {root.url}: its weights do not map onto the expert ({odd})")
