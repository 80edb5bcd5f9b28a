"""parallelize(): a diffusers model patched in place to run on this rank's band (flowfleet.parallel.patched
for what that means), the one place that knows which wrapper serves which diffusers class."""

from __future__ import annotations

import torch.distributed as dist
from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKL
from diffusers.models.autoencoders.vae import Decoder
from diffusers.models.unets.unet_2d_condition import UNet2DConditionModel

from flowfleet.distributed import Group
from flowfleet.errors import FlowfleetError
from flowfleet.parallel.mode import UNetMode
from flowfleet.parallel.patched import PatchedModel
from flowfleet.parallel.transformers import ParallelFlux, ParallelPixArt, ParallelSD3
from flowfleet.parallel.unet.model import ParallelUNet
from flowfleet.parallel.vae import ParallelVAEDecoder

# The diffusers model class each wrapper patches (a VAE is patched through its decoder, see below).
WRAPPERS: dict[type, type[PatchedModel]] = {
    UNet2DConditionModel: ParallelUNet,
    ParallelPixArt.MODEL: ParallelPixArt,
    ParallelSD3.MODEL: ParallelSD3,
    ParallelFlux.MODEL: ParallelFlux,
    Decoder: ParallelVAEDecoder,
}


def default_group() -> Group:
    """All ranks of the default process group, or a single process when none is initialised."""
    if dist.is_available() and dist.is_initialized():
        return Group(None, dist.get_rank(), dist.get_world_size())
    return Group.solo()


def parallelize(
    model,
    group: Group | None = None,
    *,
    mode: UNetMode | str = UNetMode.DISPLACED,
    warmup: int = 4,
    cfg_split: bool = False,
    max_batch: int | None = None,
    batch_bytes: int | None = None,
    timeout_s: float = 60.0,
) -> PatchedModel:
    """Patch a diffusers model in place to run on this rank's band of `group` (default: every rank of the
    default process group): a UNet2DConditionModel, a PixArt, SD3 or Flux transformer, or a VAE
    (AutoencoderKL: its decoder; sync only).
    `cfg_split`: the two halves of a guided batch on two halves of the ranks; `batch_bytes`: bytes per
    asynchronous all-gather (None: from the model's bytes, see parallel.comm). Returns the handle
    (reset(), restore(), comm, modes); use it as a context manager."""
    if isinstance(model, AutoencoderKL):
        model = model.decoder  # vae.decode(z) runs post_quant_conv (1x1, per row) then the decoder

    cls = next((parallel for kind, parallel in WRAPPERS.items() if isinstance(model, kind)), None)
    if cls is None:
        names = ", ".join(kind.__name__ for kind in WRAPPERS)
        raise FlowfleetError(f"patch parallelism: {type(model).__name__} is not supported (supported: {names})")
    return cls(
        model,
        group or default_group(),
        mode=mode,
        warmup=warmup,
        cfg_split=cfg_split,
        max_batch=max_batch,
        batch_bytes=batch_bytes,
        timeout_s=timeout_s,
    )
