"""What every source is: an ordered, restartable stream of RawItems, and the one error it raises."""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Iterator

from flowfleet.errors import FlowfleetError


class SourceError(FlowfleetError):
    """A source that cannot be read at all (missing, empty, wrong columns); names the path or field."""


@dataclass
class RawItem:
    """One source item before decoding. `error` is set when the item could not even be read."""

    key: str  # stable name within the source: relative file path, tar member key, row number
    image: Any  # encoded bytes | np.ndarray uint8 [H, W(, C)] | PIL.Image.Image | None
    caption: str | None  # None: the source has no caption for this item
    label: int = -1
    error: str | None = None


class Source(ABC):
    """An ordered, restartable stream of RawItems."""

    kind: str = ""
    has_labels: bool = False
    label_names: tuple[str, ...] | None = None  # what each label means, where the source knows (label i: [i])

    @abstractmethod
    def fingerprint(self) -> dict[str, Any]:
        """What identifies this source's content (names, sizes, seeds), cheap to compute."""

    @abstractmethod
    def items(self, start: int = 0) -> Iterator[RawItem]:
        """Items from position `start` on (positions count every item, readable or not)."""

    def notice(self) -> str | None:
        """The licences and attribution its data asks to be carried with what is made from it (prepare writes it into
        RUN_ROOT/data/NOTICE.md); None when it asks nothing."""
        return None

    def length(self) -> int | None:
        """Number of items (the source's __len__); None when unknown without reading everything (tar streams,
        which define no __len__: Python's len() cannot say "unknown")."""
        return len(self) if hasattr(self, "__len__") else None


def content_digest(parts: list[str]) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode())
        h.update(b"\0")
    return h.hexdigest()[:32]


def open_fs(path: str):
    import fsspec

    try:
        return fsspec.core.url_to_fs(path)
    except (ValueError, ImportError) as err:
        raise SourceError(f"data.path: {path}: {err}") from None
