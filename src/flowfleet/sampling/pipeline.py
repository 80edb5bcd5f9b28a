"""FleetPipeline: K experts + a router sampled as one model (paris §2.7).

    pipe = FleetPipeline.from_pretrained("runs/r/model", offload=2)
    out = pipe(["a handwritten digit seven"], n=16, strategy="top2", guidance_scale=2.0, seed=0)
    out.images  # [16, C, H, W] in [-1, 1];  out.trace: what the router chose per step and sample

The sampling loop is `flowfleet.flow.integrate` over a velocity function (x_t, t, step) -> v. The
routed one (RoutedVelocity) runs the router on x_t (Paris' p(k | x_t, t); a prompt-aware router also
reads the prompt, and then guides the mixture: each guidance branch routed by its own posterior) every
`route_every` steps, keeps the top-k present experts per sample and branch with renormalised weights, and
runs each selected expert only on its own rows (flowfleet.sampling.routing). Anything with
that signature can replace it (`sample(..., velocity_fn=...)`), e.g. a patch-parallel version of the same
computation.

Experts and the router are callables in the model-call convention of docs/contracts.md, so the same
loop samples DiT modules, counting wrappers and closed-form flows (the tests' Gaussian-mixture toy).
FleetPipeline is a plain class rather than a diffusers DiffusionPipeline: diffusers loads every
component eagerly, while a fleet loads experts lazily and may keep only M of them resident.

Opening a folder checks its files first (flowfleet.sampling.folder); the encoders and the prompts' or labels'
condition are FleetConditioning's, below. Model classes, tqdm and the encoders are
imported where used, so importing the pipeline stays light.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from flowfleet.config import SamplingSettings
from flowfleet.errors import FlowfleetError, ParameterError
from flowfleet.flow import Strategy, integrate, time_grid
from flowfleet.flow.sampler import VelocityFn
from flowfleet.layout import MODEL_VAE
from flowfleet.sampling.cache import BlockCache
from flowfleet.sampling.folder import ModelIndex, SchedulerConfig, open_folder
from flowfleet.sampling.prompts import PromptEmbeddings
from flowfleet.sampling.routing import Condition, Selection, draw_selection, present_probs, run_selected, select_experts
from flowfleet.sampling.store import ExpertStore
from flowfleet.sampling.trace import RoutingTrace
from flowfleet.storage import RunRoot

# (x_t [B, C, H, W], t [B], **prompt keywords for a prompt-aware router) -> logits [B, K]
RouterFn = Callable[..., torch.Tensor]


# --------------------------------------------------------------------------------------------------
#                                   Settings and results
# --------------------------------------------------------------------------------------------------


@dataclass
class FleetOutput:
    images: torch.Tensor  # [n, C_img, H_img, W_img] in [-1, 1]
    latents: torch.Tensor  # [n, C, H, W] what the experts denoised
    trace: RoutingTrace
    settings: SamplingSettings
    prompts: list[str] = field(default_factory=list)  # per sample ("" without text)


# --------------------------------------------------------------------------------------------------
#                               The per-step velocity (the seam)
# --------------------------------------------------------------------------------------------------


class RoutedVelocity:
    """(x_t, t, step) -> v of the routed fleet, with classifier-free guidance on all channels.

    The router sees x_t and t (paris §2.5), and the prompt when it is prompt-aware. Guided over the mixture (the
    settings' guidance "mixture", with a router that reads the prompt), each branch of guidance is routed by its own
    posterior, p(k | x_t, t, c) for the conditional rows and p(k | x_t, t, null) for the unconditional ones, each
    with its own top-k (flowfleet.flow.guided_mixture); otherwise (guidance "expert", or a
    prompt-blind router, whose two posteriors are one) the conditional rows' choice serves both. The router runs on
    every evaluation when route_every == 1 (Heun's corrector included) and otherwise on the first evaluation of
    every route_every-th step, its choice being reused in between; the trajectory strategy routes once, at the
    first evaluation, and keeps that expert to the end. What it runs: the settings' strategy, k, guidance
    (SamplingConfig.guidance_at; every row of a call shares its t, as a sampling step's do), route_every and cache.
    """

    def __init__(self, pipe: "FleetPipeline", cond: Condition, settings: SamplingSettings, trace: RoutingTrace):
        self.pipe, self.cond, self.trace = pipe, cond, trace
        self.settings, self.k, self.route_every = settings, settings.k, settings.route_every
        self.kept = settings.strategy.kept  # trajectory: one drawn expert, kept
        self.guided = pipe.guidance_applies(settings.guidance_scale)  # at some step: the unconditional rows exist
        # the unconditional branch's own posterior: only where it differs from the prompt's
        self.mixture = self.guided and settings.guidance == "mixture" and pipe.router_sees_prompt and not self.kept
        self.cache_threshold = settings.cache
        self._cache: BlockCache | None = None  # built at the first call, when the batch is known
        self._selection: tuple[Selection, Selection | None] | None = None
        self._last_step = -1

    def __call__(self, x: torch.Tensor, t: torch.Tensor, step: int) -> torch.Tensor:
        selection, uncond = self.select(x, t, step)
        guidance_scale = self.settings.guidance_at(float(t[0]))
        guided = self.pipe.guidance_applies(guidance_scale)  # an unguided step runs no unconditional rows
        if self.cache_threshold > 0 and (self._cache is None or self._cache.rows != x.shape[0] * (1 + guided)):
            self._cache = BlockCache(self.cache_threshold, x.shape[0] * (1 + guided), self.trace.stats.cache)
        stats = self.trace.stats
        return run_selected(
            self.pipe.experts, x, t, self.cond, selection, guidance_scale, guided, stats, self._cache, uncond
        )

    def select(self, x: torch.Tensor, t: torch.Tensor, step: int) -> tuple[Selection, Selection | None]:
        """This evaluation's per-sample experts and weights (routing + trace, no expert runs): the conditional
        branch's, and the unconditional branch's where guidance over the mixture routes it apart (else None: the
        conditional's serves both). The patch-parallel velocity (flowfleet.parallel.fleet) routes through here too."""
        first_eval = step != self._last_step
        reroute = self._selection is None or (
            not self.kept and (self.route_every == 1 or (first_eval and step % self.route_every == 0))
        )
        if self._selection is None or reroute:
            self._selection = self._route(x, t)
            self.trace.router_calls += self.pipe.router is not None
        if first_eval:
            guided = self.pipe.guidance_applies(self.settings.guidance_at(float(t[0])))  # null rows at this step
            uncond = self._selection[1] if guided else None
            self.trace.record(float(t[0]), self._selection[0], routed=reroute, uncond=uncond)
            self._last_step = step
        return self._selection

    def _route(self, x: torch.Tensor, t: torch.Tensor) -> tuple[Selection, Selection | None]:
        pipe = self.pipe
        probs = pipe.router_probs(x, t, self.cond)  # [B, P]
        if self.kept:  # the trajectory sampler: drawn once, at x_1, under the prompt
            return draw_selection(probs, pipe.present, pipe.num_experts, x), None
        select = functools.partial(select_experts, present=pipe.present, num_experts=pipe.num_experts, k=self.k)
        if not self.mixture:
            return select(probs), None
        return select(probs), select(pipe.router_probs(x, t, self.cond, null=True))


# --------------------------------------------------------------------------------------------------
#                         The condition: prompts or labels, and their encoders
# --------------------------------------------------------------------------------------------------

TEXT_CONDITIONING = ("pooled", "cross_attn")


class FleetConditioning:
    """FleetPipeline's encoders and conditions. It reads what the pipeline sets: conditioning, num_classes, index
    (the folder's model_index.json, or None), folder, device, dtype and latent_decoder."""

    conditioning: str
    num_classes: int
    index: ModelIndex | None
    folder: str | None
    device: torch.device
    dtype: torch.dtype
    latent_decoder: Any

    @property
    def text_encoder(self) -> Any:
        return self._text_encoder

    @text_encoder.setter
    def text_encoder(self, encoder: Any) -> None:
        self._text_encoder = encoder
        # each distinct prompt encoded once, alone (flowfleet.sampling.prompts)
        self.prompts = PromptEmbeddings(encoder) if encoder is not None else None

    def share_prompts(self, other: "FleetConditioning") -> None:
        """Keep prompt embeddings with another pipeline of the same text encoder (an evaluation's fleet and its
        monolith): a prompt both sample is encoded once. The embeddings are the same either way."""
        if other.text_encoder is not self.text_encoder:
            raise ValueError("share_prompts: the pipelines have different text encoders")
        self.prompts = other.prompts

    def load_encoders(self) -> None:
        """Build the text encoder and latent decoder from the folder's references, where not given."""
        if self.index is None:
            return
        if self.text_encoder is None and self.conditioning in TEXT_CONDITIONING:
            self.text_encoder = build_text_encoder_from(self.index, self.device)
        if self.latent_decoder is None:
            self.latent_decoder = build_latent_decoder_from(self.index, self.device, self.folder)

    def check_condition(self, prompts: Sequence[str] | None, labels: Sequence[int] | None) -> None:
        """Validate prompts / labels for this fleet's conditioning (before any encoder is loaded)."""
        check_condition(self.conditioning, self.num_classes, prompts, labels)

    def encode_condition(
        self, prompts: Sequence[str] | None, labels: Sequence[int] | None, n: int
    ) -> tuple[Condition, list[str]]:
        """Per-sample Condition for n samples, cycling through the prompts (or labels)."""
        self.check_condition(prompts, labels)
        if self.conditioning in TEXT_CONDITIONING:
            width = self.index.text_width if self.index is not None else None
            return _text_condition(self.prompts, list(prompts or []), width, n, self.device, self.dtype)
        if self.conditioning == "class":
            labels = list(labels or [])
            which = torch.arange(n) % len(labels)
            return Condition(labels=torch.tensor(labels, device=self.device)[which]), [""] * n
        return Condition(), [""] * n


def check_condition(
    conditioning: str, num_classes: int, prompts: Sequence[str] | None, labels: Sequence[int] | None
) -> None:
    """Prompts for a text-conditioned fleet (none empty), labels in 0..num_classes-1 for a class-conditioned one."""
    if conditioning in TEXT_CONDITIONING:
        if not prompts:
            raise ParameterError("prompt", "required (the experts are text-conditioned)")
        if any(not p.strip() for p in prompts):
            raise ParameterError("prompt", "empty prompt")
    elif conditioning == "class":
        if not labels:
            raise ParameterError("label", "required (the experts are class-conditioned)")
        bad = [y for y in labels if not 0 <= y < num_classes]
        if bad:
            raise ParameterError("label", f"{bad[0]} outside 0..{num_classes - 1}")


def _text_condition(
    embeddings: PromptEmbeddings | None,
    prompts: list[str],
    width: int | None,
    n: int,
    device: torch.device,
    dtype: torch.dtype,
) -> tuple[Condition, list[str]]:
    """n samples' text condition, cycling through the prompts, each encoded once; the encoder's width checked
    against the experts' (`width`; None: not known)."""
    if embeddings is None:
        raise FlowfleetError("text encoder: none loaded for this text-conditioned fleet")
    emb = embeddings(prompts)  # tokens [P, L, T], mask [P, L], pooled [P, T]
    if width is not None and emb.tokens.shape[-1] != width:
        raise FlowfleetError(f"text encoder: width {emb.tokens.shape[-1]} differs from the experts' text width {width}")
    which = torch.arange(n) % len(prompts)
    cond = Condition(
        text_tokens=emb.tokens[which].to(device, dtype),
        text_mask=emb.mask[which].to(device).bool(),
        text_pooled=emb.pooled[which].to(device, dtype),
    )
    return cond, [prompts[i] for i in which.tolist()]


def _encoders_module():
    try:
        from flowfleet.data import encoders
    except ImportError:
        raise FlowfleetError(
            "encoders: flowfleet.data.encoders is not available in this install "
            "(pass text_encoder= / latent_decoder= objects instead)"
        ) from None
    return encoders


def build_text_encoder_from(index: ModelIndex, device: torch.device | str) -> Any:
    """The text encoder the fleet was trained with, from its reference (never copied into the folder)."""
    cfg = index.text_config()
    if cfg is None or cfg.name == "none":
        raise FlowfleetError("model_index.json: text-conditioned experts but no text encoder reference")
    return _encoders_module().build_text_encoder(cfg, device)


def build_latent_decoder_from(index: ModelIndex, device: torch.device | str, folder: str | None = None) -> Any:
    """The latent encoder (for .decode). Pixel-space fleets need none: their 'latents' are images. A
    run-trained autoencoder's weights are in the model folder's vae/."""
    cfg = index.latent_config()
    if cfg.name == "pixels":
        return None
    weights = RunRoot(folder).url_of(MODEL_VAE) if folder is not None else None
    return _encoders_module().build_latent_encoder(cfg, index.image_channels, device, weights)


# --------------------------------------------------------------------------------------------------
#                                        The pipeline
# --------------------------------------------------------------------------------------------------


class FleetPipeline(FleetConditioning):
    """Experts (an ExpertStore), a router callable, optional text encoder and latent decoder.

    router=None is allowed for a fleet of one expert (a monolith sampled through the same loop).
    """

    def __init__(
        self,
        experts: ExpertStore,
        router: RouterFn | None,
        *,
        latent_shape: Sequence[int],
        conditioning: str = "none",
        num_classes: int = 0,
        text_encoder: Any = None,
        latent_decoder: Any = None,
        scheduler: SchedulerConfig | None = None,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        index: ModelIndex | None = None,
    ):
        if router is None and len(experts.present) != 1:
            raise ValueError("a router is required for a fleet of more than one expert")
        self.experts = experts
        self.router = router
        self.latent_shape = tuple(int(s) for s in latent_shape)
        self.conditioning = conditioning
        self.num_classes = num_classes
        self.text_encoder = text_encoder
        self.latent_decoder = latent_decoder
        self.folder: str | None = None  # the model folder it was opened from (from_pretrained)
        self.scheduler = scheduler or SchedulerConfig()
        self.device = torch.device(device)
        self.dtype = dtype
        self.index = index

    @property
    def num_experts(self) -> int:
        return self.experts.num_experts

    def with_router(self, router: RouterFn) -> "FleetPipeline":
        """The same experts, encoders and settings routed by another router over the same K experts (a
        comparison router: Paris' prompt-blind one, or a prompt-aware one); the experts are shared, not copied."""
        outputs = getattr(getattr(router, "cfg", None), "num_outputs", self.num_experts)
        if outputs != self.num_experts:
            raise FlowfleetError(f"router: {outputs} outputs, the fleet has {self.num_experts} experts")
        other = copy.copy(self)
        other.router = router
        return other

    @property
    def present(self) -> tuple[int, ...]:
        return self.experts.present

    # -- loading ----------------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(
        cls,
        model_dir: str,
        *,
        device: torch.device | str = "cpu",
        offload: int | None = None,
        text_encoder: Any = None,
        latent_decoder: Any = None,
        load_encoders: bool = True,
    ) -> "FleetPipeline":
        """Open an assembled fleet (its files checked: flowfleet.sampling.folder). The router loads now; experts
        load when first selected.

        text_encoder / latent_decoder: objects following docs/contracts.md (`.encode(captions)`,
        `.decode(latents)`); when None and load_encoders, they are built from the references in the
        folder with flowfleet.data.encoders.
        """
        opened = open_folder(model_dir, device, offload)
        index = opened.index
        pipe = cls(
            opened.experts,
            opened.router,
            latent_shape=index.latent_shape,
            conditioning=index.conditioning,
            num_classes=index.num_classes,
            text_encoder=text_encoder,
            latent_decoder=latent_decoder,
            scheduler=index.scheduler,
            device=device,
            index=index,
        )
        pipe.folder = opened.root.url
        if load_encoders:
            pipe.load_encoders()
        return pipe

    # -- routing and guidance ---------------------------------------------------------------------------

    @property
    def router_sees_prompt(self) -> bool:
        """True for a router that reads the condition, p(k | x_t, t, prompt), instead of Paris' p(k | x_t, t): a DiT
        router with text conditioning, or a router callable that says so (`reads_condition = True`)."""
        cfg = getattr(self.router, "cfg", None)
        if cfg is not None:
            return bool(cfg.uses_text)
        return bool(getattr(self.router, "reads_condition", False))

    def router_probs(
        self, x: torch.Tensor, t: torch.Tensor, cond: Condition | None = None, null: bool = False
    ) -> torch.Tensor:
        """p(k | x_t, t[, prompt]) over the present experts, [B, P] (renormalised when some are absent); null: the
        prompt dropped, p(k | x_t, t, null), from a router that reads it (trained with condition dropout, as the
        experts are: the unconditional branch's posterior of guidance over the mixture)."""
        if self.router is None:
            return torch.ones(x.shape[0], 1, dtype=x.dtype, device=x.device)
        kwargs = cond.kwargs() if cond is not None and self.router_sees_prompt else {}
        if null and kwargs:
            kwargs["drop"] = torch.ones(x.shape[0], dtype=torch.bool, device=x.device)
        return present_probs(self.router(x, t, **kwargs), self.present)

    def guidance_applies(self, guidance_scale: float) -> bool:
        """CFG needs a condition to drop; scale 1 is no guidance (and saves the unconditional pass)."""
        return self.conditioning != "none" and guidance_scale != 1.0

    def velocity_fn(self, cond: Condition, settings: SamplingSettings, trace: RoutingTrace) -> VelocityFn:
        """The per-step velocity (x_t, t, step) -> v of this fleet under `settings` (self.settings()); see
        RoutedVelocity."""
        return RoutedVelocity(self, cond, settings, trace)

    # -- settings -----------------------------------------------------------------------------------------

    def settings(self, strategy: "str | Strategy | None" = None, **choices: Any) -> SamplingSettings:
        """This call's settings: the fleet's (model_index.json's scheduler) with the given choices (None: the
        fleet's), checked (a one-line SettingError naming the option) and k resolved against the present experts."""
        return self.scheduler.for_call(len(self.present), strategy=strategy, **choices)

    # -- conditioning ------------------------------------------------------------------------------------

    # -- sampling ----------------------------------------------------------------------------------------

    def sample(
        self,
        noise: torch.Tensor,
        cond: Condition,
        settings: SamplingSettings,
        velocity_fn: VelocityFn | None = None,
        progress: bool | str = False,
        parallel: Any = None,
        on_step: Callable[[int], None] | None = None,
    ) -> tuple[torch.Tensor, RoutingTrace]:
        """Integrate from noise x_1 to x_0 with the routed velocity (or the given velocity_fn).

        progress: True shows a bar named after the strategy; a string names the bar itself.
        on_step(i): called after step i (0-based) is done, e.g. by a web page's progress bar.
        parallel: a flowfleet.parallel.fleet.ParallelFleet: the same routed velocity, patch-parallel
        over its ranks (`generate --nproc N`)."""
        trace = RoutingTrace(self.num_experts)
        if velocity_fn is None and parallel is not None:
            if settings.cache:
                raise ParameterError("cache", "not with --nproc (the patch-parallel experts run every block)")
            velocity_fn = parallel.velocity_fn(self, cond, settings, trace)
        vf = velocity_fn or self.velocity_fn(cond, settings, trace)
        grid = time_grid(settings.steps, settings.shift, device=noise.device)
        label = progress if isinstance(progress, str) else settings.strategy.name
        with _steps_shown(settings.steps, label if progress else None, on_step) as step_done, torch.inference_mode():
            x0 = integrate(vf, noise, grid, settings.sampler, callback=step_done)
        return x0, trace

    def noise(self, n: int, seed: int) -> torch.Tensor:
        """x_1 of n samples, [n, C, H, W] on the device: one seeded generator on the CPU, so a seed draws the
        same images on any device, in any batch split, alone or batched with other requests."""
        gen = torch.Generator().manual_seed(seed)
        return torch.randn(n, *self.latent_shape, generator=gen, dtype=self.dtype).to(self.device)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents -> images in [-1, 1] (identity for pixel-space fleets)."""
        images = self.latent_decoder.decode(latents) if self.latent_decoder is not None else latents
        return images.clamp(-1.0, 1.0)

    def __call__(
        self,
        prompts: Sequence[str] | None = None,
        n: int = 16,
        *,
        labels: Sequence[int] | None = None,
        batch_size: int | None = None,
        progress: bool | str = False,
        parallel: Any = None,
        settings: SamplingSettings | None = None,
        on_step: Callable[[int, int], None] | None = None,
        noise: torch.Tensor | None = None,
        **choices: Any,
    ) -> FleetOutput:
        """Generate n samples. Noise for all n comes from one seeded generator, so the batch size does not change the
        images. choices: sampling settings (strategy, steps, guidance_scale, seed, ...: config.SamplingSettings;
        unset: the fleet's); settings: the choices as self.settings() already resolved them (then no choices).
        parallel: see sample(). on_step(done, total): after every sampling step of every batch (total = steps x
        batches). noise: x_1 of the n samples [n, C, H, W] (e.g. drawn from a caller's torch.Generator; default: the
        seed's, self.noise)."""
        if n < 1:
            raise ParameterError("n", f"must be >= 1, got {n}")
        if settings is None:
            settings = self.settings(**choices)
        elif choices:
            raise FlowfleetError(f"settings: given whole, so not also {', '.join(sorted(choices))}")
        cond, per_sample_prompts = self.encode_condition(prompts, labels, n)
        if noise is None:
            noise = self.noise(n, settings.seed)
        elif tuple(noise.shape) != (n, *self.latent_shape):
            raise FlowfleetError(f"noise: shape {tuple(noise.shape)}, expected {(n, *self.latent_shape)}")
        bs = batch_size or n
        total = settings.steps * ((n + bs - 1) // bs)
        latents, traces = [], []
        for start in range(0, n, bs):
            rows = torch.arange(start, min(start + bs, n), device=self.device)
            step_cb = None
            if on_step is not None:
                step_cb = functools.partial(_report_step, on_step, settings.steps * (start // bs), total)
            x0, trace = self.sample(
                noise[rows], cond.select(rows), settings, progress=progress, parallel=parallel, on_step=step_cb
            )
            latents.append(x0)
            traces.append(trace)
        latents_t = torch.cat(latents)
        with torch.inference_mode():
            images = self.decode(latents_t)
        return FleetOutput(images, latents_t, RoutingTrace.concat(traces), settings, per_sample_prompts)


# --------------------------------------------------------------------------------------------------
#                                          Progress
# --------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _steps_shown(steps: int, label: str | None, on_step: Callable[[int], None] | None):
    """The sampler's callback after each step: a progress bar named `label` (None: no bar) and on_step(i)."""
    bar = None
    if label is not None:
        from tqdm.auto import tqdm

        bar = tqdm(total=steps, desc=f"sampling ({label})", unit="step", leave=False)

    def step_done(i: int, x: torch.Tensor) -> None:
        if bar is not None:
            bar.update(1)
        if on_step is not None:
            on_step(i)

    try:
        yield step_done
    finally:
        if bar is not None:
            bar.close()


def _report_step(on_step: Callable[[int, int], None], done_before: int, total: int, i: int) -> None:
    """on_step(done, total) after step i of a batch that starts once done_before steps are done."""
    on_step(done_before + i + 1, total)
