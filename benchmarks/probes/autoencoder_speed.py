"""The demo's autoencoder step (flowfleet.data.autoencoder: the preset's 16-32-32 AutoencoderKL on 28 px images
padded to 32, batches of 32, AdamW), timed in milliseconds per step after a warm-up. The OpenMP wait policy is
read when torch loads, so compare it across processes, one after the other:

    for p in PASSIVE ACTIVE PASSIVE ACTIVE; do OMP_WAIT_POLICY=$p python benchmarks/probes/autoencoder_speed.py; done

Random images stand in for the digits: a convolution's cost does not depend on the pixels.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F

from flowfleet.data.autoencoder import build_autoencoder, pad
from flowfleet.presets import preset


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    cfg = preset("mnist").encoders.latent.autoencoder
    torch.manual_seed(0)
    vae = build_autoencoder(cfg, 1, 28).train()
    images = pad(torch.rand(512, 1, 28, 28) * 2 - 1, cfg.side(28))
    opt = torch.optim.AdamW(vae.parameters(), lr=cfg.lr)
    gen = torch.Generator().manual_seed(0)

    def step() -> None:
        x = images[torch.randint(0, images.shape[0], (cfg.batch_size,), generator=gen)]
        posterior = vae.encode(x).latent_dist
        recon = vae.decode(posterior.sample(gen)).sample
        loss = F.l1_loss(recon, x) + F.mse_loss(recon, x) + cfg.kl_weight * posterior.kl().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    for _ in range(10):
        step()
    t0 = time.perf_counter()
    for _ in range(a.steps):
        step()
    ms = (time.perf_counter() - t0) / a.steps * 1000
    print(f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')} threads={a.threads}: {ms:.1f} ms/step")


if __name__ == "__main__":
    main()
