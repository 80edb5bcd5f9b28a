"""What a person looks at while a job trains: sample grids (experts, monolith) and router accuracy plots.

Grids are tiled with PIL; plots use matplotlib's object API on an Agg canvas (no pyplot global
state). Both come back as PNG bytes for the job folder's samples/step-XXXXXXX.png.

matplotlib and PIL are imported inside the functions that draw (slow imports).
"""

from __future__ import annotations

import io
from typing import Callable

import torch

from flowfleet.flow import guided_velocity, integrate, interpolate, time_grid
from flowfleet.flow.sampler import SamplerName
from flowfleet.models.config import DiTConfig

T_BUCKETS = 10  # router accuracy is reported per t-bucket [i/10, (i+1)/10)


def _png(fig) -> bytes:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return buf.getvalue()


# ------------------------------------------------------------------------------------------------
#                                     Experts / monolith
# ------------------------------------------------------------------------------------------------


def condition_kwargs(batch: dict[str, torch.Tensor], cfg: DiTConfig) -> dict[str, torch.Tensor]:
    """The model-call keywords (docs/contracts.md) a model with this conditioning reads from a batch."""
    if cfg.conditioning == "class":
        return {"labels": batch["labels"]}
    if cfg.conditioning == "pooled":
        return {"text_pooled": batch["text_pooled"]}
    if cfg.conditioning == "cross_attn":
        kw = {"text_tokens": batch["text_tokens"], "text_mask": batch["text_mask"]}
        if cfg.add_pooled:
            kw["text_pooled"] = batch["text_pooled"]
        return kw
    return {}


@torch.no_grad()
def sample_flow(
    model: torch.nn.Module,
    cfg: DiTConfig,
    cond: dict[str, torch.Tensor],
    n: int,
    *,
    steps: int,
    sampler: SamplerName,
    guidance: float,
    shift: float,
    seed: int,
    device: torch.device,
) -> torch.Tensor:
    """n latents sampled from noise with classifier-free guidance (when the model is conditioned)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x1 = torch.randn(n, cfg.in_channels, *cfg.input_size, generator=gen, device=device)
    conditioned = cfg.conditioning != "none"
    keep = torch.zeros(n, dtype=torch.bool, device=device)

    def velocity(x: torch.Tensor, t: torch.Tensor, _: int) -> torch.Tensor:
        if not conditioned:
            return model(x, t, drop=keep)
        return guided_velocity(model, x, t, cond, guidance)

    return integrate(velocity, x1, time_grid(steps, shift, device=device), sampler=sampler)


def latents_to_images(latents: torch.Tensor, decode: Callable[[torch.Tensor], torch.Tensor] | None) -> torch.Tensor:
    """[B, C, H, W] latents -> [B, H, W, 3 or 1] in [0, 1] for display. Without a decoder (pixel
    latents are images already) the first channels are shown, min-max scaled when C is not 1 or 3."""
    x = decode(latents) if decode is not None else latents
    x = x.float().cpu()
    if x.shape[1] in (1, 3):
        x = (x.clamp(-1, 1) + 1) / 2
    else:
        x = x[:, :3]
        lo = x.amin(dim=(1, 2, 3), keepdim=True)
        hi = x.amax(dim=(1, 2, 3), keepdim=True)
        x = (x - lo) / (hi - lo).clamp_min(1e-8)
    return x.permute(0, 2, 3, 1)


def sample_grid_png(
    samples: torch.Tensor, reals: torch.Tensor, captions: list[str], title: str, cell: int = 96
) -> bytes:
    """Generated samples (top row) above the real items whose captions conditioned them (bottom row),
    each caption under its column. Drawn with PIL: a grid of images needs no plotting library."""
    from PIL import Image, ImageDraw

    n = samples.shape[0]
    scale = max(1, cell // max(samples.shape[1], 1))
    pad, text_h, title_h = 4, 36, 16
    h, w = samples.shape[1] * scale, samples.shape[2] * scale
    canvas = Image.new("RGB", (n * (w + pad) + pad, title_h + 2 * (h + pad) + text_h), "white")
    draw = ImageDraw.Draw(canvas)
    draw.text((pad, 2), title, fill="black")
    for row, images in enumerate((samples, reals)):
        for i in range(n):
            img = (images[i].clamp(0, 1) * 255).round().to(torch.uint8)
            img = img.expand(*img.shape[:2], 3) if img.shape[-1] == 1 else img  # [H, W, 3]
            tile = Image.fromarray(img.numpy()).resize((w, h), Image.Resampling.NEAREST)
            canvas.paste(tile, (pad + i * (w + pad), title_h + row * (h + pad)))
    for i, caption in enumerate(captions[:n]):
        x, y = pad + i * (w + pad), title_h + 2 * (h + pad)
        chars = max(4, w // 6)  # PIL's default bitmap font is ~6 px per character
        for line in range(3):
            draw.text((x, y + 11 * line), caption[line * chars : (line + 1) * chars], fill="black")
    buf = io.BytesIO()
    canvas.save(buf, format="PNG")
    return buf.getvalue()


# ------------------------------------------------------------------------------------------------
#                                          Router
# ------------------------------------------------------------------------------------------------


@torch.no_grad()
def router_accuracy(
    model: torch.nn.Module,
    latents: torch.Tensor,
    clusters: torch.Tensor,
    num_clusters: int,
    *,
    seed: int,
    device: torch.device,
    batch_size: int = 256,
    cond: dict[str, torch.Tensor] | None = None,
) -> dict:
    """Accuracy of argmax p(k | x_t, t[, prompt]) against the cluster id, per t-bucket (t uniform inside
    each of T_BUCKETS buckets, fresh noise), plus the confusion matrix over all buckets. `cond`: the
    items' prompt keywords (condition_kwargs), for a prompt-aware router; its report then holds the same table
    with the prompt dropped ("without_prompt": p(k | x_t, t, null), the unconditional branch's posterior of
    guidance over the mixture), on the same noise and times."""
    report = _router_accuracy(model, latents, clusters, num_clusters, seed, device, batch_size, cond or {})
    if cond:
        null = {**cond, "drop": torch.ones(latents.shape[0], dtype=torch.bool)}
        without = _router_accuracy(model, latents, clusters, num_clusters, seed, device, batch_size, null)
        report["without_prompt"] = without
    return report


def _router_accuracy(
    model: torch.nn.Module,
    latents: torch.Tensor,
    clusters: torch.Tensor,
    num_clusters: int,
    seed: int,
    device: torch.device,
    batch_size: int,
    cond: dict[str, torch.Tensor],
) -> dict:
    gen = torch.Generator().manual_seed(seed)
    correct = torch.zeros(T_BUCKETS, dtype=torch.long)
    confusion = torch.zeros(num_clusters, num_clusters, dtype=torch.long)  # [true, predicted]
    n = latents.shape[0]
    for b in range(T_BUCKETS):
        for start in range(0, n, batch_size):
            x0 = latents[start : start + batch_size]
            k = clusters[start : start + batch_size]
            m = x0.shape[0]
            t = (b + torch.rand(m, generator=gen)) / T_BUCKETS
            eps = torch.randn(x0.shape, generator=gen)
            x_t = interpolate(x0, eps, t)
            kw = {name: v[start : start + batch_size].to(device) for name, v in cond.items()}
            pred = model(x_t.to(device), t.to(device), **kw).argmax(dim=1).cpu()
            correct[b] += (pred == k).sum()
            confusion += torch.bincount(k * num_clusters + pred, minlength=num_clusters**2).reshape(
                num_clusters, num_clusters
            )
    acc = (correct.double() / n).tolist()
    return {
        "t_buckets": [[i / T_BUCKETS, (i + 1) / T_BUCKETS] for i in range(T_BUCKETS)],
        "accuracy": acc,
        "overall_accuracy": float(sum(acc) / T_BUCKETS),
        "chance": float(torch.bincount(clusters, minlength=num_clusters).max() / n),
        "items": n,
        "confusion": confusion.tolist(),
    }


def router_png(report: dict, title: str) -> bytes:
    """Accuracy per t-bucket (bars) beside the confusion matrix."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 3.6))
    fig.suptitle(title, fontsize=9)
    ax = fig.add_subplot(1, 2, 1)
    centres = [(lo + hi) / 2 for lo, hi in report["t_buckets"]]
    without = report.get("without_prompt")
    if without is None:
        ax.bar(centres, report["accuracy"], width=0.09)
    else:  # a router that reads the prompt: with it and without it, side by side
        ax.bar([c - 0.0225 for c in centres], report["accuracy"], width=0.045, label="with the prompt")
        ax.bar([c + 0.0225 for c in centres], without["accuracy"], width=0.045, label="without it")
    ax.axhline(report["chance"], color="gray", linestyle="--", linewidth=1, label="largest cluster share")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_xlabel("t  (0 = data, 1 = noise)")
    ax.set_ylabel("top-1 accuracy")
    ax.legend(fontsize=7)
    ax = fig.add_subplot(1, 2, 2)
    conf = torch.tensor(report["confusion"], dtype=torch.float64)
    conf = conf / conf.sum(dim=1, keepdim=True).clamp_min(1)
    im = ax.imshow(conf.numpy(), vmin=0, vmax=1, cmap="viridis")
    ticks = list(range(conf.shape[0]))
    ax.set_xticks(ticks)
    ax.set_yticks(ticks)
    ax.set_xlabel("predicted cluster")
    ax.set_ylabel("true cluster")
    fig.colorbar(im, ax=ax, fraction=0.046)
    fig.tight_layout()
    return _png(fig)
