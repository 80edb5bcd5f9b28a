"""Small synthetic runs for tests and benchmarks: a run.yaml plus data/, clusters/ and partitions/
written directly as ShardSets (what `prepare` and `cluster` would write), no encoders needed.

Cluster k's latents are noise around a per-cluster constant image, so a router can learn them.
"""

from __future__ import annotations

from typing import Any

import safetensors.torch
import torch

from flowfleet.config import RunConfig
from flowfleet.data.shards import ShardSet, ShardSetManifest
from flowfleet.presets import PRESETS
from flowfleet.storage import RunRoot


def synthetic_config(*, k: int = 2, size: int = 8, channels: int = 1, steps: int = 6, batch: int = 8,
                     train: dict[str, Any] | None = None, monolith: bool = False) -> RunConfig:
    """mnist-tiny shrunk to size x size latents, a hidden-32 depth-1 expert and router."""
    raw = PRESETS["mnist-tiny"]()
    raw["name"] = "synthetic"
    raw["data"].update(image_size=size, channels=channels)
    raw["cluster"].update(k=k, fine_k=2 * k, features="semantic", balance=False)
    raw["expert"].update(input_size=(size, size), in_channels=channels, hidden_size=32, depth=1, num_heads=2,
                         patch_size=2)
    raw["router"].update(input_size=(size, size), in_channels=channels, hidden_size=32, depth=1, num_heads=2,
                         patch_size=2, num_outputs=k)
    common = dict(steps=steps, batch_size=batch, lr=1e-3, ema_decay=0.9, ckpt_every=10_000,
                  sample_every=10_000, log_every=1, warmup_steps=0)
    raw["train"].update(common, **(train or {}))
    raw["router_train"].update(common, **(train or {}))
    raw["monolith"] = {"enabled": monolith, "match_compute": True}
    raw["sampling"].update(steps=3)
    return RunConfig.from_dict(raw, where="synthetic config")


def write_synthetic_run(root: RunRoot, cfg: RunConfig, *, per_cluster: int = 12, seed: int = 0,
                        shard_size: int = 10, text_by_cluster: bool = False) -> None:
    """run.yaml, data/ (all items), clusters/assignments.safetensors and partitions/k/.
    text_by_cluster: the pooled text vector names the item's cluster (a per-cluster direction plus a
    little noise), as captions do when clusters are made from them; otherwise it is noise."""
    cfg.save(root)
    gen = torch.Generator().manual_seed(seed)
    k, (c, h, w) = cfg.cluster.k, cfg.latent_shape
    n = k * per_cluster
    cluster = torch.arange(n) % k  # [N]
    centres = torch.linspace(-0.8, 0.8, k)  # per-cluster brightness
    latents = centres[cluster].reshape(n, 1, 1, 1) + 0.1 * torch.randn(n, c, h, w, generator=gen)
    length, width = cfg.encoders.text.max_length, cfg.encoders.text.width
    fields = {"latents": latents.float(), "features": torch.randn(n, 16, generator=gen),
              "labels": cluster.clone(), "index": torch.arange(n)}
    if width:  # a text encoder is configured
        fields["text_tokens"] = torch.randn(n, length, width, generator=gen).half()
        fields["text_mask"] = (torch.arange(length)[None] < torch.randint(1, length + 1, (n, 1), generator=gen)
                               ).to(torch.uint8)
        fields["text_pooled"] = torch.randn(n, width, generator=gen)
        if text_by_cluster:
            directions = torch.nn.functional.normalize(torch.randn(k, width, generator=gen), dim=1)
            fields["text_pooled"] = directions[cluster] + 0.05 * fields["text_pooled"] / width**0.5
    captions = [f"item {i} of cluster {int(cluster[i])}" for i in range(n)]

    def write(folder: str, rows: torch.Tensor) -> None:
        shards, manifest = ShardSet(root, folder), ShardSetManifest()
        for start in range(0, len(rows), shard_size):
            sel = rows[start : start + shard_size]
            shards.append(manifest, {f: v[sel] for f, v in fields.items()}, [captions[i] for i in sel])
        manifest.complete = True
        shards.write_manifest(manifest)

    write("data", torch.arange(n))
    root.write_bytes(safetensors.torch.save({"assign": cluster}), "clusters", "assignments.safetensors")
    for j in range(k):
        write(f"partitions/{j}", torch.nonzero(cluster == j).flatten())
