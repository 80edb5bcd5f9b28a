"""The evaluation's summary on the terminal: one row per model at its chosen guidance scale, then the real floor, in
two narrow tables (the judge's figures, then the rest) that print whole in an 80-column log (rich)."""

from __future__ import annotations

from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

WIDTH = 80  # the narrowest log or terminal the summary is made for


def print_table(result: dict[str, Any], console: Console | None = None) -> None:
    """One row per model (at its chosen guidance scale), then the real floor: prompt accuracy, classifier FD,
    precision and recall (with a judge) in the first table; FID, adherence, alignment and sampling time in the
    second; then what the columns mean."""
    console = console or Console()
    fid = result["fid"]
    judged = result.get("prompt_accuracy") or None
    split = result.get("reference_split") or {}
    runs = result["runs"]
    rows = list(runs.items())
    floor = split.get("floor") or {}
    if floor.get("n"):  # real items scored like a model: the distances a perfect model would show at this n
        rows.append(("real images", {**floor, "real": True}))
    against = f"{fid['reference_images']} {'held-out' if split.get('held_out') else 'training'} images"
    where = f" (the {split['split']} split)" if split.get("split") else ""
    console.print(f"{fid['generated_images']} samples per model against {against}{where}")

    with_pr = any(run.get("precision") is not None for run in runs.values())
    first = _table("model", "cfg")
    if judged:
        first.add_column("accuracy", justify="right")
        first.add_column("class. FD", justify="right")
    if with_pr:
        first.add_column("precision", justify="right")
        first.add_column("recall", justify="right")
    for name, run in rows:
        row = [name, _num(run.get("cfg"), 1)]
        if judged:
            row += [_num(run.get("prompt_accuracy"), 3), _num(run.get("classifier_fd"), 2)]
        if with_pr:
            row += [_num(run.get("precision"), 3), _num(run.get("recall"), 3)]
        first.add_row(*row)
    if len(first.columns) > 2:
        console.print(first)

    adherence = result.get("adherence") or {}
    align = (result.get("diagnostics") or {}).get("alignment") or {}
    second = _table("model", "FID")
    if judged:
        second.add_column("confidence", justify="right")
    if adherence:
        second.add_column("adherence", justify="right")
    if align:
        second.add_column("in cluster", justify="right")
    second.add_column("sampling s", justify="right")
    for name, run in rows:
        row = [name, _num(run.get("fid"), 1)]
        if judged:
            row.append(_num(run.get("confidence"), 3))
        if adherence:
            a = adherence.get(name) or {}
            row.append(f"{a['both']:.3f}" if a.get("both") is not None else "")
        if align:
            a = align.get(name) or {}
            row.append(f"{a['assigned_is_dominant']:.3f}" if a else "")
        row.append("" if run.get("real") else f"{run['sampling_s']:.1f}")
        second.add_row(*row)
    console.print(second)
    for line in _legend(result, judged, bool(align)):
        console.print(line)


def _table(*headers: str) -> Table:
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column(headers[0], no_wrap=True)
    for header in headers[1:]:
        table.add_column(header, justify="right", no_wrap=True)
    return table


def _legend(result: dict[str, Any], judged: dict[str, Any] | None, align: bool) -> list[str]:
    """What the columns mean, one sentence a line."""
    fid = result["fid"]
    lines = []
    guidance = result.get("guidance")
    if guidance:
        validated = guidance.get("chosen_on") == "validation"
        on = "the validation split" if validated else "these images (no validation split)"
        lines.append(
            f"cfg: each model's guidance scale, swept from {guidance['sweep']} on {on}: the lowest classifier FD (FID "
            f"without a judge) of the scales with prompt accuracy >= {guidance['min_accuracy']}."
        )
    if judged:
        clf = judged.get("classifier") or {}
        val = f" (validation accuracy {clf['val_accuracy']:.3f})" if "val_accuracy" in clf else ""
        lines.append(
            f"accuracy: the share of samples the {clf.get('judge', 'classifier')}{val} reads as the prompted class; "
            "confidence: its mean probability of that class; class. FD: the Fréchet distance in its features, "
            "precision and recall in them too."
        )
    lines.append(f"FID: {fid['extractor']} at {fid.get('resize', '?')} px (lower is better).")
    if align:
        lines.append("in cluster: the share of samples whose image features lie in their dominant expert's cluster.")
    if not fid.get("standard_input", True):
        lines.append(
            f"note: Inception input {fid['resize']} px (non-standard): compare only with FIDs at the same size and "
            "sample counts."
        )
    return lines


def _num(value: Any, digits: int) -> str:
    return "" if value is None else f"{value:.{digits}f}"
