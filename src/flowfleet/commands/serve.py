"""`flowfleet serve`: a model folder as a web page and an HTTP API."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="a web page and HTTP API for a model folder (fleet, monolith or student)",
        description="Serve an assembled model folder: a Gradio page at / (prompt, strategy, steps, CFG, seed; "
        "the images with each image's routing; the fleet card) and a JSON API at /api/generate (docs at /docs). "
        "Requests run one at a time; beyond --max-queue waiting ones they are refused as busy (HTTP 503).",
    )
    p.add_argument("model_dir", metavar="MODEL_DIR", help="assembled model folder (model/, model-monolith/, ...)")
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=7860, help="port (default 7860, Gradio's)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--offload", type=int, default=None, metavar="M", help="keep at most M experts in memory")
    p.add_argument("--max-queue", type=int, default=8, help="requests that may wait behind the running one")
    p.add_argument("--max-steps", type=int, default=200, help="most sampling steps a request may ask for")
    p.add_argument("--max-images", type=int, default=8, help="most images per request")
    p.add_argument("--no-ui", action="store_true", help="the HTTP API only (no Gradio page)")
    p.add_argument(
        "--nproc",
        type=int,
        default=1,
        metavar="N",
        help="split each image over N processes (DistriFusion, as `generate --nproc`); relaunches itself "
        "under torchrun unless already inside one; rank 0 serves",
    )
    p.add_argument("--parallel", choices=("sync", "displaced", "naive"), default="displaced", help="with --nproc")
    p.add_argument("--warmup", type=int, default=1, metavar="W", help="with --parallel displaced: synchronous steps")
    p.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from flowfleet.errors import FlowfleetError
    from flowfleet.models.files import validation_message
    from flowfleet.serve.app import serve
    from flowfleet.serve.service import ServeLimits

    try:
        limits = ServeLimits(max_queue=args.max_queue, max_steps=args.max_steps, max_images=args.max_images)
    except ValidationError as err:
        raise FlowfleetError(f"--{validation_message(err).replace('_', '-')}") from None
    if not 0 < args.port < 65536:
        raise FlowfleetError(f"--port: {args.port} outside 1..65535")
    if args.nproc > 1:
        from flowfleet.distributed import in_torchrun
        from flowfleet.parallel.launch import relaunch_torchrun

        if not in_torchrun():  # every rank runs this same command under torchrun; rank 0 serves
            return relaunch_torchrun(args.nproc, args.argv)
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
    )
    return 0
