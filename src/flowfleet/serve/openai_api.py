"""The OpenAI Images API over a served fleet, so that the `openai` SDK, LiteLLM, Open WebUI and curl scripts written
for it work unchanged:

    POST /v1/images/generations   {"model": MODEL, "prompt": "a handwritten digit seven", "n": 2,
                                   "size": "28x28", "response_format": "b64_json"}
                              ->  200 {"created": 1764300000, "data": [{"b64_json": PNG}, ...]}
    GET  /v1/models               {"object": "list", "data": [{"id": MODEL, "object": "model", ...}]}

MODEL is the served folder's name. `size` is the fleet's own (anything else is a 400 naming it); images come as
`b64_json` only (nothing is kept to link to, so no `url`); `user` is taken and ignored. flowfleet's own settings are
extra body fields (the SDK's `extra_body`): k and the sampling settings (strategy, steps, guidance_scale, seed, ...).
A request is the same call as /api/generate (flowfleet.serve.service: the same checks, queue, batches, limits and API
key), so a seed draws the same pixels through either route. Errors take OpenAI's shape, {"error": {"message", "type",
"param", "code"}}, with the status codes the SDK maps to its exceptions: 400 BadRequestError, 401
AuthenticationError, 404 NotFoundError (another model), 503 with Retry-After (busy; the SDK retries it)."""

from __future__ import annotations

import time
from typing import Any, Literal

from fastapi import FastAPI
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, ValidationError

from flowfleet.errors import validation_message
from flowfleet.serve.http import RETRY_AFTER_S, Service, generate_on_loop, png_base64
from flowfleet.serve.service import BadRequest, Busy, GenerateRequest

PREFIX = "/v1/"
CREATED = int(time.time())  # what /v1/models reports as the model's creation time: when this server started


class ImagesRequest(BaseModel):
    """The body of POST /v1/images/generations: OpenAI's fields, then flowfleet's."""

    model_config = ConfigDict(extra="allow")  # the sampling settings, checked as /api/generate checks them

    prompt: str
    model: str | None = None  # the served folder's name (default: it)
    n: int = 1
    size: str | None = None  # "WxH", the fleet's own (default: it)
    response_format: Literal["b64_json", "url"] = "b64_json"
    user: str | None = None  # taken, ignored
    k: int | None = None  # flowfleet's own (the SDK's extra_body), as /api/generate has it, with the settings

    def generate_request(self) -> GenerateRequest:
        """The same call as /api/generate's (a ValidationError names a field that is neither's)."""
        return GenerateRequest(**self.model_dump(exclude={"model", "size", "response_format", "user"}))


def openai_error(status: int, message: str, param: str | None = None, code: str | None = None, **headers: str):
    """An error in OpenAI's shape (one line of message)."""
    kind = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error"}.get(
        status, "server_error"
    )
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers or None)


def param_of(message: str) -> str | None:
    """The field a flowfleet message names ("steps: expected 1..200, got 0" -> "steps")."""
    head, sep, _ = message.partition(":")
    return head if sep and head.replace("_", "").isalnum() else None


def add_openai_routes(app: FastAPI, service: Service, model_name: str) -> None:
    """POST /v1/images/generations and GET /v1/models on `app`, answering for `service`."""
    known: dict[str, str] = {}

    async def native_size() -> str:
        """The fleet's size as OpenAI writes sizes (width x height), asked of the service once, when first needed
        (under Ray Serve a replica answers it: not while the ingress is being built)."""
        if "size" not in known:
            height, width = await run_in_threadpool(lambda: service.image_size)
            known["size"] = f"{width}x{height}"
        return known["size"]

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"id": model_name, "object": "model", "created": CREATED, "owned_by": "flowfleet"}],
        }

    @app.post("/v1/images/generations")
    async def images_generations(req: ImagesRequest) -> Any:
        if req.model is not None and req.model != model_name:
            return openai_error(
                404, f"model: {req.model!r} is not served here (this server serves {model_name!r})", "model",
                "model_not_found",
            )  # fmt: skip
        native = await native_size()
        if req.size is not None and req.size != native:
            return openai_error(400, f"size: {req.size!r} is not this fleet's; it draws {native} only", "size")
        if req.response_format != "b64_json":
            return openai_error(
                400, "response_format: only b64_json (this server keeps no images to link to)", "response_format"
            )
        try:
            g = await generate_on_loop(service, req.generate_request())
        except ValidationError as err:
            message = validation_message(err)
            return openai_error(400, message, param_of(message))
        except BadRequest as err:
            return openai_error(400, str(err), param_of(str(err)))
        except Busy as err:
            return openai_error(503, str(err), None, "server_busy", **{"Retry-After": str(RETRY_AFTER_S)})
        return {"created": int(time.time()), "data": [{"b64_json": png_base64(im)} for im in g.images]}
