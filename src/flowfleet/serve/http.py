"""What the two HTTP APIs of `flowfleet serve` share (flowfleet.serve.app's own at /api, the OpenAI Images API
at /v1, flowfleet.serve.openai_api): the service they call, the call from the event loop, images as base64 PNG."""

from __future__ import annotations

import base64
import io
from typing import Any, Protocol

from fastapi.concurrency import run_in_threadpool

from flowfleet.sampling.card import FleetCard
from flowfleet.serve.service import GenerateRequest, Generation

RETRY_AFTER_S = 2  # a busy server's Retry-After


class Service(Protocol):
    """What the routes need of a service: a FleetService, or under Ray Serve its replicas' front
    (flowfleet.serve.ray_serve.ReplicaFront)."""

    @property
    def card(self) -> FleetCard: ...

    def generate(self, req: GenerateRequest) -> Generation: ...

    def health(self) -> dict[str, Any]: ...

    @property
    def image_size(self) -> tuple[int, int]: ...  # (H, W) of the images it draws


async def generate_on_loop(service: Service, req: GenerateRequest) -> Generation:
    """The service's call from the event loop: awaited where the service can (FleetService.generate_async), in
    the thread pool where it blocks (a Ray Serve front)."""
    generate_async = getattr(service, "generate_async", None)
    if generate_async is not None:
        return await generate_async(req)
    return await run_in_threadpool(service.generate, req)


def png_base64(image: Any) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode("ascii")
