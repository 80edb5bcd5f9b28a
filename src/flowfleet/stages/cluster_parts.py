"""`flowfleet cluster RUN --parts N`: the partitions written by N processes at once, byte for byte what one `cluster`
writes. The clustering itself is decided once, here (the k-means on its sample, every item assigned:
stages.cluster.fit_clusters); writing the partitions, which reads every prepared item and writes it again, is what
is cut: part i of N takes a contiguous run of data/'s shards (`cluster --part i/N`) and writes the partitions' shards
that lie wholly in it where one cluster would, and the pieces of those that straddle two parts into
cluster-parts/<i>-of-<N>/; `cluster --merge N` joins the pieces, writes each partition's manifest, the previews and
the report. Every part knows where its items fall in each partition from the assignments alone, so no part waits
for another. On a Slurm cluster (`--backend slurm`, or a run.yaml `backends` entry of kind slurm) the fit, the parts
and the merge are Slurm jobs, on a Ray cluster (`--backend ray`) the tasks of one Ray job; elsewhere they are the
same commands, started by hand or by any scheduler: `cluster --fit-only`, then `cluster --part i/N` on each
machine, then `cluster --merge N`.

    cluster-parts/fit.json                  the report so far (what --merge completes into clusters/report.json)
    cluster-parts/<i>-of-<N>/done.json      part i has written all it writes
    cluster-parts/<i>-of-<N>/<k>/shard-<j>  its rows of partition k's shard j, where the shard straddles parts
    cluster-parts/<i>-of-<N>/examples.*    its preview members: latents (.safetensors), captions (.json)
    cluster-parts/<i>-of-<N>.log            the part's output (`--parts`)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import safetensors.torch
import torch
from tqdm.auto import tqdm

from flowfleet.cluster.assignments import read_assignments
from flowfleet.config import BackendConfig, load_run_config
from flowfleet.data.shards import (
    ShardSet,
    ShardSetManifest,
    fields_of,
    open_complete,
    parse_shard,
    shard_bytes,
    shard_name,
)
from flowfleet.errors import FlowfleetError, ParameterError
from flowfleet.layout import CLUSTER_PARTS, DATA, partition
from flowfleet.stages.cluster import (
    EXAMPLE_CAPTIONS,
    Fitted,
    PartitionRows,
    finish_report,
    fit_clusters,
    partition_extra,
    preview_members,
)
from flowfleet.stages.parts import run_parts, submit_parts
from flowfleet.storage import RunRoot

FIT = "fit.json"
DONE = "done.json"
EXAMPLES = "examples.safetensors"
EXAMPLE_CAPTIONS_FILE = "examples.json"


@dataclass
class PartsClustered:
    report: dict[str, Any]
    spans: dict[str, tuple[float, float]] = field(default_factory=dict)  # each part's (start, end), perf_counter


def part_folder(i: int, n: int) -> str:
    return f"{CLUSTER_PARTS}/{i}-of-{n}"


def cluster_in_parts(
    run_root: str | RunRoot,
    n: int,
    *,
    backend: str = "auto",
    device: str | None = None,
    parallel: int | None = None,
    progress: bool = True,
) -> PartsClustered:
    """Decide the partitions here, write them in `n` parts as local processes (`parallel` at a time), then merge."""
    if n < 1:
        raise ParameterError("parts", f"must be >= 1, got {n}")
    t0 = time.perf_counter()
    fit = fit_for_parts(run_root, backend=backend, device=device, progress=progress)
    preload = ("flowfleet.cli", "flowfleet.stages.cluster_parts")  # what every part imports, once
    spans = run_parts(fit.root, ["cluster"], n, CLUSTER_PARTS, parallel=parallel, preload=preload)
    return PartsClustered(merge_cluster_parts(fit.root, n, device=device, started=t0, progress=progress), spans)


def fit_for_parts(
    run_root: str | RunRoot, *, backend: str = "auto", device: str | None = None, progress: bool = True
) -> Fitted:
    """`cluster --fit-only`: the partitions decided (the k-means, every item's assignment) and cluster-parts/ begun
    afresh with fit.json, for `cluster --part i/N` anywhere after it."""
    fit = fit_clusters(run_root, backend=backend, device=device, progress=progress)
    for name in fit.root.ls(CLUSTER_PARTS):  # an earlier fit's parts; the logs stay (a scheduler appends to them)
        if not name.endswith(".log"):
            fit.root.remove(CLUSTER_PARTS, name, recursive=True)
    fit.root.write_json(fit.report, CLUSTER_PARTS, FIT)
    return fit


def submit_cluster_parts(run_root: str | RunRoot, n: int, backend: str | BackendConfig) -> dict[str, str]:
    """The fit, the n parts and the merge as jobs of a Slurm or Ray backend (stages.parts.submit_parts) -> step name ->
    job id. Returns once they are submitted."""
    root = run_root if isinstance(run_root, RunRoot) else RunRoot(run_root)
    return submit_parts(root, "cluster", n, backend, CLUSTER_PARTS, ("fit", ["--fit-only"]))


def shard_range(count: int, i: int, n: int) -> tuple[int, int]:
    """data/'s shards [lo, hi) that part i of n writes: contiguous runs, as even as whole shards allow."""
    return count * i // n, count * (i + 1) // n


def write_cluster_part(run_root: str | RunRoot, i: int, n: int, *, progress: bool = True) -> dict[str, int]:
    """`cluster --part i/N`: part i's rows of every partition, from the assignments the clustering wrote
    -> {"shards": written whole, "pieces": straddling ones' pieces}."""
    root = run_root if isinstance(run_root, RunRoot) else RunRoot(run_root)
    cfg = load_run_config(root)
    if not root.exists(CLUSTER_PARTS, FIT):
        raise FlowfleetError(
            f"{root.url_of(CLUSTER_PARTS, FIT)}: missing; `flowfleet cluster {root.url} --fit-only` (or `--parts {n}`) "
            "decides the partitions before its parts write them"
        )
    data = open_complete(root, DATA, f"flowfleet prepare {root.url}")
    manifest = data.manifest()
    assign = read_assignments(root)
    k_total, size = cfg.cluster.k, cfg.data.shard_size
    lo, hi = shard_range(len(manifest.shards), i, n)
    first = sum(s["count"] for s in manifest.shards[:lo])  # data/'s index runs 0..N-1 in shard order
    totals = torch.bincount(assign, minlength=k_total).tolist()
    at = torch.bincount(assign[:first], minlength=k_total).tolist()  # each partition's row of this part's first
    picked = preview_members(assign, k_total, cfg.cluster.seed)
    mine = part_folder(i, n)
    root.remove(mine, recursive=True)
    pending = PartitionRows(assign, k_total, picked)
    written = {"shards": 0, "pieces": 0}

    def flush(k: int, final: bool) -> None:
        """Write what of partition k's pending rows fills its shards: a shard begun here whole into partitions/k/,
        a piece of one begun or ended in another part into this part's folder."""
        while pending.count(k):
            j = at[k] // size
            need = min((j + 1) * size, totals[k]) - at[k]
            if pending.count(k) < need and not final:
                return
            m = min(need, pending.count(k))
            rows = shard_bytes(*pending.take(k, m))
            if at[k] == j * size and m == need:
                root.write_bytes(rows, partition(k), shard_name(j))
                written["shards"] += 1
            else:
                root.write_bytes(rows, mine, str(k), shard_name(j))
                written["pieces"] += 1
            at[k] += m

    for shard in tqdm(manifest.shards[lo:hi], desc=f"partitions, part {i}/{n}", unit="shard", disable=not progress):
        for k in pending.add(*data.read_shard(shard["name"])):
            flush(k, final=False)
    for k in range(k_total):
        flush(k, final=True)
    shown = {str(k): torch.cat(lat) for k, (lat, _) in pending.examples.items() if lat}
    root.write_bytes(safetensors.torch.save(shown), mine, EXAMPLES)
    root.write_json({str(k): caps for k, (_, caps) in pending.examples.items()}, mine, EXAMPLE_CAPTIONS_FILE)
    root.write_json({"part": [i, n], "data_shards": [lo, hi], **written}, mine, DONE)  # last: the part is done
    return written


def merge_cluster_parts(
    run_root: str | RunRoot, n: int, *, device: str | None = None, started: float | None = None, progress: bool = True
) -> dict[str, Any]:
    """`cluster --merge N`: the straddling shards joined from their pieces, each partition's manifest (the same as
    one `cluster` writes), the previews, and clusters/report.json last. The parts' folders are removed after."""
    root = run_root if isinstance(run_root, RunRoot) else RunRoot(run_root)
    t0 = time.perf_counter() if started is None else started
    cfg = load_run_config(root)
    for i in range(n):
        if not root.exists(part_folder(i, n), DONE):
            raise FlowfleetError(
                f"{root.url_of(part_folder(i, n), DONE)}: missing; run `flowfleet cluster {root.url} --part {i}/{n}`"
            )
    data = open_complete(root, DATA, f"flowfleet prepare {root.url}")
    manifest = data.manifest()
    assign = read_assignments(root)
    k_total, size = cfg.cluster.k, cfg.data.shard_size
    totals = torch.bincount(assign, minlength=k_total).tolist()
    for k in tqdm(range(k_total), desc="cluster --merge", unit="partition", disable=not progress):
        out = ShardSetManifest(extra=partition_extra(cfg, manifest, assign, k))
        for j in range(-(-totals[k] // size)):  # shard j holds the partition's rows j * size on (the last: the rest)
            name, count = shard_name(j), min(size, totals[k] - j * size)
            if not root.exists(partition(k), name):  # it straddles parts: joined from their pieces, in part order
                parsed = [
                    parse_shard(root.read_bytes(part_folder(i, n), str(k), name))
                    for i in range(n)
                    if root.exists(part_folder(i, n), str(k), name)
                ]
                captions = [c for _, caps in parsed for c in caps]
                if len(captions) != count:
                    raise FlowfleetError(
                        f"{root.url_of(partition(k), name)}: its parts' pieces hold {len(captions)} items, not "
                        f"{count}; run `flowfleet cluster {root.url} --parts {n}` again"
                    )
                tensors = {f: torch.cat([t[f] for t, _ in parsed]) for f in parsed[0][0]}
                root.write_bytes(shard_bytes(tensors, captions), partition(k), name)
            if not out.fields:  # (one shard read: the others' items are counted, not read)
                out.fields = fields_of(parse_shard(root.read_bytes(partition(k), name))[0])
            out.shards.append({"name": name, "count": count})
        out.complete = True
        ShardSet(root, partition(k)).write_manifest(out)
    examples = _examples(root, n, k_total)
    report = finish_report(root, cfg, root.read_json(CLUSTER_PARTS, FIT), examples, device, time.perf_counter() - t0)
    for i in range(n):
        root.remove(part_folder(i, n), recursive=True)
    root.remove(CLUSTER_PARTS, FIT)
    return report


def _examples(root: RunRoot, n: int, k_total: int) -> dict[int, tuple[torch.Tensor, list[str]]]:
    """Each partition's preview members, from the parts in order (as one `cluster` meets them)."""
    latents: dict[int, list[torch.Tensor]] = {k: [] for k in range(k_total)}
    captions: dict[int, list[str]] = {k: [] for k in range(k_total)}
    for i in range(n):
        shown = safetensors.torch.load(root.read_bytes(part_folder(i, n), EXAMPLES))
        caps = root.read_json(part_folder(i, n), EXAMPLE_CAPTIONS_FILE)
        for k in range(k_total):
            if str(k) in shown:
                latents[k].append(shown[str(k)])
            captions[k] += caps.get(str(k), [])
    return {k: (torch.cat(latents[k]), captions[k][:EXAMPLE_CAPTIONS]) for k in range(k_total)}
