"""`flowfleet serve DIR --ray`: the same HTTP API (flowfleet.serve.app) as replicas of a Ray Serve
deployment on an existing Ray cluster, behind Ray Serve's HTTP proxy.

    flowfleet serve s3://bucket/runs/r/model --ray --address HEAD:6379 --replicas 2
    flowfleet serve runs/r/model --ray --replicas 1 --max-replicas 4     # autoscaled on ongoing requests

Two deployments, composed as Ray Serve composes models:

    HTTP -> Serve's proxy -> FleetIngress (the API; no model, no CPUs, on the head node)
                                 -> handle -> FleetSampler replicas (a FleetService each: device, batcher)

Each sampling replica opens the model folder, which every node must be able to read (a shared file
system, or an fsspec URL such as s3://). Ray Serve spreads the replicas over the nodes, routes each call,
and replaces a replica whose process or node dies once there is room for it. A request whose sampling
replica dies under it is sent to another one by the ingress (ReplicaFront): a generation is a function of
its settings and seed, so the retry draws the same images, and the client sees a slower 200, not an
error. Requests on the other replicas do not notice. The ingress replicas live on the head node, whose
loss ends the cluster anyway; a proxy on another node dies with it, and a load balancer in front of the
proxies sends its clients elsewhere.

Batching stays the service's own (flowfleet.serve.batcher), not `@serve.batch`: it groups requests by
their sampling settings, counts images (not requests) against the queue bound and refuses with a 503 and
Retry-After, which `@serve.batch` (one list per arrival window, no grouping, no bound) would have to be
taught again. A sampling replica admits max_batch + max_queue calls at once (Serve's
max_ongoing_requests), so the service, not Serve's router, decides what waits and what is refused.

The Gradio page is not served here: its queue keeps each browser session in one process, which a
request router over replicas does not promise. The API (and /docs) is.

The command blocks like `serve run` and deletes its application on Ctrl-C / SIGTERM. Ray is imported only
in this module.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from flowfleet.errors import ParameterError
from flowfleet.sampling.card import FleetCard
from flowfleet.serve.service import Busy, GenerateRequest, Generation, ServeLimits

log = logging.getLogger(__name__)

APP_NAME = "flowfleet"
HEAD_NODE_RESOURCE = "node:__internal_head__"  # Ray's resource that only the head node has
RETRY_ATTEMPTS = 3  # sampling replicas a request may lose before it is answered 503
PROXY_LOCATIONS = ("EveryNode", "HeadOnly")  # Ray Serve's own names (ray.serve.config.ProxyLocation)


class ReplicaLost(Busy):
    """Every sampling replica tried for a request went away (HTTP 503, Retry-After: Serve starts others)."""


class RayServeOptions(BaseModel):
    """Where and how many: the deployment's side of `serve --ray`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    address: str | None = None  # what ray.init takes: HEAD:6379, ray://HEAD:10001, auto; None: RAY_ADDRESS or local
    replicas: int = Field(1, ge=1)  # fixed count, or the autoscaler's minimum when max_replicas is set
    max_replicas: int | None = Field(None, ge=1)  # autoscale between replicas and this, on ongoing requests
    replica_cpus: float = Field(1.0, gt=0)  # Ray's num_cpus per replica (and the replica's torch threads)
    replica_gpus: float = Field(0.0, ge=0)  # Ray's num_gpus per replica (device "auto" then picks CUDA)
    proxy_location: str = "EveryNode"  # where Serve runs its HTTP proxies (when this command starts Serve)
    app_name: str = APP_NAME

    @model_validator(mode="after")
    def _check(self) -> "RayServeOptions":
        if self.max_replicas is not None and self.max_replicas < self.replicas:
            raise ValueError(f"max_replicas: {self.max_replicas} is below replicas {self.replicas}")
        if self.proxy_location not in PROXY_LOCATIONS:
            raise ValueError(f"proxy_location: expected one of {', '.join(PROXY_LOCATIONS)}, got {self.proxy_location}")
        return self


class FleetSampler:
    """One sampling replica: the model folder opened as a FleetService (its own device and batcher)."""

    def __init__(self, model_dir: str, device: str, offload: int | None, limits: dict[str, Any], threads: int):
        import torch

        from flowfleet.serve.service import FleetService

        torch.set_num_threads(threads)  # the CPUs Ray gave this replica, not every core of its node
        self.model_dir = model_dir
        self.service = FleetService.open(model_dir, device=device, offload=offload, limits=ServeLimits(**limits))
        self.service.replica = _replica_name()

    def generate(self, req: GenerateRequest) -> Generation:  # a plain def: Serve runs it in a thread
        return self.service.generate(req)

    def health(self) -> dict[str, Any]:
        return self.service.health()

    def card(self) -> FleetCard:
        return self.service.card

    def image_size(self) -> tuple[int, int]:
        return self.service.image_size

    def check_health(self) -> None:
        """Ray Serve's periodic health check: a replica whose sampling thread died is replaced."""
        if self.service.batcher is not None and not self.service.batcher.alive:
            raise RuntimeError(f"{self.model_dir}: the sampling thread of this replica has stopped")


class ReplicaFront:
    """The routes' service (flowfleet.serve.app.Service) in the HTTP ingress: each call goes to a sampling
    replica through Ray Serve's handle. A replica that dies with the request (its process or its node) is
    not the request's fault: the same request goes to another replica, which draws the same images (its
    noise is its seed's), up to `attempts` times; then a ReplicaLost (HTTP 503, Retry-After)."""

    def __init__(self, samplers: Any, attempts: int = RETRY_ATTEMPTS):
        self.samplers, self.attempts = samplers, attempts
        self._card: FleetCard | None = None
        self._image_size: tuple[int, int] | None = None
        self._lock = threading.Lock()
        self.retried = 0  # calls sent again because their replica went away

    @property
    def card(self) -> FleetCard:  # asked of a replica when first needed (a handle's result blocks: not in __init__)
        if self._card is None:
            self._card = self._call("card")
        return self._card

    @property
    def image_size(self) -> tuple[int, int]:  # (H, W), asked of a replica when first needed, as the card
        if self._image_size is None:
            self._image_size = tuple(self._call("image_size"))
        return self._image_size

    def generate(self, req: GenerateRequest) -> Generation:
        return self._call("generate", req)  # its attempts: how many replicas were asked

    def health(self) -> dict[str, Any]:
        return {**self._call("health"), "ray_serve": {**_deployment_status(), "retried": self.retried}}

    def _call(self, method: str, *args: Any) -> Any:
        from ray.exceptions import ActorDiedError, ActorUnavailableError, RayTaskError

        lost: Exception | None = None
        for attempt in range(self.attempts):
            try:
                answer = getattr(self.samplers, method).remote(*args).result()
                if isinstance(answer, Generation):
                    answer.attempts = attempt + 1
                return answer
            except (ActorDiedError, ActorUnavailableError) as err:  # the replica went away mid-call
                lost = err
                if attempt + 1 < self.attempts:
                    with self._lock:
                        self.retried += 1
                log.warning("a sampling replica was lost during %s (attempt %d): %s", method, attempt + 1, err)
            except RayTaskError as err:  # the replica raised: the request's own error (BadRequest, Busy ...)
                raise err.cause from None
        first = str(lost).strip().splitlines()[0] if lost is not None else ""
        raise ReplicaLost(
            f"replica lost: {self.attempts} sampling replicas went away during this request ({first[:160]})"
        )


class FleetIngress:
    """The HTTP ingress replica: the API of `flowfleet serve` (flowfleet.serve.app, no page) over a
    ReplicaFront. Light (no model): Ray Serve builds its app after the constructor."""

    def __init__(self, samplers: Any, model_dir: str, api_key: str | None):
        self.samplers, self.model_dir, self.api_key = samplers, model_dir, api_key

    def __serve_build_asgi_app__(self) -> Any:
        from flowfleet.serve.app import create_app

        return create_app(ReplicaFront(self.samplers), self.model_dir, ui=False, api_key=self.api_key)


def _replica_name() -> str | None:
    from ray import serve

    try:
        return str(serve.get_replica_context().replica_id.unique_id)
    except Exception:  # outside a replica (a test builds one by hand)
        return None


def _deployment_status() -> dict[str, Any]:
    """The sampling deployment's replicas by state, as Serve's controller sees them."""
    import ray
    from ray import serve

    if not ray.is_initialized():  # not inside a replica (serve.status() would start a Ray of its own)
        return {"status": "unknown (not in a Ray cluster)"}
    try:
        app = serve.status().applications[serve.get_replica_context().app_name]
        sampler = app.deployments["FleetSampler"]
        states = {str(getattr(k, "value", k)): n for k, n in sampler.replica_states.items()}
        return {"status": str(getattr(sampler.status, "value", sampler.status)), "replicas": states}
    except Exception as err:  # noqa: BLE001 - health answers even when the controller does not
        log.debug("serve.status(): %r", err)
        return {"status": f"unknown ({type(err).__name__}: {err})"[:200]}


def build_application(
    model_dir: str,
    options: RayServeOptions,
    *,
    device: str = "auto",
    offload: int | None = None,
    limits: ServeLimits | None = None,
    api_key: str | None = None,
) -> Any:
    """The Ray Serve application (Deployment.bind()): the ingress over the sampling replicas."""
    from ray import serve

    limits = limits or ServeLimits()
    scale: dict[str, Any] = {"num_replicas": options.replicas}
    if options.max_replicas is not None and options.max_replicas > options.replicas:
        scale = {
            "autoscaling_config": {
                "min_replicas": options.replicas,
                "max_replicas": options.max_replicas,
                # a replica is busy when a full batch is sampling: add one when that holds on average
                "target_ongoing_requests": limits.max_batch,
            }
        }
    admitted = limits.max_batch + limits.max_queue  # the service decides what waits and what is refused
    samplers = serve.deployment(
        ray_actor_options={"num_cpus": options.replica_cpus, "num_gpus": options.replica_gpus},
        max_ongoing_requests=admitted,
        health_check_period_s=10,
        **scale,
    )(FleetSampler).bind(model_dir, device, offload, limits.model_dump(), max(1, int(options.replica_cpus)))
    fronts = max(options.replicas, options.max_replicas or 0)  # one per sampling replica (threads wait on it)
    ingress = serve.deployment(
        # no model, no CPUs; on the head node, whose loss ends the cluster anyway: an ingress on another
        # node would take the requests it holds down with that node, where a sampling replica's are retried
        ray_actor_options={"num_cpus": 0, "resources": {HEAD_NODE_RESOURCE: 0.001}},
        max_ongoing_requests=admitted,
        num_replicas=fronts,
    )(serve.ingress()(FleetIngress))
    return ingress.bind(samplers, model_dir, api_key)


def serve_on_ray(
    model_dir: str,
    options: RayServeOptions,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    device: str = "auto",
    offload: int | None = None,
    limits: ServeLimits | None = None,
    api_key: str | None = None,
) -> None:
    """Deploy the model folder on the Ray cluster, print where it answers, and block until interrupted;
    then delete the application (the cluster and Serve itself stay)."""
    try:
        import ray
        from ray import serve
    except ImportError:
        raise ParameterError("ray", "Ray Serve is not installed (pip install 'flowfleet[ray]')") from None

    address = options.address or os.environ.get("RAY_ADDRESS")
    try:
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
    except Exception as err:  # connection refused, wrong address: Ray's own exception types
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ParameterError(f"address {address}", f"no Ray cluster answers ({first[:200]})") from None
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        # Serve already running on this cluster keeps its own proxies (Serve warns that these are not applied)
        serve.start(proxy_location=options.proxy_location, http_options={"host": host, "port": port})
        app = build_application(model_dir, options, device=device, offload=offload, limits=limits, api_key=api_key)
        serve.run(app, name=options.app_name, route_prefix="/")
        count = (
            f"{options.replicas}..{options.max_replicas} replicas (autoscaled)"
            if options.max_replicas and options.max_replicas > options.replicas
            else f"{options.replicas} replica(s)"
        )
        print(
            f"serving {model_dir} on http://{host}:{port} as Ray Serve application {options.app_name!r}, "
            f"{count}  (API /api/generate, docs /docs)",
            flush=True,
        )
        stop.wait()
    finally:
        try:
            serve.delete(options.app_name)
        finally:
            ray.shutdown()
