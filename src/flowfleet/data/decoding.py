"""A source's items decoded for encoding, the bad ones counted: what prepare and the encoders beside the
autoencoder's training (flowfleet.stages.prepare_beside) both read, item for item the same.

Bad input never stops a run: an unreadable image is skipped and listed (key + reason, by source position), a missing
caption becomes "" and is counted (BadInput, which prepare's manifest records).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from flowfleet.data.images import ImageDecodeError, open_image, to_tensor
from flowfleet.data.sources import RawItem

MAX_LISTED = 1000  # skipped items listed by key in the manifest (all are counted)


@dataclass
class BadInput:
    """Skipped items and missing captions: what the manifest says up to `start`, plus what this run saw
    (by source position, so that a shard's manifest counts exactly the items before its end)."""

    listed: list[dict[str, Any]]  # {"key", "reason", "pos"}, at most MAX_LISTED
    skipped_before: int
    missing_before: int
    skipped_pos: list[int] = field(default_factory=list)
    missing_pos: list[int] = field(default_factory=list)

    def skip(self, key: str, reason: str, pos: int) -> None:
        self.skipped_pos.append(pos)
        if len(self.listed) < MAX_LISTED:
            self.listed.append({"key": key, "reason": reason, "pos": pos})

    def positions(self) -> dict[str, Any]:
        """What `prepare --merge` needs of a part: every skipped item and missing caption by position."""
        return {"skipped": self.listed, "skipped_pos": self.skipped_pos, "missing_pos": self.missing_pos}

    def record(self, end: int | None = None) -> dict[str, Any]:
        """Manifest keys for the items before source position `end` (all when None)."""
        before = (lambda p: p < end) if end is not None else (lambda p: True)  # noqa: E731
        return {
            "skipped": [s for s in self.listed if before(s["pos"])],
            "skipped_count": self.skipped_before + sum(map(before, self.skipped_pos)),
            "missing_captions": self.missing_before + sum(map(before, self.missing_pos)),
        }


def decode_items(
    items: Iterator[RawItem], start: int, size: int, channels: int, bad: BadInput, labels: list[int] | None = None
) -> Iterator[tuple[int, torch.Tensor, str, int]]:
    """(source position after the item, image [C, S, S], caption, label) for every usable item (with
    `labels`, only the items of those labels: the others are passed over, not counted as bad)."""
    for pos, item in enumerate(items, start):
        if labels is not None and item.label not in labels:
            continue
        if item.error is None:
            try:
                image = to_tensor(open_image(item.image), size, channels)
            except ImageDecodeError as err:
                item.error = str(err)
        if item.error is not None:
            bad.skip(item.key, item.error, pos)
            continue
        caption = (item.caption or "").strip()
        if not caption:
            bad.missing_pos.append(pos)
        yield pos + 1, image, caption, item.label
