"""`flowfleet export diffusers`: one expert of a model folder as a diffusers PixArtTransformer2DModel.

OUT/
  transformer/                    PixArtTransformer2DModel (config.json + diffusion_pytorch_model.safetensors)
  scheduler/                      FlowMatchEulerDiscreteScheduler (shift 1: flowfleet's time convention)
  negative_prompt_embeds.safetensors  the expert's learned null text ("prompt_embeds" [1, L, T],
                                  "prompt_attention_mask" [1, L]): its unconditional branch for CFG
  text_encoder.json               which text encoder made the expert's prompt embeddings (a reference)
  README.md                       how to sample it with diffusers

The mapping and the conditions an expert must meet are in flowfleet.models.pixart.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import safetensors.torch
import torch

from flowfleet.errors import ParameterError
from flowfleet.models.dit import DiTExpert
from flowfleet.models.files import load_model
from flowfleet.models.pixart import pixart_config, to_pixart
from flowfleet.sampling.folder import expert_folder, read_model_index
from flowfleet.storage import RunRoot

SAMPLING_EXAMPLE = """# Sampling this expert with diffusers (flowfleet's Euler sampler, the same numbers)

```python
import numpy as np, torch, safetensors.torch
from diffusers import FlowMatchEulerDiscreteScheduler, PixArtTransformer2DModel

transformer = PixArtTransformer2DModel.from_pretrained("{out}/transformer").eval()
scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained("{out}/scheduler")
null = safetensors.torch.load_file("{out}/negative_prompt_embeds.safetensors")
# prompt_embeds [B, {text_len}, {text_dim}], prompt_attention_mask [B, {text_len}]: the text encoder named in
# text_encoder.json, as flowfleet's prepare writes them
steps, cfg = 20, 4.0
scheduler.set_timesteps(sigmas=np.linspace(1.0, 0.0, steps + 1)[:-1])  # sigma 1 -> 0 (the default grid stops at 1/1000)
x = torch.randn(B, {channels}, {size}, {size})
for t in scheduler.timesteps:
    with torch.no_grad():
        v_cond = transformer(x, encoder_hidden_states=prompt_embeds, encoder_attention_mask=prompt_attention_mask,
                             timestep=t.expand(B), return_dict=False)[0]
        v_null = transformer(x, encoder_hidden_states=null["prompt_embeds"].expand(B, -1, -1),
                             encoder_attention_mask=null["prompt_attention_mask"].expand(B, -1),
                             timestep=t.expand(B), return_dict=False)[0]
    x = scheduler.step(v_null + cfg * (v_cond - v_null), t, x).prev_sample
```
"""


def export_diffusers(model_dir: str, expert: int, out: str) -> str:
    """Write expert `expert` of the model folder as a diffusers folder in `out` (local or fsspec URL)."""
    from diffusers.models.transformers.pixart_transformer_2d import PixArtTransformer2DModel
    from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteScheduler

    root = RunRoot(model_dir)
    index = read_model_index(root)
    if expert not in index.present_experts:
        raise ParameterError(f"expert {expert}", f"{root.url} holds experts {index.present_experts}")
    model = load_model(DiTExpert, root, expert_folder(expert))
    cfg = model.cfg
    config = pixart_config(cfg)  # one line naming the field when the expert is no PixArt transformer
    state, null = to_pixart(cfg, model.state_dict())
    transformer = PixArtTransformer2DModel(**config)
    transformer.load_state_dict(state, strict=True)
    out_root = RunRoot(out)
    with tempfile.TemporaryDirectory(prefix="flowfleet-export-") as tmp:
        transformer.save_pretrained(Path(tmp, "transformer"))
        FlowMatchEulerDiscreteScheduler(shift=1.0).save_pretrained(Path(tmp, "scheduler"))
        for path in sorted(Path(tmp).rglob("*")):
            if path.is_file():
                out_root.write_bytes(path.read_bytes(), *path.relative_to(tmp).parts)
    negative = {"prompt_embeds": null[None].contiguous(), "prompt_attention_mask": torch.ones(1, cfg.text_len)}
    out_root.write_bytes(safetensors.torch.save(negative), "negative_prompt_embeds.safetensors")
    out_root.write_json(index.text_encoder_config or {}, "text_encoder.json")
    example = SAMPLING_EXAMPLE.format(
        out=out_root.url, text_len=cfg.text_len, text_dim=cfg.text_dim, channels=cfg.in_channels, size=cfg.input_size[0]
    )
    out_root.write_bytes(example.encode(), "README.md")
    return out_root.url
