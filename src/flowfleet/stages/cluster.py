"""Stage `cluster`: split RUN_ROOT/data/ into cluster.k partitions (paris §2.6, DDM's data partitioning).

Reads the semantic features of every prepared item, partitions them (two-stage k-means, or the
seeded random baseline), and writes

    clusters/assignments.safetensors   "assign" [N] int64 (aligned with data/'s index), "fine" [N]
    clusters/centroids.safetensors     "fine" [F, D], "coarse" [K, D], "fine_to_coarse" [F]
    clusters/preview-k.png             up to 64 random members of partition k
    clusters/report.json               sizes, inertia, fine->coarse map, NMI vs labels, label mix, examples
    partitions/k/                      a ShardSet with partition k's items (all fields, captions)

report.json is written last: its presence means the stage finished. Re-running replaces all of it.

scikit-learn (NMI) is imported only when the data has labels.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import safetensors.torch
import torch
from tqdm.auto import tqdm

from flowfleet.cluster.assignments import write_assignments
from flowfleet.cluster.features import FEATURE_FIELDS, caption_residual, clustering_features
from flowfleet.cluster.kmeans import l2_normalize_, random_partition, two_stage_kmeans
from flowfleet.config import ClusterConfig, RunConfig, load_run_config
from flowfleet.data.encoders import run_latent_encoder
from flowfleet.data.shards import ShardSet, ShardSetManifest, open_complete
from flowfleet.device import resolve_device
from flowfleet.errors import FlowfleetError
from flowfleet.layout import CENTROIDS, CLUSTER_REPORT, CLUSTERS, DATA, PARTITIONS, RUN_FILE, partition
from flowfleet.sampling.views import image_grid, png_bytes
from flowfleet.storage import RunRoot

PREVIEW_ITEMS = 64
EXAMPLE_CAPTIONS = 5


def preview_name(k: int) -> str:
    return f"preview-{k}.png"


def nmi(labels: torch.Tensor, assign: torch.Tensor) -> float | None:
    """Normalised mutual information between source labels and partitions (items labelled -1 ignored)."""
    keep = labels >= 0
    if int(keep.sum()) == 0:
        return None
    from sklearn.metrics import normalized_mutual_info_score

    return float(normalized_mutual_info_score(labels[keep].numpy(), assign[keep].numpy()))


def label_coherence(labels: torch.Tensor, assign: torch.Tensor) -> float | None:
    """Mean over labels of the share of that label's items in its majority partition: 1.0 when every
    label (digit) lies whole in one partition; 1/K for a label spread evenly. Items labelled -1 ignored."""
    shares = []
    for lab in torch.unique(labels[labels >= 0]).tolist():
        members = assign[labels == lab]
        shares.append(float(torch.bincount(members).max()) / members.numel())
    return sum(shares) / len(shares) if shares else None


def one_point_per_caption(x: torch.Tensor, captions: list[str]) -> tuple[torch.Tensor, int]:
    """Rows of items with the same caption replaced by their mean (re-normalised), and the number of
    distinct captions. A text encoder run in different batches gives one caption slightly different
    vectors; k-means with more centroids than captions would then cut a caption's items apart."""
    if len(captions) != x.shape[0]:
        raise FlowfleetError(f"data/: {x.shape[0]} feature rows but {len(captions)} captions")
    ids: dict[str, int] = {}
    group = torch.tensor([ids.setdefault(cap, len(ids)) for cap in captions])  # [N]
    means = torch.zeros(len(ids), x.shape[1], dtype=x.dtype).index_add_(0, group, x)
    return l2_normalize_(means)[group], len(ids)


def _feature_description(kind: str, manifest: ShardSetManifest) -> dict[str, Any]:
    encoders = manifest.extra.get("encoders") or {}
    if kind == "latent":
        return {"kind": kind, "latent": encoders.get("latent")}
    return {
        "kind": kind,
        "semantic": encoders.get("semantic") if kind != "text" else None,
        "text": encoders.get("text") if kind != "semantic" else None,
    }


def _label_mix(labels: torch.Tensor, assign: torch.Tensor, k: int) -> list[dict[str, int]]:
    """Per partition: {label: count}, most frequent first."""
    out = []
    for j in range(k):
        lab = labels[(assign == j) & (labels >= 0)]
        values, counts = torch.unique(lab, return_counts=True)
        order = torch.argsort(counts, descending=True, stable=True)
        out.append({str(int(values[i])): int(counts[i]) for i in order})
    return out


def cluster(
    run_root: str | RunRoot, *, backend: str = "auto", device: str | None = None, progress: bool = True
) -> dict[str, Any]:
    """Partition the prepared data; writes clusters/ and partitions/. Returns the report.
    backend: "faiss", "torch" or "auto" (faiss when installed); device: for the torch backend."""
    t0 = time.perf_counter()
    fit = fit_clusters(run_root, backend=backend, device=device, progress=progress)
    examples = write_partitions(fit.root, fit.cfg, fit.data, fit.data.manifest(), fit.assign, progress=progress)
    return finish_report(fit.root, fit.cfg, fit.report, examples, device, time.perf_counter() - t0)


@dataclass
class Fitted:
    """What `cluster` decided before it writes the partitions: the items' partition (assign [N]) and the report."""

    root: RunRoot
    cfg: RunConfig
    data: ShardSet
    assign: torch.Tensor
    report: dict[str, Any]


def fit_clusters(
    run_root: str | RunRoot, *, backend: str = "auto", device: str | None = None, progress: bool = True
) -> Fitted:
    """The partitions of the prepared items, decided: clusters/assignments.safetensors and centroids.safetensors
    written (any earlier clusters/ and partitions/ removed first); the partitions themselves not yet."""
    root = run_root if isinstance(run_root, RunRoot) else RunRoot(run_root)
    cfg = load_run_config(root)
    c = cfg.cluster
    data = open_complete(root, DATA, f"flowfleet prepare {root.url}")
    manifest = data.manifest()
    t0 = time.perf_counter()
    x, labels, index, fine_k = clustered_features(data, c)
    n = x.shape[0]
    if not torch.equal(index, torch.arange(n)):
        raise FlowfleetError(f"{data.url}: the shards' index is not 0..{n - 1} in order; run prepare with --restart")
    if c.k > n:
        raise FlowfleetError(f"cluster.k: {c.k} partitions for only {n} prepared items")
    dev = resolve_device(device)

    report: dict[str, Any] = {
        "mode": c.mode,
        "k": c.k,
        "count": n,
        "config": c.model_dump(mode="json"),
        "source": manifest.extra.get("source"),
        "features": _feature_description(c.features, manifest),
    }
    assign, fine, coarse, fine_to_coarse, fine_assign = partition_items(x, c, fine_k, backend, dev, progress, report)
    sizes = torch.bincount(assign, minlength=c.k).tolist()
    _check_floor(sizes, c, root)
    report.update(sizes=sizes, seconds_clustering=round(time.perf_counter() - t0, 2))
    report.update(_label_report(labels, assign, c, manifest.extra.get("label_names")))

    # Replace any earlier result, then write the small files before the partitions.
    root.remove(CLUSTERS, recursive=True)
    root.remove(PARTITIONS, recursive=True)
    write_assignments(root, assign, fine_assign)
    root.write_bytes(
        safetensors.torch.save(
            {"fine": fine.contiguous(), "coarse": coarse.contiguous(), "fine_to_coarse": fine_to_coarse.contiguous()}
        ),
        *CENTROIDS,
    )
    return Fitted(root, cfg, data, assign, report)


def finish_report(
    root: RunRoot,
    cfg: RunConfig,
    report: dict[str, Any],
    examples: dict[int, tuple[torch.Tensor, list[str]]],
    device: str | None,
    seconds: float,
) -> dict[str, Any]:
    """The previews of the written partitions, then report.json, last: the stage has finished."""
    write_previews(root, cfg, examples, resolve_device(device))
    report["examples"] = {str(k): caps for k, (_, caps) in examples.items()}
    report["seconds"] = round(seconds, 2)
    root.write_json(report, *CLUSTER_REPORT)
    return report


def clustered_features(data: ShardSet, c: ClusterConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """What `cluster` partitions under `c`, from the prepared shards: the items' features x [N, D] (cluster.features
    raised to cluster.power, less what the caption tells where cluster.caption_residual, one point per caption for
    caption features), their labels [N] and index [N], and the fine k they allow."""
    extra = ["text_pooled"] if c.caption_residual else []
    fields, captions = data.load([*FEATURE_FIELDS[c.features], *extra, "labels", "index"], with_captions=True)
    x = clustering_features(fields, c.features, c.power)
    if c.caption_residual:
        x = caption_residual(x, fields["text_pooled"])
    fine_k = c.fine_k
    if c.features == "text":  # one caption, one point: never split items that say the same thing
        x, distinct = one_point_per_caption(x, captions)
        fine_k = min(fine_k, distinct)
    return x, fields["labels"], fields["index"], fine_k


def partition_items(
    x: torch.Tensor,
    c: ClusterConfig,
    fine_k: int,
    backend: str,
    device: torch.device,
    progress: bool,
    report: dict[str, Any],
) -> tuple[torch.Tensor, ...]:
    """(assign, fine, coarse, fine_to_coarse, fine_assign) of the items' features x [N, D] under cluster.mode:
    the two-stage k-means, or the random baseline; what the k-means did goes into `report`."""
    n = x.shape[0]
    if c.mode == "random":
        assign = random_partition(n, c.k, c.seed)
        sums = torch.zeros(c.k, x.shape[1]).index_add_(0, assign, x)
        coarse = sums / torch.bincount(assign, minlength=c.k).unsqueeze(1)
        # no fine stage: the "fine" centroids are the partitions' own (copies: safetensors refuses shared storage)
        fine, fine_to_coarse, fine_assign = coarse.clone(), torch.arange(c.k), assign.clone()
        report.update(backend="none")
    else:
        res = two_stage_kmeans(
            x,
            c.k,
            fine_k=fine_k,
            sample_size=c.sample_size,
            iters=c.iters,
            seed=c.seed,
            balance=c.balance_within if c.balance else None,
            min_size=max(c.min_share, (1 - c.balance_within) / c.k if c.balance else 0.0) * n,
            backend=backend,
            device=device,
            progress=progress,
        )
        assign, fine, coarse = res.assign, res.fine, res.coarse
        fine_to_coarse, fine_assign = res.fine_to_coarse, res.fine_assign
        report.update(
            backend=res.backend,
            fine_k=fine.shape[0],
            sample_size=res.sample_size,
            inertia={"fine": res.inertia_fine, "coarse": res.inertia_coarse, "coarse_per_item": res.inertia_coarse / n},
            reseeds=res.reseeds,
            notes=res.notes,
            seconds_per_phase=res.seconds,
            fine_to_coarse=fine_to_coarse.tolist(),
        )
    return assign, fine, coarse, fine_to_coarse, fine_assign


def _label_report(
    labels: torch.Tensor, assign: torch.Tensor, c: ClusterConfig, names: list[str] | None
) -> dict[str, Any]:
    """How the partitions follow the source's labels, where it has them: NMI (and the same sizes at random),
    label coherence, each partition's label mix, and what each label means."""
    n = assign.shape[0]
    score = nmi(labels, assign)
    if score is None:
        return {"nmi": None, "label_coherence": None}
    shuffled = assign[torch.randperm(n, generator=torch.Generator().manual_seed(c.seed))]
    return {
        "nmi": score,
        "nmi_random_same_sizes": nmi(labels, shuffled),
        "label_coherence": label_coherence(labels, assign),
        "label_mix": _label_mix(labels, assign, c.k),
        "label_names": names,  # what label i means, where the source says
    }


def _check_floor(sizes: list[int], c: ClusterConfig, root: RunRoot) -> None:
    """Refuse, before anything is written, a partition under cluster.min_share of the items (one the k-means could
    not lift to it: flowfleet.cluster.kmeans.lift_to_floor)."""
    n = sum(sizes)
    small = min(range(len(sizes)), key=lambda j: sizes[j])
    if sizes[small] >= c.min_share * n:
        return
    fix = "fewer partitions (cluster.k)" if c.balance else "cluster.balance: true, or fewer partitions (cluster.k)"
    raise FlowfleetError(
        f"{root.url_of(RUN_FILE)}: cluster {small} holds {sizes[small]} of {n} items ({sizes[small] / n:.1%}), under "
        f"cluster.min_share {c.min_share:g} even with the fine clusters nearest it (sizes {sizes}); more fine "
        f"clusters (cluster.fine_k) can fill it, or set {fix}"
    )


def write_partitions(
    root: RunRoot,
    cfg: RunConfig,
    data: ShardSet,
    manifest: ShardSetManifest,
    assign: torch.Tensor,
    *,
    progress: bool = True,
) -> dict[int, tuple[torch.Tensor, list[str]]]:
    """partitions/k/ for every k, streamed shard by shard; returns per partition (latents, captions)
    of up to PREVIEW_ITEMS seeded-random members for the previews."""
    k_total = cfg.cluster.k
    size = cfg.data.shard_size
    picked = preview_members(assign, k_total, cfg.cluster.seed)
    sets = [ShardSet(root, partition(k)) for k in range(k_total)]
    outs = [ShardSetManifest(extra=partition_extra(cfg, manifest, assign, k)) for k in range(k_total)]
    pending = PartitionRows(assign, k_total, picked)

    def flush(k: int, final: bool) -> None:
        while pending.count(k) and (pending.count(k) >= size or final):
            sets[k].append(outs[k], *pending.take(k, min(size, pending.count(k))))

    for shard in tqdm(manifest.shards, desc="partitions", unit="shard", disable=not progress, dynamic_ncols=True):
        for k in pending.add(*data.read_shard(shard["name"])):
            flush(k, final=False)
    for k in range(k_total):
        flush(k, final=True)
        outs[k].complete = True
        sets[k].write_manifest(outs[k])
    return pending.previews()


class PartitionRows:
    """Each partition's rows met in data/'s shards and not yet written, in data order, and its preview members."""

    def __init__(self, assign: torch.Tensor, k_total: int, picked: torch.Tensor):
        self.assign, self.picked = assign, picked  # [N] partition, [N] bool: in its preview (preview_members)
        self.rows: list[dict[str, list[torch.Tensor]]] = [{} for _ in range(k_total)]
        self.captions: list[list[str]] = [[] for _ in range(k_total)]
        self.examples: dict[int, tuple[list[torch.Tensor], list[str]]] = {k: ([], []) for k in range(k_total)}

    def add(self, tensors: dict[str, torch.Tensor], captions: list[str]) -> list[int]:
        """A shard's items, each to its partition -> the partitions that got any."""
        part = self.assign[tensors["index"]]  # [n]
        got = []
        for k in range(len(self.rows)):
            rows = (part == k).nonzero().flatten()
            if len(rows) == 0:
                continue
            for f, v in tensors.items():
                self.rows[k].setdefault(f, []).append(v[rows])
            caps = [captions[i] for i in rows.tolist()]
            self.captions[k] += caps
            show = self.picked[tensors["index"][rows]]
            self.examples[k][0].append(tensors["latents"][rows[show]])
            self.examples[k][1].extend(c for c, s in zip(caps, show.tolist()) if s)
            got.append(k)
        return got

    def count(self, k: int) -> int:
        return len(self.captions[k])

    def take(self, k: int, m: int) -> tuple[dict[str, torch.Tensor], list[str]]:
        """Partition k's first m pending rows (and their captions), no longer pending."""
        cat = {f: torch.cat(v) for f, v in self.rows[k].items()}
        self.rows[k] = {f: [v[m:]] for f, v in cat.items()}
        taken, self.captions[k] = self.captions[k][:m], self.captions[k][m:]
        return {f: v[:m] for f, v in cat.items()}, taken

    def previews(self) -> dict[int, tuple[torch.Tensor, list[str]]]:
        """Each partition's preview members met so far: their latents, and the first EXAMPLE_CAPTIONS captions."""
        return {k: (torch.cat(lat), caps[:EXAMPLE_CAPTIONS]) for k, (lat, caps) in self.examples.items()}


def preview_members(assign: torch.Tensor, k_total: int, seed: int) -> torch.Tensor:
    """[N] bool: up to PREVIEW_ITEMS seeded-random members of each partition, the ones its preview shows."""
    gen = torch.Generator().manual_seed(seed)
    picked = torch.zeros(assign.shape[0], dtype=torch.bool)
    for k in range(k_total):
        members = (assign == k).nonzero().flatten()
        picked[members[torch.randperm(len(members), generator=gen)[:PREVIEW_ITEMS]]] = True
    return picked


def partition_extra(cfg: RunConfig, manifest: ShardSetManifest, assign: torch.Tensor, k: int) -> dict[str, Any]:
    """What partition k's manifest records beside its shards."""
    return {
        "partition": k,
        "num_partitions": cfg.cluster.k,
        "source": manifest.extra.get("source"),
        "encoders": manifest.extra.get("encoders"),
        "cluster": cfg.cluster.model_dump(mode="json"),
        "data_count": manifest.count,
        # every partition's items, so that an expert's job can take its share of the fleet's steps
        # (train.expert_steps: by_size) from its own manifest
        "partition_counts": torch.bincount(assign, minlength=cfg.cluster.k).tolist(),
    }


def write_previews(
    root: RunRoot, cfg: RunConfig, examples: dict[int, tuple[torch.Tensor, list[str]]], device: torch.device
) -> None:
    """clusters/preview-k.png: a grid of partition k's sampled members, decoded to images."""
    latent = run_latent_encoder(root, cfg, device)
    for k, (latents, _) in examples.items():
        images = latent.decode(latents).cpu()  # [<=64, C, H, W]
        root.write_bytes(png_bytes(image_grid(images)), CLUSTERS, preview_name(k))
