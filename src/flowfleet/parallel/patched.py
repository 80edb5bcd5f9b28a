"""A diffusers model patched in place to run one band of rows per rank, used from a normal pipeline loop.

What every patch-parallel diffusers model shares (the U-Net, flowfleet.parallel.unet; the transformers,
flowfleet.parallel.transformers): the model object keeps its type, attributes and state dict, but its own
forward and some of its layers' forwards (or attention processors) are replaced by band wrappers, and
restore() undoes it, so a pipeline holding the model runs patch-parallel without knowing. Patching
instance forwards, as accelerate's hooks do, keeps everything else untouched.

Each call: the full latent (identical on every rank) and the call's other arguments, bound by name to the
model class's forward -> (with CFG split) this rank group's half of every per-sample argument -> the model's
own forward on this rank's band (the subclass decides what it is given: the full latent for a U-Net whose
first convolution cuts the band, the band itself for a transformer) -> one all-gather of the output bands
-> the full prediction on every rank, so every rank's scheduler takes the identical step.

CFG split (`cfg_split=True`, an even number of ranks N, as distrifuser): a pipeline's guided call has the
batch [unconditional; conditional] (2B rows). Ranks [0, N/2) run its first half and ranks [N/2, N) its
second, each half split into N/2 bands: half the rows per rank, twice the rows per band, and the band
exchanges stay inside each group of N/2. A call whose batch is odd (no guidance) runs whole in both groups.

Sampler steps are counted from the start of a run: a new step begins when the timestep changes (Heun's
corrector at t_next and separate CFG calls at the same t are not steps of their own). A run starts at the
first call, after reset(), or when the timestep rises above the previous call's (a new scheduler loop).
The first step of a run and `warmup` more (default 4, as the paper and distrifuser) run as `sync`; so
does any evaluation whose batch size differs from the previous one's (the previous step's buffers would
belong to other samples). The first call of the object also runs the model once without communication
to discover every layer's comm slot (BandStep.declare) and registers them, in forward order, with one
CommManager.

diffusers' first-block cache (`transformer.enable_cache(FirstBlockCacheConfig(...))`, where diffusers has it:
Flux) works on a patched model: every rank takes the whole image's skip decision (parallel.cache).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn as nn

from flowfleet.distributed import Group, split_group
from flowfleet.errors import FlowfleetError, ParameterError
from flowfleet.parallel.cache import FBCacheSync
from flowfleet.parallel.comm import CommManager
from flowfleet.parallel.mode import ParallelMode, UNetMode
from flowfleet.parallel.sequence import SequenceMesh
from flowfleet.parallel.sequence import ulysses_degree as sequence_degree
from flowfleet.parallel.step import BandStep


class BatchHalves:
    """One rank group's half of each per-sample argument of a guided batch (a tensor whose first dimension is the
    batch, in dicts such as added_cond_kwargs and lists such as ControlNet's residuals too). The half of an unchanged
    tensor is the same tensor object on every call, so caches keyed on the prompt tensor (text keys/values) keep
    working."""

    def __init__(self, half: int):
        self.half = half  # which half of the batch (0: the first)
        self._cache: dict[str, tuple[torch.Tensor, int, torch.Tensor]] = {}  # argument -> (tensor, version, half)

    def __call__(self, name: str, value, b: int):
        if isinstance(value, dict):
            return {k: self(f"{name}.{k}", v, b) for k, v in value.items()}
        if isinstance(value, (list, tuple)):  # ControlNet residuals: one tensor per block
            return type(value)(self(f"{name}.{i}", v, b) for i, v in enumerate(value))
        if not (isinstance(value, torch.Tensor) and value.ndim > 0 and value.shape[0] == b):
            return value
        cached = self._cache.get(name)
        if cached is None or cached[0] is not value or cached[1] != value._version:
            cached = (value, value._version, value[self.half * (b // 2) : (self.half + 1) * (b // 2)])
            self._cache[name] = cached
        return cached[2]


class PatchedModel:
    """Base of the patch-parallel diffusers models; see the module docstring. A subclass names the forward
    argument holding the latent (`SAMPLE`), the arguments it cannot split (`UNSUPPORTED`), and provides
    _install() (patch the layers), _check_input(), _band_inputs() and _output()."""

    SAMPLE = "sample"
    UNSUPPORTED: tuple[str, ...] = ()
    SHARED: tuple[str, ...] = ()  # arguments that are never per sample (token ids), so never halved
    RESIDUALS: tuple[str, ...] = ()  # whole-image tensors (ControlNet residuals) each band gets its share of
    RETURNS_TUPLE = True  # the class forward returns (output,) for return_dict=False (not a VAE Decoder)
    what = "model"  # for messages

    def __init__(
        self,
        model: Any,  # a diffusers model (an nn.Module)
        group: Group,
        *,
        mode: UNetMode | str = UNetMode.DISPLACED,
        warmup: int = 4,
        cfg_split: bool = False,
        max_batch: int | None = None,
        batch_bytes: int | None = None,
        timeout_s: float = 60.0,
        ulysses_degree: int | None = None,
    ):
        if warmup < 0:
            raise ParameterError("warmup", f"must be >= 0, got {warmup}")
        if max_batch is not None and max_batch < 1:
            raise FlowfleetError(f"max_batch: must be >= 1, got {max_batch}")
        if cfg_split and group.size % 2:
            raise FlowfleetError(f"cfg_split: needs an even number of ranks, got {group.size}")
        band_count = group.size // 2 if cfg_split else group.size
        self._check_mode(model, UNetMode.parse(mode), band_count)
        degree = 1
        if band_count > 1 or ulysses_degree is not None:  # one band: every mode is the plain model
            heads = self._attention_heads(model)
            degree = sequence_degree(UNetMode.parse(mode).exchange, band_count, heads, ulysses_degree, "ulysses_degree")
        self.model = model
        self._class_forward = type(model).forward  # the model's own forward
        self._signature = inspect.signature(self._class_forward)
        self.requested = UNetMode.parse(mode)
        self.world = group
        self.cfg_split = cfg_split
        bands = split_group(group, group.size // 2, timeout_s) if cfg_split else group
        self.half = group.rank // bands.size  # with cfg_split: which half of a guided batch this rank runs
        # One rank owns the whole image: nothing to exchange, every mode is the plain model.
        self.mode = self.requested if bands.size > 1 else UNetMode.NAIVE
        self.warmup = int(warmup)
        self.max_batch = max_batch
        weights = next(model.parameters())
        self.comm = CommManager(
            bands, group, device=weights.device, dtype=weights.dtype, batch_bytes=batch_bytes, timeout_s=timeout_s
        )
        self.step = BandStep(self.comm, bands.rank, bands.size)
        self.cache = FBCacheSync(self.comm)  # diffusers' first-block cache, decided on every rank's statistics
        if self.mode.exchange.sequence:
            self.step.mesh = SequenceMesh.build(bands, degree, timeout_s)  # collective: every rank, same order
        self.modes: list[UNetMode] = []  # the mode each evaluation ran in (since construction)
        self._evals = 0  # evaluations since the run started
        self._steps = 0  # sampler steps since the run started (the step of the current evaluation)
        self._filled: int | None = None  # batch size whose activations the receive buffers hold
        self._last_t: float | None = None
        self._rows = 0  # batch rows per band slot (the largest batch one group runs), set at registration
        self.halves = BatchHalves(self.half)
        self.slots: dict[str, tuple[int, ...]] = {}  # comm slot -> shape, in forward order (after the first call)
        self._registered = False  # comm slots registered and allocated (first call)
        self._patched: list[nn.Module] = []
        self._processors: dict[Any, Any] = {}  # attention layer -> its own processor
        self._install()
        model.forward = self.forward  # an instance attribute shadows the class's forward
        self._patched.append(model)

    # ----------------------------------------------------------------------------------------------
    #                                  Patching the model
    # ----------------------------------------------------------------------------------------------

    def _install(self) -> None:
        raise NotImplementedError

    def _attention_heads(self, model: Any) -> list[int]:
        """Every attention layer's head count (the transformers: for the Ulysses degree)."""
        return []

    def _check_mode(self, model: Any, mode: UNetMode, bands: int) -> None:
        """A one-line error for a mode this model cannot run on `bands` bands. Here: the exact sequence-
        parallel modes, which only the transformers (no convolutions) take."""
        if mode.exchange.sequence:
            raise FlowfleetError(
                f"patch-parallel {self.what}: mode={mode.value} is exact sequence parallelism for transformers "
                f"(PixArt, SD3, Flux); a {self.what}'s convolutions need halo rows (use mode=sync or displaced)"
            )

    def _patch(self, module: nn.Module, wrapper) -> None:
        module.forward = wrapper
        self._patched.append(module)

    def _set_processor(self, attn, processor) -> None:
        self._processors[attn] = attn.processor
        attn.set_processor(processor)

    def restore(self) -> None:
        """Undo parallelize(): the model is the plain single-device model again."""
        self.comm.drain()
        self.cache.detach()
        for m in self._patched:
            if "forward" in m.__dict__:
                del m.forward
        for attn, processor in self._processors.items():
            attn.set_processor(processor)
        self._patched, self._processors = [], {}

    def __enter__(self):
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

    def forward(self, *args, return_dict: bool = True, **kwargs):
        """The model class's forward signature: full latent in, full prediction out, on every rank."""
        call = self._bind(args, kwargs)
        for key in self.UNSUPPORTED:
            if call.get(key) is not None:
                raise FlowfleetError(f"patch-parallel {self.what}: {key} is not supported")
        sample = call[self.SAMPLE]
        b = self._check_input(sample)
        if self.max_batch is not None and b > self.max_batch:
            raise FlowfleetError(f"patch-parallel {self.what}: batch of {b} exceeds max_batch={self.max_batch}")
        split = self.cfg_split and b % 2 == 0
        if split:  # this group's half of [unconditional; conditional]
            call = {name: value if name in self.SHARED else self.halves(name, value, b) for name, value in call.items()}
        rows = call[self.SAMPLE].shape[0]
        t_now = float(torch.as_tensor(call.get("timestep", 0), dtype=torch.float64).max())
        if self._last_t is not None and t_now > self._last_t:
            self.reset()  # the timestep went back up: a new scheduler loop
        elif self._last_t is not None and t_now != self._last_t:
            self._steps += 1  # a new sampler step
        self._last_t = t_now
        self.cache.attach(self.model)  # a cache enabled after parallelize() too
        if not self._registered:
            self._register(call)
        mode = self.mode.at_step(self._steps, self.warmup)
        if rows > self._rows:
            raise FlowfleetError(
                f"patch-parallel {self.what}: {rows} rows per rank group exceed the {self._rows} its buffers hold "
                f"(a batch of {b}; give max_batch for the largest one)"
            )
        if mode.exchange is ParallelMode.DISPLACED and self._filled != rows:
            mode = UNetMode.SYNC  # no previous-step activations for this batch
        self.comm.begin_step(self._evals)
        self.step.mode, self.step.batch = mode, rows
        band = self._run(call)  # [rows, C, H/n, W]   (n = ranks per group)
        if mode.exchange is ParallelMode.DISPLACED:
            self.comm.flush()  # a batch not yet complete (a layer skipped this evaluation) leaves now
        self._filled = rows if mode.exchange is not ParallelMode.NAIVE else None
        self.modes.append(mode)
        self._evals += 1
        sizes = self.step.counts(band.shape[-2])  # every band's output rows (or tokens)
        groups = self.comm.gather_image(band, sizes, what=f"{self.what} output band")  # [B/groups, C, H, W] each
        full = torch.cat(groups) if split else groups[0]  # [B, C, H, W]
        return self._output(full) if return_dict or not self.RETURNS_TUPLE else (full,)

    __call__ = forward

    def _run(self, call: dict[str, Any]) -> torch.Tensor:
        """The model's own forward on this rank's band -> the output band."""
        if not self.RETURNS_TUPLE:
            return self._class_forward(self.model, **self._band_inputs(call))
        return self._class_forward(self.model, **self._band_inputs(call), return_dict=False)[0]

    # ----------------------------------------------------------------------------------------------
    #                                What a subclass decides
    # ----------------------------------------------------------------------------------------------

    def _check_input(self, sample: torch.Tensor) -> int:
        """Raise a one-line error for a latent this model cannot split; -> its batch size."""
        raise NotImplementedError

    def _band_inputs(self, call: dict[str, Any]) -> dict[str, Any]:
        """What the model's own forward is given: the full latent (default) or this rank's band of it."""
        return call

    def _output(self, full: torch.Tensor):
        raise NotImplementedError

    # ----------------------------------------------------------------------------------------------

    def _bind(self, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The call's arguments by name, as the model class's forward would see them."""
        try:
            bound = self._signature.bind(self.model, *args, **kwargs)
        except TypeError as e:
            raise FlowfleetError(f"patch-parallel {self.what}: {e}") from None
        call = dict(bound.arguments)
        call.pop(next(iter(self._signature.parameters)))  # self
        for name, param in self._signature.parameters.items():
            if param.kind is inspect.Parameter.VAR_KEYWORD and name in call:
                call.update(call.pop(name))
        call.pop("return_dict", None)
        return call

    def _my_bands(self, call: dict[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
        """`call` with this band's share of the whole-image tensors (or lists of them) under `names`
        (ControlNet residuals: rows at every U-Net level, or tokens)."""
        out = dict(call)
        for name in names:
            value = call.get(name)
            if isinstance(value, torch.Tensor):
                out[name] = self.step.cut(value)
            elif value is not None:
                out[name] = type(value)(self.step.cut(v) for v in value)
        return out

    def _group_rows(self, b: int) -> int:
        """Rows one rank group runs of a batch of b."""
        return b // 2 if self.cfg_split and b % 2 == 0 else b

    def _register(self, call: dict[str, Any]) -> None:
        """Run once without communication, collect every layer's slot, register them in forward order."""
        self._rows = self._group_rows(self.max_batch) if self.max_batch is not None else call[self.SAMPLE].shape[0]
        if self.mode.exchange is not ParallelMode.NAIVE and not self.mode.exchange.sequence:
            self.step.mode, self.step.batch, self.step.recording = UNetMode.NAIVE, call[self.SAMPLE].shape[0], {}
            try:
                with torch.no_grad(), self.cache.bypass():
                    self._run(call)
                slots = self.step.recording
            finally:
                self.step.recording = None
            for name, shape in slots.items():
                self.slots[name] = (self._rows, *shape)
                self.comm.register(name, self.slots[name], family=self.what)
        self.comm.allocate()
        self._registered = True
