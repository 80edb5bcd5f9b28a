"""RUN_ROOT/reports/report.html: one self-contained page (images embedded), viewable offline.

Everything is read from the run root's files (docs/contracts.md), so a report can be rebuilt at any
time and shows whatever stages have run; a section whose inputs do not exist yet says which command
produces them. Sections, in order (their HTML ids are SECTIONS): what the run found first, then how.

    overview     the run in one line and the results table: each model's distance with the real floor,
                 precision / recall, prompt accuracy and its ratio to the monolith (quality.py)
    samples      the showcase grids (the same prompts and noise for every model) and the evaluation's grids
    fid          quality per model: prompt accuracy and classifier FD (MNIST), FID, the draws, the guidance sweep
    clusters     clusters/report.json (sizes, NMI) and the preview-k.png grids
    training     loss curves of every job (metrics.jsonl), job table, router accuracy per t (each router)
    routing      router-probability heatmaps per strategy
    adherence    prompt adherence (shapes source)
    diagnostics  router accuracy per t, centroid alignment, expert disagreement, expert usage
    timings      stage timings (reports/timings.json), job wall times, evaluation timings, the stages' outputs
    config       run.yaml and the evaluation's settings, folded away

Modules: parts.py (the files read, Section, the builder's base), quality.py (the quality section and the
results table), builder.py (every other section), tables.py (tables built from plain data), page.py (HTML).
The plots drawn here are also written beside the page, to reports/plots/*.png.
"""

from __future__ import annotations

from flowfleet.errors import FlowfleetError
from flowfleet.evaluate.report.builder import ReportBuilder
from flowfleet.evaluate.report.page import render
from flowfleet.evaluate.report.parts import EVALUATION_FILE, REPORT_FILE, SECTIONS, TIMINGS_FILE, TITLES, run_yaml
from flowfleet.evaluate.report.tables import draws_table, generalization_table, router_accuracy_table
from flowfleet.layout import REPORTS
from flowfleet.storage import RunRoot

__all__ = [
    "EVALUATION_FILE",
    "REPORT_FILE",
    "SECTIONS",
    "TIMINGS_FILE",
    "TITLES",
    "ReportBuilder",
    "draws_table",
    "generalization_table",
    "render",
    "router_accuracy_table",
    "write_report",
]


def write_report(run_root: str | RunRoot) -> str:
    """Build reports/report.html (and reports/plots/*.png) from whatever the run root holds; returns its URL."""
    root = run_root if isinstance(run_root, RunRoot) else RunRoot(run_root)
    if not root.exists():
        raise FlowfleetError(f"{root.url}: no such run root")
    builder = ReportBuilder(root)
    sections = builder.build()
    cfg = run_yaml(root) or {}
    for name, png in builder.plots.items():
        root.write_bytes(png, REPORTS, "plots", name)
    root.write_bytes(render(sections, name=str(cfg.get("name", root.url)), url=root.url).encode(), REPORTS, REPORT_FILE)
    return root.url_of(REPORTS, REPORT_FILE)
