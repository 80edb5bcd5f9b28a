"""`flowfleet serve`: one model folder as a web page (Gradio, at /) and an HTTP API (FastAPI, at /api).

    POST /api/generate   {"prompt": "a handwritten digit seven", "strategy": "top2", "steps": 30,
                          "guidance_scale": 2.0, "seed": 0, "n": 4}     (+ "routing": true for the traces below)
                     ->  200 {"images": [base64 PNG, ...], "prompts": [...], "settings": {...}, "seconds": ...
                          [, "routing": [[{step, t, experts, weights, probs}, ...] per image]]}
                         422 {"error": "steps: expected 1..200, got 0"}        a request to fix
                         413 {"error": "request body: ..."}                    larger than any valid one
                         503 {"error": "busy: ..."} + Retry-After              the queue is full
                         401 {"error": "authorization: ..."}                   with an API key: none or wrong
    (concurrent requests are sampled together: flowfleet.serve.batcher)
    GET  /api/card       the fleet card (flowfleet.sampling.card) as JSON
    GET  /api/health     {"status": "ok", served, refused_busy, bad_request, failed, limits}
    GET  /docs           the OpenAPI page FastAPI writes for the above

Why FastAPI beside Gradio's own API: status codes a client can act on (422 / 503) and a JSON body
any HTTP client reads, where Gradio's API streams events for its own client. Both call FleetService,
so they share one queue.
"""

from __future__ import annotations

import hmac
import logging
import posixpath
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from flowfleet import __version__
from flowfleet.errors import ParameterError, validation_message
from flowfleet.parallel.mode import DEFAULT_PARALLEL, DISPLACED_WARMUP
from flowfleet.serve.http import RETRY_AFTER_S, Service, generate_on_loop, png_base64
from flowfleet.serve.openai_api import PREFIX as OPENAI_PREFIX
from flowfleet.serve.openai_api import add_openai_routes, openai_error
from flowfleet.serve.service import BadRequest, Busy, FleetService, GenerateRequest, Generation, ServeLimits

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 256 * 1024  # far above any valid request (a prompt is at most ServeLimits.max_prompt_chars)
BEARER = {"WWW-Authenticate": "Bearer"}
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def response_json(g: Generation, routing: bool = False) -> dict[str, Any]:
    """The answer to /api/generate; `routing` (the request's): with each image's routing per step."""
    return {
        "images": [png_base64(im) for im in g.images],
        "prompts": g.prompts,
        **({"routing": g.routing} if routing else {}),
        "settings": g.settings.to_json(),
        "seconds": round(g.seconds, 4),
        "waited": round(g.waited, 4),
    }


def _error(status: int, message: str, **headers: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers or None)


class ApiGuard:
    """What every API call must pass before its body is read: the API key (401; when the server has one) and the
    declared body size (413). Plain ASGI middleware: Starlette's @app.middleware("http") runs each response
    through a stream of its own, a cost every request would pay."""

    def __init__(self, app: ASGIApp, api_key: str | None = None):
        self.app, self.api_key = app, api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(("/api/", OPENAI_PREFIX)):
            refused = self.refusal(Headers(scope=scope), openai=scope["path"].startswith(OPENAI_PREFIX))
            if refused is not None:
                await refused(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def refusal(self, headers: Headers, openai: bool) -> JSONResponse | None:
        """The answer refusing the call, in OpenAI's error shape on /v1/; None: let it through."""
        if self.api_key:
            scheme, _, given = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), self.api_key.encode()):
                why = "missing" if not given else "wrong key"
                message = f"authorization: {why} (send 'Authorization: Bearer KEY')"
                if openai:
                    return openai_error(401, message, None, "invalid_api_key", **BEARER)
                return _error(401, message, **BEARER)
        size = headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > MAX_BODY_BYTES:
            message = f"request body: {int(size)} bytes, at most {MAX_BODY_BYTES}"
            return openai_error(413, message) if openai else _error(413, message)
        return None


def create_app(service: Service, model_dir: str, ui: bool = True, api_key: str | None = None) -> FastAPI:
    """The API routes, and the Gradio page mounted at / when ui (a FleetService only; tests of the API alone
    pass False). api_key: every /api/* call must carry `Authorization: Bearer KEY` (401 otherwise) and the
    page asks for it at login."""
    app = FastAPI(title="flowfleet", version=__version__, summary=f"serving {model_dir}")

    app.add_middleware(ApiGuard, api_key=api_key)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0] if err.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or "request"
        if first.get("type") == "json_invalid":
            where = "request body"
            message = f"request body: not valid JSON ({first.get('ctx', {}).get('error', 'parse error')})"
        else:  # a check across fields names its field first ("stepz: not a field ..."), as validation_message reads
            text = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
            key, sep, rest = text.partition(": ")
            if where == "request" and sep and key.isidentifier():
                where, text = key, rest
            message = f"{where}: {text}"
        if request.url.path.startswith(OPENAI_PREFIX):  # OpenAI's API answers a malformed request with 400
            return openai_error(400, message, where if where not in ("request", "request body") else None)
        return _error(422, message)

    @app.get("/api/health")
    def health() -> dict[str, Any]:
        return service.health()

    @app.get("/api/card")
    def card() -> dict[str, Any]:
        return service.card.to_json()

    @app.post("/api/generate")
    async def generate(req: GenerateRequest) -> Any:
        try:
            g = await generate_on_loop(service, req)
            # under Ray Serve: which replica drew it, after how many tries
            ray = {"X-Flowfleet-Replica": g.replica, "X-Flowfleet-Attempts": str(g.attempts)} if g.replica else None
            return JSONResponse(response_json(g, req.routing), headers=ray)
        except ValidationError as err:
            return _error(422, validation_message(err))
        except BadRequest as err:
            return _error(422, str(err))
        except Busy as err:
            return _error(503, str(err), **{"Retry-After": str(RETRY_AFTER_S)})

    add_openai_routes(app, service, posixpath.basename(model_dir.rstrip("/")) or model_dir)

    if ui:
        import gradio as gr

        from flowfleet.serve.ui import THEME, build_ui

        if not isinstance(service, FleetService):
            raise TypeError("create_app: the page needs a FleetService in this process")
        page = build_ui(service, model_dir)
        # page requests run concurrently into the service, whose batcher groups them (and bounds the queue)
        page.queue(max_size=service.limits.max_queue, default_concurrency_limit=service.limits.max_batch)
        login = {}
        if api_key:  # the page asks for the same key (Gradio's login form; any user name)
            login = dict(
                auth=lambda _user, password: hmac.compare_digest(password.encode(), api_key.encode()),
                auth_message="This server needs its API key: any user name, the key as the password.",
            )
        app = gr.mount_gradio_app(app, page, path="/", ssr_mode=False, theme=THEME, **login)
    return app


def serve(
    model_dir: str,
    *,
    host: str = "127.0.0.1",
    port: int = 7860,
    device: str = "auto",
    offload: int | None = None,
    limits: ServeLimits | None = None,
    ui: bool = True,
    nproc: int = 1,
    parallel: str = DEFAULT_PARALLEL,
    warmup: int = DISPLACED_WARMUP,
    ulysses_degree: int | None = None,
    api_key: str | None = None,
) -> None:
    """Open the model folder and serve it until interrupted (uvicorn).

    nproc > 1 (inside torchrun, as `flowfleet serve --nproc N` relaunches itself): every rank opens the
    model and joins the patch-parallel fleet; rank 0 serves, the others sample what it announces."""
    import uvicorn

    serving = None
    if nproc != 1:
        from flowfleet.parallel.fleet import join_fleet
        from flowfleet.serve.parallel import ParallelServing

        if nproc < 1:
            raise ParameterError("nproc", f"must be >= 1, got {nproc}")
        fleet = join_fleet(model_dir, nproc, parallel, warmup, device=device, ulysses_degree=ulysses_degree)
        serving = ParallelServing(fleet)
    service = FleetService.open(model_dir, device=device, offload=offload, limits=limits, parallel=serving)
    if serving is not None and not serving.is_main:
        served = serving.follow(service.pipe)
        serving.stop()
        log.info("rank %d: left after %d requests", serving.fleet.ctx.rank, served)
        return
    if not api_key and host not in LOOPBACK:
        log.warning(
            "serving on %s without an API key: anyone who reaches this port can generate "
            "(set FLOWFLEET_API_KEY or --api-key)",
            host,
        )
    app = create_app(service, model_dir, ui=ui, api_key=api_key)
    split = f", each image over {nproc} ranks ({parallel})" if serving is not None else ""
    print(f"serving {model_dir} on http://{host}:{port}{split}  (page /, API /api/generate, docs /docs)", flush=True)
    try:
        uvicorn.run(app, host=host, port=port, log_level="warning")
    finally:
        service.close()
        if serving is not None:
            serving.stop()
