"""The web page of `flowfleet serve`: a Gradio page (the convention of diffusion demos) over FleetService.

Prompt and settings in; the images, each image's routing view (which experts drew it at each step, with
what weight) and a usage summary out; a progress bar that moves with the sampling steps; the fleet
card (experts, their clusters' previews and sizes, the router's accuracy) above. Errors in a request
(and a full queue) are shown as Gradio's one-line error messages, never as tracebacks.
"""

from __future__ import annotations

import io
from typing import Any, Callable

import gradio as gr
from PIL import Image
from pydantic import ValidationError

from flowfleet.errors import validation_message
from flowfleet.sampling.card import card_markdown
from flowfleet.sampling.views import sample_routing_view
from flowfleet.serve.service import STRATEGIES, BadRequest, Busy, FleetService, GenerateRequest, Generation
from flowfleet.storage import RunRoot

# System fonts: the page makes no request beyond this server (Gradio's default theme asks Google Fonts).
THEME = gr.themes.Soft(font=["ui-sans-serif", "system-ui", "sans-serif"], font_mono=["ui-monospace", "monospace"])


def usage_markdown(g: Generation) -> str:
    """Which experts ran, as a share of (image, step) selections, and how long it took."""
    sel = g.trace.selections()
    total = max(sum(sel.values()), 1)
    shares = ", ".join(f"expert {k}: {100 * c / total:.0f} %" for k, c in sorted(sel.items()))
    s = g.settings
    return (
        f"{len(g.images)} image(s), {s.strategy}, {s.steps} steps, guidance {s.guidance_scale:g}, seed {s.seed} — "
        f"{g.seconds:.2f} s (waited {g.waited:.2f} s). Selections: {shares}."
    )


def _enlarged(image: Image.Image, side: int = 192) -> Image.Image:
    """Small samples (28 px digits) scaled up by whole pixels, so the page shows pixels, not blur."""
    scale = max(1, side // max(image.size))
    return image.resize((image.width * scale, image.height * scale), Image.Resampling.NEAREST)


def _generate_handler(service: FleetService, present: int) -> Callable[..., tuple[list, list, str]]:
    """The Generate button's function (and Gradio's /generate API): the form's values as a GenerateRequest,
    sampled by the service with its progress shown; -> (images, each image's routing view, the usage summary)."""

    def run(
        prompt: str,
        label: Any,
        strategy: str,
        k: Any,
        steps: Any,
        guidance_scale: Any,
        seed: Any,
        n: Any,
        progress: gr.Progress = gr.Progress(),  # noqa: B008 (Gradio passes its progress tracker this way)
    ) -> tuple[list, list, str]:
        try:
            req = GenerateRequest(
                prompt=prompt if service.needs_prompt else None,
                label=int(label) if service.needs_label and label is not None else None,
                strategy=strategy if present > 1 else None,
                k=int(k) if strategy == "topk" and present > 1 else None,
                steps=int(steps),
                guidance_scale=float(guidance_scale),
                seed=int(seed or 0),
                n=int(n),
            )
            g = service.generate(
                req, on_step=lambda done, total: progress((done, total), desc="sampling", unit="steps")
            )
        except ValidationError as err:
            raise gr.Error(validation_message(err)) from None
        except (BadRequest, Busy) as err:
            raise gr.Error(str(err)) from None
        captions = [f"{i}: {p}" if p else str(i) for i, p in enumerate(g.prompts)]
        shown = [(_enlarged(im), c) for im, c in zip(g.images, captions)]
        views = [(sample_routing_view(g.trace, i), f"image {i}") for i in range(len(g.images))]
        return shown, views, usage_markdown(g)

    return run


def build_ui(service: FleetService, model_dir: str) -> gr.Blocks:
    card, lim, pipe = service.card, service.limits, service.pipe
    defaults = pipe.scheduler
    present = len(pipe.present)
    folder = RunRoot(model_dir)
    previews = [
        (Image.open(io.BytesIO(folder.read_bytes(*e.preview.split("/")))), f"expert {e.expert}")
        for e in card.experts
        if e.preview is not None
    ]
    name = defaults.strategy.name
    default_strategy = "full" if name == "full" else "top1" if name == "top1" else "topk"

    with gr.Blocks(title=f"flowfleet · {card.name or 'model'}", analytics_enabled=False) as page:
        gr.Markdown(f"# flowfleet · {card.name or model_dir}")
        with gr.Accordion("Fleet card", open=True):
            gr.Markdown(card_markdown(card), elem_id="fleet-card")
            if previews:
                gr.Gallery(previews, label="what each expert was trained on", columns=min(len(previews), 4), height=220)
        with gr.Row():
            with gr.Column(scale=1):
                prompt = gr.Textbox(
                    label="prompt",
                    placeholder="a handwritten digit seven",
                    max_length=lim.max_prompt_chars,
                    visible=service.needs_prompt,
                    elem_id="prompt",
                )
                label = gr.Number(
                    label=f"class label (0..{pipe.num_classes - 1})", value=0, precision=0, visible=service.needs_label
                )
                strategy = gr.Radio(list(STRATEGIES), value=default_strategy, label="strategy", visible=present > 1)
                k = gr.Slider(1, max(present, 1), value=min(2, present), step=1, label="k (topk)", visible=present > 1)
                steps = gr.Slider(1, lim.max_steps, value=min(defaults.steps, lim.max_steps), step=1, label="steps")
                guidance_scale = gr.Slider(
                    0,
                    lim.max_guidance_scale,
                    value=min(defaults.guidance_scale, lim.max_guidance_scale),
                    step=0.1,
                    label="guidance scale",
                )
                seed = gr.Number(label="seed", value=0, precision=0, minimum=0)
                n = gr.Slider(1, lim.max_images, value=min(4, lim.max_images), step=1, label="images")
                go = gr.Button("Generate", variant="primary", elem_id="generate")
            with gr.Column(scale=2):
                images = gr.Gallery(label="images", columns=4, format="png", object_fit="contain", elem_id="images")
                routing = gr.Gallery(
                    label="routing per image", columns=2, format="png", object_fit="contain", elem_id="routing"
                )
                summary = gr.Markdown(elem_id="summary")

        # also Gradio's own API: gradio_client.Client(url).predict(prompt, label, strategy, k, steps, guidance_scale,
        # seed, n, api_name="/generate") -> (images, routing views, summary); the JSON APIs are /api and /v1
        go.click(
            _generate_handler(service, present),
            [prompt, label, strategy, k, steps, guidance_scale, seed, n],
            [images, routing, summary],
            api_name="generate",
            api_visibility="public",
        )
    return page
