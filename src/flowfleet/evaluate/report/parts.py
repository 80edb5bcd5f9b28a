"""The report's parts: the files it reads from a run root (none of which may make it fail), the Section a page is
made of, and the builder's base (a run root, its evaluation, the plots drawn on the way)."""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from typing import Any

from flowfleet.layout import EXPERTS, METRICS_FILE, MONOLITH, REPORTS, ROUTERS, RUN_FILE, expert_job
from flowfleet.storage import RunRoot

REPORT_FILE = "report.html"
EVALUATION_FILE = "evaluation.json"
TIMINGS_FILE = "timings.json"
MIX_LABELS = 10  # labels listed per cluster in the report: all ten digits of the built-in data
# The page's sections, in order (their HTML ids): the result first, then how it came about, the configuration last.
SECTIONS = (
    "overview",
    "samples",
    "fid",
    "clusters",
    "training",
    "routing",
    "adherence",
    "diagnostics",
    "timings",
    "config",
)
TITLES = {
    "overview": "Results",
    "samples": "Samples per strategy",
    "fid": "Quality",
    "clusters": "Clusters",
    "training": "Training",
    "routing": "Routing heatmaps",
    "adherence": "Prompt adherence",
    "diagnostics": "Diagnostics",
    "timings": "Timings",
    "config": "Configuration",
}


# --------------------------------------------------------------------------------------------------
#                                    Reading the run root
# --------------------------------------------------------------------------------------------------


def read_json(root: RunRoot, *parts: str) -> Any:
    """A JSON file of the run root, or None when absent or unreadable (the report never fails on one)."""
    try:
        return root.read_json(*parts) if root.exists(*parts) else None
    except (ValueError, OSError):
        return None


def read_metrics(root: RunRoot, job_dir: str) -> list[dict[str, Any]]:
    """metrics.jsonl as records; torn or non-JSON lines (a crash mid-write) are skipped."""
    if not root.exists(job_dir, METRICS_FILE):
        return []
    records = []
    for line in root.read_bytes(job_dir, METRICS_FILE).decode(errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and "step" in rec:
            records.append(rec)
    return records


def job_dirs(root: RunRoot) -> list[str]:
    """experts/k (numeric order), router, monolith: whichever exist."""
    experts = sorted((int(n) for n in root.ls(EXPERTS) if n.isdigit()))
    return [expert_job(k) for k in experts] + [d for d in (*ROUTERS, MONOLITH) if root.exists(d)]


def job_label(job_dir: str) -> str:
    return f"expert {job_dir.split('/')[1]}" if job_dir.startswith(f"{EXPERTS}/") else job_dir


@dataclass
class Image:
    caption: str
    data: str  # data: URI (embedded PNG)


def embed(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


@dataclass
class Table:
    """A table of the page: its caption, column names and rows of cells (already formatted)."""

    caption: str
    header: list[str]
    rows: list[list[Any]]


@dataclass
class Section:
    id: str
    title: str
    missing: str = ""  # non-empty: what to run to fill this section
    notes: list[str] = field(default_factory=list)
    tables: list[Table] = field(default_factory=list)
    images: list[Image] = field(default_factory=list)
    pre: str = ""  # preformatted text (the config)
    lists: list[dict[str, Any]] = field(default_factory=list)  # {"caption", "items": [...]}


# --------------------------------------------------------------------------------------------------
#                                         Sections
# --------------------------------------------------------------------------------------------------


def run_yaml(root: RunRoot) -> dict[str, Any] | None:
    try:
        raw = root.read_yaml(RUN_FILE) if root.exists(RUN_FILE) else None
    except ValueError:
        return None
    return raw if isinstance(raw, dict) else None


def wall_time(records: list[dict[str, Any]]) -> float | None:
    times = [r["time"] for r in records if isinstance(r.get("time"), (int, float))]
    return (max(times) - min(times)) if len(times) >= 2 else None


def fmt(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


# --------------------------------------------------------------------------------------------------
#                                    The builder's base
# --------------------------------------------------------------------------------------------------


class BuilderBase:
    """A run root and its evaluation (reports/evaluation.json, None before `flowfleet evaluate`); the plots
    drawn for the page, also written beside it (reports/plots/)."""

    def __init__(self, root: RunRoot):
        self.root = root
        self.evaluation = read_json(root, REPORTS, EVALUATION_FILE)
        self.plots: dict[str, bytes] = {}

    def _plot(self, name: str, png: bytes, caption: str) -> Image:
        self.plots[name] = png
        return Image(caption, embed(png))

    def _file_image(self, caption: str, *parts: str) -> Image | None:
        if not self.root.exists(*parts):
            return None
        return Image(caption, embed(self.root.read_bytes(*parts)))

    def _runs(self) -> dict[str, dict[str, Any]]:
        return (self.evaluation or {}).get("runs", {}) or {}

    def _needs_evaluation(self, s: Section) -> bool:
        if not self.evaluation:
            s.missing = "no reports/evaluation.json yet: `flowfleet evaluate RUN_ROOT/model --reference RUN_ROOT`"
            return True
        return False
