"""parallelize(): a diffusers model patched in place to run on this rank's band (flowfleet.parallel.patched
for what that means), the one place that knows which wrapper serves which diffusers class."""

from __future__ import annotations

import os

import diffusers
import torch.distributed as dist
from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKL
from diffusers.models.autoencoders.vae import Decoder
from diffusers.models.unets.unet_2d_condition import UNet2DConditionModel
from packaging.specifiers import SpecifierSet
from packaging.version import Version

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


# The diffusers releases the wrappers are tested against: `make test` runs the parallel and parity tests
# on the venv's (the newest, 0.42.1) and again on the oldest (DIFFUSERS_OLDEST in the Makefile, 0.35.2;
# 0.30.3 lacks Flux's attention class); pyproject.toml declares the same range. The wrappers mirror
# diffusers' attention processors and block forwards step by step, so a release outside it is refused
# unless asked for (allow_untested_diffusers, or FLOWFLEET_ALLOW_UNTESTED_DIFFUSERS=1).
SUPPORTED_DIFFUSERS = SpecifierSet(">=0.35.2,<0.43")
ALLOW_UNTESTED_ENV = "FLOWFLEET_ALLOW_UNTESTED_DIFFUSERS"


def check_diffusers(version: str | None = None, allow_untested: bool = False) -> None:
    """A one-line FlowfleetError naming the installed diffusers release when the wrappers are not tested on it."""
    version = version or diffusers.__version__
    if Version(version) in SUPPORTED_DIFFUSERS or allow_untested or os.environ.get(ALLOW_UNTESTED_ENV) == "1":
        return
    raise FlowfleetError(
        f"patch parallelism: diffusers {version} is untested (tested: diffusers{SUPPORTED_DIFFUSERS}); install a "
        f"tested release, or try this one with allow_untested_diffusers=True or {ALLOW_UNTESTED_ENV}=1"
    )


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
    allow_untested_diffusers: bool = False,
    ulysses_degree: int | None = None,
) -> PatchedModel:
    """Patch a diffusers model in place to run on this rank's band of `group` (default: every rank of the
    default process group): a UNet2DConditionModel, a PixArt, SD3 or Flux transformer, or a VAE
    (AutoencoderKL: its decoder; sync only). `mode`: flowfleet.parallel.mode.UNetMode (the transformers also
    take "ulysses", "ring" and "usp", exact sequence parallelism; `ulysses_degree`: usp's Ulysses group size,
    None: the largest that divides the bands and every layer's heads).
    `cfg_split`: the two halves of a guided batch on two halves of the ranks; `batch_bytes`: bytes per
    asynchronous all-gather (None: from the model's bytes, see parallel.comm). A diffusers release outside
    SUPPORTED_DIFFUSERS is refused unless `allow_untested_diffusers`. Returns the handle (reset(), restore(),
    comm, modes); use it as a context manager."""
    check_diffusers(allow_untested=allow_untested_diffusers)
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
        ulysses_degree=ulysses_degree,
    )
