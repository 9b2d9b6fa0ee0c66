"""safetensors files: the 8-byte length, then the JSON header. Tensor bytes are never read.

The header is validated as strictly as the format's own reader: known dtypes, byte lengths that
match dtype x shape, offsets that tile the data area with no gap, overlap or trailing bytes.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

from .. import dtypes
from ..errors import CheckpointError, LimitExceeded
from ..inventory import Inventory, TensorRecord
from .jsonfile import DuplicateKey, loads_unique

MAX_HEADER_BYTES = 100_000_000


def read_header(path: Path) -> tuple[dict[str, Any], int]:
    """The parsed header and the offset where the data area starts."""
    size = path.stat().st_size
    with path.open("rb") as fh:
        raw = fh.read(8)
        if len(raw) < 8:
            raise CheckpointError("file is too short to be safetensors", path=str(path))
        (n,) = struct.unpack("<Q", raw)
        if n > MAX_HEADER_BYTES:
            raise LimitExceeded(f"safetensors header claims {n} bytes, over the {MAX_HEADER_BYTES}-byte cap", path=str(path))
        if n > size - 8:
            raise CheckpointError(
                f"safetensors header claims {n} bytes but the file has {size - 8} after the length (truncated?)", path=str(path)
            )
        text = fh.read(n)
    try:
        header = loads_unique(text.decode("utf-8"))
    except UnicodeDecodeError:
        raise CheckpointError("safetensors header is not UTF-8", path=str(path)) from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"safetensors header is not JSON ({exc.msg} at char {exc.pos})", path=str(path)) from None
    except DuplicateKey as exc:
        raise CheckpointError(f"safetensors header names '{exc.key}' twice", path=str(path)) from None
    except RecursionError:
        raise CheckpointError("safetensors header nests too deeply", path=str(path)) from None
    if not isinstance(header, dict):
        raise CheckpointError("safetensors header is not a JSON object", path=str(path))
    return header, 8 + n


def read(path: Path, *, file_label: str = "") -> Inventory:
    header, start = read_header(path)
    data_size = path.stat().st_size - start
    metadata = header.pop("__metadata__", None)
    if metadata is not None and (
        not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
    ):
        raise CheckpointError("safetensors __metadata__ must map strings to strings", path=str(path))
    spans: list[tuple[int, int, str]] = []
    tensors: list[TensorRecord] = []
    for name, entry in header.items():
        tensors.append(_entry(path, name, entry, spans))
    spans.sort()
    cursor = 0
    for begin, end, name in spans:
        if begin < cursor:
            raise CheckpointError(f"tensor '{name}' overlaps the tensor before it in the data area", path=str(path))
        if begin > cursor:
            raise CheckpointError(f"a gap of {begin - cursor} bytes lies before tensor '{name}'", path=str(path))
        cursor = end
    if cursor != data_size:
        what = "trailing bytes" if cursor < data_size else "a data area shorter than the header says (truncated?)"
        raise CheckpointError(f"{what}: header covers {cursor} bytes, the file holds {data_size}", path=str(path))
    tensors.sort(key=lambda t: t.offset)
    meta: dict[str, object] = {"safetensors_metadata": dict(metadata or {})}
    if file_label:
        tensors = [t.with_(file=file_label) for t in tensors]
    return Inventory(str(path), "safetensors", tuple(tensors), (), meta)


def _entry(path: Path, name: str, entry: Any, spans: list[tuple[int, int, str]]) -> TensorRecord:
    if not isinstance(entry, dict):
        raise CheckpointError(f"header entry '{name}' is not an object", path=str(path))
    code = entry.get("dtype")
    dtype = dtypes.SAFETENSORS_CODES.get(code) if isinstance(code, str) else None
    if dtype is None:
        raise CheckpointError(f"tensor '{name}' has unknown dtype {code!r}", path=str(path))
    shape = entry.get("shape")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise CheckpointError(f"tensor '{name}' has a bad shape {shape!r}", path=str(path))
    offsets = entry.get("data_offsets")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offsets)
        or offsets[1] < offsets[0]
    ):
        raise CheckpointError(f"tensor '{name}' has bad data_offsets {offsets!r}", path=str(path))
    numel = math.prod(shape)
    nbytes = numel * dtypes.get(dtype).itemsize
    if nbytes != offsets[1] - offsets[0]:
        raise CheckpointError(
            f"tensor '{name}' is {dtype}{shape} = {nbytes} bytes but its offsets span {offsets[1] - offsets[0]}", path=str(path)
        )
    spans.append((offsets[0], offsets[1], name))
    return TensorRecord(name=name, dtype=dtype, shape=tuple(shape), nbytes=nbytes, offset=offsets[0], stride=None)
