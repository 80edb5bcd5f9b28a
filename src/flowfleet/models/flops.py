"""Analytic FLOP counts of the DiT (per sample), for benchmarks and `train-monolith --match-compute`, and its
parameter count from a config alone (flowfleet admit bounds a stranger's config.json by it).

Counted like torch.utils.flop_counter / the DiT paper: 2 FLOPs per multiply-add of every matrix
product (linear layers, the patch-embedding convolution, attention's QK^T and AV products);
elementwise work (norms, activations, softmax, modulation) is left out. A training step costs about
three forwards (the backward pass computes gradients for activations and weights, ~2 forwards).

Written by hand because the count must be known from a DiTConfig alone (no model, no tracing), e.g.
to size the monolith from the experts' configs; tests check it against FlopCounterMode exactly.
"""

from __future__ import annotations

from flowfleet.models.config import REPA_HIDDEN, DiTConfig

TIMESTEP_FREQUENCIES = 256  # width of the sinusoid fed to the timestep MLP (models.embeddings)
TRAIN_FORWARD_MULTIPLE = 3  # forward + backward (~2x forward)


def _linear(rows: int, fan_in: int, fan_out: int) -> int:
    """FLOPs of rows x [fan_in -> fan_out]."""
    return 2 * rows * fan_in * fan_out


def block_flops(cfg: DiTConfig) -> int:
    """One DiTBlock's forward FLOPs for one sample."""
    d, n, lt = cfg.hidden_size, cfg.num_tokens, cfg.text_len
    mlp_hidden = int(d * cfg.mlp_ratio)
    flops = 0
    if cfg.adaln == "zero":
        flops += _linear(1, d, 6 * d)  # adaLN modulation from c
    flops += _linear(n, d, 3 * d)  # qkv
    flops += 2 * (2 * n * n * d)  # QK^T and AV over all heads
    flops += _linear(n, d, d)  # attention output projection
    if cfg.conditioning == "cross_attn":
        flops += _linear(n, d, d) + _linear(lt, d, 2 * d)  # q from image tokens, k/v from text tokens
        flops += 2 * (2 * n * lt * d)  # QK^T and AV against the text
        flops += _linear(n, d, d)  # output projection
    flops += _linear(n, d, mlp_hidden) + _linear(n, mlp_hidden, d)  # MLP
    return flops


def forward_flops(cfg: DiTConfig) -> int:
    """FLOPs of one forward pass of DiTModel(cfg) for one sample."""
    d, n, p = cfg.hidden_size, cfg.num_tokens, cfg.patch_size
    flops = _linear(n, cfg.in_channels * p * p, d)  # patch embedding (a strided conv = a linear per patch)
    flops += _linear(1, TIMESTEP_FREQUENCIES, d) + _linear(1, d, d)  # timestep MLP
    if cfg.conditioning == "pooled" or (cfg.conditioning == "cross_attn" and cfg.add_pooled):
        flops += _linear(1, cfg.text_dim, d) + _linear(1, d, d)  # pooled-text MLP
    if cfg.conditioning == "cross_attn":
        flops += _linear(cfg.text_len, cfg.text_dim, d) + _linear(cfg.text_len, d, d)  # token projector
    if cfg.adaln == "single":
        flops += _linear(1, d, 6 * d)  # the global t-block
    flops += cfg.depth * block_flops(cfg)
    if cfg.num_outputs:
        flops += _linear(1, d, 2 * d) + _linear(1, d, cfg.num_outputs)  # classifier head
    else:
        if cfg.adaln == "zero":
            flops += _linear(1, d, 2 * d)  # final adaLN
        flops += _linear(n, d, p * p * cfg.out_ch)  # final linear to patches
    return flops


def projector_flops(cfg: DiTConfig) -> int:
    """FLOPs of REPA's projector over one sample's tokens (a training forward's only: sampling never runs it)."""
    if not cfg.repa_dim:
        return 0
    d, n, h = cfg.hidden_size, cfg.num_tokens, REPA_HIDDEN * cfg.hidden_size
    return _linear(n, d, h) + _linear(n, h, h) + _linear(n, h, cfg.repa_dim)


def train_flops_per_sample(cfg: DiTConfig) -> int:
    """Approximate FLOPs of one training sample (forward + backward), REPA's projector included."""
    return TRAIN_FORWARD_MULTIPLE * (forward_flops(cfg) + projector_flops(cfg))


def train_flops(cfg: DiTConfig, steps: int, batch_size: int) -> int:
    """Approximate FLOPs of a whole training run of `steps` optimiser steps of `batch_size` samples."""
    return train_flops_per_sample(cfg) * steps * batch_size


def _linear_params(fan_in: int, fan_out: int, bias: bool = True) -> int:
    return fan_in * fan_out + (fan_out if bias else 0)


def parameter_count(cfg: DiTConfig) -> int:
    """DiTModel(cfg)'s parameters from the config's numbers alone: no module is built, so a stranger's config.json
    (flowfleet admit) is bounded by it before anything is allocated, whatever its depth or width. Tests check it
    against the built model's own count."""
    d, p = cfg.hidden_size, cfg.patch_size
    mlp = int(d * cfg.mlp_ratio)
    cross = cfg.conditioning == "cross_attn"
    total = cfg.in_channels * p * p * d + d  # patch embedding (a strided convolution)
    total += _linear_params(TIMESTEP_FREQUENCIES, d) + _linear_params(d, d)  # timestep MLP
    if cfg.conditioning == "class":
        total += (cfg.num_classes + 1) * d  # label table with its null class
    if cfg.conditioning == "pooled" or (cross and cfg.add_pooled):
        total += cfg.text_dim + _linear_params(cfg.text_dim, d) + _linear_params(d, d)  # null vector + MLP
    if cross:
        total += cfg.text_len * cfg.text_dim + _linear_params(cfg.text_dim, d) + _linear_params(d, d)  # null + MLP
    total += cfg.augment_dim * d  # the augmentation's mapping (no bias)
    if cfg.adaln == "single":
        total += _linear_params(d, 6 * d)  # the global t-block
    block = _linear_params(d, 3 * d) + _linear_params(d, d) + _linear_params(d, mlp) + _linear_params(mlp, d)
    block += _linear_params(d, 6 * d) if cfg.adaln == "zero" else 6 * d  # per-block modulation or its table
    if cross:
        block += _linear_params(d, d) + _linear_params(d, 2 * d) + _linear_params(d, d)  # q, kv, output
        block += 2 * d if cfg.cross_norm else 0  # the queries' LayerNorm
    total += cfg.depth * block
    h = REPA_HIDDEN * d
    total += _linear_params(d, h) + _linear_params(h, h) + _linear_params(h, cfg.repa_dim) if cfg.repa_dim else 0
    if cfg.num_outputs:
        return total + _linear_params(d, 2 * d) + _linear_params(d, cfg.num_outputs)  # the router's head
    total += _linear_params(d, p * p * cfg.out_ch)  # final linear to patches
    return total + (_linear_params(d, 2 * d) if cfg.adaln == "zero" else 2 * d)  # final modulation
