"""What a person looks at after `generate`: the image grid, a router-probability heatmap, usage bars.

matplotlib, PIL and diffusers' grid helper are imported inside the functions that draw (slow imports).
"""

from __future__ import annotations

import io
import math
from collections import Counter

import numpy as np
import torch
from PIL import Image

from flowfleet.sampling.trace import RoutingTrace


def to_pil(images: torch.Tensor) -> list[Image.Image]:
    """[n, C, H, W] in [-1, 1] (C = 1 or 3) -> PIL images."""
    u8 = ((images.detach().float().cpu().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)  # [n, C, H, W]
    arr = u8.permute(0, 2, 3, 1).numpy()  # [n, H, W, C]
    if arr.shape[-1] == 1:
        return [Image.fromarray(a[..., 0], mode="L").convert("RGB") for a in arr]
    return [Image.fromarray(a[..., :3], mode="RGB") for a in arr]


def image_grid(images: torch.Tensor, cols: int | None = None, min_cell: int = 64) -> Image.Image:
    """A near-square grid (diffusers' make_image_grid), cells upscaled to at least `min_cell` pixels."""
    from diffusers.utils import make_image_grid

    pil = to_pil(images)
    n = len(pil)
    cols = cols or math.ceil(math.sqrt(n))
    rows = math.ceil(n / cols)
    w, h = pil[0].size
    scale = max(1, math.ceil(min_cell / max(w, h)))
    pil = [im.resize((w * scale, h * scale), Image.Resampling.NEAREST) for im in pil]
    pil += [Image.new("RGB", pil[0].size)] * (rows * cols - n)  # black padding
    return make_image_grid(pil, rows=rows, cols=cols)


def png_bytes(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def routing_heatmap(trace: RoutingTrace, max_samples: int = 64) -> bytes:
    """PNG: mean router probability per expert over the steps, and each sample's top expert per step."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import BoundaryNorm
    from matplotlib.figure import Figure  # no pyplot: its global figure registry is module state

    probs = trace.prob_matrix().numpy()  # [S, B, K]
    top1 = trace.top1_matrix().numpy()[:, :max_samples]  # [S, B']
    steps, k = probs.shape[0], trace.num_experts
    fig = Figure(figsize=(11, 3.6), dpi=110)
    FigureCanvasAgg(fig)
    ax1, ax2 = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1, 1.3]})
    im = ax1.imshow(
        probs.mean(axis=1).T, aspect="auto", origin="lower", vmin=0, vmax=1, cmap="viridis", interpolation="nearest"
    )
    ax1.set(title="mean router probability", xlabel="sampling step (t: 1 -> 0)", ylabel="expert")
    ax1.set_yticks(range(k))
    fig.colorbar(im, ax=ax1, fraction=0.05)
    im2 = ax2.imshow(
        top1.T,
        aspect="auto",
        origin="lower",
        cmap=_expert_colors(k),
        norm=BoundaryNorm(np.arange(k + 1) - 0.5, k),
        interpolation="nearest",
    )
    ax2.set(title="top expert per sample", xlabel="sampling step (t: 1 -> 0)", ylabel="sample")
    cb = fig.colorbar(im2, ax=ax2, fraction=0.05, ticks=range(k))
    cb.set_label("expert")
    for ax in (ax1, ax2):
        if steps <= 20:
            ax.set_xticks(range(steps))
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def sample_routing_view(trace: RoutingTrace, i: int) -> Image.Image:
    """One image's routing: per sampling step, the experts that ran on it as stacked bars of their
    weights (one colour per expert, as in routing_heatmap), the router's probabilities as dots."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    k, steps = trace.num_experts, trace.num_steps
    weights = np.zeros((steps, k))  # [S, K] weight of each expert on image i at each step
    for s in range(steps):
        for e, w in zip(trace.experts[s][i].tolist(), trace.weights[s][i].tolist()):
            weights[s, e] += w
    probs = trace.prob_matrix()[:, i].numpy()  # [S, K]
    colors = _expert_colors(k).colors
    fig = Figure(figsize=(4.2, 2.4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    x, bottom = np.arange(steps), np.zeros(steps)
    for e in range(k):
        if weights[:, e].any():
            ax.bar(x, weights[:, e], bottom=bottom, color=colors[e], label=f"expert {e}", width=0.85)
            bottom += weights[:, e]
        ax.scatter(x, probs[:, e], s=9, color=colors[e], edgecolors="black", linewidths=0.4, zorder=3)
    ax.set(ylim=(0, 1.05), xlabel="sampling step (t: 1 -> 0)", ylabel="weight")
    ax.set_title(f"image {i}: experts per step (dots: router)", fontsize=9)
    ax.set_xticks(x if steps <= 10 else x[:: -(-steps // 8)])  # at most about 8 labels
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return Image.open(io.BytesIO(buf.getvalue())).convert("RGB")


def _expert_colors(k: int):
    """One distinct colour per expert (tab10 / tab20; sampled from turbo beyond 20 experts)."""
    from matplotlib import colormaps
    from matplotlib.colors import ListedColormap

    if k <= 20:
        table = colormaps["tab10" if k <= 10 else "tab20"]
        assert isinstance(table, ListedColormap)
        return ListedColormap(np.asarray(table.colors)[:k])
    return ListedColormap(colormaps["turbo"](np.linspace(0, 1, k)))


def usage_table(trace: RoutingTrace, loads: Counter[int] | None = None, width: int = 30):
    """A rich Table: one bar per expert with its share of (sample, step) selections and what ran."""
    from rich.bar import Bar
    from rich.console import RenderableType
    from rich.table import Table

    sel = trace.selections()
    total = max(sum(sel.values()), 1)
    table = Table(title="expert usage", title_justify="left", show_edge=False)
    table.add_column("expert", justify="right")
    table.add_column("share of selections", width=width)
    table.add_column("%", justify="right")
    table.add_column("forward calls", justify="right")
    table.add_column("rows run", justify="right")
    if loads is not None:
        table.add_column("loads", justify="right")
    for k in range(trace.num_experts):
        share = sel.get(k, 0) / total
        row: list[RenderableType] = [
            str(k),
            Bar(1.0, 0.0, share, width=width, color="cyan"),
            f"{100 * share:5.1f}",
            str(trace.stats.calls.get(k, 0)),
            str(trace.stats.rows.get(k, 0)),
        ]
        if loads is not None:
            row.append(str(loads.get(k, 0)))
        table.add_row(*row)
    return table
