"""safetensors files: the 8-byte length, then the JSON header. Tensor bytes are never read.

A header is accepted exactly where the safetensors crate (0.8: ``SafeTensors::read_metadata`` and
``Metadata::validate`` in safetensors/src/tensor.rs, serde_json underneath) accepts it, and each
tensor is reported with the dtype and shape ``safetensors.torch.load_file`` gives it. A file the crate
opens but torch cannot hold (an F6 dtype, an F4 tensor with an odd last dimension) is refused.
Where JSON readers differ (a name written twice), the file is refused rather than read one way.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from typing import Any

from .. import dtypes
from ..errors import CheckpointError, LimitExceeded
from ..inventory import Inventory, Layout, Span, TensorRecord
from . import locate
from .jsonfile import DuplicateKey, unique_pairs
from .locate import AnyPath
from .remote import RemoteError
from .source import Source

MAX_HEADER_BYTES = 100_000_000
"""The crate's ``MAX_HEADER_SIZE``: a longer header is refused."""
_U64_MAX = (1 << 64) - 1
_I64_MAX = (1 << 63) - 1
_MAX_DEPTH = 127
"""serde_json refuses the 128th nested array or object."""
_FIELDS = ("dtype", "shape", "data_offsets")
_ESCAPED_SURROGATE = re.compile(r"\\u[dD][89abcdefABCDEF]")
_SURROGATE = re.compile("[\ud800-\udfff]")


class _Refused(ValueError):
    """The header is not one the crate accepts; the message says why."""


@dataclass(frozen=True)
class HeaderEntry:
    """One tensor as the header describes it, checked as the crate checks it."""

    name: str
    code: str
    """The header's dtype code (``F32``, ``F4``)."""
    shape: tuple[int, ...]
    """The header's shape (for F4, a count of 4-bit values)."""
    begin: int
    end: int


@dataclass(frozen=True)
class Header:
    """A header the crate accepts."""

    entries: tuple[HeaderEntry, ...]
    """In data order."""
    metadata: dict[str, str]
    start: int
    """Where the data area starts: 8 + the header's length."""


# -- JSON as serde_json reads it ------------------------------------------------------------------


def _parse_int(text: str) -> int | float:
    # serde_json reads -0 and integers beyond i64/u64 as floats, which a usize field then refuses;
    # one beyond f64 is "number out of range" wherever it stands, even in a field the crate ignores.
    if len(text) < 19 and text != "-0":
        return int(text)
    if text == "-0":
        return -0.0
    try:
        value = int(text)
        as_float = float(value)
    except (ValueError, OverflowError):
        raise _Refused("a number in the header is out of range") from None
    return value if -(1 << 63) <= value <= _U64_MAX else as_float


def _parse_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise _Refused("a number in the header is out of range")
    return value


def _parse_constant(text: str) -> Any:
    raise _Refused(f"the header holds {text}, which is not JSON")


def _depth(value: Any) -> int:
    """Nesting depth of arrays and objects (a scalar is 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, level)
        stack.extend((child, level + 1) for child in children)
    return deepest


def _has_surrogate(value: Any) -> bool:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def _loads(text: str) -> Any:
    """JSON as serde_json accepts it: no NaN, no number beyond f64, no lone surrogate escape."""
    # The crate keeps the last of two equal tensor names; other JSON readers keep the first: refused.
    value = json.loads(text, object_pairs_hook=unique_pairs, parse_int=_parse_int, parse_float=_parse_float, parse_constant=_parse_constant)
    # Python decodes a lone surrogate escape (\ud800) to a lone code point; serde_json refuses it.
    if _ESCAPED_SURROGATE.search(text) and _has_surrogate(value):
        raise _Refused("the header holds a lone UTF-16 surrogate escape, which the safetensors crate refuses")
    return value


# -- the header -----------------------------------------------------------------------------------


def _read_header(src: Source) -> tuple[dict[str, Any], int]:
    """The parsed header and the offset where the data area starts: 8 bytes, then the header, nothing else."""
    path = src.name
    size = src.size
    raw = src.read(0, 8)
    if len(raw) < 8:
        raise CheckpointError("file is too short to be safetensors", path=str(path))
    (n,) = struct.unpack("<Q", raw)
    if n > MAX_HEADER_BYTES:
        raise LimitExceeded(f"safetensors header claims {n} bytes, over the {MAX_HEADER_BYTES}-byte cap", path=str(path))
    if n > size - 8:
        raise CheckpointError(
            f"safetensors header claims {n} bytes but the file has {size - 8} after the length (truncated?)", path=str(path)
        )
    text = src.read(8, n)
    try:
        header = _loads(text.decode("utf-8"))
    except UnicodeDecodeError:
        raise CheckpointError("safetensors header is not UTF-8", path=str(path)) from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"safetensors header is not JSON ({exc.msg} at char {exc.pos})", path=str(path)) from None
    except DuplicateKey as exc:
        raise CheckpointError(f"safetensors header names '{exc.key}' twice; readers disagree on which one counts", path=str(path)) from None
    except _Refused as exc:
        raise CheckpointError(f"safetensors header refused: {exc}", path=str(path)) from None
    except RecursionError:
        raise CheckpointError("safetensors header nests too deeply", path=str(path)) from None
    if not isinstance(header, dict):
        raise CheckpointError("safetensors header is not a JSON object", path=str(path))
    return header, 8 + n


def _usize(value: Any) -> bool:
    return type(value) is int and 0 <= value <= _U64_MAX


def _code(name: str, raw: Any, path: str) -> str:
    # serde reads an enum from its name, or from a one-key object whose value is null (a unit variant).
    if isinstance(raw, dict) and len(raw) == 1:
        ((raw, unit),) = raw.items()
        if unit is not None:
            raw = None
    if not isinstance(raw, str) or (raw not in dtypes.SAFETENSORS_CODES and raw not in dtypes.SAFETENSORS_TORCHLESS):
        raise CheckpointError(f"tensor '{name}' has unknown dtype {raw!r}", path=str(path))
    return raw


def _entry(name: str, raw: Any, path: str) -> HeaderEntry:
    if isinstance(raw, list):
        # serde reads a struct from an array of its fields, in order: [dtype, shape, data_offsets].
        if len(raw) != len(_FIELDS):
            raise CheckpointError(f"header entry '{name}' is an array of {len(raw)} items, not 3", path=str(path))
        fields = dict(zip(_FIELDS, raw, strict=True))
    elif isinstance(raw, dict):
        missing = [f for f in _FIELDS if f not in raw]
        if missing:
            raise CheckpointError(f"header entry '{name}' has no {missing[0]}", path=str(path))
        fields = raw
        # Fields the crate does not know are skipped, but still parsed under serde_json's depth limit.
        extra_depth = max((_depth(v) for k, v in raw.items() if k not in _FIELDS), default=0)
        if 2 + extra_depth > _MAX_DEPTH:
            raise CheckpointError(f"header entry '{name}' nests too deeply for the safetensors crate", path=str(path))
    else:
        raise CheckpointError(f"header entry '{name}' is not an object", path=str(path))
    code = _code(name, fields["dtype"], path)
    shape = fields["shape"]
    if not isinstance(shape, list) or not all(_usize(d) for d in shape):
        raise CheckpointError(f"tensor '{name}' has a bad shape {shape!r}", path=str(path))
    offsets = fields["data_offsets"]
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_usize(o) for o in offsets):
        raise CheckpointError(f"tensor '{name}' has bad data_offsets {offsets!r}", path=str(path))
    return HeaderEntry(name, code, tuple(shape), offsets[0], offsets[1])


def _check_size(entry: HeaderEntry, path: str) -> None:
    # The crate multiplies the shape left to right in u64 and refuses on overflow, even when a later 0
    # would make the product 0; then the bits, which must fill whole bytes.
    numel = 1
    for dim in entry.shape:
        numel *= dim
        if numel > _U64_MAX:
            break
    nbits = numel * dtypes.safetensors_bits(entry.code)
    span = entry.end - entry.begin
    if numel > _U64_MAX or nbits > _U64_MAX:
        raise CheckpointError(
            f"tensor '{entry.name}' has a shape {list(entry.shape)} whose size overflows 64 bits; its offsets span {span}",
            path=str(path),
        )
    if nbits % 8:
        raise CheckpointError(
            f"tensor '{entry.name}' is {entry.code}{list(entry.shape)} = {nbits} bits, which do not fill whole bytes", path=str(path)
        )
    if nbits // 8 != span:
        label = dtypes.SAFETENSORS_CODES.get(entry.code, entry.code)
        raise CheckpointError(
            f"tensor '{entry.name}' is {label}{list(entry.shape)} = {nbits // 8} bytes but its offsets span {span}", path=str(path)
        )


def parse(path: AnyPath | Source) -> Header:
    """The header, checked as the crate checks it; CheckpointError where the crate would refuse the file."""
    with locate.opened(path) as src:
        return _parse(src)


def _parse(src: Source) -> Header:
    path = src.name
    header, start = _read_header(src)
    data_size = src.size - start
    metadata = header.pop("__metadata__", None)
    if metadata is not None and (
        not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
    ):
        raise CheckpointError("safetensors __metadata__ must map strings to strings", path=str(path))
    entries = [_entry(name, raw, path) for name, raw in header.items()]
    # Metadata::validate: sorted by offsets, each tensor starts where the one before ended.
    entries.sort(key=lambda e: (e.begin, e.end))
    cursor = 0
    for e in entries:
        if e.end < e.begin:
            raise CheckpointError(f"tensor '{e.name}' has bad data_offsets {[e.begin, e.end]!r}", path=str(path))
        if e.begin < cursor:
            raise CheckpointError(f"tensor '{e.name}' overlaps the tensor before it in the data area", path=str(path))
        if e.begin > cursor:
            raise CheckpointError(f"a gap of {e.begin - cursor} bytes lies before tensor '{e.name}'", path=str(path))
        _check_size(e, path)
        cursor = e.end
    if cursor != data_size:
        what = "trailing bytes" if cursor < data_size else "a data area shorter than the header says (truncated?)"
        raise CheckpointError(f"{what}: header covers {cursor} bytes, the file holds {data_size}", path=str(path))
    return Header(tuple(entries), dict(metadata or {}), start)


def accepts(path: AnyPath | Source) -> bool:
    """Whether ``safetensors.safe_open`` would open the file (whatever torch makes of its dtypes)."""
    try:
        parse(path)
    except RemoteError:
        raise
    except (CheckpointError, OSError):
        return False
    return True


# -- tensors as torch gets them -------------------------------------------------------------------


def _record(entry: HeaderEntry, path: str) -> TensorRecord:
    if entry.code in dtypes.SAFETENSORS_TORCHLESS:
        raise CheckpointError(
            f"tensor '{entry.name}' is {entry.code}, which safetensors can store but torch has no dtype for", path=str(path)
        )
    shape = list(entry.shape)
    if any(d > _I64_MAX for d in shape):
        raise CheckpointError(f"tensor '{entry.name}' has a dimension over 2**63 - 1, which torch cannot hold", path=str(path))
    per_byte = dtypes.SAFETENSORS_PACKED.get(entry.code)
    if per_byte:
        # safetensors' torch binding divides the last dimension by the values per byte, and refuses
        # the tensor when it does not divide evenly.
        if not shape or shape[-1] % per_byte:
            raise CheckpointError(
                f"tensor '{entry.name}' is {entry.code}{shape}: torch's float4_e2m1fn_x2 needs an even last dimension",
                path=str(path),
            )
        shape[-1] //= per_byte
    dtype = dtypes.SAFETENSORS_CODES[entry.code]
    return TensorRecord(name=entry.name, dtype=dtype, shape=tuple(shape), nbytes=entry.end - entry.begin, offset=entry.begin, stride=None)


def read(path: AnyPath | Source, *, file_label: str = "") -> Inventory:
    with locate.opened(path) as src:
        header = _parse(src)
        name = src.name
    tensors = [_record(e, name) for e in header.entries]
    layout = Layout("safetensors", {t.name: Span(header.start + t.offset, t.nbytes) for t in tensors})
    meta: dict[str, object] = {"safetensors_metadata": header.metadata}
    if file_label:
        tensors = [t.with_(file=file_label) for t in tensors]
    return Inventory(name, "safetensors", tuple(tensors), (), meta, layout=layout)
