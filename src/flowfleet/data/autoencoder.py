"""A run-trained latent space: a small diffusers AutoencoderKL fitted by `prepare` on the run's training
images (encoders.latent.name `autoencoder`).

Paris' experts denoise a VAE's latents (sd-vae-ft-mse); where no pretrained VAE fits the data (28 px
digits), the run trains its own, once, before encoding, and every expert, router and sampler shares it,
frozen, as they would share a downloaded VAE. The model is diffusers' own AutoencoderKL (its encoder,
decoder, diagonal-Gaussian posterior and KL); what is written here is only its small configuration, its
training loop (L1 + L2 reconstruction + kl_weight x KL, AdamW, one seeded pass order) and the latents'
scale: `scaling_factor` = 1 / std of the training latents, stored in its config.json as diffusers does.

Images are padded with -1 to `pad_to` before the encoder and cropped back to their side (`_image_size`
in config.json) after the decoder.
"""

from __future__ import annotations

import json
import logging
import time

import safetensors.torch
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from flowfleet.config import AutoencoderConfig
from flowfleet.models.files import WEIGHTS_NAME, ModelFileError, save_model
from flowfleet.storage import RunRoot
from flowfleet.threads import ThreadGovernor

log = logging.getLogger(__name__)

MSE_SUBSET = 1024  # images decoded for the logged reconstruction error


def build_autoencoder(cfg: AutoencoderConfig, channels: int, image_size: int):
    """An untrained AutoencoderKL of `cfg`'s shape for images [B, channels, side, side] (side = pad_to)."""
    from diffusers import AutoencoderKL

    blocks = len(cfg.block_out_channels)
    return AutoencoderKL(
        in_channels=channels,
        out_channels=channels,
        down_block_types=("DownEncoderBlock2D",) * blocks,
        up_block_types=("UpDecoderBlock2D",) * blocks,
        block_out_channels=tuple(cfg.block_out_channels),
        layers_per_block=cfg.layers_per_block,
        latent_channels=cfg.latent_channels,
        norm_num_groups=min(16, *cfg.block_out_channels),
        sample_size=cfg.side(image_size),
        mid_block_add_attention=False,  # 8 x 8 latents: convolutions see the whole grid already
    )


def pad(images: torch.Tensor, side: int) -> torch.Tensor:
    """[B, C, S, S] -> [B, C, side, side], the margin filled with -1 (black)."""
    m = (side - images.shape[-1]) // 2
    return F.pad(images, (m, m, m, m), value=-1.0) if m else images


def crop(images: torch.Tensor, size: int) -> torch.Tensor:
    """The inverse of `pad`: the central size x size."""
    m = (images.shape[-1] - size) // 2
    return images[..., m : m + size, m : m + size] if m else images


def train_autoencoder(images: torch.Tensor, cfg: AutoencoderConfig, progress: bool = True, threads: int | None = None):
    """Fit an AutoencoderKL to `images` [N, C, S, S] in [-1, 1]; returns it in eval mode with its
    scaling_factor set (1 / std of the posterior means of the training images). On a CPU its loop runs `threads`
    threads (None: the process's count on an idle machine), or follows the load (cfg.follow_load)."""
    n, channels, size = images.shape[0], images.shape[1], images.shape[-1]
    torch.manual_seed(cfg.seed)
    vae = build_autoencoder(cfg, channels, size).train()
    # fused, as the trainer's: one kernel over every parameter rather than a loop over them
    opt = torch.optim.AdamW(vae.parameters(), lr=cfg.lr, weight_decay=0.0, fused=True)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, cfg.lr, total_steps=cfg.steps, pct_start=0.1)
    gen = torch.Generator().manual_seed(cfg.seed)
    x_all = pad(images, cfg.side(size))
    t0 = time.perf_counter()
    bar = tqdm(range(cfg.steps), desc="autoencoder", unit="step", disable=not progress, dynamic_ncols=True)
    governor = ThreadGovernor(follow=cfg.follow_load, fixed=threads)
    try:
        for _ in bar:
            governor.step()
            x = x_all[torch.randint(0, n, (min(cfg.batch_size, n),), generator=gen)]
            posterior = vae.encode(x).latent_dist
            recon = vae.decode(posterior.sample(gen)).sample
            rec = F.l1_loss(recon, x) + F.mse_loss(recon, x)
            loss = rec + cfg.kl_weight * posterior.kl().mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            bar.set_postfix(rec=f"{rec.item():.4f}", refresh=False)
    finally:
        governor.restore()  # (the encoding after it has large operations: every thread)
    vae.eval()
    with torch.no_grad():
        z = torch.cat([vae.encode(b).latent_dist.mean for b in x_all.split(256)])  # [N, c, h, w]: the scale's
        # The logged reconstruction error is read on an evenly spread subset: decoding every training image sits on
        # the demo's critical path, and a subset of MSE_SUBSET gives the same figure to within a percent
        every = -(-n // MSE_SUBSET)
        mse = float(
            torch.cat(
                [
                    F.mse_loss(crop(vae.decode(zb).sample, size), xb, reduction="none").flatten(1).mean(1)
                    for zb, xb in zip(z[::every].split(256), images[::every].split(256))
                ]
            ).mean()
        )
    # diffusers' own field for the latents' scale; `_image_size` (a private key diffusers keeps) for the crop
    vae.register_to_config(scaling_factor=float(1.0 / z.std()), _image_size=size)
    log.info(
        "autoencoder: %d steps on %d images in %.0f s, reconstruction MSE %.4f (%d of them), latent std %.3f",
        cfg.steps,
        n,
        time.perf_counter() - t0,
        mse,
        len(range(0, n, every)),
        float(z.std()),
    )
    return vae


def save_autoencoder(vae, root: RunRoot, *parts: str) -> None:
    """config.json + safetensors (the weights first: the config names a finished folder)."""
    save_model(vae, root, *parts)


def load_autoencoder(root: RunRoot, *parts: str):
    """The AutoencoderKL in root/parts, strictly (every tensor present with its shape), in eval mode."""
    from diffusers import AutoencoderKL

    where = root.url_of(*parts)
    if not root.exists(*parts, "config.json") or not root.exists(*parts, WEIGHTS_NAME):
        raise ModelFileError(f"{where}: missing autoencoder (config.json and {WEIGHTS_NAME}); run `flowfleet prepare`")
    try:
        config = json.loads(root.read_bytes(*parts, "config.json"))
        vae = AutoencoderKL.from_config(config)
        state = safetensors.torch.load(root.read_bytes(*parts, WEIGHTS_NAME))
        vae.load_state_dict(state, strict=True)
    except (ValueError, RuntimeError, json.JSONDecodeError) as err:
        raise ModelFileError(f"{where}: not a loadable AutoencoderKL ({str(err).splitlines()[0][:200]})") from None
    return vae.eval().requires_grad_(False)
