"""`flowfleet serve`: a model folder as a web page and an HTTP API."""

from __future__ import annotations

import argparse
import os

from flowfleet.commands.options import add_command, add_device, add_parallel, relaunch_parallel, settings_from

API_KEY_HELP = (
    "require 'Authorization: Bearer KEY' on /api/* and KEY as the page's password (default: $FLOWFLEET_API_KEY; "
    "prefer it, a command line is visible to other users)"
)


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "serve", run_serve)
    p.add_argument("model_dir", metavar="MODEL_DIR", help="assembled model folder (model/, model-monolith/, ...)")
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=7860, help="port (default 7860, Gradio's)")
    add_device(p)
    p.add_argument("--offload", type=int, default=None, metavar="M", help="keep at most M experts in memory")
    p.add_argument(
        "--max-queue", type=int, default=64, help="images that may wait beyond the batch being sampled (default 64)"
    )
    p.add_argument("--max-batch", type=int, default=32, help="images sampled together, across requests (default 32)")
    p.add_argument(
        "--batch-window-ms",
        type=float,
        default=50.0,
        metavar="MS",
        help="how long the first request of a batch waits for others with its settings (default 50; a lone "
        "request pays it once)",
    )
    p.add_argument("--max-steps", type=int, default=200, help="most sampling steps a request may ask for")
    p.add_argument("--max-images", type=int, default=8, help="most images per request")
    p.add_argument("--no-ui", action="store_true", help="the HTTP API only (no Gradio page)")
    p.add_argument("--api-key", default=None, metavar="KEY", help=API_KEY_HELP)
    add_parallel(p)
    ray = p.add_argument_group("--ray: replicas of a Ray Serve deployment (the API; no page)")
    ray.add_argument(
        "--ray",
        action="store_true",
        help="serve the API as Ray Serve replicas on a Ray cluster; --host/--port are Serve's HTTP proxy's",
    )
    ray.add_argument(
        "--address",
        default=None,
        help="the Ray cluster to join, as ray.init takes it: HEAD:6379, ray://HEAD:10001 or auto (default: "
        "RAY_ADDRESS; neither: a Ray started on this machine for this command)",
    )
    ray.add_argument("--replicas", type=int, default=1, metavar="N", help="replicas (default 1)")
    ray.add_argument(
        "--max-replicas",
        type=int,
        default=None,
        metavar="M",
        help="autoscale between --replicas and M on ongoing requests (default: a fixed --replicas)",
    )
    ray.add_argument("--replica-cpus", type=float, default=1.0, metavar="C", help="CPUs per replica (default 1)")
    ray.add_argument("--replica-gpus", type=float, default=0.0, metavar="G", help="GPUs per replica (default 0)")
    ray.add_argument(
        "--proxy-location",
        choices=("EveryNode", "HeadOnly"),
        default="EveryNode",
        help="where Ray Serve runs its HTTP proxies, when this command starts Serve (default EveryNode)",
    )


def run_serve(args: argparse.Namespace) -> int:
    """a web page and HTTP API for a model folder (fleet, monolith or student)

    Serve an assembled model folder: a Gradio page at / (prompt, strategy, steps, CFG, seed; the images with each
    image's routing; the fleet card) and a JSON API at /api/generate (docs at /docs). Requests that arrive within
    --batch-window-ms and share their settings but the seed are sampled as one batch of at most --max-batch images
    (each keeps its prompt, seed and routing); beyond --max-queue waiting images they are refused as busy (HTTP
    503, Retry-After). With --ray, the same API runs as replicas of a Ray Serve deployment on a Ray cluster
    (flowfleet.serve.ray_serve); the model folder must be readable from every node.
    """

    from flowfleet.errors import FlowfleetError
    from flowfleet.serve.app import serve
    from flowfleet.serve.service import ServeLimits

    limits = settings_from(ServeLimits, args, ("max_queue", "max_steps", "max_images", "max_batch", "batch_window_ms"))
    if not 0 < args.port < 65536:
        raise FlowfleetError(f"--port: {args.port} outside 1..65535")
    api_key = args.api_key or os.environ.get("FLOWFLEET_API_KEY") or None
    if args.ray:
        return _serve_on_ray(args, limits, api_key)
    relaunched = relaunch_parallel(args)  # every rank runs this same command under torchrun; rank 0 serves
    if relaunched is not None:
        return relaunched
    serve(
        args.model_dir,
        host=args.host,
        port=args.port,
        device=args.device,
        offload=args.offload,
        limits=limits,
        ui=not args.no_ui,
        nproc=args.nproc,
        parallel=args.parallel,
        warmup=args.warmup,
        ulysses_degree=args.ulysses_degree,
        api_key=api_key,
    )
    return 0


def _serve_on_ray(args: argparse.Namespace, limits, api_key: str | None) -> int:
    from flowfleet.errors import FlowfleetError
    from flowfleet.serve.ray_serve import RayServeOptions, serve_on_ray

    if args.nproc != 1:
        raise FlowfleetError("--ray: each replica samples on its own device; --nproc is not supported with it")
    fields = ("address", "replicas", "max_replicas", "replica_cpus", "replica_gpus", "proxy_location")
    options = settings_from(RayServeOptions, args, fields)
    serve_on_ray(
        args.model_dir,
        options,
        host=args.host,
        port=args.port,
        device=args.device,
        offload=args.offload,
        limits=limits,
        api_key=api_key,
    )
    return 0
