"""The Diffusion Transformer shared by experts and routers (DiT reference model, Peebles & Xie).

Deliberate differences from facebookresearch/DiT, each optional except the first:
  * no learned sigma by default (out_channels = in_channels, a velocity); set out_channels = 2C for the
    paper's learned-sigma head (used to check parameter counts);
  * non-square latents: the position grid is (H/p) x (W/p);
  * conditioning: class labels (DiT), a pooled text vector added to the timestep embedding, or
    cross-attention to text tokens between self-attention and MLP (paris §2.4.2, PixArt-alpha);
  * adaLN-single (PixArt-alpha, paris §2.4.3): one global t-MLP plus a learned [6, D] table per block.
    The global MLP's output layer and the gate rows of the tables start at zero so every block is the
    identity at initialisation, in the spirit of adaLN-Zero (PixArt starts both random);
  * num_outputs > 0 replaces the final layer by a classification head (the router, paris §2.5);
  * objective "ddpm": the network predicts DiT's noise on a VP schedule (learned sigma optional, its half
    ignored); `forward` still takes flowfleet's (x_t, t) and returns the velocity, converting at the VP step of
    the same SNR (flowfleet.flow.path). Training passes the VP state and step through (`forward(raw=True)`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.modeling_utils import ModelMixin
from torch import nn
from typing_extensions import Self

from flowfleet.flow.path import (
    TIME_CONVENTION,
    embedder_timestep,
    velocity_from_eps,
    vp_input_scale,
    vp_log_snr,
    vp_timestep,
)
from flowfleet.models.config import REPA_HIDDEN, DiTConfig
from flowfleet.models.embeddings import (
    LabelEmbedder,
    PatchEmbed,
    PooledTextEmbedder,
    TextTokenProjector,
    TimestepEmbedder,
    sincos_2d,
)
from flowfleet.models.layers import ClassifierHead, DiTBlock, FinalLayer, linear_at, projector, zero_


class DiTModel(ModelMixin, ConfigMixin):
    """x_t [B, C, H, W], t [B] in [0, 1], condition -> velocity [B, C, H, W] (or logits [B, K]).

    Condition keywords: `labels` [B] (class), `text_pooled` [B, T] (pooled), `text_tokens` [B, L, T] and
    `text_mask` [B, L] (cross_attn). `drop` [B] bool replaces the condition by the null condition
    (classifier-free guidance). `augment` [B, augment_dim]: the augmentation of each training item (models
    with augment_dim > 0; none at sampling).
    """

    config_name = "config.json"  # type: ignore[assignment]  # diffusers declares it None, subclasses set it
    _supports_gradient_checkpointing = False

    @register_to_config
    def __init__(
        self,
        size: str | None = None,
        input_size: tuple[int, int] = (32, 32),
        in_channels: int = 4,
        out_channels: int | None = None,
        patch_size: int | None = None,  # None: from `size`, else 2
        hidden_size: int | None = None,  # None: from `size`, else 384
        depth: int | None = None,  # None: from `size`, else 12
        num_heads: int | None = None,  # None: from `size`, else 6
        mlp_ratio: float = 4.0,
        mlp_act: str = "gelu_tanh",
        adaln: str = "zero",
        conditioning: str = "none",
        num_classes: int = 0,
        text_dim: int = 0,
        text_len: int = 0,
        add_pooled: bool = False,
        cross_norm: bool = True,
        cond_dropout: float = 0.1,
        dropout: float = 0.0,
        augment_dim: int = 0,
        num_outputs: int = 0,
        repa_dim: int = 0,
        objective: str = "fm",
        schedule: str | None = None,
        time_convention: str = TIME_CONVENTION,
    ):
        super().__init__()
        # One way to build a model: DiTConfig resolves `size` and refuses fields that contradict it.
        shape = {"patch_size": patch_size, "hidden_size": hidden_size, "depth": depth, "num_heads": num_heads}
        cfg = DiTConfig(
            size=size,
            input_size=tuple(input_size),
            in_channels=in_channels,
            out_channels=out_channels,
            **{name: v for name, v in shape.items() if v is not None},
            mlp_ratio=mlp_ratio,
            mlp_act=mlp_act,
            adaln=adaln,
            conditioning=conditioning,
            num_classes=num_classes,
            text_dim=text_dim,
            text_len=text_len,
            add_pooled=add_pooled,
            cross_norm=cross_norm,
            cond_dropout=cond_dropout,
            dropout=dropout,
            augment_dim=augment_dim,
            num_outputs=num_outputs,
            repa_dim=repa_dim,
            objective=objective,
            schedule=schedule,
            time_convention=time_convention,
        )
        self.register_to_config(**{name: getattr(cfg, name) for name in shape})  # config.json: resolved values
        self.cfg = cfg
        self._build_layers(cfg)
        self.initialize_weights()

    def _build_layers(self, cfg: DiTConfig) -> None:
        """The embedders, the blocks and the output of `cfg` (DiT's: patch, time, fixed 2-D sin-cos positions, a
        condition embedder per conditioning; a classifier head for a router)."""
        d = cfg.hidden_size
        gh, gw = cfg.grid_size

        self.x_embedder = PatchEmbed(cfg.in_channels, d, cfg.patch_size)
        self.t_embedder = TimestepEmbedder(d)
        self.register_buffer("pos_embed", sincos_2d(d, gh, gw)[None], persistent=False)  # [1, N, D] fixed
        self.y_embedder = LabelEmbedder(cfg.num_classes, d) if cfg.conditioning == "class" else None
        use_pooled = cfg.conditioning == "pooled" or (cfg.conditioning == "cross_attn" and cfg.add_pooled)
        self.pooled_embedder = PooledTextEmbedder(cfg.text_dim, d) if use_pooled else None
        cross = cfg.conditioning == "cross_attn"
        self.text_projector = TextTokenProjector(cfg.text_dim, cfg.text_len, d) if cross else None
        # EDM's augmentation mapping: no bias, so parameters of zero (or none given) add nothing
        self.augment_embedder = nn.Linear(cfg.augment_dim, d, bias=False) if cfg.augment_dim else None
        # adaLN-single: one global MLP from c to all six modulation chunks.
        self.t_block = nn.Sequential(nn.SiLU(), nn.Linear(d, 6 * d)) if cfg.adaln == "single" else None

        self.blocks = nn.ModuleList(
            [
                DiTBlock(d, cfg.num_heads, cfg.mlp_ratio, cfg.adaln, cross, cfg.cross_norm, cfg.mlp_act, cfg.dropout)
                for _ in range(cfg.depth)
            ]
        )
        self.head: ClassifierHead | None
        self.final_layer: FinalLayer | None
        if cfg.num_outputs:
            self.head = ClassifierHead(d, cfg.num_outputs)
            self.final_layer = None
        else:
            self.head = None
            self.final_layer = FinalLayer(d, cfg.patch_size, cfg.out_ch, cfg.adaln)
        self.repa_projector = projector(d, REPA_HIDDEN * d, cfg.repa_dim) if cfg.repa_dim else None  # training only
        # a ddpm model's log SNR per VP step (float64 [1000], kept off the module's dtype and state dict)
        self.vp_table = vp_log_snr(cfg.schedule) if cfg.objective == "ddpm" and cfg.schedule else None

    @classmethod
    def from_dit_config(cls, cfg: DiTConfig) -> Self:
        return cls(**cfg.model_dump())

    # ----------------------------------------------------------------------------------------------
    #                                     Initialisation
    # ----------------------------------------------------------------------------------------------

    def initialize_weights(self) -> None:
        def _basic_init(module: nn.Module) -> None:
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

        self.apply(_basic_init)
        proj = self.x_embedder.proj  # like nn.Linear: xavier on the flattened kernel, zero bias
        nn.init.xavier_uniform_(proj.weight.view(proj.weight.shape[0], -1))
        if proj.bias is not None:
            nn.init.zeros_(proj.bias)
        if self.y_embedder is not None:
            nn.init.normal_(self.y_embedder.embedding_table.weight, std=0.02)
        nn.init.normal_(linear_at(self.t_embedder.mlp, 0).weight, std=0.02)
        nn.init.normal_(linear_at(self.t_embedder.mlp, 2).weight, std=0.02)
        if self.t_block is not None:  # zero like adaLN-Zero's per-block MLPs (PixArt: normal 0.02)
            zero_(linear_at(self.t_block, 1))
        for block in self.dit_blocks:
            if self.cfg.adaln == "zero":
                zero_(linear_at(block.adaLN_modulation, -1))
            else:
                nn.init.normal_(block.scale_shift_table, std=self.cfg.hidden_size**-0.5)
                with torch.no_grad():
                    block.scale_shift_table[[2, 5]] = 0.0  # gates: identity blocks at init
            if block.cross_attn is not None:
                zero_(block.cross_attn.proj)
        if self.final_layer is not None:
            if self.cfg.adaln == "zero":
                zero_(linear_at(self.final_layer.adaLN_modulation, -1))
            zero_(self.final_layer.linear)
        if self.head is not None:
            zero_(linear_at(self.head.adaLN_modulation, -1))

    @property
    def dit_blocks(self) -> list[DiTBlock]:
        """self.blocks, typed (iterating an nn.ModuleList is typed as yielding any Module)."""
        return [block for block in self.blocks if isinstance(block, DiTBlock)]

    # ----------------------------------------------------------------------------------------------
    #                                        Forward
    # ----------------------------------------------------------------------------------------------

    def network_input(self, x: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """flowfleet's (x_t [B, C, H, W], t [B]) -> what the network reads: its input and its embedder's timestep
        (1000 t; a ddpm model: the VP state and step of the same SNR, flowfleet.flow.path)."""
        if self.vp_table is None:
            return x, embedder_timestep(t)
        table = self._vp_table_on(x.device)
        scale = vp_input_scale(t.to(torch.float64)).to(x.dtype).reshape(-1, *([1] * (x.ndim - 1)))
        return x * scale, vp_timestep(t, table).float()

    def output_velocity(self, out: torch.Tensor, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """The network's output [B, out_ch, H, W] at (x_t, t) as the velocity: as it is, or a ddpm model's noise
        (its first C channels; a learned sigma's half is dropped) converted."""
        if self.vp_table is None:
            return out
        eps = out[:, : self.cfg.in_channels]
        return velocity_from_eps(eps, x, t, self._vp_table_on(x.device))

    def _vp_table_on(self, device: torch.device) -> torch.Tensor:
        """The ddpm table on `device`, moved once (not a buffer: module.to(dtype) would round it)."""
        assert self.vp_table is not None
        if self.vp_table.device != device:
            self.vp_table = self.vp_table.to(device)
        return self.vp_table

    def conditioning(
        self,
        emb_t: torch.Tensor,
        labels=None,
        text_pooled=None,
        text_tokens=None,
        text_mask=None,
        drop=None,
        augment=None,
    ):
        """emb_t [B]: the embedder's timestep (network_input) -> c [B, D] (timestep + global condition), block
        modulation input, cross-attn context and mask."""
        c = self.t_embedder(emb_t)  # [B, D]
        if self.augment_embedder is not None and augment is not None:
            c = c + self.augment_embedder(augment.to(c.dtype))  # [B, D]; not dropped with the condition
        if self.y_embedder is not None:
            c = c + self.y_embedder(labels, drop)  # [B, D]
        if self.pooled_embedder is not None:
            c = c + self.pooled_embedder(text_pooled, drop)  # [B, D]
        ctx = ctx_mask = None
        if self.text_projector is not None:
            ctx, ctx_mask = self.text_projector(text_tokens, text_mask, drop)  # [B, L, D], [B, L]
        block_c = self.t_block(c) if self.t_block is not None else c  # [B, 6D] or [B, D]
        return c, block_c, ctx, ctx_mask

    def unpatchify(self, x: torch.Tensor, grid_h: int) -> torch.Tensor:
        """[B, gh*gw, p*p*C] -> [B, C, gh*p, gw*p]."""
        p, ch = self.cfg.patch_size, self.cfg.out_ch
        b, n, _ = x.shape
        grid_w = n // grid_h
        x = x.reshape(b, grid_h, grid_w, p, p, ch)
        x = torch.einsum("nhwpqc->nchpwq", x)
        return x.reshape(b, ch, grid_h * p, grid_w * p)

    def forward(self, x: torch.Tensor, t: torch.Tensor, raw: bool = False, **cond: Any) -> torch.Tensor:
        """x_t [B, C, H, W] and t [B] in flowfleet's convention, the condition keywords of `network` -> the
        velocity [B, C, H, W] (or logits [B, K]). raw: x and t are the network's own input and embedder timestep
        (a ddpm model's VP state and step, as it trains) and the output is the network's (its noise): through
        forward, so that a DistributedDataParallel wrapper sees the call."""
        if x.shape[-2:] != tuple(self.cfg.input_size) or x.shape[1] != self.cfg.in_channels:
            raise ValueError(
                f"input of shape {tuple(x.shape[1:])} does not match the model's "
                f"({self.cfg.in_channels}, {self.cfg.input_size[0]}, {self.cfg.input_size[1]})"
            )
        t = torch.as_tensor(t, device=x.device, dtype=torch.float32).expand(x.shape[0])
        if raw:
            return self.network(x, t, **cond)
        x_in, emb_t = self.network_input(x, t)
        out = self.network(x_in, emb_t, **cond)
        return out if self.head is not None else self.output_velocity(out, x, t)

    def network(self, x: torch.Tensor, emb_t: torch.Tensor, **cond: Any) -> torch.Tensor:
        """The transformer itself: its input [B, C, H, W], embedder timestep [B] and condition keywords
        (`conditioning`'s) -> its raw output [B, out_ch, H, W] (a velocity, or a ddpm model's noise) or logits."""
        h = self.x_embedder(x) + self.pos_embed.to(x.dtype)  # [B, N, D]
        c, block_c, ctx, ctx_mask = self.conditioning(emb_t, **cond)
        for block in self.blocks:
            h = block(h, block_c, ctx, ctx_mask)  # [B, N, D]
        if self.head is not None:
            return self.head(h, c)  # [B, K]
        assert self.final_layer is not None  # exactly one of head / final_layer exists
        h = self.final_layer(h, c)  # [B, N, p*p*C]
        return self.unpatchify(h, self.cfg.grid_size[0])  # [B, out_ch, H, W]


@contextlib.contextmanager
def block_output(model: DiTModel, index: int) -> Iterator[list[torch.Tensor]]:
    """Within the block, the hidden tokens [B, N, D] that the model's block `index` (negative: from the last) outputs
    at each forward are appended to the list it yields: a regulariser of the representation reads them."""
    kept: list[torch.Tensor] = []
    handle = model.dit_blocks[index].register_forward_hook(lambda module, args, out: kept.append(out))
    try:
        yield kept
    finally:
        handle.remove()


class DiTExpert(DiTModel):
    """An expert: a DiT predicting the flow-matching velocity of its own data partition."""


class DiTRouter(DiTModel):
    """The router: a DiT trunk without text and a K-way head, p(k | x_t, t) (paris §2.5)."""
