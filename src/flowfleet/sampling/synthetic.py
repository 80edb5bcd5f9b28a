"""Random-weight fleets for tests and benchmarks: a run root whose jobs look finished, without training.

write_random_fleet() writes run.yaml, experts/k/{status.json,final/} and router/{status.json,final/}
exactly as the training jobs do (docs/contracts.md), with random weights. DiT's adaLN-Zero
initialisation makes every fresh expert output zero, so all parameters are redrawn: experts then
differ from each other and routing decisions matter. HashTextEncoder is a deterministic stand-in for
the text encoder interface (captions -> tokens, mask, pooled), so tests need no MiniLM.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass
from typing import Any, Iterable

import torch

from flowfleet.config import RunConfig
from flowfleet.models.config import DiTConfig
from flowfleet.storage import RunRoot


def tiny_run_config(k: int = 3, *, size: int = 8, channels: int = 1, hidden: int = 32, depth: int = 1,
                    patch: int = 2, text_len: int = 4, conditioning: str = "cross_attn",
                    router_hidden: int = 32, router_depth: int = 1, **sampling: Any) -> RunConfig:
    """A valid run.yaml for a small pixel-space fleet (text width 384: MiniLM's, as RunConfig requires)."""
    text = conditioning in ("pooled", "cross_attn")
    expert = DiTConfig(input_size=(size, size), in_channels=channels, patch_size=patch, hidden_size=hidden,
                       depth=depth, num_heads=2, conditioning=conditioning, text_dim=384 if text else 0,
                       text_len=text_len if conditioning == "cross_attn" else 0,
                       add_pooled=conditioning == "cross_attn")
    router = DiTConfig(input_size=(size, size), in_channels=channels, patch_size=patch, hidden_size=router_hidden,
                       depth=router_depth, num_heads=2, num_outputs=k)
    return RunConfig(
        name="synthetic",
        data={"source": "mnist", "image_size": size, "channels": channels},
        encoders={"latent": {"name": "pixels"},
                  "text": {"name": "minilm" if text else "none", "max_length": text_len}},
        cluster={"k": k},
        expert=expert,
        router=router,
        sampling={"steps": 4, "cfg": 2.0, "strategy": "top2", **sampling},
    )


def randomize_(model: torch.nn.Module, seed: int, std: float = 0.1) -> torch.nn.Module:
    """Redraw every parameter from N(0, std^2) with a fixed seed (in place)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * std)
    return model


def _status(job: str, steps: int) -> dict[str, Any]:
    return {"job": job, "state": "done", "step": steps, "total_steps": steps, "samples_seen": 0,
            "last_checkpoint": None, "host": "synthetic", "pid": 0, "heartbeat": time.time(),
            "last_loss": None, "message": "random weights (flowfleet.sampling.synthetic)"}


def write_random_fleet(run_root: str, cfg: RunConfig, *, experts: Iterable[int] | None = None,
                       seed: int = 0, std: float = 0.1) -> RunRoot:
    """Write run.yaml, finished random experts (all K unless `experts` names some) and a router."""
    from flowfleet.models.dit import DiTExpert, DiTRouter
    from flowfleet.models.files import save_model

    root = RunRoot(run_root)
    cfg.save(root)
    ids = range(cfg.cluster.k) if experts is None else experts
    for k in ids:
        model = randomize_(DiTExpert.from_dit_config(cfg.expert), seed=seed * 1000 + k, std=std)
        save_model(model, root, "experts", str(k), "final")
        root.write_json(_status(f"expert-{k}", cfg.train.steps), "experts", str(k), "status.json")
    router = randomize_(DiTRouter.from_dit_config(cfg.router), seed=seed * 1000 + 999, std=std)
    save_model(router, root, "router", "final")
    root.write_json(_status("router", cfg.router_train.steps), "router", "status.json")
    return root


@dataclass(frozen=True)
class TextEmbeddingsLike:
    tokens: torch.Tensor  # [B, L, T]
    mask: torch.Tensor  # [B, L] bool
    pooled: torch.Tensor  # [B, T]


class HashTextEncoder:
    """Deterministic fake text encoder: each caption's embedding is seeded by its CRC32. Tokens past the
    caption's word count are masked out, so the mask is exercised too."""

    def __init__(self, width: int = 384, max_length: int = 4):
        self.width = width
        self.max_length = max_length
        self.calls: list[list[str]] = []

    def encode(self, captions: list[str]) -> TextEmbeddingsLike:
        self.calls.append(list(captions))
        toks, masks = [], []
        for c in captions:
            gen = torch.Generator().manual_seed(zlib.crc32(c.encode()))
            toks.append(torch.randn(self.max_length, self.width, generator=gen))
            n = max(1, min(len(c.split()), self.max_length))
            masks.append(torch.arange(self.max_length) < n)
        tokens = torch.stack(toks)  # [B, L, T]
        mask = torch.stack(masks)  # [B, L]
        pooled = (tokens * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)  # [B, T]
        return TextEmbeddingsLike(tokens, mask, pooled)
