"""prepare's semantic and text encoders beside the autoencoder's training.

A run that trains its own latent space (encoders.latent.name autoencoder) first trains it, a loop of small steps,
while the semantic encoder (Inception) and the text encoder (MiniLM), which need no latent space, wait for it: on the
emoji demo most of the encoding after it is theirs. Such a loop gains little from a second CPU thread, so a second
process that encodes the items' features and captions on a
thread of its own while the autoencoder trains on the others (its ThreadGovernor gives that thread up) does their
work in the autoencoder's time; prepare then encodes only the latents of the items it finished.

    beside = EncodersBeside.start(root, spans=[(0, train_stop), (train_stop, size)], threads=1, usable=2)
    ensure_autoencoder(...)
    found = beside.finish()   # the process stopped; what it finished, by each item's source position
    found.take(ends)          # a batch's features and text fields, or None where it lacks one of them

The process (`python -m flowfleet.stages.prepare_beside RUN SPANS FOLDER`) reads the source as prepare does (the same
decoding and skips, the same batches of data.batch_size from each span's start) and writes CHUNK_BATCHES batches at a
time into a local temporary folder, each file atomically: stopped at any point, the files it finished are whole, and
prepare encodes whatever they lack. Written by hand: no library runs two stages of one pipeline beside each other on
one machine's cores, which is all this does.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

CHUNK_BATCHES = 2  # batches per file: what a stopped process loses at most
STOP_WAIT_S = 10.0  # how long a stopped process may take to exit before it is killed
Span = tuple[int, int | None]  # source positions [start, stop); None: to the end


@dataclass(frozen=True)
class Found:
    """The rows the process finished: each item's source position after it (prepare's `ends`) -> its row."""

    row_of: dict[int, int]
    tensors: dict[str, torch.Tensor]  # features [N, F], text_tokens [N, L, T], text_mask [N, L], text_pooled [N, T]

    def __len__(self) -> int:
        return len(self.row_of)

    def take(self, ends: list[int]) -> dict[str, torch.Tensor] | None:
        """The fields of the items that end at `ends`, in order; None unless every one was finished."""
        if not all(e in self.row_of for e in ends):
            return None
        rows = torch.tensor([self.row_of[e] for e in ends])
        return {k: v[rows] for k, v in self.tensors.items()}


class EncodersBeside:
    """The encoding process, started beside the autoencoder's training; `finish` stops it and reads what it wrote."""

    def __init__(self, process: subprocess.Popen, folder: tempfile.TemporaryDirectory, log_file, training_threads: int):
        self.process, self.folder, self.log_file = process, folder, log_file
        self.training_threads = training_threads  # what the CPUs leave the autoencoder's loop beside it

    @classmethod
    def start(cls, root_url: str, spans: list[Span], threads: int, usable: int) -> "EncodersBeside":
        """The process on `threads` of the `usable` CPUs; the training keeps the rest."""
        from flowfleet.train.fanout import Slot

        folder = tempfile.TemporaryDirectory(prefix="flowfleet-beside-")
        env = Slot(threads, shared=True).env()  # a budget of threads beside the training's, idle ones asleep
        text = ",".join(f"{a}:{'' if b is None else b}" for a, b in spans)
        log_file = open(Path(folder.name) / "log.txt", "wb")
        cmd = [sys.executable, "-m", "flowfleet.stages.prepare_beside", root_url, text, folder.name]
        process = subprocess.Popen(cmd, env=env, stdout=log_file, stderr=subprocess.STDOUT)
        log.info(
            "prepare: the semantic and text encoders run beside the autoencoder (pid %d, %d thread(s))",
            process.pid,
            threads,
        )
        return cls(process, folder, log_file, max(1, usable - threads))

    def finish(self) -> Found:
        """Stop the process (it may be done already) and read every file it finished."""
        from flowfleet.train.fanout import last_line

        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log_file.close()
        try:
            found = _read(Path(self.folder.name))
            code = self.process.returncode
            if code not in (0, -15):  # done, or stopped by us
                last = last_line((Path(self.folder.name) / "log.txt").read_text(errors="replace"))
                log.warning(
                    "prepare: the encoders beside the autoencoder failed (%s); prepare encodes what they did not",
                    last or f"exit code {code}",
                )
            return found
        finally:
            self.folder.cleanup()


def _read(folder: Path) -> Found:
    from safetensors.torch import load_file

    parts = [load_file(str(f)) for f in sorted(folder.glob("chunk-*.safetensors"))]
    if not parts:
        return Found({}, {})
    ends = torch.cat([p.pop("ends") for p in parts]).tolist()
    tensors = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
    return Found({e: i for i, e in enumerate(ends)}, tensors)


# --------------------------------------------------------------------------------------------------
#                                          The process
# --------------------------------------------------------------------------------------------------


def encode_spans(root_url: str, spans: list[Span], folder: Path) -> int:
    """Every usable item of `spans` through the run's semantic and text encoders, in prepare's batches, into
    folder/chunk-NNNNN.safetensors; -> the items written."""
    from flowfleet.config import load_run_config
    from flowfleet.data.decoding import BadInput, decode_items
    from flowfleet.data.encoders import build_semantic_encoder, build_text_encoder, encode_meaning
    from flowfleet.data.sources import build_source
    from flowfleet.storage import RunRoot

    cfg = load_run_config(RunRoot(root_url))
    d = cfg.data
    source = build_source(d, cfg.storage.options)
    semantic = build_semantic_encoder(cfg.encoders.semantic, torch.device("cpu"), cfg.repa_grid)
    text = build_text_encoder(cfg.encoders.text, torch.device("cpu"))
    chunks = _ChunkWriter(folder)
    for start, stop in spans:
        items = source.items(start)
        if stop is not None:
            items = itertools.islice(items, max(stop - start, 0))
        decoded = decode_items(items, start, d.image_size, d.channels, BadInput([], 0, 0), d.labels)
        while batch := list(itertools.islice(decoded, d.batch_size)):  # prepare's batches, from the span's start
            ends, images, captions, _ = zip(*batch)
            chunks.add(list(ends), encode_meaning(semantic, text, torch.stack(images), list(captions)))
        chunks.flush()  # (a span's last batches)
    return chunks.written


class _ChunkWriter:
    """Rows gathered CHUNK_BATCHES batches at a time into folder/chunk-NNNNN.safetensors, each file written whole."""

    def __init__(self, folder: Path):
        from flowfleet.storage import RunRoot

        self.root, self.files, self.written = RunRoot(str(folder)), 0, 0
        self.ends: list[int] = []
        self.fields: dict[str, list[torch.Tensor]] = {}
        self.batches = 0

    def add(self, ends: list[int], fields: dict[str, torch.Tensor]) -> None:
        self.ends += ends
        for k, v in fields.items():
            self.fields.setdefault(k, []).append(v)
        self.batches += 1
        if self.batches == CHUNK_BATCHES:
            self.flush()

    def flush(self) -> None:
        from safetensors.torch import save

        if not self.ends:
            return
        tensors = {k: torch.cat(v).contiguous() for k, v in self.fields.items()}
        tensors["ends"] = torch.tensor(self.ends, dtype=torch.int64)
        self.root.write_bytes(save(tensors), f"chunk-{self.files:05d}.safetensors")  # whole, or not
        self.files, self.written = self.files + 1, self.written + len(self.ends)
        self.ends, self.fields, self.batches = [], {}, 0


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m flowfleet.stages.prepare_beside", description=__doc__)
    p.add_argument("run_root")
    p.add_argument("spans", help="START:STOP,... source positions (STOP empty: to the end)")
    p.add_argument("folder", type=Path)
    a = p.parse_args(argv)
    spans: list[Span] = []
    for span in a.spans.split(","):
        first, _, last = span.partition(":")
        spans.append((int(first), int(last) if last else None))
    print(f"{encode_spans(a.run_root, spans, a.folder)} items encoded", flush=True)


if __name__ == "__main__":
    main()
