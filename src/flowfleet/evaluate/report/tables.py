"""The report's tables that several sections or other modules build from plain data: a cluster's make-up, a
figure's spread over evaluation draws, the experts' generalisation, the routers' accuracy per t."""

from __future__ import annotations

import statistics
from typing import Any

from flowfleet.evaluate.report.parts import MIX_LABELS, Table, fmt


def cluster_rows(rep: dict[str, Any]) -> list[list[Any]]:
    """[cluster, items, "label: count, ..."] per cluster of a clusters/report.json (the most frequent labels)."""
    mixes = rep.get("label_mix") or []
    names = rep.get("label_names") or []

    def name(lab: str) -> str:
        return names[int(lab)] if lab.isdigit() and int(lab) < len(names) else lab

    rows = []
    for k, size in enumerate(rep.get("sizes") or []):
        mix = mixes[k] if k < len(mixes) and isinstance(mixes[k], dict) else {}
        shown = sorted(mix.items(), key=lambda kv: -kv[1])[:MIX_LABELS]
        rows.append([k, size, ", ".join(f"{name(lab)}: {cnt}" for lab, cnt in shown)])
    return rows


def spread(values: list[float]) -> str:
    """mean ± sd (the sample sd) of a metric over evaluation draws."""
    if len(values) < 2:
        return fmt(values[0]) if values else ""
    return f"{statistics.mean(values):.2f} ± {statistics.stdev(values):.2f}"


def draws_table(draws: dict[str, Any]) -> Table:
    """Each model's figures over the evaluation draws (evaluate --repeats): mean ± sd, its distance over the
    real floor of the same draw, and a fleet row's distance over the monolith's of the same draw."""
    seeds, floor, runs = draws["seeds"], draws["floor"], draws["runs"]
    metric = "classifier_fd" if "classifier_fd" in floor else "fid"
    mono = runs.get("monolith", {}).get(metric)

    def ratios(a: list[float], b: list[float] | None) -> str:
        return spread([x / y for x, y in zip(a, b)]) if b and all(v is not None for v in [*a, *b]) else ""

    # the emoji judge reads the subcategory too: its accuracy beside the category's
    accuracies = (
        "prompt_accuracy",
        *(("subcategory_accuracy",) if any("subcategory_accuracy" in r for r in runs.values()) else ()),
    )

    rows = [
        [
            name,
            spread(r[metric]),
            ratios(r[metric], floor.get(metric)),
            "" if name == "monolith" else ratios(r[metric], mono),
            *[spread(r[k]) if r.get(k) and None not in r[k] else "" for k in (*accuracies, "precision", "recall")],
        ]
        for name, r in runs.items()
    ]
    rows.append(
        [
            "real images (the floor)",
            spread(floor[metric]),  # (an evaluation without a floor: "")
            "",
            "",
            *[""] * len(accuracies),
            *[spread(floor[k]) if k in floor and None not in floor[k] else "" for k in ("precision", "recall")],
        ]
    )
    distance = "classifier FD" if metric == "classifier_fd" else "FID"
    return Table(
        caption=f"over {len(seeds)} evaluation draws (seeds {seeds[0]}–{seeds[-1]}), each model at its chosen "
        f"scale: every draw samples other prompts and noise and splits the held-out reference and the real floor "
        f"afresh, so these are mean ± sd over draws. A {distance} at this sample count moves by several points "
        "from draw to draw; the ratios are taken draw by draw (the same reference, prompts and noise)",
        header=[
            "model",
            distance,
            "÷ floor",
            "÷ monolith",
            "prompt accuracy",
            *(["subcategory accuracy"] if len(accuracies) > 1 else []),
            "precision",
            "recall",
        ],
        rows=rows,
    )


def one_draw(runs: dict[str, Any], floor: dict[str, Any]) -> dict[str, Any]:
    """An evaluation of one draw (evaluate --repeats 1) in the shape of its draws (draws_table): each figure a list
    of one value, the judge's distance where a model has one, else FID."""
    metric = "classifier_fd" if any(r.get("classifier_fd") is not None for r in runs.values()) else "fid"
    figures = (metric, "prompt_accuracy", "precision", "recall")
    return {
        "seeds": [0],
        "floor": {k: [floor.get(k)] for k in (metric, "precision", "recall") if k == metric or k in floor},
        "runs": {name: {k: [r.get(k)] for k in figures} for name, r in runs.items()},
    }


def generalization_table(gen: dict[str, Any]) -> Table:
    """Each expert's and the monolith's loss on training and held-out items of the expert's cluster."""

    def cells(r: dict[str, Any]) -> list[str]:
        out = []
        for name in ("expert", "monolith"):
            train, held = r.get(f"{name}_train"), r.get(f"{name}_heldout")
            gap = held - train if train is not None and held is not None else None
            out += [fmt(train), fmt(held), "" if gap is None else f"{gap:+.4f}"]
        return out

    rows = [[f"expert {r['expert']}", r["items"]["train"], r["items"]["heldout"], *cells(r)] for r in gen["clusters"]]
    rows.append(
        [
            "all (item-weighted)",
            "",
            "",
            *cells({f"{m}_{s}": v for m, d in gen["summary"].items() for s, v in d.items()}),
        ]
    )
    return Table(
        caption="do the experts generalise? flow-matching loss (velocity MSE, condition on, mean over "
        f"{len(gen['t'])} t bins) of each expert and of the monolith on training items and on held-out items of "
        "the expert's cluster, the same items and noise for both. An expert whose held-out loss is well above "
        "its training loss and above the monolith's is short of data: the regime in which a fleet trails a "
        "monolith of the same FLOPs",
        header=[
            "cluster",
            "train items",
            "held-out items",
            "expert train",
            "expert held-out",
            "expert gap",
            "monolith train",
            "monolith held-out",
            "monolith gap",
        ],
        rows=rows,
    )


def router_accuracy_table(routers: dict[str, dict[str, Any]], kinds: dict[str, str]) -> Table:
    """Accuracy per t-bucket of each router (rows), from its report.json."""
    buckets = next(iter(routers.values()))["t_buckets"]
    return Table(
        caption="router accuracy against the cluster of x0, per t-bucket (t = 1 is noise); chance = the "
        "largest cluster's share",
        header=["router", "sees", *[f"t {lo:.1f}-{hi:.1f}" for lo, hi in buckets], "overall", "chance"],
        rows=[
            [
                label,
                sees,
                *[fmt(a) for a in table["accuracy"]],
                fmt(table.get("overall_accuracy")),
                fmt(table.get("chance")),
            ]
            for name, rep in routers.items()
            for label, sees, table in _with_and_without_prompt(name, kinds.get(name, ""), rep)
        ],
    )


def _with_and_without_prompt(name: str, sees: str, rep: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    """A router's table, and for one that reads the prompt its table with the prompt dropped as a row of its own."""
    rows = [(name, sees, rep)]
    if rep.get("without_prompt"):
        rows.append((f"{name}, the prompt dropped", "x_t, t (null prompt)", rep["without_prompt"]))
    return rows
