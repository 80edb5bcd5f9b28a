"""The evaluation's summary on the terminal: one row per model at its chosen guidance scale, then the real floor, in
two narrow tables (the judge's figures, then the rest) that print whole in an 80-column log (rich)."""

from __future__ import annotations

from typing import Any, Callable

from rich import box
from rich.console import Console
from rich.table import Table

WIDTH = 80  # the narrowest log or terminal the summary is made for
Column = tuple[str, Callable[[str, dict[str, Any]], str]]  # a header and its cell of (model name, its figures)


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
    adherence = result.get("adherence") or {}
    align = (result.get("diagnostics") or {}).get("alignment") or {}
    first: list[Column] = [("cfg", lambda name, run: _num(run.get("cfg"), 1))]
    if judged:
        first.append(("accuracy", lambda name, run: _num(run.get("prompt_accuracy"), 3)))
        first.append(("class. FD", lambda name, run: _num(run.get("classifier_fd"), 2)))
    if with_pr:
        first.append(("precision", lambda name, run: _num(run.get("precision"), 3)))
        first.append(("recall", lambda name, run: _num(run.get("recall"), 3)))
    second: list[Column] = [("FID", lambda name, run: _num(run.get("fid"), 1))]
    if judged:
        second.append(("confidence", lambda name, run: _num(run.get("confidence"), 3)))
    if adherence:
        second.append(("adherence", lambda name, run: _num((adherence.get(name) or {}).get("both"), 3)))
    if align:
        second.append(("in cluster", lambda name, run: _num((align.get(name) or {}).get("assigned_is_dominant"), 3)))
    second.append(("sampling s", lambda name, run: "" if run.get("real") else f"{run['sampling_s']:.1f}"))
    if len(first) > 1:
        console.print(_table(rows, first))
    else:  # no judge: one table, the scale beside FID
        second.insert(0, first[0])
    console.print(_table(rows, second))
    for line in _legend(result, judged, bool(align)):
        console.print(line)


def _table(rows: list[tuple[str, dict[str, Any]]], columns: list[Column]) -> Table:
    """One row per model (name first), a right-aligned column per (header, cell)."""
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("model", no_wrap=True)
    for header, _ in columns:
        table.add_column(header, justify="right", no_wrap=True)
    for name, run in rows:
        table.add_row(name, *(cell(name, run) for _, cell in columns))
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
