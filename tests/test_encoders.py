"""Every encoder behind the docs/contracts.md interface: tiny random AutoencoderKL / DINOv2 / CLIP
built here and loaded by path, the real MiniLM and Inception from their wheels."""

from __future__ import annotations

import string

import pytest
import torch
from fixtures.tolerances import gamma, net_tol

from flowfleet.config import LatentEncoderConfig, SemanticEncoderConfig, TextEncoderConfig
from flowfleet.data.encoders import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    EncoderError,
    build_latent_encoder,
    build_semantic_encoder,
    build_text_encoder,
    fit_length,
)


def images(b=2, c=3, s=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(b, c, s, s, generator=g) * 2 - 1


# ------------------------------------------------------------------------------------------------
#                                          latents
# ------------------------------------------------------------------------------------------------


def test_pixel_latents_are_the_image():
    enc = build_latent_encoder(LatentEncoderConfig(name="pixels"), channels=1)
    x = images(c=1) * 1.5
    z = enc.encode(x)
    assert torch.equal(z, x.clamp(-1, 1)) and torch.equal(enc.decode(z), z)
    with pytest.raises(ValueError, match=r"\[B, 1, H, W\]"):
        enc.encode(images(c=3))


@pytest.fixture(scope="module")
def tiny_vae(tmp_path_factory):
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    vae = AutoencoderKL(
        block_out_channels=(8, 8, 8, 8),
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        latent_channels=4,
        norm_num_groups=4,
        layers_per_block=1,
        sample_size=16,
    ).eval()
    path = tmp_path_factory.mktemp("vae")
    vae.save_pretrained(path)
    return vae, str(path)


def test_vae_latents_scaled_mean_and_decode(tiny_vae):
    vae, path = tiny_vae
    enc = build_latent_encoder(LatentEncoderConfig(name="sd-vae-ft-mse", path=path), channels=3)
    x = images()
    z = enc.encode(x)
    assert z.shape == (2, 4, 2, 2)
    with torch.no_grad():
        ref = vae.encode(x).latent_dist.mean * 0.18215
    # the tiny VAE's longest reduction is a GroupNorm over 2 channels x 16 x 16 = 512 values; its encoder
    # passes ~30 layers (4 blocks x 2 convs and 2 norms, downsamplers, mid block), its decoder ~45
    torch.testing.assert_close(z, ref, rtol=0, atol=net_tol(ref, 512, 30))
    y = enc.decode(z)
    assert y.shape == (2, 3, 16, 16) and y.min() >= -1 and y.max() <= 1
    with torch.no_grad():
        want = vae.decode(ref / 0.18215).sample.clamp(-1, 1)
    torch.testing.assert_close(y, want, rtol=0, atol=net_tol(want, 512, 45))
    assert enc.describe()["downsample"] == 8 and enc.describe()["path"] == path


def test_vae_grayscale_and_sampling(tiny_vae):
    _, path = tiny_vae
    gray = build_latent_encoder(LatentEncoderConfig(name="sd-vae-ft-mse", path=path), channels=1)
    x = images(c=1)
    assert gray.decode(gray.encode(x)).shape == (2, 1, 16, 16)
    sampler = build_latent_encoder(LatentEncoderConfig(name="sd-vae-ft-mse", path=path, sample=True), channels=1)
    a, b = sampler.encode(x), sampler.encode(x)
    assert not torch.equal(a, b)  # a posterior sample, not its mean
    # statistical: a posterior sample lies within a few posterior sds of the mean; this tiny random VAE's sd
    # (exp(logvar / 2) of near-zero logvars) is ~1 x scaling_factor 0.18 -> 1.0 is > 5 sd
    assert torch.allclose(a, gray.encode(x), atol=1.0)


def test_vae_missing_weights_is_one_line(tmp_path):
    with pytest.raises(EncoderError, match=r"encoders.latent.path: cannot load AutoencoderKL from '.*nothing'"):
        build_latent_encoder(LatentEncoderConfig(name="sd-vae-ft-mse", path=str(tmp_path / "nothing")), channels=3)


# ------------------------------------------------------------------------------------------------
#                                       semantic features
# ------------------------------------------------------------------------------------------------


def _tiny_dinov2(path, registers=0):
    from transformers import Dinov2Config, Dinov2Model

    torch.manual_seed(0)
    kw = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, mlp_ratio=2, patch_size=14, image_size=28)
    if registers:
        from transformers import Dinov2WithRegistersConfig, Dinov2WithRegistersModel

        model = Dinov2WithRegistersModel(Dinov2WithRegistersConfig(num_register_tokens=registers, **kw))
    else:
        model = Dinov2Model(Dinov2Config(**kw))
    model.eval().save_pretrained(path)
    return model


def _reference_pixels(u8: torch.Tensor) -> torch.Tensor:
    """transformers' own DINOv2 preprocessing of uint8 [B, 3, 32, 32]: a 32-pixel side is only cropped to 28 and
    normalised."""
    from transformers import BitImageProcessor

    proc = BitImageProcessor(
        size={"shortest_edge": 32},
        crop_size={"height": 28, "width": 28},
        image_mean=IMAGENET_MEAN,
        image_std=IMAGENET_STD,
        do_convert_rgb=False,
    )
    return proc(list(u8.permute(0, 2, 3, 1).numpy()), return_tensors="pt")["pixel_values"]


@pytest.mark.parametrize("registers", [0, 4])
def test_dinov2_mean_pooled_patch_tokens_match_the_reference_preprocessing(tmp_path, registers):
    model = _tiny_dinov2(tmp_path, registers)
    # crop 28 -> resize side round(28 * 256 / 224) = 32: a 32-pixel input is only cropped and normalised
    enc = build_semantic_encoder(SemanticEncoderConfig(name="dinov2", path=str(tmp_path), image_size=28))
    assert enc.dim == 32
    u8 = torch.randint(0, 256, (2, 3, 32, 32), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    feats = enc.encode(u8.float() / 127.5 - 1)
    pixel_values = _reference_pixels(u8)
    with torch.no_grad():
        hidden = model(pixel_values=pixel_values).last_hidden_state  # [2, 1 + registers + 4, 32]
    assert hidden.shape[1] == 1 + registers + 4
    ref = hidden[:, 1 + registers :].mean(1)
    # The same network on inputs normalised in another order: its longest reduction is the 3 x 14 x 14
    # patch embedding, over 4 layers (embedding, attention, MLP, final norm).
    torch.testing.assert_close(feats, ref, atol=net_tol(ref, 3 * 14 * 14, 4), rtol=0)


def test_dinov2_repa_tokens_are_its_patch_tokens_on_the_grid(tmp_path):
    """With the experts' grid, DINOv2's REPA tokens are its last layer's patch tokens (2 x 2 of them here, pooled to a
    2 x 2 grid: themselves), the same as the reference forward's; the features are unchanged by the grid."""
    model = _tiny_dinov2(tmp_path)
    cfg = SemanticEncoderConfig(name="dinov2", path=str(tmp_path), image_size=28)
    enc = build_semantic_encoder(cfg, grid=(2, 2))
    u8 = torch.randint(0, 256, (2, 3, 32, 32), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    x = u8.float() / 127.5 - 1
    tokens = enc.tokens(x)
    pixel_values = _reference_pixels(u8)
    with torch.no_grad():
        ref = model(pixel_values=pixel_values).last_hidden_state[:, 1:]  # [2, 4, 32], row by row
    assert tokens.shape == (2, 4, 32)
    torch.testing.assert_close(tokens, ref, atol=net_tol(ref, 3 * 14 * 14, 4), rtol=0)
    assert torch.equal(enc.encode(x), build_semantic_encoder(cfg).encode(x))
    with pytest.raises(EncoderError, match="built without the experts' token grid"):
        build_semantic_encoder(cfg).tokens(x)


def test_dinov2_refuses_other_models(tmp_path):
    from transformers import BertConfig, BertModel

    bert = BertConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    BertModel(bert).save_pretrained(tmp_path)
    with pytest.raises(EncoderError, match="is a 'bert' model, not DINOv2"):
        build_semantic_encoder(SemanticEncoderConfig(name="dinov2", path=str(tmp_path)))


def test_pixel_features():
    enc = build_semantic_encoder(SemanticEncoderConfig(name="pixels", image_size=8))
    x = images(c=1, s=16)
    f = enc.encode(x)
    assert f.shape == (2, 192) and enc.dim == 192
    assert torch.equal(f.view(2, 3, 8, 8)[:, 0], f.view(2, 3, 8, 8)[:, 2])  # gray repeated to RGB
    flat = enc.encode(torch.full((1, 3, 16, 16), 0.25))
    # a resize, no other transform: an antialiased bilinear 16 -> 8 passes 4 taps per axis, and its weights
    # sum to 1 up to their own rounding: fewer than 16 float32 roundings of 0.25
    torch.testing.assert_close(flat, torch.full((1, 192), 0.25), rtol=0, atol=gamma(16, torch.float32) * 0.25)


def test_inception_matches_the_torchscript_network():
    from flowfleet.data.inception import default_1_path

    enc = build_semantic_encoder(SemanticEncoderConfig(name="inception"))
    assert enc.dim == 2048 and enc.describe()["image_size"] == 299
    x = images(b=2, c=1, s=32)
    feats = enc.encode(x)
    net = torch.jit.load(str(default_1_path()), map_location="cpu").eval()
    u8 = ((x.clamp(-1, 1) + 1) * 127.5).round()  # the uint8 values the FID interface sees
    ref_in = (
        torch.nn.functional.interpolate(u8.expand(-1, 3, -1, -1), size=(299, 299), mode="bilinear", align_corners=False)
        / 128
        - 1
    )
    with torch.inference_mode():
        ref = net(ref_in)
    assert feats.shape == (2, 2048)
    # The same TorchScript network on the same resize: Inception-v3's longest reduction is a 3 x 3 conv over
    # 448 channels (4032 terms), its longest path 48 layers.
    torch.testing.assert_close(feats, ref, atol=net_tol(ref, 3 * 3 * 448, 48), rtol=0)
    small = build_semantic_encoder(SemanticEncoderConfig(name="inception", image_size=80)).encode(x)
    assert small.shape == (2, 2048) and not torch.allclose(small, feats)
    with pytest.raises(EncoderError, match="image_size: 40 outside 75..299"):
        build_semantic_encoder(SemanticEncoderConfig(name="inception", image_size=40))


def test_inception_repa_tokens_are_mixed_5d_pooled_to_the_grid():
    """With the experts' grid, the Inception's REPA tokens are Mixed_5d's output (288 channels; 7 x 7 at 75 px)
    average-pooled to the grid, as the TorchScript network's layers compute it from the FID input; the features are
    those without a grid."""
    from flowfleet.data.inception import default_1_path

    cfg = SemanticEncoderConfig(name="inception", image_size=75)
    enc = build_semantic_encoder(cfg, grid=(4, 4))
    x = images(b=2, c=1, s=32)
    tokens = enc.tokens(x)
    net = torch.jit.load(str(default_1_path()), map_location="cpu").eval()
    u8 = ((x.clamp(-1, 1) + 1) * 127.5).round()
    h = torch.nn.functional.interpolate(u8.expand(-1, 3, -1, -1), size=(75, 75), mode="bilinear", align_corners=False)
    h = h / 128 - 1
    with torch.inference_mode():
        for name, layer in net.net.layers.named_children():
            h = layer(h)
            if name == "mixed_2":
                break
    assert h.shape == (2, 288, 7, 7) and tokens.shape == (2, 16, 288)
    ref = torch.nn.functional.adaptive_avg_pool2d(h, 4).flatten(2).transpose(1, 2)
    # the same layers in another memory layout: up to Mixed_5d the longest reduction is a 5 x 5 conv over 48
    # channels (its 5 x 5 branch), the longest path 12 layers
    torch.testing.assert_close(tokens, ref, atol=net_tol(ref, 5 * 5 * 48, 12), rtol=0)
    assert torch.equal(enc.encode(x), build_semantic_encoder(cfg).encode(x))


# ------------------------------------------------------------------------------------------------
#                                            text
# ------------------------------------------------------------------------------------------------


def test_fit_length_pads_and_truncates():
    tokens = torch.ones(2, 3, 4)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    t, m = fit_length(tokens, mask, 5)
    assert t.shape == (2, 5, 4) and m.dtype == torch.bool
    assert m.tolist() == [[True, True, False, False, False], [True, True, True, False, False]]
    assert t[0, 2:].abs().sum() == 0 and t[1, :3].min() == 1
    t, m = fit_length(tokens, mask, 2)
    assert t.shape == (2, 2, 4) and m.all()


def test_text_none_is_none():
    assert build_text_encoder(TextEncoderConfig(name="none")) is None


@pytest.fixture(scope="module")
def minilm():
    return build_text_encoder(TextEncoderConfig(name="minilm", max_length=8))


def test_minilm_tokens_mask_and_pooled_match_sentence_transformers(minilm):
    captions = ["a handwritten digit seven", "a very long caption that has many more words than eight tokens", ""]
    emb = minilm.encode(captions)
    assert minilm.width == 384 and minilm.max_length == 8
    assert emb.tokens.shape == (3, 8, 384) and emb.mask.shape == (3, 8) and emb.pooled.shape == (3, 384)
    assert emb.tokens.dtype == torch.float32 and emb.mask.dtype == torch.bool
    n_real = [len(minilm.model.tokenizer(c)["input_ids"]) for c in captions]
    assert emb.mask.sum(1).tolist() == [min(n, 8) for n in n_real]
    assert emb.tokens[2, 2:].abs().sum() == 0  # "" is [CLS] [SEP] and padding
    ref = minilm.model.encode(captions, convert_to_tensor=True)
    # MiniLM-L6: 6 blocks of attention and a 1536-wide MLP, then mean pooling and normalisation; the two
    # sides batch and pad differently, so only the order of the sums differs.
    torch.testing.assert_close(emb.pooled, ref, atol=net_tol(ref, 1536, 2 * 6 + 2), rtol=0)
    again = minilm.encode(captions[:1])  # batch-independent
    torch.testing.assert_close(again.tokens[0], emb.tokens[0], atol=net_tol(emb.tokens[0], 1536, 2 * 6 + 1), rtol=0)


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    path = tmp_path_factory.mktemp("clip")
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for ch in string.ascii_lowercase + string.digits:  # one token per character: no merges needed
        vocab[ch] = len(vocab)
        vocab[ch + "</w>"] = len(vocab)
    tok = CLIPTokenizer(vocab=vocab, merges=[])
    tok.save_pretrained(path)
    torch.manual_seed(0)
    cfg = CLIPTextConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=32,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    )
    CLIPTextModel(cfg).eval().save_pretrained(path)
    return str(path)


def test_clip_fixed_length_tokens_and_eos_pooled(tiny_clip):
    enc = build_text_encoder(TextEncoderConfig(name="clip", path=tiny_clip, max_length=12))
    emb = enc.encode(["a cat", "abcdefghijklmnopqrstuvwxyz"])
    assert enc.width == 32
    assert emb.tokens.shape == (2, 12, 32) and emb.mask.shape == (2, 12) and emb.pooled.shape == (2, 32)
    # "a cat" -> <start> a c a t</w> <end> = 6 real tokens; the long caption is truncated to 12
    assert emb.mask.sum(1).tolist() == [6, 12]
    assert emb.tokens[0, 6:].abs().sum() == 0
    assert torch.equal(emb.pooled[0], emb.tokens[0, 5])  # pooled = the end-of-text state, the same numbers
    with pytest.raises(EncoderError, match="max_length: 40 exceeds the CLIP model's 32 positions"):
        build_text_encoder(TextEncoderConfig(name="clip", path=tiny_clip, max_length=40))


def test_clip_missing_path_is_one_line(tmp_path):
    with pytest.raises(EncoderError, match="encoders.text.path: cannot load a CLIP text model"):
        build_text_encoder(TextEncoderConfig(name="clip", path=str(tmp_path / "none")))
