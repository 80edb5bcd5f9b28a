"""One model folder behind a bounded queue: validated requests in, images and routing traces out.

    service = FleetService.open("runs/r/model", limits=ServeLimits(max_queue=64))
    result = service.generate(GenerateRequest(prompt="a handwritten digit seven", strategy="top2", n=4))
    result.images  # PIL images;  result.routing[i]: which experts drew image i at each step, with what weight

The web page and the HTTP API (flowfleet.serve.app) are two faces of this one call. A request is
checked against the fleet before it waits (a bad one never takes a place in the queue); then its images
take places among max_batch + max_queue, or it is refused as busy at once. Requests that arrive within
batch_window_ms of each other and share their settings but the seed are sampled as one batch
(flowfleet.serve.batcher): each keeps its own prompt, noise (its seed) and per-sample routing, so its
images are the ones it would get alone, up to float rounding. One worker thread owns the device. A model
split over ranks (--nproc) samples one request at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from flowfleet.config import SAMPLING_CHOICES, SamplingSettings, SettingError
from flowfleet.errors import FlowfleetError
from flowfleet.sampling.card import FleetCard, read_card
from flowfleet.sampling.pipeline import TEXT_CONDITIONING, FleetPipeline
from flowfleet.sampling.trace import RoutingTrace
from flowfleet.sampling.views import to_pil
from flowfleet.serve.batcher import Batcher, BatchJob
from flowfleet.threads import ThreadGovernor

if TYPE_CHECKING:  # torch.distributed only for --nproc
    from flowfleet.serve.parallel import ParallelServing

STRATEGIES = ("top1", "topk", "full")  # the choices of the page; the API also takes top2, topk:3 ...


class ServeLimits(BaseModel):
    """What one request may ask for, and how many may wait."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_queue: int = Field(64, ge=0)  # images that may wait beyond the batch being sampled
    max_steps: int = Field(200, ge=1)
    max_images: int = Field(8, ge=1)  # per request
    max_guidance_scale: float = Field(30.0, ge=0)
    max_prompt_chars: int = Field(1000, ge=1)
    max_batch: int = Field(32, ge=1)  # images sampled together (requests batched across clients)
    batch_window_ms: float = Field(50.0, ge=0, le=10_000)  # how long a batch waits for more requests

    @model_validator(mode="after")
    def _batch_holds_a_request(self) -> "ServeLimits":
        if self.max_batch < self.max_images:
            raise ValueError(f"max_batch: {self.max_batch} is below max_images {self.max_images} (one request)")
        return self


def _with_sampling_settings(schema: dict[str, Any]) -> None:
    """A request's JSON schema (FastAPI's /docs) lists the sampling settings it may set: SamplingSettings' own."""
    own = SamplingSettings.model_json_schema()["properties"]
    schema["properties"].update({name: own[name] for name in SAMPLING_CHOICES})


class GenerateRequest(BaseModel):
    """One generate call: what to draw, and any sampling setting by its name (config.SamplingSettings: strategy,
    steps, guidance_scale, seed, cache, ...); unset settings take the model folder's (its model_index.json). The
    settings are checked where they are declared, when the service resolves them (Service.check)."""

    model_config = ConfigDict(extra="allow", json_schema_extra=_with_sampling_settings)

    prompt: str | None = None  # text-conditioned fleets
    label: int | None = None  # class-conditioned fleets
    k: int | None = None  # experts per sample for strategy "topk"
    n: int = 1  # images
    routing: bool = False  # the API's answer also carries each image's routing per step (the page always shows it)

    @model_validator(mode="after")
    def _only_sampling_settings(self) -> "GenerateRequest":
        for name in self.model_extra or {}:
            if name not in SAMPLING_CHOICES:
                settings = ", ".join(SAMPLING_CHOICES)
                # any JSON key, in one short line beside the settings' names
                shown = name if name.isidentifier() and len(name) <= 24 else repr(name[:24])
                raise ValueError(f"{shown}: not a field of a request nor a sampling setting ({settings})")
        return self

    def choices(self) -> dict[str, Any]:
        """The sampling settings this request sets."""
        return dict(self.model_extra or {})


class BadRequest(FlowfleetError):
    """A request this fleet cannot serve as asked (HTTP 422); the message names the field."""


class Busy(FlowfleetError):
    """Every place in the queue is taken (HTTP 503); try again later."""


@dataclass
class Generation:
    images: list[Any]  # PIL images
    prompts: list[str]
    trace: RoutingTrace
    settings: SamplingSettings
    seconds: float  # generation only, without the wait in the queue
    waited: float  # seconds in the queue
    replica: str | None = None  # under Ray Serve: the replica that drew it
    attempts: int = 1  # under Ray Serve: replicas asked (more than 1: one went away with the request)

    @functools.cached_property
    def routing(self) -> list[list[dict[str, Any]]]:
        """Per image, per step: t, experts, weights, router probabilities (made when asked for: a request's
        `routing`, the page)."""
        return per_image_routing(self.trace)


def per_image_routing(trace: RoutingTrace) -> list[list[dict[str, Any]]]:
    """The routing trace split per image: [image][step] -> {t, experts, weights, probs; uncond_experts and
    uncond_weights where guidance over the mixture routed the unconditional branch apart}."""
    return [[trace.image_step(s, i) for s in range(trace.num_steps)] for i in range(trace.num_samples)]


@dataclass
class _Sample:
    """What one request asks the batch for (the payload of its BatchJob)."""

    prompts: list[str] | None
    labels: list[int] | None
    n: int
    settings: SamplingSettings
    on_step: Callable[[int, int], None] | None


@dataclass
class _Drawn:
    images: list[Any]  # PIL images
    prompts: list[str]
    trace: RoutingTrace
    seconds: float  # the batch's sampling time


class FleetService:
    def __init__(
        self,
        pipe: FleetPipeline,
        card: FleetCard,
        limits: ServeLimits | None = None,
        parallel: "ParallelServing | None" = None,
        threads: int | None = None,
    ):
        """parallel: rank 0 of a model split over N ranks (flowfleet.serve.parallel); each call is
        announced to the other ranks and sampled patch-parallel, one at a time. threads: torch's CPU threads
        of the batcher's worker (default: as the process has them)."""
        limits = limits or ServeLimits()
        self.pipe, self.card, self.limits, self.parallel = pipe, card, limits, parallel
        self._generating = threading.Lock()  # --nproc: one patch-parallel call at a time
        self._counts_lock = threading.Lock()
        self.counts = {"served": 0, "refused_busy": 0, "bad_request": 0, "failed": 0}
        self.admitted = 0  # images of the requests holding a place now (sampling and waiting)
        self.replica: str | None = None  # under Ray Serve (flowfleet.serve.ray_serve): this replica's id
        self._governor: ThreadGovernor | None = None

        def take_threads() -> None:  # in the batcher's worker, whose thread count is its own (OpenMP's is per thread)
            if threads:
                torch.set_num_threads(threads)
            if pipe.device.type == "cpu":  # a request's batch is a loop of small steps: it follows the load
                self._governor = ThreadGovernor()

        self.batcher = (
            Batcher(self._sample_batch, limits.batch_window_ms / 1000, limits.max_batch, on_start=take_threads)
            if parallel is None
            else None
        )

    @classmethod
    def open(
        cls,
        model_dir: str,
        *,
        device: Any = "auto",
        offload: int | None = None,
        limits: ServeLimits | None = None,
        parallel: "ParallelServing | None" = None,
    ) -> "FleetService":
        """Load the model folder (router and encoders now, experts when first selected) and its card."""
        from flowfleet.device import resolve_device

        dev = parallel.fleet.ctx.device if parallel is not None else resolve_device(device)
        # One thread samples, the batcher's worker, and it alone runs torch's parallel CPU kernels: a second team
        # of OpenMP threads in the process (the loading thread's, a request's) makes libgomp count more threads
        # than cores and throttle every team's spinning, which slows sampling several times over on a small box. So
        # the folder loads on one thread; the worker takes the rest.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            pipe = FleetPipeline.from_pretrained(model_dir, device=dev, offload=offload)
        finally:
            if parallel is not None:  # (a patch-parallel rank samples in the request's thread)
                torch.set_num_threads(threads)
        return cls(pipe, read_card(model_dir), limits, parallel, threads=threads if parallel is None else None)

    @functools.cached_property
    def image_size(self) -> tuple[int, int]:
        """(H, W) of the images this fleet draws (a zero latent decoded once)."""
        pipe = self.pipe
        with torch.inference_mode():
            image = pipe.decode(torch.zeros(1, *pipe.latent_shape, device=pipe.device, dtype=pipe.dtype))
        return int(image.shape[-2]), int(image.shape[-1])

    # -- checks -----------------------------------------------------------------------------------

    @property
    def needs_prompt(self) -> bool:
        return self.pipe.conditioning in TEXT_CONDITIONING

    @property
    def needs_label(self) -> bool:
        return self.pipe.conditioning == "class"

    def check(self, req: GenerateRequest) -> SamplingSettings:
        """The request's settings, or BadRequest naming the field (nothing is queued or run)."""
        lim = self.limits
        if self.needs_prompt:
            if req.prompt is None or not req.prompt.strip():
                raise BadRequest("prompt: empty (this fleet draws what a prompt asks for)")
            try:
                req.prompt.encode("utf-8")
            except UnicodeEncodeError as err:  # a lone surrogate ("\ud800") is valid JSON, not text
                raise BadRequest(f"prompt: not valid Unicode text ({err.reason} at position {err.start})") from None
            if len(req.prompt) > lim.max_prompt_chars:
                raise BadRequest(f"prompt: {len(req.prompt)} characters, at most {lim.max_prompt_chars}")
        elif req.prompt:
            raise BadRequest(f"prompt: this fleet is {self.pipe.conditioning}-conditioned and takes no prompt")
        if self.needs_label and (req.label is None or not 0 <= req.label < self.pipe.num_classes):
            raise BadRequest(f"label: expected 0..{self.pipe.num_classes - 1}, got {req.label}")
        if not 1 <= req.n <= lim.max_images:
            raise BadRequest(f"n: expected 1..{lim.max_images} images, got {req.n}")
        choices = req.choices()
        strategy = choices.get("strategy")
        present = len(self.pipe.present)
        if strategy == "topk":
            if req.k is None or not 1 <= req.k <= present:
                raise BadRequest(f"k: expected 1..{present} experts for strategy topk, got {req.k}")
            choices["strategy"] = f"topk:{req.k}"
        elif req.k is not None:
            raise BadRequest(f"k: only for strategy topk (got strategy {strategy!r})")
        try:
            settings = self.pipe.settings(**choices)
        except SettingError as err:
            raise BadRequest(f"{err.name}: {err.message}") from None
        if "steps" in choices and settings.steps > lim.max_steps:
            raise BadRequest(f"steps: expected 1..{lim.max_steps}, got {settings.steps}")
        scale, most = settings.guidance_scale, lim.max_guidance_scale
        if "guidance_scale" in choices and scale > most:
            raise BadRequest(f"guidance_scale: expected a number in 0..{most}, got {scale}")
        return settings

    # -- the call ---------------------------------------------------------------------------------

    def generate(self, req: GenerateRequest, on_step: Callable[[int, int], None] | None = None) -> Generation:
        """Check, queue (or refuse as Busy), generate. on_step(done, total) after every sampling step."""
        sample = self._take_place(req, on_step)
        with self._holding(req.n):
            if self.batcher is not None:
                job = BatchJob(sample.settings.model_copy(update={"seed": 0}), req.n, sample)
                drawn = self.batcher.submit(job).result()
                waited = (job.started or job.arrived) - job.arrived
            else:
                t0 = time.perf_counter()
                with self._generating:
                    waited = time.perf_counter() - t0
                    drawn = self._sample_parallel(sample)
        return self._served(drawn, sample.settings, waited)

    async def generate_async(self, req: GenerateRequest) -> Generation:
        """generate() for an event loop (the HTTP API): waits for its batch without holding a thread, so that
        the answers of a batch of many requests are written one after the other by the loop rather than by as
        many threads taking turns."""
        if self.batcher is None:  # --nproc: one patch-parallel call at a time, in a thread
            return await asyncio.to_thread(self.generate, req)
        sample = self._take_place(req, None)
        with self._holding(req.n):
            job = BatchJob(sample.settings.model_copy(update={"seed": 0}), req.n, sample)
            # shielded: a client that goes away does not cancel the batch its request is part of
            drawn = await asyncio.shield(asyncio.wrap_future(self.batcher.submit(job)))
            waited = (job.started or job.arrived) - job.arrived
        return self._served(drawn, sample.settings, waited)

    @contextlib.contextmanager
    def _holding(self, images: int) -> Iterator[None]:
        """While a request's images hold their places: a failure is counted, the places are given back."""
        try:
            yield
        except Exception:
            self._count("failed")
            raise
        finally:
            self._admit(-images)

    def _take_place(self, req: GenerateRequest, on_step: Callable[[int, int], None] | None) -> _Sample:
        """The request checked (BadRequest) and given its places in the queue (Busy): what its batch samples."""
        try:
            settings = self.check(req)
        except BadRequest:
            self._count("bad_request")
            raise
        if not self._admit(req.n):
            self._count("refused_busy")
            raise Busy(
                f"busy: {self.admitted} images are already being sampled or waiting "
                f"(at most {self.limits.max_batch + self.limits.max_queue}); try again shortly"
            )
        prompts = [req.prompt] if self.needs_prompt and req.prompt else None
        labels = [req.label] if self.needs_label and req.label is not None else None
        return _Sample(prompts, labels, req.n, settings, on_step)

    def _served(self, drawn: _Drawn, settings: SamplingSettings, waited: float) -> Generation:
        self._count("served")
        return Generation(drawn.images, drawn.prompts, drawn.trace, settings, drawn.seconds, waited, self.replica)

    def _sample_batch(self, jobs: Sequence[BatchJob]) -> list[_Drawn]:
        """The batcher's call: every job's samples in one batch (one settings but the seed), each job's own
        noise and conditioning, split back per job."""
        if self._governor is not None:
            self._governor.step()  # (reads the load at most every FOLLOW_EVERY_S)
        samples: list[_Sample] = [job.payload for job in jobs]
        settings = samples[0].settings
        total = sum(s.n for s in samples)
        cycled = lambda items, n: [items[i % len(items)] for i in range(n)]  # noqa: E731 - as encode_condition
        prompts = [p for s in samples for p in cycled(s.prompts, s.n)] if samples[0].prompts else None
        labels = [y for s in samples for y in cycled(s.labels, s.n)] if samples[0].labels else None
        t0 = time.perf_counter()
        cond, per_sample = self.pipe.encode_condition(prompts, labels, total)
        noise = torch.cat([self.pipe.noise(s.n, s.settings.seed) for s in samples])

        def step_done(i: int) -> None:
            for s in samples:
                if s.on_step is not None:
                    s.on_step(i + 1, settings.steps)

        x0, trace = self.pipe.sample(noise, cond, settings, on_step=step_done)
        with torch.inference_mode():
            images = to_pil(self.pipe.decode(x0))  # here, where torch runs (the request's thread runs none)
        seconds = time.perf_counter() - t0
        drawn, start = [], 0
        for s in samples:
            rows = slice(start, start + s.n)
            drawn.append(_Drawn(images[rows], per_sample[rows], trace.select(rows), seconds))
            start += s.n
        return drawn

    def _sample_parallel(self, sample: _Sample) -> _Drawn:
        from flowfleet.serve.parallel import Call

        assert self.parallel is not None
        t0 = time.perf_counter()
        call = Call(sample.prompts, sample.n, sample.labels, sample.settings)
        self.parallel.announce(call)
        out = self.parallel.run(self.pipe, call, sample.on_step)
        return _Drawn(to_pil(out.images), out.prompts, out.trace, time.perf_counter() - t0)

    def close(self) -> None:
        if self.batcher is not None:
            self.batcher.close()

    def _count(self, what: str) -> None:
        with self._counts_lock:
            self.counts[what] += 1

    def _admit(self, images: int) -> bool:
        """Take places for `images` (False: the queue is full), or give them back (negative)."""
        with self._counts_lock:
            if images > 0 and self.admitted + images > self.limits.max_batch + self.limits.max_queue:
                return False
            self.admitted += images
            return True

    def health(self) -> dict[str, Any]:
        with self._counts_lock:
            counts, admitted = dict(self.counts), self.admitted
        return {
            "status": "ok",
            "experts": list(self.pipe.present),
            "limits": self.limits.model_dump(),
            "parallel": self.parallel.describe() if self.parallel is not None else None,
            "replica": self.replica,
            "admitted": admitted,
            "batches": self.batcher.batches if self.batcher is not None else None,
            "batched_images": self.batcher.batched_images if self.batcher is not None else None,
            **counts,
        }
