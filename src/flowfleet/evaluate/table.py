"""The evaluation's table on the terminal: one row per model at its chosen guidance scale, then the real
floor (rich)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table


def print_table(result: dict[str, Any]) -> None:
    """One row per model (at its chosen guidance scale), then the real floor: prompt accuracy, classifier FD,
    precision and recall (with a judge), FID, adherence, alignment when present."""
    fid = result["fid"]
    digits = result.get("prompt_accuracy") or None
    split = result.get("reference_split") or {}
    against = f"{fid['reference_images']} {'held-out' if split.get('held_out') else 'training'} reference images"
    title = f"{fid['generated_images']} samples per model vs {against}; FID: {fid['extractor']} (lower is better)"
    table = Table(title=title, title_justify="left")
    table.add_column("model")
    table.add_column("cfg", justify="right")
    with_pr = any(run.get("precision") is not None for run in result["runs"].values())
    if digits:
        table.add_column("prompt accuracy", justify="right")
        table.add_column("confidence", justify="right")
        table.add_column("classifier FD", justify="right")
    if with_pr:
        table.add_column("precision", justify="right")
        table.add_column("recall", justify="right")
    table.add_column("FID", justify="right")
    adherence = result.get("adherence") or {}
    align = (result.get("diagnostics") or {}).get("alignment") or {}
    if adherence:
        table.add_column("adherence", justify="right")
    if align:
        table.add_column("in dominant expert's cluster", justify="right")
    table.add_column("sampling s", justify="right")
    floor = split.get("floor") or {}
    rows = [(name, run) for name, run in result["runs"].items()]
    if floor.get("n"):  # real items scored like a model: the distances a perfect model would show at this n
        rows.append((f"real floor (n {floor['n']})", {**floor, "real": True}))
    for name, run in rows:
        row = [name, _num(run.get("cfg"), 1)]
        if digits:
            row += [
                _num(run.get("prompt_accuracy"), 3),
                _num(run.get("confidence"), 3),
                _num(run.get("classifier_fd"), 2),
            ]
        if with_pr:
            row += [_num(run.get("precision"), 3), _num(run.get("recall"), 3)]
        row.append(_num(run.get("fid"), 2))
        if adherence:
            a = adherence.get(name) or {}
            row.append(f"{a['both']:.3f}" if a.get("both") is not None else "")
        if align:
            a = align.get(name) or {}
            row.append(f"{a['assigned_is_dominant']:.3f}" if a else "")
        row.append("" if run.get("real") else f"{run['sampling_s']:.1f}")
        table.add_row(*row)
    Console().print(table)
    guidance = result.get("guidance")
    if guidance:
        on = (
            "the validation split"
            if guidance.get("chosen_on") == "validation"
            else "the draw shown (no validation split)"
        )
        Console().print(
            f"cfg: each model's scale, swept from {guidance['sweep']} on {on}, with the lowest classifier FD (FID "
            f"without a judge) of those with prompt accuracy >= {guidance['min_accuracy']}; the figures are the "
            f"{split.get('split') or 'reference'} split's"
        )
    if digits:
        clf = digits.get("classifier") or {}
        val = f" (validation accuracy {clf['val_accuracy']:.3f})" if "val_accuracy" in clf else ""
        Console().print(
            f"prompt accuracy: share of samples the {clf.get('judge', 'classifier')}{val} reads as the prompted class"
        )
    if not fid.get("standard_input", True):
        Console().print(
            f"note: Inception input {fid['resize']} px (non-standard): compare only with FIDs at the same "
            "size and sample counts"
        )


def _num(value: Any, digits: int) -> str:
    return "" if value is None else f"{value:.{digits}f}"
