"""Memory and time of writing and reading a model folder (flowfleet.models.files.save_model / load_model).

For one DiT size it saves a model into a local run root and loads it back, then writes a training checkpoint of it
(weights, EMA, AdamW's two moments: four times the weights) and reads it back, each operation in a fresh process, and
reports the operation's wall time and its peak memory beyond what the process held before it, beside the size of
the weights file: the peak resident memory (Linux: reset through /proc/self/clear_refs, then read from VmHWM),
which counts the pages of a memory-mapped file, and the peak of the process's own (anonymous) memory, which does
not: those pages are the kernel's file cache, given back under pressure. A save that goes through memory costs
about one more copy of the weights; a load that reads the file whole and then builds the model costs two; a
checkpoint written through memory costs its largest file (the optimizer's, twice the weights).

    .venv/bin/python benchmarks/model_files.py                       # DiT-B/2 on 4x32x32 latents, 3 repeats
    .venv/bin/python benchmarks/model_files.py --size XL/2 --repeats 1

Another checkout's code is measured with the same script through PYTHONPATH=<checkout>/src.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

MIB = 2**20
OPS = ("save", "load", "checkpoint", "resume")  # a model folder; a training checkpoint (CheckpointStore)


def rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


class AnonPeak:
    """The peak of the process's anonymous memory (RssAnon: its own allocations, not the page cache of files
    it maps), sampled every millisecond by a thread while the block runs."""

    def __enter__(self) -> "AnonPeak":
        self.before = self.peak = rss_kib("RssAnon")
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.sample, daemon=True)
        self.thread.start()
        return self

    def sample(self) -> None:
        while not self.done.wait(0.001):
            self.peak = max(self.peak, rss_kib("RssAnon"))

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.thread.join()
        self.peak = max(self.peak, rss_kib("RssAnon"))


def checkpoint_of(model) -> "Checkpoint":  # noqa: F821
    """A training checkpoint of `model` as the trainer writes one: the weights, their EMA and AdamW's two moments."""
    from flowfleet.train.checkpoint import Checkpoint

    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    moments = {f"{k}.{m}": torch.zeros_like(v) for k, v in weights.items() for m in ("exp_avg", "exp_avg_sq")}
    ema = {k: v.clone() for k, v in weights.items()}
    return Checkpoint(step=1, tensors={"model": weights, "ema": ema, "optimizer": moments})


def child(op: str, size: str, input_size: int, folder: str) -> dict:
    """One operation in this process: its seconds and its peak memory above the memory held before it."""
    from flowfleet.models.config import DiTConfig
    from flowfleet.models.dit import DiTExpert
    from flowfleet.models.files import WEIGHTS_NAME, load_model, save_model
    from flowfleet.storage import RunRoot
    from flowfleet.train.checkpoint import CheckpointStore

    cfg = DiTConfig(size=size, input_size=(input_size, input_size), in_channels=4)
    model = DiTExpert.from_dit_config(cfg) if op in ("save", "checkpoint") else None
    ckpt = checkpoint_of(model) if op == "checkpoint" else None
    store = CheckpointStore(RunRoot(folder), "job")
    Path("/proc/self/clear_refs").write_text("5")  # the peak RSS (VmHWM) starts again from the RSS now
    before = rss_kib("VmRSS")
    start = time.perf_counter()
    with AnonPeak() as anon:
        if op == "save":
            save_model(model, folder, "m")
        elif op == "load":
            model = load_model(DiTExpert, folder, "m")
        elif op == "checkpoint":
            store.save(ckpt)
        else:
            ckpt = store.load(store.latest())
    seconds = time.perf_counter() - start
    return {
        "op": op,
        "seconds": seconds,
        "peak_extra_mib": (rss_kib("VmHWM") - before) / 1024,
        "peak_anon_extra_mib": (anon.peak - anon.before) / 1024,
        "weights_mib": (Path(folder) / "m" / WEIGHTS_NAME).stat().st_size / MIB,
        "params": sum(p.numel() for p in model.parameters()) if model is not None else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="B/2", help="DiT size preset (default B/2)")
    ap.add_argument("--input-size", type=int, default=32, help="latent height and width (default 32)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--child", choices=OPS, help=argparse.SUPPRESS)
    ap.add_argument("--folder", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.size, args.input_size, args.folder)))
        return

    runs: dict[str, list[dict]] = {op: [] for op in OPS}
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="flowfleet-model-files-") as folder:
            for op in OPS:
                cmd = [sys.executable, __file__, "--child", op, "--size", args.size]
                cmd += ["--input-size", str(args.input_size), "--folder", folder]
                out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
                runs[op].append(json.loads(out.strip().splitlines()[-1]))
    first = runs["save"][0]
    print(f"DiT-{args.size}, {args.input_size}x{args.input_size} latents: {first['params'] / 1e6:.1f}M parameters, "
          f"weights file {first['weights_mib']:.0f} MiB, {args.repeats} repeats (median)")  # fmt: skip
    summary = {"size": args.size, "input_size": args.input_size, "weights_mib": first["weights_mib"]}
    for op, rows in runs.items():
        seconds = statistics.median(r["seconds"] for r in rows)
        peak = statistics.median(r["peak_extra_mib"] for r in rows)
        anon = statistics.median(r["peak_anon_extra_mib"] for r in rows)
        w = first["weights_mib"]
        print(f"  {op:10s}  {seconds:6.2f} s   peak memory +{peak:5.0f} MiB ({peak / w:.2f}x the weights), "
              f"of it the process's own +{anon:5.0f} MiB ({anon / w:.2f}x)")  # fmt: skip
        summary[op] = {"seconds": seconds, "peak_extra_mib": peak, "peak_anon_extra_mib": anon}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
