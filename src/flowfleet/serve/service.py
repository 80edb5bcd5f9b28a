"""One model folder behind a bounded queue: validated requests in, images and routing traces out.

    service = FleetService.open("runs/r/model", limits=ServeLimits(max_queue=8))
    result = service.generate(GenerateRequest(prompt="a handwritten digit seven", strategy="top2", n=4))
    result.images  # PIL images;  result.routing[i]: which experts drew image i at each step, with what weight

The web page and the HTTP API (flowfleet.serve.app) are two faces of this one call. A request is
checked against the fleet before it waits (a bad one never takes a place in the queue); then it takes
one of 1 + max_queue places or is refused as busy at once; generation itself runs one request at a
time, because one device holds the model.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from pydantic import BaseModel, ConfigDict, Field

from flowfleet.errors import FlowfleetError
from flowfleet.sampling.card import FleetCard, read_card
from flowfleet.sampling.pipeline import TEXT_CONDITIONING, FleetPipeline, SamplingSettings
from flowfleet.sampling.trace import RoutingTrace
from flowfleet.sampling.views import to_pil

if TYPE_CHECKING:  # torch.distributed only for --nproc
    from flowfleet.serve.parallel import ParallelServing

STRATEGIES = ("top1", "topk", "full")  # the choices of the page; the API also takes top2, topk:3 ...


class ServeLimits(BaseModel):
    """What one request may ask for, and how many may wait."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_queue: int = Field(8, ge=0)  # requests waiting behind the one being generated
    max_steps: int = Field(200, ge=1)
    max_images: int = Field(8, ge=1)
    max_cfg: float = Field(30.0, ge=0)
    max_prompt_chars: int = Field(1000, ge=1)


class GenerateRequest(BaseModel):
    """One generate call. Unset choices take the model folder's defaults (its model_index.json)."""

    model_config = ConfigDict(extra="forbid")

    prompt: str | None = None  # text-conditioned fleets
    label: int | None = None  # class-conditioned fleets
    strategy: str | None = None  # top1 | top2 | topk | topk:K | full
    k: int | None = None  # experts per sample for strategy "topk"
    steps: int | None = None
    cfg: float | None = None
    seed: int = Field(0, ge=0, le=2**63 - 1)
    n: int = 1  # images


class BadRequest(FlowfleetError):
    """A request this fleet cannot serve as asked (HTTP 422); the message names the field."""


class Busy(FlowfleetError):
    """Every place in the queue is taken (HTTP 503); try again later."""


@dataclass
class Generation:
    images: list[Any]  # PIL images
    prompts: list[str]
    routing: list[list[dict[str, Any]]]  # per image, per step: t, experts, weights, router probabilities
    trace: RoutingTrace
    settings: SamplingSettings
    seconds: float  # generation only, without the wait in the queue
    waited: float  # seconds in the queue


def per_image_routing(trace: RoutingTrace) -> list[list[dict[str, Any]]]:
    """The routing trace split per image: [image][step] -> {t, experts, weights, probs}."""
    return [
        [
            {
                "step": s,
                "t": round(trace.times[s], 6),
                "router_ran": trace.routed[s],
                "experts": trace.experts[s][i].tolist(),
                "weights": [round(w, 6) for w in trace.weights[s][i].tolist()],
                "probs": [round(p, 6) for p in trace.probs[s][i].tolist()],
            }
            for s in range(trace.num_steps)
        ]
        for i in range(trace.num_samples)
    ]


class FleetService:
    def __init__(
        self,
        pipe: FleetPipeline,
        card: FleetCard,
        limits: ServeLimits | None = None,
        parallel: "ParallelServing | None" = None,
    ):
        """parallel: rank 0 of a model split over N ranks (flowfleet.serve.parallel); each call is
        announced to the other ranks and sampled patch-parallel."""
        limits = limits or ServeLimits()
        self.pipe, self.card, self.limits, self.parallel = pipe, card, limits, parallel
        self._generating = threading.Lock()  # one generation at a time: one device holds the model
        self._places = threading.BoundedSemaphore(1 + limits.max_queue)
        self._counts_lock = threading.Lock()
        self.counts = {"served": 0, "refused_busy": 0, "bad_request": 0, "failed": 0}
        self.admitted = 0  # requests holding a place now (the running one and those waiting)

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
        pipe = FleetPipeline.from_pretrained(model_dir, device=dev, offload=offload)
        return cls(pipe, read_card(model_dir), limits, parallel)

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
            if len(req.prompt) > lim.max_prompt_chars:
                raise BadRequest(f"prompt: {len(req.prompt)} characters, at most {lim.max_prompt_chars}")
        elif req.prompt:
            raise BadRequest(f"prompt: this fleet is {self.pipe.conditioning}-conditioned and takes no prompt")
        if self.needs_label:
            if req.label is None or not 0 <= req.label < self.pipe.num_classes:
                raise BadRequest(f"label: expected 0..{self.pipe.num_classes - 1}, got {req.label}")
        if not 1 <= req.n <= lim.max_images:
            raise BadRequest(f"n: expected 1..{lim.max_images} images, got {req.n}")
        if req.steps is not None and not 1 <= req.steps <= lim.max_steps:
            raise BadRequest(f"steps: expected 1..{lim.max_steps}, got {req.steps}")
        if req.cfg is not None and not (math.isfinite(req.cfg) and 0 <= req.cfg <= lim.max_cfg):
            raise BadRequest(f"cfg: expected a number in 0..{lim.max_cfg}, got {req.cfg}")
        strategy = req.strategy
        present = len(self.pipe.present)
        if strategy == "topk":
            if req.k is None or not 1 <= req.k <= present:
                raise BadRequest(f"k: expected 1..{present} experts for strategy topk, got {req.k}")
            strategy = f"topk:{req.k}"
        elif req.k is not None:
            raise BadRequest(f"k: only for strategy topk (got strategy {req.strategy!r})")
        try:
            settings = self.pipe.settings(strategy, req.steps, None, req.cfg, None, None, req.seed)
        except FlowfleetError as err:
            raise BadRequest(str(err).removeprefix("--")) from None
        return settings

    # -- the call ---------------------------------------------------------------------------------

    def generate(self, req: GenerateRequest, on_step: Callable[[int, int], None] | None = None) -> Generation:
        """Check, queue (or refuse as Busy), generate. on_step(done, total) after every sampling step."""
        try:
            settings = self.check(req)
        except BadRequest:
            self._count("bad_request")
            raise
        if not self._places.acquire(blocking=False):
            self._count("refused_busy")
            raise Busy(f"busy: {self.limits.max_queue} requests are already waiting; try again shortly")
        self._admit(+1)
        try:
            t0 = time.perf_counter()
            with self._generating:
                t1 = time.perf_counter()
                prompts = [req.prompt] if self.needs_prompt and req.prompt else None
                labels = [req.label] if self.needs_label and req.label is not None else None
                try:
                    if self.parallel is not None:
                        from flowfleet.serve.parallel import Call

                        call = Call(prompts, req.n, labels, settings)
                        self.parallel.announce(call)
                        out = self.parallel.run(self.pipe, call, on_step)
                    else:
                        out = self.pipe(prompts, req.n, labels=labels, settings=settings, on_step=on_step)
                except Exception:
                    self._count("failed")
                    raise
                seconds = time.perf_counter() - t1
        finally:
            self._admit(-1)
            self._places.release()
        self._count("served")
        return Generation(
            to_pil(out.images), out.prompts, per_image_routing(out.trace), out.trace, settings, seconds, t1 - t0
        )

    def _count(self, what: str) -> None:
        with self._counts_lock:
            self.counts[what] += 1

    def _admit(self, by: int) -> None:
        with self._counts_lock:
            self.admitted += by

    def health(self) -> dict[str, Any]:
        with self._counts_lock:
            counts, admitted = dict(self.counts), self.admitted
        return {
            "status": "ok",
            "experts": list(self.pipe.present),
            "limits": self.limits.model_dump(),
            "parallel": self.parallel.describe() if self.parallel is not None else None,
            "admitted": admitted,
            **counts,
        }
