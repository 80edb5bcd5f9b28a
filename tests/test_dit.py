"""DiT backbone: reference parameter counts, identity blocks at init, embedding orders, options."""

from __future__ import annotations

import math

import pytest
import torch
from fixtures.tolerances import gamma, net_tol, unit_roundoff

from flowfleet.models.config import DiTConfig
from flowfleet.models.dit import DiTExpert, DiTModel, DiTRouter
from flowfleet.models.embeddings import sincos_1d, sincos_2d, timestep_sinusoid


def _model(**kw) -> DiTModel:
    base = dict(size="tiny", patch_size=2, input_size=(8, 8), in_channels=3)  # "tiny": patch size free
    base.update(kw)
    return DiTModel.from_dit_config(DiTConfig(**base))


def _tol(model: DiTModel, ref: torch.Tensor) -> float:
    """Two evaluations of `model` equal in exact arithmetic (another batch around the same sample, masked
    inputs that carry zero weight): its longest reduction (the MLP's hidden width) over its layers (patch
    embedding, attention and MLP per block, the final layer)."""
    return net_tol(ref, int(model.cfg.hidden_size * model.cfg.mlp_ratio), 2 * model.cfg.depth + 2)


def _randomize(model: torch.nn.Module, seed: int = 1) -> None:
    """Perturb every parameter so zero-initialised paths become active."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))


# ------------------------------------------------------------------------------------------------
# Reference drift: DiT paper parameter counts (class-conditional, learned sigma, 32x32x4 latents)
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("size, millions", [("S/2", 33), ("B/2", 130), ("L/2", 458), ("XL/2", 675)])
def test_parameter_counts_match_dit_paper(size, millions):
    cfg = DiTConfig(
        size=size, input_size=(32, 32), in_channels=4, out_channels=8, conditioning="class", num_classes=1000
    )
    with torch.device("meta"):
        model = DiTModel.from_dit_config(cfg)
    n = sum(p.numel() for p in model.parameters())
    assert abs(n / 1e6 - millions) / millions < 0.01, f"{size}: {n / 1e6:.2f}M vs {millions}M"


def test_size_presets_fill_architecture():
    cfg = DiTConfig(size="XL/2")
    assert (cfg.depth, cfg.hidden_size, cfg.num_heads, cfg.patch_size) == (28, 1152, 16, 2)
    cfg = DiTConfig(size="B/4", input_size=(32, 32))
    assert (cfg.depth, cfg.hidden_size, cfg.num_heads, cfg.patch_size) == (12, 768, 12, 4)
    with pytest.raises(ValueError, match="unknown DiT size"):
        DiTConfig(size="Q/2")


# ------------------------------------------------------------------------------------------------
# Initialisation
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("adaln", ["zero", "single"])
@pytest.mark.parametrize("conditioning", ["none", "class", "pooled", "cross_attn"])
def test_every_block_is_identity_at_init(adaln, conditioning):
    model = _model(adaln=adaln, conditioning=conditioning, num_classes=5, text_dim=12, text_len=4)
    b = 3
    x = torch.randn(b, 3, 8, 8)
    t = torch.rand(b)
    kw = dict(labels=torch.tensor([0, 1, 2]), text_pooled=torch.randn(b, 12), text_tokens=torch.randn(b, 4, 12))
    _, block_c, ctx, mask = model.conditioning(t, **{k: v for k, v in kw.items()})
    h = torch.randn(b, model.cfg.num_tokens, model.cfg.hidden_size)
    for block in model.blocks:
        assert torch.equal(block(h, block_c, ctx, mask), h)
    # zero-initialised final layer: the whole network outputs zeros
    assert torch.count_nonzero(model(x, t, **kw)) == 0


def test_linear_layers_are_xavier_and_pos_embed_fixed():
    model = _model()
    w = model.blocks[0].mlp.fc1.weight
    bound = math.sqrt(6.0 / (w.shape[0] + w.shape[1]))
    assert w.abs().max() <= bound and w.abs().max() > 0.5 * bound
    assert "pos_embed" not in dict(model.named_parameters())
    assert torch.equal(model.pos_embed[0], sincos_2d(model.cfg.hidden_size, 4, 4))


# ------------------------------------------------------------------------------------------------
# Embedding orders
# ------------------------------------------------------------------------------------------------


def test_timestep_embedding_is_cos_then_sin():
    t = torch.tensor([0.0, 3.0])
    emb = timestep_sinusoid(t, 256)
    assert emb.shape == (2, 256)
    assert torch.equal(emb[0, :128], torch.ones(128)) and torch.equal(emb[0, 128:], torch.zeros(128))  # exact
    freqs = torch.exp(-math.log(10000) * torch.arange(128) / 128)
    # Each side: exp within 1 ulp (2u relative) and the product t * f (u) -> |argument error| <= 3u * 3.0;
    # cos/sin within 1 ulp of a value <= 1 (2u). Two such sides differ by at most twice that.
    tol = 2 * (3 * 3.0 + 2) * unit_roundoff(torch.float32)
    assert torch.allclose(emb[1, :128], torch.cos(3.0 * freqs), atol=tol, rtol=0)
    assert torch.allclose(emb[1, 128:], torch.sin(3.0 * freqs), atol=tol, rtol=0)


def test_position_embedding_is_sin_then_cos_column_then_row():
    d = 16
    one = sincos_1d(8, torch.tensor([0.0, 1.0]))
    assert torch.equal(one[0], torch.cat([torch.zeros(4), torch.ones(4)]).double())  # sin 0, cos 0: exact
    # float64 on both sides, the first frequency is 1 (exact): sin/cos of 1.0 within a few ulps each
    one_rad = torch.tensor(1.0, dtype=torch.float64)
    assert torch.allclose(one[1, 0], torch.sin(one_rad), atol=gamma(4), rtol=0)
    assert torch.allclose(one[1, 4], torch.cos(one_rad), atol=gamma(4), rtol=0)
    pe = sincos_2d(d, grid_h=2, grid_w=3)  # row-major tokens: index = row * 3 + col
    assert pe.shape == (6, d)
    # moving one column changes only the first half; moving one row only the second half
    # the unchanged half is the same function of the same coordinate: bit-identical
    assert not torch.allclose(pe[1, :8], pe[0, :8]) and torch.equal(pe[1, 8:], pe[0, 8:])
    assert torch.equal(pe[3, :8], pe[0, :8]) and not torch.allclose(pe[3, 8:], pe[0, 8:])


# ------------------------------------------------------------------------------------------------
# Options and shapes
# ------------------------------------------------------------------------------------------------


def test_non_square_latents():
    model = _model(input_size=(8, 16), patch_size=4)
    _randomize(model)
    out = model(torch.randn(2, 3, 8, 16), torch.rand(2))
    assert out.shape == (2, 3, 8, 16)
    assert model.pos_embed.shape == (1, 2 * 4, model.cfg.hidden_size)


def test_wrong_input_shape_is_refused():
    model = _model()
    with pytest.raises(ValueError, match="does not match"):
        model(torch.randn(1, 3, 16, 16), torch.rand(1))


def test_router_outputs_logits_over_k():
    router = DiTRouter.from_dit_config(DiTConfig(size="tiny/2", input_size=(8, 8), in_channels=1, num_outputs=5))
    assert router(torch.randn(4, 1, 8, 8), torch.rand(4)).shape == (4, 5)


def test_adaln_single_has_fewer_parameters():
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert count(_model(adaln="single")) < count(_model(adaln="zero"))


@pytest.mark.parametrize("conditioning", ["class", "pooled", "cross_attn"])
def test_dropped_condition_ignores_the_condition(conditioning):
    model = _model(conditioning=conditioning, num_classes=5, text_dim=12, text_len=4)
    _randomize(model)
    x, t = torch.randn(2, 3, 8, 8), torch.rand(2)
    a = dict(labels=torch.tensor([0, 1]), text_pooled=torch.randn(2, 12), text_tokens=torch.randn(2, 4, 12))
    b = dict(labels=torch.tensor([3, 4]), text_pooled=torch.randn(2, 12), text_tokens=torch.randn(2, 4, 12))
    drop = torch.tensor([True, True])
    # dropped: the null condition replaces a and b before the network, so the same inputs -> the same bits
    assert torch.equal(model(x, t, **a, drop=drop), model(x, t, **b, drop=drop))
    assert not torch.allclose(model(x, t, **a), model(x, t, **b))
    # dropping only sample 1 leaves sample 0 as conditioned (another batch around it: rounding only)
    mixed = model(x, t, **a, drop=torch.tensor([False, True]))
    ref = model(x, t, **a)[0]
    assert torch.allclose(mixed[0], ref, atol=_tol(model, ref), rtol=0)


def test_dropout_acts_in_training_only():
    plain, dropped = _model(), _model(dropout=0.5)
    _randomize(plain)
    dropped.load_state_dict(plain.state_dict())  # dropout adds no parameters
    x, t = torch.randn(2, 3, 8, 8), torch.rand(2)
    with torch.no_grad():
        # eval(): nn.Dropout is the identity, so the same weights give the same bits
        assert torch.equal(dropped.eval()(x, t), plain.eval()(x, t))
        dropped.train()
        torch.manual_seed(0)
        a = dropped(x, t)
        torch.manual_seed(0)
        assert torch.equal(a, dropped(x, t))  # the masks come from torch's generator (checkpointed on resume)
        assert not torch.allclose(a, dropped(x, t))  # another mask
        assert not torch.allclose(a, plain.eval()(x, t))
    assert DiTConfig(size="tiny", dropout=0.1).dropout == 0.1
    with pytest.raises(ValueError, match="dropout"):
        DiTConfig(size="tiny", dropout=1.0)


def test_cross_attention_respects_text_mask():
    model = _model(conditioning="cross_attn", text_dim=12, text_len=4)
    _randomize(model)
    x, t = torch.randn(1, 3, 8, 8), torch.rand(1)
    tokens = torch.randn(1, 4, 12)
    mask = torch.tensor([[True, True, False, False]])
    other = tokens.clone()
    other[:, 2:] = torch.randn(1, 2, 12)
    ref = model(x, t, text_tokens=tokens, text_mask=mask)
    assert torch.allclose(ref, model(x, t, text_tokens=other, text_mask=mask), atol=_tol(model, ref), rtol=0)
    assert not torch.allclose(model(x, t, text_tokens=tokens), model(x, t, text_tokens=other))


def test_expert_is_a_dit_model():
    expert = DiTExpert.from_dit_config(DiTConfig(size="tiny/2", input_size=(8, 8), in_channels=1))
    assert isinstance(expert, DiTModel)


@pytest.mark.parametrize(
    "bad, field",
    [
        (dict(input_size=(9, 8)), "input_size"),
        (dict(hidden_size=130, num_heads=4), "hidden_size"),
        (dict(conditioning="class", num_classes=0), "num_classes"),
        (dict(conditioning="cross_attn", text_dim=8, text_len=0), "text_len"),
        (dict(time_convention="x_t=t*x0+(1-t)*eps"), "time_convention"),
    ],
)
def test_invalid_configs_name_the_field(bad, field):
    with pytest.raises(ValueError, match=field):
        DiTConfig(**{**dict(size="tiny/2", input_size=(8, 8)), **bad})


def test_size_builds_that_size_and_contradicting_fields_are_refused(tmp_path):
    from pydantic import ValidationError

    from flowfleet.models.dit import DiTModel
    from flowfleet.models.files import read_dit_config, save_model

    model = DiTModel(size="B/4", input_size=(32, 32))
    assert (model.cfg.depth, model.cfg.hidden_size, model.cfg.num_heads, model.cfg.patch_size) == (12, 768, 12, 4)
    small = DiTModel(size="tiny/4", input_size=(8, 8))  # the same config.json round trip, without 0.5 GB of weights
    save_model(small, str(tmp_path), "m")
    assert read_dit_config(str(tmp_path), "m") == small.cfg and small.cfg.size == "tiny/4"  # says what was built
    assert DiTModel(size="B/4", hidden_size=768).cfg.hidden_size == 768  # agreeing fields are fine
    with pytest.raises(ValidationError, match="hidden_size: 384 contradicts size 'B/4'"):
        DiTModel(size="B/4", hidden_size=384)
    with pytest.raises(ValidationError, match="patch_size: 2 contradicts size 'S/4'"):
        DiTModel(size="S/4", patch_size=2)
    plain = DiTModel()  # no size: the documented defaults
    assert (plain.cfg.depth, plain.cfg.hidden_size, plain.cfg.patch_size) == (12, 384, 2)
