"""`flowfleet export diffusers` (an expert in diffusers' format) and `flowfleet export skypilot` (a run's
jobs as SkyPilot task files)."""

from __future__ import annotations

import argparse

from flowfleet.commands.options import add_command


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help="an expert in diffusers' format, or a run's jobs as SkyPilot tasks",
        description="diffusers: write a model folder's expert as a PixArtTransformer2DModel "
        "folder, a FlowMatchEulerDiscreteScheduler config, the expert's null text as negative prompt embeddings "
        "and a sampling example (the expert needs adaln single, cross_attn, cross_norm false, add_pooled false). "
        "skypilot: write one SkyPilot task file per training job of a run.",
    )
    targets = p.add_subparsers(dest="target", metavar="TARGET", required=True)
    d = add_command(targets, "diffusers", run_export_diffusers)
    d.add_argument("model_dir", metavar="MODEL_DIR", help="assembled model folder (flowfleet assemble's output)")
    d.add_argument("out", metavar="OUT", help="folder (or fsspec URL) to write")
    d.add_argument("--expert", type=int, required=True, metavar="K", help="which expert")

    s = add_command(targets, "skypilot", run_export_skypilot)
    s.add_argument("run_root", metavar="RUN_ROOT", help="the run root: an object store URL (s3://...)")
    s.add_argument("out", metavar="DIR", help="folder to write the task files into")
    s.add_argument("--accelerators", default=None, help="per node, NAME[:COUNT], e.g. A100:1 (default: CPU only)")
    s.add_argument("--cpus", default=None, help="e.g. 8+")
    s.add_argument("--memory", default=None, help="GB, e.g. 32+")
    s.add_argument("--num-nodes", type=int, default=1, help="nodes per job (multi-node DDP)")
    s.add_argument("--setup", default=None, help='setup command (default: pip install "flowfleet[all]")')
    s.add_argument("--use-spot", action="store_true", help="spot instances (managed jobs resume from checkpoints)")


def run_export_diffusers(args: argparse.Namespace) -> int:
    """a PixArtTransformer2DModel folder that diffusers loads"""

    from flowfleet.stages.export import export_diffusers

    out = export_diffusers(args.model_dir, args.expert, args.out)
    print(f"wrote {out}: expert {args.expert} as a diffusers PixArtTransformer2DModel folder")
    return 0


def run_export_skypilot(args: argparse.Namespace) -> int:
    """one SkyPilot task file per training job (run root on an object store)

    Write DIR/<job>.yaml for every training job of the run (torchrun driven by SkyPilot's variables, the run root's URL
    in FLOWFLEET_RUN_ROOT) and DIR/launch.sh with `sky jobs launch` for each.
    """

    from flowfleet.backends.skypilot import DEFAULT_SETUP, SkyPilotOptions, export_skypilot

    options = SkyPilotOptions(
        accelerators=args.accelerators,
        cpus=args.cpus,
        memory=args.memory,
        num_nodes=args.num_nodes,
        setup=args.setup or DEFAULT_SETUP,
        use_spot=args.use_spot,
    )
    files = export_skypilot(args.run_root, args.out, options)
    print(f"wrote {len(files) - 1} SkyPilot task files and {files[-1]}")
    return 0
