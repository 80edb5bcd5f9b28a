"""Does a training job's memory grow with its data? The peak memory of a process that opens a shard set and gathers
training batches through each loader (run.yaml train.loader: memory, stream), for shard sets of paris-xl2's item
shapes at several sizes, and how many items a second each loader gathers.

    .venv/bin/python benchmarks/data_memory.py --sizes 10000,100000,300000 --out runs/bench/data-memory

Writes a synthetic shard set per size under OUT/ once (paris-xl2's items: SD-VAE latents 4 x 32 x 32 float32, CLIP
ViT-L/14's tokens of 768 float16, padded to 77, with their mask and the pooled 768, a label and an index: 135 KB an
item padded, as the in-memory loader holds it; the shards store the tokens unpadded, captions of 8 to 40 tokens,
uniformly: an assumption, ~55 KB an item on disk), then
for each size and loader runs a fresh process that opens the set as a job would (flowfleet.train.stream.open_data,
the fields an expert of paris-xl2 reads), draws --batches batches of --batch items through the job's sampler
(ResumableSampler: random items across the whole set) and gathers them. Reported per run: the process's peak
resident memory (VmHWM: a memory-mapped page it touched counts too; ru_maxrss would carry the parent's peak across
fork and exec), the seconds to open, the items a second gathered, and the peak's growth from the smallest size. The
in-memory loader is skipped where the set would not fit in --max-memory-gb.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ITEM_BYTES = 4 * 32 * 32 * 4 + 77 * 768 * 2 + 77 + 768 * 4 + 8 + 8  # padded: an item in memory
SHORTEST, LONGEST = 8, 40  # the synthetic captions' token counts (uniform)
STORED_BYTES = ITEM_BYTES - (77 - (SHORTEST + LONGEST) / 2) * 768 * 2 - 77 + 4  # unpadded: an item on disk
FIELDS = ["latents", "text_tokens", "text_mask", "text_pooled", "labels", "index"]

CHILD = """
import json, sys, time
import torch
from flowfleet.data.shards import ShardSet
from flowfleet.storage import RunRoot
from flowfleet.train.data import ResumableSampler
from flowfleet.train.stream import open_data
folder, loader, batches, batch = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
t0 = time.perf_counter()
data = open_data(ShardSet(RunRoot(folder), "data"), %r, loader)
opened = time.perf_counter() - t0
sampler = ResumableSampler(len(data), seed=0)
t0 = time.perf_counter()
for step in range(batches):
    data.gather(sampler.take(step * batch, batch))
gathered = time.perf_counter() - t0
hwm = next(line for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({"open_s": opened, "items_per_s": batches * batch / gathered, "peak_mb": int(hwm.split()[1]) / 1024}))
""" % (FIELDS,)


def write_set(folder: Path, n: int, shard_size: int) -> None:
    """n synthetic items of paris-xl2's shapes into folder/data/ (once: a complete set is kept)."""
    import torch

    from flowfleet.data.shards import ShardSet, ShardSetManifest
    from flowfleet.storage import RunRoot

    shards = ShardSet(RunRoot(str(folder)), "data")
    if shards.exists() and shards.manifest().complete and shards.manifest().count == n:
        return
    gen = torch.Generator().manual_seed(0)
    manifest = ShardSetManifest()
    for start in range(0, n, shard_size):
        b = min(shard_size, n - start)
        lengths = torch.randint(SHORTEST, LONGEST + 1, (b, 1), generator=gen)
        mask = (torch.arange(77) < lengths).to(torch.uint8)
        tensors = {
            "latents": torch.randn(b, 4, 32, 32, generator=gen),
            "text_tokens": torch.randn(b, 77, 768, generator=gen).half() * mask[..., None],  # zeros past it
            "text_mask": mask,
            "text_pooled": torch.randn(b, 768, generator=gen),
            "labels": torch.zeros(b, dtype=torch.int64),
            "index": torch.arange(start, start + b),
        }
        shards.append(manifest, tensors, ["a caption"] * b)
    manifest.complete = True
    shards.write_manifest(manifest)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="10000,100000,300000", help="items per set")
    p.add_argument("--out", default="runs/bench/data-memory")
    p.add_argument("--shard-size", type=int, default=1000)
    p.add_argument("--batches", type=int, default=50)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--max-memory-gb", type=float, default=8.0, help="the in-memory loader only below this set size")
    a = p.parse_args()
    sizes = [int(s) for s in a.sizes.split(",")]
    rows = []
    for n in sizes:
        folder = Path(a.out) / str(n)
        t0 = time.perf_counter()
        write_set(folder, n, a.shard_size)
        disk = n * STORED_BYTES / 2**30
        print(f"{n} items ({disk:.2f} GiB on disk) ready in {time.perf_counter() - t0:.0f} s", flush=True)
        for loader in ("stream", "memory"):
            if loader == "memory" and 2 * n * ITEM_BYTES / 2**30 > a.max_memory_gb:  # (loaded, then concatenated)
                rows.append({"items": n, "loader": loader, "skipped": f"over --max-memory-gb {a.max_memory_gb}"})
                continue
            cmd = [sys.executable, "-c", CHILD, str(folder), loader, str(a.batches), str(a.batch)]
            got = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
            rows.append({"items": n, "loader": loader, **got})
            print(json.dumps(rows[-1]), flush=True)
    print(f"\n{'items':>8} {'disk GiB':>8} {'loader':>7} {'peak MB':>8} {'growth':>7} {'open s':>7} {'items/s':>8}")
    for loader in ("stream", "memory"):
        ran = [r for r in rows if r["loader"] == loader and "peak_mb" in r]
        for r in ran:
            growth = r["peak_mb"] / ran[0]["peak_mb"] - 1
            print(
                f"{r['items']:>8} {r['items'] * STORED_BYTES / 2**30:>8.2f} {loader:>7} {r['peak_mb']:>8.0f} "
                f"{growth:>+7.1%} {r['open_s']:>7.2f} {r['items_per_s']:>8.0f}"
            )
    (Path(a.out) / "data_memory.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
