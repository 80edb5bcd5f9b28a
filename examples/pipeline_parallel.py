"""A diffusers pipeline whose denoiser (Stable Diffusion's U-Net or PixArt's transformer) runs
patch-parallel over N processes (DistriFusion).

    .venv/bin/python examples/pipeline_parallel.py --nproc 2                     # tiny random SD pipeline, CPU
    .venv/bin/python examples/pipeline_parallel.py --nproc 3 --pipeline pixart   # tiny random PixArt-α
    .venv/bin/python examples/pipeline_parallel.py --nproc 2 --mode sync --steps 10
    .venv/bin/python examples/pipeline_parallel.py --nproc 2 --model DIR --prompt "a red fox" --size 512
    torchrun --nproc-per-node 4 examples/pipeline_parallel.py --nproc 4 --model DIR   # NCCL, one GPU each

Every rank builds the same pipeline and runs it twice with the same seed: once as it is (the
single-device reference) and once with `pipe.unet` / `pipe.transformer` patched by
flowfleet.parallel.parallelize, so the pipeline's own scheduler loop drives the band-parallel model.
Rank 0 writes a PNG grid (reference | patch-parallel | 10 x |difference|) and prints the largest
difference, the PSNR, the time per step and the bytes this rank sent per step.

Without --model there are no weights here: the pipeline is a tiny randomly initialised one (U-Net or
PixArt transformer, VAE) and the prompt embedding is a seeded random tensor (the prompt text only picks
the seed), so the images are noise patterns; they still show whether the parallel model reproduces the
plain one. With --model DIR (a local Stable Diffusion or PixArt-α folder, by --pipeline) the pipeline's
own tokenizer and text encoder are used.

Launching: under torchrun each process joins the group from torchrun's environment (NCCL when it has a
GPU, gloo otherwise); without torchrun --nproc N starts N processes with torch.multiprocessing (gloo on
CPU, or NCCL with one GPU each when there are N GPUs).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import zlib
from pathlib import Path

import torch

from flowfleet.distributed import DistContext, in_torchrun, init_from_env, init_process_group, shutdown
from flowfleet.errors import FlowfleetError
from flowfleet.parallel import parallelize
from flowfleet.parallel.launch import free_port
from flowfleet.parallel.unet import UNetMode
from flowfleet.sampling.views import image_grid, png_bytes
from flowfleet.storage import RunRoot


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2, help="processes splitting each image into row bands")
    p.add_argument("--pipeline", default="sd", choices=["sd", "pixart"], help="Stable Diffusion or PixArt-α")
    p.add_argument("--mode", default="displaced", choices=[m.value for m in UNetMode])
    p.add_argument(
        "--cfg-split",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with guidance and an even --nproc: the unconditional and conditional halves on two rank groups",
    )
    p.add_argument(
        "--warmup", type=int, default=4, help="synchronous steps after the first one (default 4, as the paper)"
    )
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--size", type=int, default=64, help="image height and width in pixels")
    p.add_argument("--guidance", type=float, default=5.0, help="classifier-free guidance scale (1 = none)")
    p.add_argument("--prompt", default="a lighthouse on a cliff at dusk")
    p.add_argument("--model", default=None, help="a local pipeline folder of that kind (default: tiny random)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="pipeline_parallel.png", help="PNG grid written by rank 0")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a collective may wait for another rank")
    args = p.parse_args(argv)
    if args.nproc < 1 or args.steps < 1 or args.size < 8 or args.warmup < 0:
        p.error("--nproc, --steps, --warmup and --size must be positive (size >= 8)")
    return args


# --------------------------------------------------------------------------------------------------
#                                         The pipeline
# --------------------------------------------------------------------------------------------------


def tiny_vae():
    """A randomly initialised VAE with SD's layout at 2 levels (latent = image / 2)."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        block_out_channels=(32, 64),
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        latent_channels=4,
        norm_num_groups=8,
    )


def tiny_pipeline(seed: int):
    """A randomly initialised Stable Diffusion pipeline small enough for a CPU (no text encoder)."""
    from diffusers import DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel

    torch.manual_seed(seed)
    unet = UNet2DConditionModel(
        sample_size=32,
        in_channels=4,
        out_channels=4,
        block_out_channels=(32, 64),
        layers_per_block=1,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32,
        attention_head_dim=8,
        norm_num_groups=8,
    )
    vae = tiny_vae()
    scheduler = DDIMScheduler(clip_sample=False, set_alpha_to_one=False, steps_offset=1)
    return StableDiffusionPipeline(
        vae=vae,
        text_encoder=None,
        tokenizer=None,
        unet=unet,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )


def tiny_pixart_pipeline(seed: int):
    """A randomly initialised PixArt-α pipeline small enough for a CPU (no text encoder)."""
    from diffusers import DPMSolverMultistepScheduler, PixArtAlphaPipeline, PixArtTransformer2DModel

    torch.manual_seed(seed)
    transformer = PixArtTransformer2DModel(
        sample_size=32,
        patch_size=2,
        in_channels=4,
        out_channels=8,  # (learned variance, as PixArt-α)
        num_layers=2,
        num_attention_heads=2,
        attention_head_dim=16,
        cross_attention_dim=32,
        caption_channels=32,
        use_additional_conditions=False,
    )
    vae = tiny_vae()
    return PixArtAlphaPipeline(
        tokenizer=None, text_encoder=None, vae=vae, transformer=transformer, scheduler=DPMSolverMultistepScheduler()
    )


def denoiser(pipe):
    """The model parallelize() splits: the pipeline's U-Net or transformer."""
    return pipe.unet if hasattr(pipe, "unet") else pipe.transformer


def build(args: argparse.Namespace, device: torch.device):
    """-> (pipeline, keyword arguments of its call, identical on every rank)."""
    pixart = args.pipeline == "pixart"
    if args.model is None:
        pipe = tiny_pixart_pipeline(args.seed) if pixart else tiny_pipeline(args.seed)
        g = torch.Generator().manual_seed(zlib.crc32(args.prompt.encode()))  # same on every rank
        width = pipe.transformer.config.caption_channels if pixart else pipe.unet.config.cross_attention_dim
        text = torch.randn(1, 7, width, generator=g).to(device)
        prompt = dict(prompt_embeds=text, negative_prompt_embeds=torch.zeros_like(text))
        if pixart:  # PixArt also takes the prompts' attention masks, and a size-binning step not wanted here
            mask = torch.ones(1, 7, device=device)
            prompt |= dict(prompt=None, negative_prompt=None, use_resolution_binning=False)
            prompt |= dict(prompt_attention_mask=mask, negative_prompt_attention_mask=mask)
    else:
        from diffusers import PixArtAlphaPipeline, StableDiffusionPipeline

        if not Path(args.model).is_dir():
            raise FlowfleetError(f"--model: {args.model!r} is not a local pipeline folder")
        dtype = torch.float16 if device.type == "cuda" else torch.float32
        if pixart:
            pipe = PixArtAlphaPipeline.from_pretrained(args.model, torch_dtype=dtype)
        else:
            pipe = StableDiffusionPipeline.from_pretrained(
                args.model, torch_dtype=dtype, safety_checker=None, requires_safety_checker=False
            )
        prompt = dict(prompt=args.prompt)
    pipe = pipe.to(device)
    pipe.set_progress_bar_config(disable=True)
    call = dict(
        num_inference_steps=args.steps,
        guidance_scale=args.guidance,
        height=args.size,
        width=args.size,
        output_type="pt",
        **prompt,
    )
    return pipe, call


def run_pipeline(pipe, call: dict, seed: int, device: torch.device) -> tuple[torch.Tensor, float]:
    """-> (images [B, 3, H, W] in [0, 1], seconds)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    images = pipe(generator=torch.Generator(device).manual_seed(seed), **call).images
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return images.float().cpu(), time.perf_counter() - t0


# --------------------------------------------------------------------------------------------------
#                                         One rank
# --------------------------------------------------------------------------------------------------


def rank_main(ctx: DistContext, args: argparse.Namespace) -> None:
    pipe, call = build(args, ctx.device)
    ref, t_ref = run_pipeline(pipe, call, args.seed, ctx.device)  # the plain pipeline (every rank)
    split = args.cfg_split and args.guidance > 1 and ctx.world_size % 2 == 0
    with parallelize(
        denoiser(pipe), ctx.world, mode=args.mode, warmup=args.warmup, cfg_split=split, timeout_s=ctx.timeout_s
    ) as handle:
        out, t_par = run_pipeline(pipe, call, args.seed, ctx.device)
        sent = handle.comm.bytes_by_step
        modes = [m.value for m in handle.modes]
    if not ctx.is_main:
        return
    diff = (out - ref).abs()
    mse = diff.square().mean().item()
    psnr = 10 * math.log10(1.0 / max(mse, 1e-20))  # images in [0, 1]
    grid = image_grid(torch.cat([ref, out, (10 * diff).clamp(0, 1)]) * 2 - 1, cols=ref.shape[0])
    out_path = Path(args.out).resolve()
    RunRoot(out_path.parent).write_bytes(png_bytes(grid), out_path.name)
    steady = sent.get(max(sent), 0) if sent else 0
    print(
        f"{args.nproc} ranks{' (CFG split)' if split else ''}, mode {args.mode} (warm-up {args.warmup}), "
        f"{args.steps} steps, {args.size}px, "
        f"{ctx.backend} on {ctx.device}"
    )
    print(f"  modes per {args.pipeline} denoiser call: {' '.join(modes)}")
    print(f"  max |parallel - single| = {diff.max().item():.3g}   PSNR = {psnr:.1f} dB")
    print(
        f"  time: single {t_ref / args.steps * 1e3:.0f} ms/step, parallel {t_par / args.steps * 1e3:.0f} ms/step "
        f"(rank 0; the single-device run was timed while every rank ran it too)"
    )
    print(f"  rank 0 sent {steady / 1e6:.3f} MB in the last step, {sum(sent.values()) / 1e6:.2f} MB in all")
    print(f"  wrote {out_path} (rows: single device | patch-parallel | 10 x |difference|)")


def _spawned(rank: int, args: argparse.Namespace, port: int) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.nproc))
    ctx = init_process_group(rank, args.nproc, init_method=f"tcp://127.0.0.1:{port}", timeout_s=args.timeout)
    try:
        rank_main(ctx, args)
    finally:
        shutdown()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if in_torchrun():
            ctx = init_from_env(timeout_s=args.timeout)
            if ctx.world_size != args.nproc:
                raise FlowfleetError(f"--nproc {args.nproc} but torchrun started {ctx.world_size} processes")
            try:
                rank_main(ctx, args)
            finally:
                shutdown()
        elif args.nproc == 1:
            from flowfleet.distributed import single_process

            rank_main(single_process("cuda" if torch.cuda.is_available() else "cpu"), args)
        else:
            if torch.cuda.is_available() and torch.cuda.device_count() < args.nproc:
                raise FlowfleetError(
                    f"--nproc {args.nproc}: only {torch.cuda.device_count()} GPUs (NCCL needs one per process)"
                )
            torch.multiprocessing.spawn(_spawned, args=(args, free_port()), nprocs=args.nproc)
    except FlowfleetError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except torch.multiprocessing.ProcessRaisedException as err:  # a rank's error, traceback printed above it
        print(f"error: {str(err).strip().splitlines()[-1]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
