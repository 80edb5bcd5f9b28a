"""A diffusers UNet2DConditionModel split into row bands over N ranks, used from a normal scheduler loop.

    with parallelize(unet, group, mode="displaced", warmup=4) as punet:   # on every rank
        for t in scheduler.timesteps:                                     # the loop is unchanged
            eps = unet(latents, t, encoder_hidden_states=text).sample     # full in, full out, every rank
            latents = scheduler.step(eps, t, latents).prev_sample

parallelize() patches the model object in place (its own forward and the forwards of its GroupNorm and
Conv2d layers become band wrappers, its attention layers get band processors) and restore() undoes it,
so a pipeline holding the U-Net (pipe.unet) runs patch-parallel without knowing. Patching instance
forwards, as accelerate's hooks do, keeps module types, attributes and the state dict untouched.

Each call: the full latent [B, C, H, W] (identical on every rank) -> this rank's band of rows after the
first convolution (exact, from the full input) -> every layer on the band (flowfleet.parallel.unet.conv,
.attention, .norm; the mode of this evaluation in the shared BandStep) -> one all-gather of the output
bands -> the full prediction on every rank, so every rank's scheduler takes the identical step.

CFG split (`cfg_split=True`, an even number of ranks N, as distrifuser): a pipeline's guided call has the
batch [unconditional; conditional] (2B rows). Ranks [0, N/2) run its first half and ranks [N/2, N) its
second, each half split into N/2 bands: half the rows per rank, twice the rows per band, and the band
exchanges stay inside each group of N/2. A call whose batch is odd (no guidance) runs whole in both groups.

Sampler steps are counted from the start of a run: a new step begins when the timestep changes (Heun's
corrector at t_next and separate CFG calls at the same t are not steps of their own). A run starts at the
first call, after reset(), or when the timestep rises above the previous call's (a new scheduler loop).
The first step of a run and `warmup` more (default 4, as the paper and distrifuser) run as `sync`; so
does any evaluation whose batch size differs from the previous one's
(the previous step's buffers would belong to other samples). The first call of the object also runs the
U-Net once without communication to discover every layer's comm slot (BandStep.declare) and registers
them, in forward order, with one CommManager.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from diffusers.models.attention_processor import Attention, AttnProcessor, AttnProcessor2_0
from diffusers.models.unets.unet_2d_condition import UNet2DConditionModel, UNet2DConditionOutput

from flowfleet.distributed import Group, split_group
from flowfleet.errors import FlowfleetError
from flowfleet.parallel.comm import CommManager
from flowfleet.parallel.mode import ParallelMode
from flowfleet.parallel.unet.attention import CrossAttentionBand, SelfAttentionBand
from flowfleet.parallel.unet.conv import FirstConvBand, HaloConvBand, RowHalo
from flowfleet.parallel.unet.mode import UNetMode
from flowfleet.parallel.unet.norm import GroupNormBand
from flowfleet.parallel.unet.step import BandStep

# Layers whose forward mixes rows in ways the band wrappers do not model (functional group norms,
# FIR/kernel resamplers with their own padding). Matched by class name so that the check works across
# diffusers releases that move or drop these classes.
_UNSUPPORTED = frozenset(
    {"AdaGroupNorm", "SpatialNorm", "FirDownsample2D", "FirUpsample2D", "KDownsample2D", "KUpsample2D"}
)
_UNSUPPORTED_ARGS = (
    "attention_mask",
    "down_block_additional_residuals",
    "mid_block_additional_residual",
    "down_intrablock_additional_residuals",
)


def check_supported(unet: nn.Module) -> None:
    """Raise a one-line FlowfleetError naming the first layer that patch parallelism cannot run exactly."""
    if not isinstance(unet, UNet2DConditionModel):
        raise FlowfleetError(
            f"patch-parallel U-Net: expected a diffusers UNet2DConditionModel, got {type(unet).__name__}"
        )
    for name, m in unet.named_modules():
        kind = type(m).__name__
        if kind in _UNSUPPORTED:
            raise FlowfleetError(f"U-Net layer {name} ({kind}) is not supported by patch parallelism")
        if isinstance(m, nn.ConvTranspose2d) and (m.kernel_size[0] > 1 or m.stride[0] > 1):
            raise FlowfleetError(f"U-Net layer {name}: transposed convolutions are not supported by patch parallelism")
        if isinstance(m, nn.Conv2d) and (isinstance(m.padding, str) or m.padding_mode != "zeros"):
            raise FlowfleetError(
                f"U-Net layer {name}: only explicit zero padding is supported "
                f"(padding={m.padding!r}, padding_mode={m.padding_mode!r})"
            )
        if kind == "Downsample2D" and getattr(m, "use_conv", False) and getattr(m, "padding", 1) == 0:
            raise FlowfleetError(f"U-Net layer {name}: asymmetric-padding downsampling (padding=0) is not supported")
        if isinstance(m, Attention):
            if not isinstance(m.processor, (AttnProcessor2_0, AttnProcessor)):
                raise FlowfleetError(
                    f"U-Net layer {name}: attention processor {type(m.processor).__name__} is not "
                    f"supported by patch parallelism (use the default AttnProcessor2_0)"
                )
            if m.spatial_norm is not None:
                raise FlowfleetError(f"U-Net layer {name}: attention with a spatial norm is not supported")


def down_factor(unet: UNet2DConditionModel) -> int:
    """How many latent rows make one row at the U-Net's coarsest level (2 ** number of resamplings)."""
    downs = sum(1 for m in unet.modules() if type(m).__name__ == "Downsample2D")
    return 2 ** max(downs, int(getattr(unet, "num_upsamplers", 0)))


def default_group() -> Group:
    """All ranks of the default process group, or a single process when none is initialised."""
    if dist.is_available() and dist.is_initialized():
        return Group(None, dist.get_rank(), dist.get_world_size())
    return Group.solo()


class ParallelUNet:
    """A UNet2DConditionModel patched to run on this rank's band of rows; see the module docstring."""

    def __init__(
        self,
        unet: UNet2DConditionModel,
        group: Group,
        *,
        mode: UNetMode | str = UNetMode.DISPLACED,
        warmup: int = 4,
        cfg_split: bool = False,
        max_batch: int | None = None,
        batch_bytes: int | None = None,
        timeout_s: float = 60.0,
    ):
        check_supported(unet)
        if cfg_split and group.size % 2:
            raise FlowfleetError(f"cfg_split: needs an even number of ranks, got {group.size}")
        if warmup < 0:
            raise FlowfleetError(f"--warmup: must be >= 0, got {warmup}")
        if max_batch is not None and max_batch < 1:
            raise FlowfleetError(f"max_batch: must be >= 1, got {max_batch}")
        self.unet = unet
        self._class_forward = type(unet).forward  # the model's own forward, called on the full latent
        self.requested = UNetMode.parse(mode)
        self.world = group
        self.cfg_split = cfg_split
        bands = split_group(group, group.size // 2, timeout_s) if cfg_split else group
        self.half = group.rank // bands.size  # with cfg_split: which half of a guided batch this rank runs
        # One rank owns the whole image: nothing to exchange, every mode is the plain model.
        self.mode = self.requested if bands.size > 1 else UNetMode.NAIVE
        self.warmup = int(warmup)
        self.max_batch = max_batch
        self.factor = down_factor(unet)
        self.comm = CommManager(
            bands, group, device=unet.device, dtype=unet.dtype, batch_bytes=batch_bytes, timeout_s=timeout_s
        )
        self.step = BandStep(self.comm, bands.rank, bands.size)
        self._rows = 0  # batch rows per band slot (the largest batch one group runs), set at registration
        self._halved: tuple[torch.Tensor, int, torch.Tensor] | None = None  # (text, its version, its half)
        self.modes: list[UNetMode] = []  # the mode each evaluation ran in (since construction)
        self._evals = 0  # evaluations since the run started
        self._steps = 0  # sampler steps since the run started (the step of the current evaluation)
        self._filled: int | None = None  # batch size whose activations the receive buffers hold
        self._last_t: float | None = None
        self.slots: dict[str, tuple[int, ...]] = {}  # comm slot -> shape, in forward order (after the first call)
        self._registered = False  # comm slots registered and allocated (first call)
        self._patched: list[nn.Module] = []
        self._processors: dict[Attention, AttnProcessor] = {}
        self._install()

    # ----------------------------------------------------------------------------------------------
    #                                  Patching the model
    # ----------------------------------------------------------------------------------------------

    def _install(self) -> None:
        unet, step = self.unet, self.step
        for name, m in unet.named_modules():
            wrapper: Callable[..., torch.Tensor] | None = None
            if isinstance(m, nn.GroupNorm):
                wrapper = GroupNormBand(m, name, step)
            elif isinstance(m, nn.Conv2d) and m is unet.conv_in:
                wrapper = FirstConvBand(m, step)
            elif isinstance(m, nn.Conv2d) and RowHalo.of(m).rows > 0:
                wrapper = HaloConvBand(m, name, step)  # (1x1 convolutions are row-local: left alone)
            elif isinstance(m, Attention):
                self._processors[m] = m.processor
                band = CrossAttentionBand(name) if m.is_cross_attention else SelfAttentionBand(name, step)
                m.set_processor(band)  # type: ignore[arg-type]  # diffusers takes any processor; it types one class
            if wrapper is not None:
                m.forward = wrapper  # an instance attribute shadows the class's forward
                self._patched.append(m)
        unet.forward = self.forward
        self._patched.append(unet)

    def restore(self) -> None:
        """Undo parallelize(): the model is the plain single-device model again."""
        self.comm.drain()
        for m in self._patched:
            if "forward" in m.__dict__:
                del m.forward
        for attn, processor in self._processors.items():
            attn.set_processor(processor)
        self._patched, self._processors = [], {}

    def __enter__(self) -> "ParallelUNet":
        return self

    def __exit__(self, *exc) -> None:
        self.restore()

    # ----------------------------------------------------------------------------------------------
    #                                    One evaluation
    # ----------------------------------------------------------------------------------------------

    def reset(self) -> None:
        """Start a new run: the next evaluation is step 0 (sync)."""
        self.comm.drain()
        self._evals, self._steps, self._filled, self._last_t = 0, 0, None, None

    def forward(
        self,
        sample: torch.Tensor,
        timestep,
        encoder_hidden_states: torch.Tensor | None = None,
        *args,
        return_dict: bool = True,
        **kwargs,
    ):
        """UNet2DConditionModel.forward's signature: full latent in, full prediction out, on every rank."""
        if args:
            raise FlowfleetError("patch-parallel U-Net: pass the arguments after encoder_hidden_states by name")
        for key in _UNSUPPORTED_ARGS:
            if kwargs.get(key) is not None:
                raise FlowfleetError(f"patch-parallel U-Net: {key} is not supported")
        b = self._check_input(sample)
        split = self.cfg_split and b % 2 == 0
        if split:  # this group's half of [unconditional; conditional]
            sample, timestep, encoder_hidden_states, kwargs = self._my_half(
                b, sample, timestep, encoder_hidden_states, kwargs
            )
        rows = sample.shape[0]
        t_now = float(torch.as_tensor(timestep, dtype=torch.float64).max())
        if self._last_t is not None and t_now > self._last_t:
            self.reset()  # the timestep went back up: a new scheduler loop
        elif self._last_t is not None and t_now != self._last_t:
            self._steps += 1  # a new sampler step
        self._last_t = t_now
        if not self._registered:
            self._register(sample, timestep, encoder_hidden_states, **kwargs)
        mode = self.mode.at_step(self._steps, self.warmup)
        if rows > self._rows:
            raise FlowfleetError(
                f"patch-parallel U-Net: {rows} rows per rank group exceed the {self._rows} its buffers hold "
                f"(a batch of {b}; give max_batch for the largest one)"
            )
        if mode.exchange is ParallelMode.DISPLACED and self._filled != rows:
            mode = UNetMode.SYNC  # no previous-step activations for this batch
        self.comm.begin_step(self._evals)
        self.step.mode, self.step.batch = mode, rows
        band = self._class_forward(self.unet, sample, timestep, encoder_hidden_states, return_dict=False, **kwargs)[
            0
        ]  # [rows, C, H/n, W]   (n = ranks per group)
        if mode.exchange is ParallelMode.DISPLACED:
            self.comm.flush()  # a batch not yet complete (a layer skipped this evaluation) leaves now
        self._filled = rows if mode.exchange is not ParallelMode.NAIVE else None
        self.modes.append(mode)
        self._evals += 1
        bands = self.comm.all_gather_world(band, what="U-Net output band")  # [N, rows, C, H/n, W]
        n = self.step.bands
        groups = [torch.cat(list(bands[g * n : (g + 1) * n]), dim=-2) for g in range(self.world.size // n)]
        full = torch.cat(groups) if split else groups[0]  # [B, C, H, W]
        return UNet2DConditionOutput(sample=full) if return_dict else (full,)

    __call__ = forward

    # ----------------------------------------------------------------------------------------------

    def _my_half(self, b: int, sample, timestep, text, kwargs):
        """This group's half of every per-sample input (a tensor whose first dimension is the batch, in
        added_cond_kwargs too); the text half is the same tensor object while the prompt tensor is (its
        keys/values stay cached)."""

        def half(x):
            if isinstance(x, dict):
                return {k: half(v) for k, v in x.items()}
            if isinstance(x, torch.Tensor) and x.ndim > 0 and x.shape[0] == b:
                return x[self.half * (b // 2) : (self.half + 1) * (b // 2)]
            return x

        if text is not None:
            cached = self._halved
            if cached is None or cached[0] is not text or cached[1] != text._version:
                self._halved = cached = (text, text._version, half(text))
            text = cached[2]
        return half(sample), half(timestep), text, {k: half(v) for k, v in kwargs.items()}

    def _group_rows(self, b: int) -> int:
        """Rows one rank group runs of a batch of b."""
        return b // 2 if self.cfg_split and b % 2 == 0 else b

    def _check_input(self, sample: torch.Tensor) -> int:
        if sample.ndim != 4:
            raise FlowfleetError(f"patch-parallel U-Net: expected a latent [B, C, H, W], got {tuple(sample.shape)}")
        b, h = sample.shape[0], sample.shape[-2]
        n = self.step.bands
        if h % (n * self.factor):
            raise FlowfleetError(
                f"patch-parallel U-Net: a latent of height {h} cannot be split into {n} bands of whole rows at every "
                f"U-Net level (the height must be a multiple of {n} x {self.factor} = {n * self.factor})"
            )
        if self.max_batch is not None and b > self.max_batch:
            raise FlowfleetError(f"patch-parallel U-Net: batch of {b} exceeds max_batch={self.max_batch}")
        return b

    def _register(self, sample, timestep, encoder_hidden_states, **kwargs) -> None:
        """Run once without communication, collect every layer's slot, register them in forward order."""
        self._rows = self._group_rows(self.max_batch) if self.max_batch is not None else sample.shape[0]
        if self.mode.exchange is not ParallelMode.NAIVE:
            self.step.mode, self.step.batch, self.step.recording = UNetMode.NAIVE, sample.shape[0], {}
            try:
                with torch.no_grad():
                    self._class_forward(self.unet, sample, timestep, encoder_hidden_states, return_dict=False, **kwargs)
                slots = self.step.recording
            finally:
                self.step.recording = None
            for name, shape in slots.items():
                self.slots[name] = (self._rows, *shape)
                self.comm.register(name, self.slots[name], family="unet")
        self.comm.allocate()
        self._registered = True


def parallelize(
    unet: UNet2DConditionModel,
    group: Group | None = None,
    *,
    mode: UNetMode | str = UNetMode.DISPLACED,
    warmup: int = 4,
    cfg_split: bool = False,
    max_batch: int | None = None,
    batch_bytes: int | None = None,
    timeout_s: float = 60.0,
) -> ParallelUNet:
    """Patch `unet` in place to run on this rank's band of `group` (default: every rank of the default
    process group); `cfg_split`: the two halves of a guided batch on two halves of the ranks;
    `batch_bytes`: bytes per asynchronous all-gather (None: from the model's bytes, see parallel.comm).
    Returns the handle (reset(), restore(), comm, modes); use it as a context manager."""
    return ParallelUNet(
        unet,
        group or default_group(),
        mode=mode,
        warmup=warmup,
        cfg_split=cfg_split,
        max_batch=max_batch,
        batch_bytes=batch_bytes,
        timeout_s=timeout_s,
    )
