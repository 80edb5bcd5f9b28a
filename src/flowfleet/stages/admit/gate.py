"""One package against one run: what the checks share (the run, the private copy, what each check found) and the
rule that makes every failure one line: anything a check raises on the package's content becomes
`refused (CHECK): FILE: why`, FILE the file it was reading."""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import Any, Callable, TypeVar

import torch

from flowfleet.config import RunConfig
from flowfleet.data.shards import ShardSet, is_packed, unpack_tokens
from flowfleet.device import resolve_device
from flowfleet.errors import FlowfleetError
from flowfleet.layout import DATA, EVAL_DATA
from flowfleet.models.config import DiTConfig
from flowfleet.stages.admit.formats import FormatError, load_json, load_safetensors
from flowfleet.stages.admit.losses import CONDITION_FIELDS
from flowfleet.stages.admit.refusal import Refused, first_line, shown
from flowfleet.stages.admit.settings import GateSettings
from flowfleet.stages.admit.signature import Signed
from flowfleet.storage import RunRoot

T = TypeVar("T")
CAPTION_MAX_CHARS = 1000  # a caption longer than this is not an emoji's or a digit's (serve's prompt limit)
TEXT_MAX_TOKENS = 1024  # a packed shard's padded text length past this is no text encoder's (CLIP's is 77)


class Gate:
    """The run, the settings, the private copy of the package (`staged`, a folder only the gate writes) and what the
    checks found; `reading`: the package file being read, which a refusal names."""

    def __init__(self, root: RunRoot, cfg: RunConfig, staged: Path, settings: GateSettings):
        self.root, self.cfg, self.staged, self.settings = root, cfg, staged, settings
        self.device = resolve_device(settings.device)
        self.signed: Signed | None = None
        self.expert_cfg: DiTConfig | None = None
        self.tensors: dict[str, torch.Tensor] = {}  # the expert's weights, once `what` has read them
        self.figures: dict[str, float] = {}
        self.grid: bytes | None = None  # the judged comparison's samples (PNG), when a judge read them
        self.reading = "the package"
        self._items: dict[str, tuple[dict[str, torch.Tensor], list[str]]] = {}

    def run(self, check: str, fn: Callable[[], T]) -> T:
        """fn(), its failures on the package's content as one line of `check`. The owner's own errors (a trusted
        keys file that does not read, a run folder that is missing) stay as they are."""
        self.reading = "the package"
        try:
            return fn()
        except FlowfleetError:
            raise
        except Exception as err:  # anything the package's bytes made a parser or a model raise
            raise Refused(check, f"{shown(self.reading)}: {first_line(err)}") from None

    @property
    def sign(self) -> Signed:
        assert self.signed is not None, "who runs first"
        return self.signed

    def staged_root(self) -> RunRoot:
        return RunRoot(str(self.staged))

    # -- the private copy's files --------------------------------------------------------------------

    def json_file(self, rel: str, check: str) -> Any:
        self.reading = rel
        try:
            return load_json((self.staged / rel).read_bytes())
        except FormatError as err:
            raise Refused(check, f"{rel}: {err}") from None

    def items(self, rel: str, check: str = "compatibility") -> tuple[dict[str, torch.Tensor], list[str]]:
        """A package shard (latents.safetensors, heldout.safetensors) of the private copy, read once and checked:
        its header, at most the kit's rows, every field with as many rows as it has captions."""
        if rel not in self._items:
            self.reading = rel
            try:
                tensors, meta = load_safetensors(self.staged / rel)
            except FormatError as err:
                raise Refused(check, f"{rel}: {err}") from None
            if is_packed(tensors):  # text tokens stored unpadded: padded again, once their sizes are bounded
                tensors = self._unpacked(rel, tensors, check)
            self._items[rel] = tensors, self._captions(rel, tensors, meta, check)
        return self._items[rel]

    def _unpacked(self, rel: str, tensors: dict[str, torch.Tensor], check: str) -> dict[str, torch.Tensor]:
        lengths, mask = tensors["text_len"], tensors.get("text_mask")
        length = int(mask.shape[-1]) if mask is not None and mask.ndim else 0
        if not 0 < length <= TEXT_MAX_TOKENS:
            raise Refused(check, f"{rel}: text_mask: a padded text length of {length}, not 1 to {TEXT_MAX_TOKENS}")
        if lengths.ndim == 1 and lengths.shape[0] > self.sign.kit.sample_rows:
            raise Refused(check, f"{rel}: {lengths.shape[0]} items, the kit takes at most {self.sign.kit.sample_rows}")
        try:
            return unpack_tokens(tensors)
        except ValueError as err:
            raise Refused(check, f"{rel}: {err}") from None

    def _captions(self, rel: str, tensors: dict[str, torch.Tensor], meta: dict[str, str], check: str) -> list[str]:
        rows = {name: int(t.shape[0]) if t.ndim else -1 for name, t in tensors.items()}
        counts = set(rows.values())
        if len(counts) != 1:
            raise Refused(check, f"{rel}: its fields disagree on their row count ({shown(rows)})")
        (n,) = counts
        cap = self.sign.kit.sample_rows
        if not 0 <= n <= cap:
            raise Refused(check, f"{rel}: {n} items, the kit takes at most {cap}")
        if "captions" not in meta:
            return [""] * n
        try:
            captions = load_json(meta["captions"].encode(), max_depth=1)
        except FormatError as err:
            raise Refused(check, f"{rel}: captions: {err}") from None
        if not (isinstance(captions, list) and len(captions) == n and all(isinstance(c, str) for c in captions)):
            raise Refused(check, f"{rel}: captions are not {n} texts, one per item")
        if any(len(c) > CAPTION_MAX_CHARS for c in captions):
            raise Refused(check, f"{rel}: a caption over {CAPTION_MAX_CHARS} characters")
        return captions

    # -- the fleet's own ------------------------------------------------------------------------------

    @functools.cached_property
    def fleet_heldout(self) -> dict[str, torch.Tensor]:
        """The fleet's held-out items (eval/, else data/): the fields its models read."""
        folder = EVAL_DATA if self.root.exists(EVAL_DATA) else DATA
        shards = ShardSet(self.root, folder)
        return shards.load(["latents", *CONDITION_FIELDS])

    @functools.cached_property
    def own_rows(self) -> set[str]:
        """The digests of the fleet's own latents (data/), one per item."""
        return {row_digest(row) for row in ShardSet(self.root, DATA).load(["latents"])["latents"]}


def row_digest(row: torch.Tensor) -> str:
    return hashlib.sha256(row.float().contiguous().numpy().tobytes()).hexdigest()
