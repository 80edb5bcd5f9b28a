"""`flowfleet export diffusers`: a model folder's expert in another library's format."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help="write an expert in another library's format (diffusers)",
        description="Write a model folder's expert for another library. diffusers: a PixArtTransformer2DModel "
        "folder, a FlowMatchEulerDiscreteScheduler config, the expert's null text as negative prompt embeddings "
        "and a sampling example (the expert needs adaln single, cross_attn, cross_norm false, add_pooled false).",
    )
    targets = p.add_subparsers(dest="target", metavar="TARGET", required=True)
    d = targets.add_parser("diffusers", help="a PixArtTransformer2DModel folder that diffusers loads")
    d.add_argument("model_dir", metavar="MODEL_DIR", help="assembled model folder (flowfleet assemble's output)")
    d.add_argument("out", metavar="OUT", help="folder (or fsspec URL) to write")
    d.add_argument("--expert", type=int, required=True, metavar="K", help="which expert")
    d.set_defaults(func=run_export_diffusers)


def run_export_diffusers(args: argparse.Namespace) -> int:
    from flowfleet.stages.export import export_diffusers

    out = export_diffusers(args.model_dir, args.expert, args.out)
    print(f"wrote {out}: expert {args.expert} as a diffusers PixArtTransformer2DModel folder")
    return 0
