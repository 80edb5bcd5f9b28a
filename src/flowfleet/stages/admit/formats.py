"""What the gate parses of a stranger's bytes, bounded before it is parsed: JSON of bounded nesting, and safetensors
files whose header is read, bounded and checked (every tensor's dtype, shape and offsets within the file, none
overlapping) before a tensor is.

Written here rather than left to json and safetensors because both trust their input's shape: json recurses once
per level of nesting (a deep one is a RecursionError), and a safetensors header's offsets are checked only as a
tensor is loaded. The gate must refuse such input in one line, at a cost bounded by its size caps.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

MAX_DEPTH = 32  # nesting of any JSON the gate reads (a manifest's is 3, a config.json's 2)
HEADER_MAX_BYTES = 1 << 20  # a safetensors header above this is not an expert's (its captions included)
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


class FormatError(ValueError):
    """Bytes that are not what their name says, in one line (the caller names the file and the check)."""


def nesting_depth(text: str) -> int:
    """The deepest nesting of [ and { in a JSON text, outside its strings (a scan of its characters, no recursion)."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def load_json(blob: bytes, max_depth: int = MAX_DEPTH) -> Any:
    """JSON of at most max_depth levels, as UTF-8 text; FormatError otherwise."""
    try:
        text = blob.decode("utf-8")
    except UnicodeDecodeError:
        raise FormatError("not UTF-8 text") from None
    depth = nesting_depth(text)
    if depth > max_depth:
        raise FormatError(f"JSON nested {depth} levels deep, at most {max_depth}")
    try:
        return json.loads(text)
    except ValueError as err:
        raise FormatError(f"not JSON ({err})") from None


def safetensors_header(path: Path) -> dict[str, Any]:
    """A safetensors file's header, checked: its length within the file and HEADER_MAX_BYTES, bounded JSON, every
    tensor a known dtype whose shape's bytes are its [begin, end) offsets, every offset within the data and no two
    tensors overlapping. -> {name: {dtype, shape, data_offsets}, "__metadata__": {...}}."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < length <= min(HEADER_MAX_BYTES, size - 8):
            raise FormatError("not a safetensors file (no header of a plausible length)")
        header = load_json(f.read(length), max_depth=4)
    if not isinstance(header, dict):
        raise FormatError("not a safetensors file (its header is not a JSON object)")
    data = size - 8 - length
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            if not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values()):
                raise FormatError("__metadata__ is not a map of strings")
            continue
        spans.append(_span(name, info, data))
    spans.sort()
    for (_, e0, n0), (b1, _, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise FormatError(f"tensors {n0!r} and {n1!r} overlap in the file")
    return header


def _span(name: str, info: Any, data: int) -> tuple[int, int, str]:
    """A tensor entry's [begin, end) within `data` bytes, checked against its dtype and shape."""
    if not isinstance(info, dict):
        raise FormatError(f"tensor {name!r}: not an entry")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in DTYPE_BYTES:
        raise FormatError(f"tensor {name!r}: dtype {dtype!r} is not one the gate reads")
    if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
        raise FormatError(f"tensor {name!r}: shape {shape!r} is not a list of sizes")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(isinstance(o, int) for o in offsets):
        raise FormatError(f"tensor {name!r}: data_offsets {offsets!r} is not [begin, end]")
    begin, end = offsets
    if not 0 <= begin <= end <= data:
        raise FormatError(f"tensor {name!r}: data_offsets {offsets} run outside the file's {data} data bytes")
    if end - begin != math.prod(shape) * DTYPE_BYTES[dtype]:
        raise FormatError(f"tensor {name!r}: {end - begin} bytes for a {dtype} tensor of shape {shape}")
    return begin, end, name


def load_safetensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A checked safetensors file's tensors and metadata (safetensors_header first: nothing is read before)."""
    header = safetensors_header(path)
    return safetensors.torch.load_file(str(path)), dict(header.get("__metadata__") or {})
