"""Experts from strangers: `keygen`, `kit`, `contribute`, `admit` (docs/contributing-experts.md)."""

from __future__ import annotations

import argparse

from flowfleet.commands.options import (
    add_command,
    add_data_source,
    add_device,
    add_progress,
    add_run_root,
    data_config,
)


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "keygen", run_keygen, epilog="example:  flowfleet keygen keys/alice")
    p.add_argument("out", metavar="OUT", help="writes OUT.key (private, owner-only) and OUT.pub (one line)")
    p.add_argument("--comment", default="", help="the name on the .pub line (default: OUT's name)")

    p = add_command(sub, "kit", run_kit, epilog="example:  flowfleet kit runs/r kits/r")
    add_run_root(p)
    p.add_argument("out", metavar="OUT", help="the kit folder to write")
    p.add_argument(
        "--max-params", type=int, default=None, metavar="N", help="the parameter cap (default 4x the run's expert)"
    )

    p = add_command(
        sub,
        "contribute",
        run_contribute,
        epilog="example:  flowfleet contribute kits/r --data ~/my-pngs --out pkgs/mine --key keys/alice.key",
    )
    p.add_argument("kit", metavar="KIT", help="a kit folder (flowfleet kit)")
    p.add_argument("--data", default=None, metavar="PATH", help="a folder of images (with captions); or --source")
    add_data_source(p, source_default="folder")
    p.add_argument("--out", required=True, metavar="PKG", help="the package folder to write")
    p.add_argument("--key", required=True, metavar="KEY", help="the private key that signs it (flowfleet keygen)")
    p.add_argument("--steps", type=int, default=None, help="training steps (default: the kit's run's)")
    p.add_argument(
        "--heldout",
        type=int,
        default=100,
        metavar="N",
        help="hold the source's last N items out of training, for the gate (with --labels: those of them it keeps; "
        "default 100)",
    )
    p.add_argument("--sample", type=int, default=1024, metavar="N", help="items of the latents sample (default 1024)")
    add_progress(p)

    p = add_command(
        sub, "admit", run_admit, epilog="example:  flowfleet admit runs/r pkgs/mine --trusted keys/trusted.pub"
    )
    add_run_root(p)
    p.add_argument("package", metavar="PKG", help="a package folder (flowfleet contribute)")
    p.add_argument("--trusted", required=True, metavar="KEYS", help="a file of .pub lines, or a folder of .pub files")
    p.add_argument(
        "--judge",
        default="auto",
        metavar="JUDGE",
        help="judge the fleet's images before and after too: auto (default: the built-in digits' or emoji's judge "
        "where the run has one), digits, emoji, MODULE:FACTORY (as evaluate --judge), or none (the loss alone)",
    )
    p.add_argument(
        "--picture",
        default=None,
        metavar="PNG",
        help="also write the judged samples (the fleet before and after) to PNG, on a refusal too",
    )
    for option, kind, default, text in (  # GateSettings' defaults (tests/test_contrib.py holds them equal)
        ("--harm", float, 0.05, "how much the fleet's loss on its own data may rise, as a share"),
        ("--judge-n", int, 300, "prompts per judged comparison"),
        (
            "--accuracy-drop",
            float,
            0.02,
            "how much the judge's prompt accuracy on the fleet's held-out prompts may fall",
        ),
        ("--fd-rise", float, 0.10, "how much the judge's Fréchet distance there may rise, a share"),
    ):
        p.add_argument(option, type=kind, default=default, help=f"{text} (default {default})")
    add_device(p)
    add_progress(p)


def run_keygen(args: argparse.Namespace) -> int:
    """make an Ed25519 key pair that signs contributed experts

    Write OUT.key (the private key, PEM, readable by its owner only) and OUT.pub (one line a fleet's owner adds to
    their trusted keys). Never overwrites.
    """
    from flowfleet.sampling.signing import keygen

    private, public, kid = keygen(args.out, args.comment)
    print(f"wrote {private} and {public} (key id {kid})")
    return 0


def run_kit(args: argparse.Namespace) -> int:
    """write what a stranger needs to train an expert this fleet can take

    The frozen latent encoder, the text encoder's identity, the time convention, the accepted objectives, the latent
    shape, the expert architecture's limits, the fleet's cluster centroids and a fingerprint of the contract. No data.
    """
    from flowfleet.stages.kit import make_kit

    kit = make_kit(args.run_root, args.out, max_params=args.max_params)
    print(f"wrote {args.out} (fingerprint {kit.fingerprint[:16]}..., at most {kit.max_params:,} parameters)")
    return 0


def run_contribute(args: argparse.Namespace) -> int:
    """train an expert for a fleet from its kit, in isolation, and sign it

    Prepare the images with the kit's encoders (in PKG.work/, resumable), train one expert on them, and write PKG:
    the expert, a capped sample of its latents and text embeddings, a held-out slice, and a manifest signed with
    --key. No image leaves the machine.
    """
    from flowfleet.stages.contribute import ContributeOptions, contribute
    from flowfleet.stages.kit import read_kit

    kit = read_kit(args.kit)
    if args.data is not None:
        args.source, args.path = "folder", args.data
    data = data_config(args, image_size=kit.image_size, channels=kit.image_channels)
    options = ContributeOptions(args.steps, args.sample, args.heldout, progress=args.progress)
    result = contribute(args.kit, data, args.out, args.key, options)
    print(
        f"wrote {result.package}: one expert, {result.steps} steps on {result.items} items (final loss "
        f"{result.final_loss:.4f}), signed by key {result.key_id}"
    )
    return 0


def run_admit(args: argparse.Namespace) -> int:
    """check a contributed expert and, if it passes, grow the fleet with it

    In order, refusing at the first failure in one line: who signed it and whether any file changed; what it holds
    (safetensors only, within the parameter cap, finite); whether it fits the fleet (latents, text, time convention,
    objective, kit fingerprint); whether it learnt (held-out loss against an untrained expert's and its own sample's);
    whether the grown fleet, its router retrained, does no harm on the fleet's held-out data and helps on the
    contribution's (by the flow-matching loss, and where a judge reads the prompts by its prompt accuracy and
    Fréchet distance). Then RUN_ROOT/model holds it, with its signer in card.json and SHA256SUMS.
    """
    from flowfleet.stages.admit import admit

    result = admit(
        args.run_root,
        args.package,
        args.trusted,
        settings=gate_settings(args),
        progress=args.progress,
        picture=args.picture,
    )
    print(
        f"admitted as expert {result.expert} (signed by {result.signer}, manifest {result.manifest_sha256[:16]}...);"
        f" wrote {result.model}"
    )
    for line in result.lines():
        print(f"  {line}")
    if result.grid:
        print(f"wrote {result.grid} (the judged samples, the fleet before and after)")
    return 0


def gate_settings(args: argparse.Namespace):  # -> flowfleet.stages.admit.GateSettings
    from flowfleet.stages.admit import GateSettings

    return GateSettings(
        harm=args.harm,
        judge=None if args.judge == "none" else args.judge,
        judge_n=args.judge_n,
        accuracy_drop=args.accuracy_drop,
        fd_rise=args.fd_rise,
        device=args.device,
    )
