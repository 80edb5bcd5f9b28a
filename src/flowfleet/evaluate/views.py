"""The pictures of an evaluation and its report, as PNG bytes.

Grids are tiled with PIL (a grid of images needs no plotting library); plots use matplotlib's object
API on an Agg canvas (no pyplot: its figure registry is global state). Every function takes plain
data (lists, dicts, tensors) so the report can redraw everything from the JSON files of a run root.

matplotlib and PIL are imported inside the functions that draw (slow to import, not needed to read results).
"""

from __future__ import annotations

import io
import math
from typing import Mapping, Sequence

import torch


def _png(fig) -> bytes:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return buf.getvalue()


def _figure(w: float, h: float):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(w, h))
    return fig


# --------------------------------------------------------------------------------------------------
#                                     Sample grids
# --------------------------------------------------------------------------------------------------


def captioned_grid_png(
    images: torch.Tensor, captions: Sequence[str], cols: int = 8, cell: int = 64, title: str = ""
) -> bytes:
    """images [n, C, H, W] in [-1, 1] in a grid, each with the first characters of its prompt below."""
    from PIL import Image, ImageDraw

    n = images.shape[0]
    captions, shared = strip_common_prefix(list(captions[:n]))
    if shared:  # "a handwritten digit" under every cell would hide the word that differs
        title = f'{title}   prompts: "{shared} ..."' if title else f'prompts: "{shared} ..."'
    cols = max(1, min(cols, n))
    rows = math.ceil(n / cols)
    h, w = images.shape[-2:]
    scale = max(1, math.ceil(cell / max(h, w)))
    ch, cw = h * scale, w * scale
    pad, text_h, title_h = 4, 24 if captions else 0, 16 if title else 0
    canvas = Image.new("RGB", (cols * (cw + pad) + pad, title_h + rows * (ch + text_h + pad) + pad), "white")
    draw = ImageDraw.Draw(canvas)
    if title:
        draw.text((pad, 2), title, fill="black")
    pixels = ((images.detach().float().cpu().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)  # [n, C, H, W]
    pixels = pixels.expand(-1, 3, -1, -1) if pixels.shape[1] == 1 else pixels[:, :3]
    chars = max(4, cw // 6)
    for i in range(n):
        r, c = divmod(i, cols)
        x, y = pad + c * (cw + pad), title_h + pad + r * (ch + text_h + pad)
        tile = Image.fromarray(pixels[i].permute(1, 2, 0).numpy()).resize((cw, ch), Image.Resampling.NEAREST)
        canvas.paste(tile, (x, y))
        if captions and i < len(captions):
            draw.text((x, y + ch + 1), captions[i][:chars], fill="black")
            draw.text((x, y + ch + 12), captions[i][chars : 2 * chars], fill="black")
    buf = io.BytesIO()
    canvas.save(buf, format="PNG")
    return buf.getvalue()


def strip_common_prefix(captions: list[str]) -> tuple[list[str], str]:
    """Drop the words every caption starts with: (the rest of each caption, the shared words)."""
    if len(captions) < 2 or not all(captions):
        return captions, ""
    words = [c.split() for c in captions]
    k = 0
    while all(len(w) > k + 1 and w[k] == words[0][k] for w in words):
        k += 1
    return [" ".join(w[k:]) for w in words], " ".join(words[0][:k])


# --------------------------------------------------------------------------------------------------
#                                        Plots
# --------------------------------------------------------------------------------------------------


def loss_curves_png(curves: Mapping[str, Sequence[tuple[int, float]]], title: str = "training loss") -> bytes:
    """One line per job: (step, loss) pairs. Log-scale y when every loss is positive."""
    fig = _figure(8, 3.8)
    ax = fig.add_subplot(1, 1, 1)
    drawn = [(name, points) for name, points in curves.items() if points]
    for name, points in drawn:
        steps, losses = zip(*points)
        ax.plot(steps, losses, label=name, linewidth=1.2, linestyle="--" if name == "monolith" else "-")
    if drawn and all(loss > 0 for _, points in drawn for _, loss in points):
        ax.set_yscale("log")
    ax.set(title=title, xlabel="optimiser step", ylabel="loss")
    ax.grid(alpha=0.3)
    if drawn:
        ax.legend(fontsize=7, ncol=2)
    else:
        ax.text(0.5, 0.5, "no metrics.jsonl yet", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    return _png(fig)


def router_accuracy_png(
    buckets: Sequence[Sequence[float]],
    accuracy: Sequence[float],
    chance: float | None,
    title: str = "router accuracy per t-bucket",
    heldout: Sequence[float] | None = None,
    heldout_without_prompt: Sequence[float] | None = None,
) -> bytes:
    """Accuracy per t bucket on the data items (bars), and on held-out items (a line) when given; a router that
    reads the prompt: also on the held-out items with the prompt dropped (a dashed line)."""
    fig = _figure(5.5, 3.4)
    ax = fig.add_subplot(1, 1, 1)
    centres = [(lo + hi) / 2 for lo, hi in buckets]
    widths = [0.9 * (hi - lo) for lo, hi in buckets]
    ax.bar(centres, accuracy, width=widths, color="tab:blue", label="training items")
    if heldout is not None:
        ax.plot(centres, heldout, color="tab:orange", marker="o", markersize=4, label="held-out items")
    if heldout_without_prompt is not None:
        ax.plot(centres, heldout_without_prompt, color="tab:green", linestyle="--", marker="s", markersize=3,
                label="held-out items, the prompt dropped")  # fmt: skip
    if chance is not None:
        ax.axhline(chance, color="gray", linestyle="--", linewidth=1, label="largest cluster share")
    if chance is not None or heldout is not None:
        ax.legend(fontsize=7)
    ax.set(title=title, xlabel="t  (0 = data, 1 = noise)", ylabel="top-1 accuracy", xlim=(0, 1), ylim=(0, 1))
    fig.tight_layout()
    return _png(fig)


def disagreement_png(
    series: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    title: str = "expert disagreement along the trajectory",
) -> bytes:
    """series: name -> (t values, spread values); t from 1 (noise) on the left to 0, the sampling order."""
    fig = _figure(5.5, 3.4)
    ax = fig.add_subplot(1, 1, 1)
    for name, (ts, spread) in series.items():
        ax.plot(ts, spread, marker="o", markersize=3, label=name)
    ax.set(
        title=title, xlabel="t  (1 = noise; sampling runs left to right)", ylabel="relative spread of expert velocities"
    )
    ax.set_xlim(1.0, 0.0)
    ax.grid(alpha=0.3)
    if series:
        ax.legend(fontsize=7)
    fig.tight_layout()
    return _png(fig)


def usage_png(usage: Mapping[str, Sequence[float]], title: str = "expert usage per strategy") -> bytes:
    """usage: strategy -> share of the ensemble weight per expert (grouped bars)."""
    fig = _figure(6.5, 3.4)
    ax = fig.add_subplot(1, 1, 1)
    names = list(usage)
    k = max((len(v) for v in usage.values()), default=0)
    width = 0.8 / max(len(names), 1)
    for i, name in enumerate(names):
        xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(usage[name]))]
        ax.bar(xs, usage[name], width=width, label=name)
    ax.set_xticks(range(k))
    ax.set(title=title, xlabel="expert", ylabel="share of ensemble weight", ylim=(0, 1))
    if names:
        ax.legend(fontsize=7)
    fig.tight_layout()
    return _png(fig)


def fid_png(scores: Mapping[str, float], title: str = "FID (lower is better)") -> bytes:
    fig = _figure(5, 3.2)
    ax = fig.add_subplot(1, 1, 1)
    names = list(scores)
    colors = ["tab:gray" if n == "monolith" else "tab:blue" for n in names]
    bars = ax.bar(names, [scores[n] for n in names], color=colors)
    for bar, name in zip(bars, names):
        ax.annotate(
            f"{scores[name]:.1f}",
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set(title=title, ylabel="FID")
    fig.tight_layout()
    return _png(fig)


SWEEP_PANELS = (
    ("classifier_fd", "classifier FD (lower is better)"),
    ("precision", "precision (fidelity)"),
    ("recall", "recall (diversity)"),
    ("prompt_accuracy", "prompt accuracy"),
    ("fid", "FID (lower is better)"),
)


def guidance_sweep_png(sweeps: Mapping[str, Sequence[Mapping[str, float]]], floor: Mapping[str, float]) -> bytes:
    """One panel per metric against the guidance scale, one line per model (`sweeps`: model -> records with
    cfg and the metrics), the real floor's value as a dashed line; a model's chosen scale is a filled dot
    when the records carry `chosen`."""
    panels = [(key, title) for key, title in SWEEP_PANELS if any(key in r for rs in sweeps.values() for r in rs)]
    fig = _figure(3.4 * len(panels), 3.2)
    for i, (key, title) in enumerate(panels, 1):
        ax = fig.add_subplot(1, len(panels), i)
        for name, records in sweeps.items():
            pts = [(r["cfg"], r[key]) for r in records if r.get(key) is not None]
            if not pts:
                continue
            (line,) = ax.plot(*zip(*pts), marker="o", markersize=3, label=name, linewidth=1.2)
            chosen = [(r["cfg"], r[key]) for r in records if r.get("chosen") and r.get(key) is not None]
            if chosen:
                ax.plot(*zip(*chosen), marker="o", markersize=8, color=line.get_color(), linestyle="none")
        if floor.get(key) is not None:
            ax.axhline(floor[key], color="black", linestyle="--", linewidth=1, label="real floor")
        ax.set(title=title, xlabel="guidance scale")
        ax.grid(alpha=0.3)
        if i == 1:
            ax.legend(fontsize=7)
    fig.tight_layout()
    return _png(fig)
