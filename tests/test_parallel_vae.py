"""Patch-parallel VAE decoding (flowfleet.parallel.parallelize on an AutoencoderKL): the decoded image
equals the single-device decode, on 2, 3, 4 and 5 gloo ranks (5: uneven bands)."""

from __future__ import annotations

import pytest
import torch
from diffusers import AutoencoderKL
from fixtures.tolerances import net_tol

from flowfleet.distributed import Group
from flowfleet.errors import FlowfleetError
from flowfleet.parallel import parallelize
from flowfleet.parallel.launch import run_local
from flowfleet.parallel.vae import ParallelVAEDecoder

pytestmark = pytest.mark.usefixtures("one_thread")
FORK = dict(start_method="fork", timeout_s=60.0)


def tiny_vae() -> AutoencoderKL:
    """SD's VAE layout at 2 levels (32/64 channels, one upsampling: 12 x 12 latent -> 24 x 24 image), 8 GN
    groups, the middle block's self-attention; every tensor random so that every layer matters."""
    torch.manual_seed(0)
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(32, 64),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=8,
        sample_size=24,
    ).eval()
    with torch.no_grad():
        for p in vae.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return vae


def latent() -> torch.Tensor:
    """Two latents [2, 4, 12, 12] with rows that differ (GroupNorm statistics of one band are not the image's)."""
    g = torch.Generator().manual_seed(1)
    rows = torch.linspace(0, 1, 12).view(1, 1, 12, 1)
    return torch.randn(2, 4, 12, 12, generator=g) * (0.3 + 2 * rows) + (rows > 0.5)


def _decode(ctx) -> dict:
    vae = tiny_vae()
    with torch.no_grad(), parallelize(vae, ctx.world) as handle:
        image = vae.decode(latent()).sample
        again = vae.decode(latent()).sample  # slots registered once; the second call exchanges only
        kind, modes, sent = type(handle).__name__, [m.value for m in handle.modes], handle.comm.bytes_by_step
    return {"image": image, "again": again, "kind": kind, "modes": modes, "bytes": sent}


@pytest.mark.parametrize("nproc", [2, 3, 4, 5])  # 12 latent rows: 5 ranks get bands of 3/3/2/2/2
def test_parallel_decode_equals_the_single_device_decode(nproc):
    vae = tiny_vae()
    with torch.no_grad():
        ref = vae.decode(latent()).sample  # [2, 3, 24, 24]
    ranks = run_local(_decode, nproc, (), **FORK)
    r0 = ranks[0]
    assert r0["kind"] == "ParallelVAEDecoder" and r0["modes"] == ["sync", "sync"]
    for r in ranks:
        assert r["image"].shape == ref.shape
        # sync bands vs one device, summation order alone: the longest reduction is a GroupNorm group of the
        # 64-channel level (8 channels x 24 x 24); ~14 layers (convolutions, norms, the mid attention)
        assert (r["image"] - ref).abs().max() <= net_tol(ref, 8 * 24 * 24, 14), (r["image"] - ref).abs().max()
        assert torch.equal(r["again"], r["image"])
    assert r0["bytes"][0] > 0  # halos, GN statistics and keys/values really travelled
    assert "forward" not in vae.decoder.__dict__  # (this process's copy was never patched)


def test_decode_refuses_rows_it_cannot_split():
    vae = tiny_vae()
    handle = ParallelVAEDecoder(vae.decoder, Group(None, 0, 13))
    try:
        with pytest.raises(FlowfleetError, match=r"cannot be split into 13 bands of whole rows \(at least 13 rows\)"):
            vae.decode(latent())
    finally:
        handle.restore()
    assert "forward" not in vae.decoder.__dict__
