"""Stage `generate`: sample an assembled fleet and leave the images and the routing views on disk.

Writes FILE.png (the grid), FILE.routing.json (per-sample expert choices per step, usage counts, the
settings) and FILE.routing.png (router probabilities over the steps) side by side; FILE may be any
fsspec URL. Settings and conditioning are validated before anything heavy is loaded.

The patch-parallel fleet is imported only for --nproc > 1.
"""

from __future__ import annotations

import posixpath
from collections import Counter
from dataclasses import dataclass
from typing import Any, Sequence

from flowfleet.device import resolve_device
from flowfleet.errors import ParameterError
from flowfleet.layout import SAMPLES
from flowfleet.parallel.mode import DEFAULT_PARALLEL, DISPLACED_WARMUP
from flowfleet.sampling.pipeline import FleetOutput, FleetPipeline
from flowfleet.sampling.views import image_grid, png_bytes, routing_heatmap
from flowfleet.storage import RunRoot


@dataclass
class GenerateResult:
    output: FleetOutput
    png: str  # URL of the grid
    routing_json: str
    heatmap: str
    loads: Counter[int]  # expert -> times loaded (lazy loading / --offload)


def sibling_paths(out: str) -> tuple[str, str, str, str]:
    """FILE.png -> (folder, 'FILE.png', 'FILE.routing.json', 'FILE.routing.png')."""
    folder, name = posixpath.split(out)
    if not name.lower().endswith(".png"):
        raise ParameterError("out", f"{out!r} must name a .png file")
    stem = name[:-4]
    return folder or ".", name, f"{stem}.routing.json", f"{stem}.routing.png"


def generate(
    model_dir: str,
    *,
    prompts: Sequence[str] | None = None,
    labels: Sequence[int] | None = None,
    n: int = 16,
    out: str | None = None,
    offload: int | None = None,
    batch_size: int | None = None,
    device: str = "auto",
    text_encoder: Any = None,
    latent_decoder: Any = None,
    nproc: int = 1,
    parallel: str = DEFAULT_PARALLEL,
    warmup: int = DISPLACED_WARMUP,
    ulysses_degree: int | None = None,
    progress: bool = False,
    **choices: Any,
) -> GenerateResult:
    """Sample the fleet in `model_dir` and write the grid, the routing record and its heatmap (to `out`, default
    DIR/samples/STRATEGY-seedSEED.png). choices: sampling settings (strategy, steps, cfg, seed, cache, ...:
    config.SamplingSettings), the fleet's model_index.json for those not given; checked before anything
    heavy loads."""
    if offload is not None and offload < 1:
        raise ParameterError("offload", f"must be >= 1, got {offload}")
    if batch_size is not None and batch_size < 1:
        raise ParameterError("batch_size", f"must be >= 1, got {batch_size}")
    if n < 1:
        raise ParameterError("n", f"must be >= 1, got {n}")
    if out is not None:
        sibling_paths(out)  # a bad `out` is refused before anything loads
    fleet = None  # nproc > 1: this process is one of nproc torchrun ranks sharing each image (flowfleet.parallel)
    if nproc != 1:
        from flowfleet.parallel.fleet import join_fleet

        if nproc < 1:
            raise ParameterError("nproc", f"must be >= 1, got {nproc}")
        fleet = join_fleet(model_dir, nproc, parallel, warmup, device=device, ulysses_degree=ulysses_degree)
    dev = fleet.ctx.device if fleet is not None else resolve_device(device)
    pipe = FleetPipeline.from_pretrained(
        model_dir,
        device=dev,
        offload=offload,
        text_encoder=text_encoder,
        latent_decoder=latent_decoder,
        load_encoders=False,
    )
    settings = pipe.settings(**choices)  # checked
    pipe.check_condition(prompts, labels)
    pipe.load_encoders()

    result = pipe(
        prompts,
        n,
        labels=labels,
        settings=settings,
        batch_size=batch_size,
        progress=progress and (fleet is None or fleet.ctx.is_main),
        parallel=fleet,
    )
    if fleet is not None:
        fleet.close()
        if not fleet.ctx.is_main:  # every rank holds the same images; rank 0 writes them
            return GenerateResult(result, "", "", "", Counter(pipe.experts.loads))

    return _write_outputs(model_dir, out, pipe, result)


def _write_outputs(model_dir: str, out: str | None, pipe: FleetPipeline, result: FleetOutput) -> GenerateResult:
    """The grid, the routing record (settings, experts, prompts, every step's choices) and its heatmap, at `out`
    and beside it (None: MODEL_DIR/samples/STRATEGY-seedSEED.png)."""
    if out is None:
        settings = result.settings
        out = posixpath.join(model_dir, SAMPLES, f"{settings.strategy.name.replace(':', '')}-seed{settings.seed}.png")
    folder, png, routing_json, heatmap = sibling_paths(out)
    dest = RunRoot(folder)
    dest.write_bytes(png_bytes(image_grid(result.images)), png)
    routing = {
        "model": model_dir,
        "settings": result.settings.to_json(),
        "present_experts": list(pipe.present),
        "prompts": result.prompts,
        **result.trace.to_json(loads=pipe.experts.loads),
    }
    dest.write_json(routing, routing_json)
    dest.write_bytes(routing_heatmap(result.trace), heatmap)
    loads = Counter(pipe.experts.loads)
    return GenerateResult(result, dest.url_of(png), dest.url_of(routing_json), dest.url_of(heatmap), loads)
