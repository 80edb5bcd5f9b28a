"""Text embeddings of prompts: each distinct prompt encoded once, alone, and kept for the next call.

    prompts = PromptEmbeddings(text_encoder)
    emb = prompts(["a handwritten digit seven"] * 32 + ["a handwritten digit one"])   # 2 encoder passes
    emb = prompts(["a handwritten digit seven"])                                       # none

Alone: a text encoder pads a batch to its longest caption, and a caption's embedding can move in the last float
bit with the length of its batch-mates; encoded alone, a prompt's embedding, and so every image drawn from it, is
a function of the prompt only, whatever else is sampled beside it (a served request batched with others). Kept:
a server sees the same prompts again and again, and an evaluation cycles through ten; the encoder runs once per
prompt (the `size` most recently used are kept).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Sequence

import torch

from flowfleet.data.encoders import TextEmbeddings


class PromptEmbeddings:
    def __init__(self, encoder: Any, size: int = 1024):
        """encoder: a text encoder (`.encode(captions) -> TextEmbeddings`, docs/contracts.md)."""
        self.encoder = encoder
        self.size = size
        self._kept: OrderedDict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = OrderedDict()
        self._lock = threading.Lock()  # a server's page and API threads may encode at once
        self.encoded = 0  # encoder passes so far (one per prompt not kept)

    def __call__(self, prompts: Sequence[str]) -> TextEmbeddings:
        """Embeddings of `prompts` in order: tokens [P, L, T], mask [P, L], pooled [P, T]."""
        rows = [self._one(p) for p in prompts]
        tokens, mask, pooled = (torch.stack([r[i] for r in rows]) for i in range(3))
        return TextEmbeddings(tokens, mask, pooled)

    def _one(self, prompt: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        with self._lock:
            if prompt in self._kept:
                self._kept.move_to_end(prompt)
                return self._kept[prompt]
            emb = self.encoder.encode([prompt])
            self.encoded += 1
            row = (emb.tokens[0], emb.mask[0], emb.pooled[0])  # [L, T], [L], [T]
            self._kept[prompt] = row
            if len(self._kept) > self.size:
                self._kept.popitem(last=False)
            return row
