"""A job's training metrics: metrics.jsonl (one JSON object per logged step) and TensorBoard events.

On a local run root lines are appended as they come and the events file lives in JOB/tb/. On an
object store, appending means rewriting, so lines are buffered and flushed (with the event files,
written to a local temp folder) at most every FLUSH_EVERY_S seconds as they come, at checkpoints and at the end:
a TensorBoard pointed at the bucket follows the job while it runs.

TensorBoard and PIL are imported only when events or images are written.
"""

from __future__ import annotations

import io
import json
import logging
import tempfile
import time
from typing import Any, Callable

import numpy as np

from flowfleet.layout import METRICS_FILE
from flowfleet.storage import RunRoot

TB_DIR = "tb"
FLUSH_EVERY_S = 30.0  # an object store's metrics and events, uploaded at most this often while lines come

log = logging.getLogger(__name__)


class MetricsLog:
    def __init__(
        self,
        root: RunRoot,
        job_dir: str,
        *,
        tensorboard: bool = True,
        flush_every_s: float = FLUSH_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.root = root
        self.job_dir = job_dir
        self.flush_every_s, self.clock = flush_every_s, clock
        self._flushed = clock()
        self._pending: list[str] = []
        self._tmp: tempfile.TemporaryDirectory | None = None
        self._tb = None
        if tensorboard:
            self._tb = self._open_tensorboard()

    def _open_tensorboard(self):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # the optional [tb] extra is not installed
            log.warning("tensorboard not installed; writing metrics.jsonl only")
            return None
        local = self.root.local_path(self.job_dir, TB_DIR)
        if local is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="flowfleet-tb-")
            local = self._tmp.name
        return SummaryWriter(log_dir=str(local))

    def truncate_after(self, step: int) -> None:
        """Drop lines logged after `step` (a resumed job repeats them from its checkpoint)."""
        if not self.root.exists(self.job_dir, METRICS_FILE):
            return
        lines = self.root.read_bytes(self.job_dir, METRICS_FILE).decode().splitlines()
        kept = []
        for line in lines:
            try:
                if json.loads(line).get("step", 0) <= step:
                    kept.append(line)
            except json.JSONDecodeError:  # a torn last line from a crash
                continue
        if len(kept) != len(lines):
            self.root.write_bytes("".join(k + "\n" for k in kept).encode(), self.job_dir, METRICS_FILE)

    def log(self, record: dict[str, Any]) -> None:
        line = json.dumps(record)
        if self.root.is_local:
            self.root.append_line(line, self.job_dir, METRICS_FILE)
        else:
            self._pending.append(line)
        if self._tb is not None:
            step = record["step"]
            for key, value in record.items():
                if key not in ("step", "time") and isinstance(value, (int, float)):
                    self._tb.add_scalar(f"train/{key}", value, step)
        if not self.root.is_local and self.clock() - self._flushed >= self.flush_every_s:
            self.flush()

    def add_image_png(self, tag: str, png: bytes, step: int) -> None:
        if self._tb is None:
            return

        from PIL import Image

        img = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))
        self._tb.add_image(tag, img, step, dataformats="HWC")

    def flush(self) -> None:
        """Write what is buffered: metrics.jsonl's new lines and, from a local temp folder, the events."""
        self._flushed = self.clock()
        if self._pending:
            exists = self.root.exists(self.job_dir, METRICS_FILE)
            old = self.root.read_bytes(self.job_dir, METRICS_FILE) if exists else b""
            self.root.write_bytes(old + "".join(p + "\n" for p in self._pending).encode(), self.job_dir, METRICS_FILE)
            self._pending.clear()
        if self._tb is not None:
            self._tb.flush()
            if self._tmp is not None:
                self.root.put_dir(self._tmp.name, self.job_dir, TB_DIR)

    def close(self) -> None:
        self.flush()
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
