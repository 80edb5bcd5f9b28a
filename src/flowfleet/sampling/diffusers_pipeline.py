"""A fleet through diffusers' own loader and calling convention:

    pipe = DiffusionPipeline.from_pretrained("runs/demo/model", trust_remote_code=True)     # offload=2 to bound
    images = pipe("a handwritten digit seven", num_inference_steps=20, guidance_scale=2.0,
                  num_images_per_prompt=4, generator=torch.Generator().manual_seed(0)).images   # PIL images

`assemble` writes the folder's `_class_name` as ["pipeline", "FlowfleetDiffusionPipeline"] beside a pipeline.py that
imports this class, so diffusers (0.35 to the newest supported) loads it as it loads any pipeline with custom code;
`trust_remote_code=True` is diffusers' own consent to run a folder's module. The call takes diffusers' argument
names (prompt, num_inference_steps, guidance_scale, num_images_per_prompt, generator, output_type "pil" / "np" /
"pt" / "latent", return_dict) and the fleet's (strategy: top1 / top2 / topk / full, top_k, class_labels, any other
sampling setting by its name), and returns `.images` as every diffusers pipeline does. The noise is drawn from
`generator` at once for the whole batch, as FleetPipeline draws a seed's:
`generator=torch.Generator().manual_seed(S)` gives the pixels `flowfleet generate --seed S` gives.
"""

# (no `from __future__ import annotations`, and typing.Optional in __init__: diffusers 0.35 reads __init__'s
# annotations as typing objects, not strings or `X | None`)
from typing import Any, Optional, Sequence

import numpy as np
import torch
from diffusers import DiffusionPipeline
from diffusers.pipelines.pipeline_utils import ImagePipelineOutput
from diffusers.utils.torch_utils import randn_tensor

from flowfleet.errors import FlowfleetError
from flowfleet.sampling.pipeline import FleetPipeline
from flowfleet.sampling.views import to_pil

OUTPUT_TYPES = ("pil", "np", "pt", "latent")


class FlowfleetDiffusionPipeline(DiffusionPipeline):
    # diffusers' loader builds, eagerly, every component of model_index.json that __init__ takes as an argument.
    # The experts are not among them: __init__ takes none, so the loader builds nothing, and the fleet opens on
    # first use from the folder the loader recorded (config._name_or_path) through FleetPipeline, whose experts
    # load when the router first selects one (`offload` bounds how many stay in memory).
    def __init__(self, offload: Optional[int] = None):
        super().__init__()
        self.offload = offload
        self._device = torch.device("cpu")
        self._fleet: FleetPipeline | None = None

    @classmethod
    def extract_init_dict(cls, config_dict: dict[str, Any], **kwargs: Any) -> Any:
        """model_index.json is flowfleet's own (FleetPipeline reads it): none of its keys is an argument here, so
        diffusers is not handed them (it would warn of each)."""
        private = {k: v for k, v in config_dict.items() if k.startswith("_")}
        return super().extract_init_dict(private, **kwargs)  # type: ignore[misc]  # ConfigMixin's, untyped in diffusers

    @property
    def folder(self) -> str:
        """The folder diffusers opened this pipeline from."""
        return str(getattr(getattr(self, "config", None), "_name_or_path", "") or "")

    @property
    def fleet(self) -> "FleetPipeline":
        """The folder opened as a FleetPipeline (router and encoders now, experts when first selected)."""
        if self._fleet is None:
            folder = self.folder
            if not folder:
                raise FlowfleetError("FlowfleetDiffusionPipeline: open one with DiffusionPipeline.from_pretrained(DIR)")
            self._fleet = FleetPipeline.from_pretrained(folder, device=self._device, offload=self.offload)
        return self._fleet

    @property
    def device(self) -> torch.device:
        return self._device

    def to(self, *args: Any, **kwargs: Any) -> "FlowfleetDiffusionPipeline":
        """The device the fleet samples on (`pipe.to("cuda")`); the weights stay fp32, as they were trained."""
        device = kwargs.get("device") or next((a for a in args if isinstance(a, (str, torch.device))), None)
        if device is not None and torch.device(device) != self._device:
            self._device, self._fleet = torch.device(device), None  # reopened there on first use
        return self

    @torch.inference_mode()
    def __call__(
        self,
        prompt: str | Sequence[str] | None = None,
        num_inference_steps: int | None = None,
        guidance_scale: float | None = None,
        num_images_per_prompt: int = 1,
        generator: torch.Generator | list[torch.Generator] | None = None,
        output_type: str = "pil",
        return_dict: bool = True,
        strategy: str | None = None,
        top_k: int | None = None,
        class_labels: int | Sequence[int] | None = None,
        **choices: Any,
    ) -> ImagePipelineOutput | tuple[Any]:
        """Images for each prompt (or class label), num_images_per_prompt each, in prompt order. choices: any other
        sampling setting by its name (config.SamplingSettings: sampler, shift, route_every, ...). Unset settings
        are the folder's (model_index.json's scheduler)."""
        if output_type not in OUTPUT_TYPES:
            raise FlowfleetError(f"output_type: expected one of {', '.join(OUTPUT_TYPES)}, got {output_type!r}")
        if num_images_per_prompt < 1:
            raise FlowfleetError(f"num_images_per_prompt: must be >= 1, got {num_images_per_prompt}")
        fleet = self.fleet
        prompts = [prompt] if isinstance(prompt, str) else list(prompt) if prompt is not None else None
        labels = [class_labels] if isinstance(class_labels, int) else list(class_labels or []) or None
        each = prompts or labels or [None]
        n = len(each) * num_images_per_prompt
        repeat = lambda items: [x for x in items for _ in range(num_images_per_prompt)] if items else None  # noqa: E731
        if top_k is not None:
            strategy = f"topk:{top_k}"
        noise = randn_tensor((n, *fleet.latent_shape), generator=generator, device=fleet.device, dtype=fleet.dtype)
        settings = fleet.settings(strategy, steps=num_inference_steps, guidance_scale=guidance_scale, **choices)
        out = fleet(repeat(prompts), n, labels=repeat(labels), settings=settings, noise=noise, progress="flowfleet")
        images: Any
        if output_type == "latent":
            images = out.latents
        elif output_type == "pil":
            images = to_pil(out.images)
        else:
            unit = ((out.images.float() + 1) / 2).clamp(0, 1).cpu()  # [n, C, H, W] in [0, 1], diffusers' range
            images = unit if output_type == "pt" else np.ascontiguousarray(unit.permute(0, 2, 3, 1).numpy())
        return ImagePipelineOutput(images=images) if return_dict else (images,)
