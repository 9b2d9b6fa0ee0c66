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
from array import array
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from json.decoder import scanstring  # type: ignore[attr-defined]  # typeshed leaves out what the decoder uses
from operator import attrgetter, sub
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
_ONLY_INT = frozenset({int})
_KNOWN_CODES = frozenset(dtypes.SAFETENSORS_CODES) | dtypes.SAFETENSORS_TORCHLESS
_SURROGATE = re.compile("[\ud800-\udfff]")


class _Refused(ValueError):
    """The header is not one the crate accepts; the message says why."""


@dataclass(frozen=True, slots=True)
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
    """A header the crate accepts, as columns in data order (a million entries' objects were a scan's cost)."""

    names: tuple[str, ...]
    codes: tuple[str, ...]
    """The header's dtype codes (``F32``, ``F4``)."""
    shapes: tuple[tuple[int, ...], ...]
    """The header's shapes (for F4, a count of 4-bit values)."""
    begins: array[int]
    ends: array[int]
    """Each tensor's data offsets, relative to the data area."""
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


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``unique_pairs`` where a key repeats (it names the key), else one C call: this runs once per tensor."""
    out = dict(pairs)
    return out if len(out) == len(pairs) else unique_pairs(pairs)


def _loads(text: str) -> Any:
    """JSON as serde_json accepts it: no NaN, no number beyond f64, no lone surrogate escape."""
    # The crate keeps the last of two equal tensor names; other JSON readers keep the first: refused.
    value = json.loads(text, object_pairs_hook=_unique, parse_int=_parse_int, parse_float=_parse_float, parse_constant=_parse_constant)
    # Python decodes a lone surrogate escape (\ud800) to a lone code point; serde_json refuses it.
    if _ESCAPED_SURROGATE.search(text) and _has_surrogate(value):
        raise _Refused("the header holds a lone UTF-16 surrogate escape, which the safetensors crate refuses")
    return value


# -- the header -----------------------------------------------------------------------------------


def _header_text(src: Source) -> tuple[str, int]:
    """The header's text and the offset where the data area starts: 8 bytes, then the header, nothing else."""
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
    try:
        return src.read(8, n).decode("utf-8"), 8 + n  # the bytes freed before parsing: a header may be 100 MB
    except UnicodeDecodeError:
        raise CheckpointError("safetensors header is not UTF-8", path=str(path)) from None


def _read_header(src: Source, text: str) -> dict[str, Any]:
    """The header ``text`` parsed the careful way."""
    path = src.name
    try:
        header = _loads(text)
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
    return header


_WS = r"[ \t\n\r]*"
"""What ``json`` skips between tokens (its ``WHITESPACE``), as serde_json does."""
_WHITESPACE = re.compile(_WS)
_NUMBER = r"(?:0|[1-9][0-9]{0,18})"
"""A JSON integer of at most 19 digits: always a u64 (one of 20 digits is read the careful way)."""
_NAME = r'"([^"\\\x00-\x1f]*(?:\\.[^"\\\x00-\x1f]*)*)"'
_COMPACT_ENTRY = re.compile(
    _NAME + rf':\{{"dtype":"([A-Z0-9_]{{1,16}})","shape":\[([0-9,]*)\],"data_offsets":\[({_NUMBER}),({_NUMBER})\]\}}([,}}])'
)
"""One tensor entry as the crate writes it (fields in its order, no whitespace), with the name, the code, the shape's
text (checked by ``_shape_and_bytes``), the offsets and the separator after it: ``,`` or the header's closing ``}``."""
_SPACED_ENTRY = re.compile(
    _WS
    + _NAME
    + rf'{_WS}:{_WS}\{{{_WS}"dtype"{_WS}:{_WS}"([A-Z0-9_]{{1,16}})"{_WS},{_WS}"shape"{_WS}:{_WS}\[([0-9, \t\n\r]*)\]{_WS},'
    + rf'{_WS}"data_offsets"{_WS}:{_WS}\[{_WS}({_NUMBER}){_WS},{_WS}({_NUMBER}){_WS}\]{_WS}\}}{_WS}([,}}])'
)
"""``_COMPACT_ENTRY`` with whitespace between its tokens (``json.dumps``' default spacing), tried where that fails."""
_SHAPE_TEXT = re.compile(rf"{_WS}(?:{_NUMBER}{_WS}(?:,{_WS}{_NUMBER}{_WS})*)?")
_OPEN = re.compile(rf"{_WS}\{{{_WS}")
_METADATA_NAME = re.compile(rf'{_WS}"__metadata__"{_WS}:{_WS}')
_AFTER_VALUE = re.compile(rf"{_WS}([,}}])")
_CACHED_SHAPES = 4096
"""At most this many shapes' texts remembered per header, parsed with their sizes in bytes by code."""


def _quick(src: Source, text: str, start: int) -> Header:
    """The header read entry by entry with one pattern (``_COMPACT_ENTRY``, the form the crate writes), each
    checked as it is read, and never held parsed as a whole. Anything else (another field order, a name twice, a
    20-digit number, an escape it cannot decode, a lone surrogate escape, offsets not in data order or not the size
    their shapes say) raises ``_NotQuick``: the careful reading then refuses or accepts it, and says why."""
    if _ESCAPED_SURROGATE.search(text):
        raise _NotQuick("a surrogate escape")
    opened = _OPEN.match(text)
    if opened is None:
        raise _NotQuick("not an object")
    at = opened.end()
    names: list[str] = []
    codes: list[str] = []
    shapes: list[tuple[int, ...]] = []
    begins = array("Q")
    ends = array("Q")
    metadata: Any = None
    metadata_seen = False
    seen_shapes: dict[tuple[str, str], tuple[tuple[int, ...], int]] = {}
    compact, spaced = _COMPACT_ENTRY.match, _SPACED_ENTRY.match
    cursor = 0
    if text.startswith("}", at):
        at += 1
    else:
        while True:
            m = compact(text, at) or spaced(text, at)
            if m is None:
                named = _METADATA_NAME.match(text, at)
                if named is None or metadata_seen:  # ``"__metadata__": null`` twice is a name twice too
                    raise _NotQuick("not the usual entry")
                metadata_seen = True
                metadata, at = _METADATA_SCAN(text, named.end())
                after = _AFTER_VALUE.match(text, at)
                if after is None:
                    raise _NotQuick("',' expected")
                at, sep = after.end(), after.group(1)
            else:
                name, code, shape_text, begin_text, end_text, sep = m.groups()
                at = m.end()
                if "\\" in name:
                    name = scanstring(text, m.start(1), True)[0]
                known = seen_shapes.get((code, shape_text))
                if known is None:
                    known = _shape_and_bytes(code, shape_text)
                    if len(seen_shapes) < _CACHED_SHAPES:
                        seen_shapes[code, shape_text] = known
                begin, end = int(begin_text), int(end_text)
                if begin != cursor or end - begin != known[1]:
                    raise _NotQuick("offsets not in data order, or not the size the shape says")
                cursor = end
                names.append(name)
                codes.append(code)
                shapes.append(known[0])
                begins.append(begin)
                ends.append(end)
            if sep == "}":
                break
    if _WHITESPACE.match(text, at).end() != len(text):  # type: ignore[union-attr]  # matches everywhere
        raise _NotQuick("trailing data")
    if cursor != src.size - start or len(set(names)) != len(names) or "__metadata__" in names:
        raise _NotQuick("a name twice, a tensor called __metadata__, or data the header does not cover")
    _check_metadata(metadata, src.name)
    return Header(tuple(names), tuple(codes), tuple(shapes), begins, ends, dict(metadata or {}), start)


def _shape_and_bytes(code: str, shape_text: str) -> tuple[tuple[int, ...], int]:
    """The shape a quick entry's text gives and the bytes the crate takes its code and shape to need; ``_NotQuick``
    where the careful reading is the one to judge (an unknown code, a size beyond u64, bits that do not fill bytes)."""
    if not _SHAPE_TEXT.fullmatch(shape_text):
        raise _NotQuick("a shape the careful reading judges")
    shape = tuple(map(int, shape_text.split(","))) if shape_text.strip() else ()
    bits = _BITS.get(code)
    numel = 1
    for dim in shape:  # as ``_check_size``: the crate's product, left to right, refused where one overflows
        numel *= dim
        if numel > _U64_MAX:
            raise _NotQuick("a size the careful reading refuses")
    if bits is None or numel * bits > _U64_MAX or numel * bits % 8:
        raise _NotQuick("an entry the careful reading judges")
    return shape, numel * bits // 8


_METADATA_SCAN = json.JSONDecoder(
    object_pairs_hook=_unique, parse_int=_parse_int, parse_float=_parse_float, parse_constant=_parse_constant
).scan_once  # type: ignore[attr-defined]
"""The C scanner json.loads runs, with the careful reading's hooks: for ``__metadata__``, the one value not a tensor."""


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


class _NotQuick(ValueError):
    """A header read the quick way (``_quick``) is not the plain form, or holds an entry that is not the usual kind."""


def _entry(name: str, raw: Any, path: str) -> HeaderEntry:
    if type(raw) is dict and len(raw) == 3:
        # The usual entry, checked in a few C calls: exactly the three fields (so nothing else to parse for
        # depth), a known code, usize lists. Anything else takes the full path below, which says what is wrong.
        code, shape, offsets = raw.get("dtype"), raw.get("shape"), raw.get("data_offsets")
        if type(code) is str and code in _KNOWN_CODES and type(shape) is list and type(offsets) is list and len(offsets) == 2:
            numbers = shape + offsets  # ``_usizes`` of both at once: this runs once per tensor
            if _ONLY_INT.issuperset(map(type, numbers)) and min(numbers) >= 0 and max(numbers) <= _U64_MAX:
                return HeaderEntry(name, code, tuple(shape), offsets[0], offsets[1])
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


_PLAIN_CODES = {code: dtype for code, dtype in dtypes.SAFETENSORS_CODES.items() if code not in dtypes.SAFETENSORS_PACKED}
"""Codes whose header shape is torch's shape."""
_BITS = {code: dtypes.safetensors_bits(code) for code in _KNOWN_CODES}


def _check_size(entry: HeaderEntry, path: str) -> None:
    # The crate multiplies the shape left to right in u64 and refuses on overflow, even when a later 0
    # would make the product 0; then the bits, which must fill whole bytes. Without a 0, no partial product
    # exceeds the whole one, so that one product says whether any overflows.
    numel = math.prod(entry.shape)
    if numel == 0:
        numel = 1
        for dim in entry.shape:
            numel *= dim
            if numel > _U64_MAX:
                break
    nbits = numel * _BITS[entry.code]
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
    # First the quick way (``_quick``: one pattern per entry, integers of at most 19 digits, offsets in data order);
    # where that header is not accepted as it stands, again the careful way, whose refusal is the one reported. The
    # quick way accepts only headers the careful way reads alike: its numbers are usizes by their pattern, its
    # entries have exactly the three fields, and the metadata is read with the careful way's hooks.
    text, start = _header_text(src)  # read once: a remote header's bytes are fetched once, and counted once
    try:
        return _quick(src, text, start)
    except (CheckpointError, ValueError, RecursionError, StopIteration):
        pass
    header = _read_header(src, text)
    del text  # the parsed header and its text are not held together longer than they must be
    metadata = header.pop("__metadata__", None)
    _check_metadata(metadata, src.name)
    # each raw entry dropped as soon as it is checked: the parsed JSON and the entries are never held whole together
    entries = [_entry(name, header.pop(name), src.name) for name in list(header)]
    return _validated(src, entries, metadata, start)


def _check_metadata(metadata: Any, path: str) -> None:
    if metadata is not None and (
        not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
    ):
        raise CheckpointError("safetensors __metadata__ must map strings to strings", path=str(path))


def _validated(src: Source, entries: list[HeaderEntry], metadata: dict[str, str] | None, start: int) -> Header:
    path = src.name
    data_size = src.size - start
    # Metadata::validate: sorted by offsets, each tensor starts where the one before ended.
    entries.sort(key=attrgetter("begin", "end"))
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
    return Header(
        tuple(e.name for e in entries),
        tuple(e.code for e in entries),
        tuple(e.shape for e in entries),
        array("Q", [e.begin for e in entries]),
        array("Q", [e.end for e in entries]),
        dict(metadata or {}),
        start,
    )


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


def _unusual_record(entry: HeaderEntry, path: str, file: str) -> TensorRecord:
    """The record of an entry ``_records`` does not make itself: a code torch has no dtype for, a dimension beyond
    i64, or a packed code (F4)."""
    nbytes = entry.end - entry.begin
    shape = entry.shape
    if entry.code in dtypes.SAFETENSORS_TORCHLESS:
        raise CheckpointError(
            f"tensor '{entry.name}' is {entry.code}, which safetensors can store but torch has no dtype for", path=str(path)
        )
    if any(d > _I64_MAX for d in shape):
        raise CheckpointError(f"tensor '{entry.name}' has a dimension over 2**63 - 1, which torch cannot hold", path=str(path))
    # F4: safetensors' torch binding divides the last dimension by the values per byte, and refuses the tensor
    # when it does not divide evenly.
    per_byte = dtypes.SAFETENSORS_PACKED[entry.code]
    if not shape or shape[-1] % per_byte:
        raise CheckpointError(
            f"tensor '{entry.name}' is {entry.code}{list(shape)}: torch's float4_e2m1fn_x2 needs an even last dimension",
            path=str(path),
        )
    dtype = dtypes.SAFETENSORS_CODES[entry.code]
    return TensorRecord(entry.name, dtype, (*shape[:-1], shape[-1] // per_byte), nbytes, file=file, offset=entry.begin)


class _Spans(Mapping[str, Span]):
    """Tensor name -> where its bytes lie, held in two arrays rather than a ``Span`` each (a million-tensor header's
    spans took a tenth of its scan's memory); looked up by name only by conversion, which makes the index then."""

    __slots__ = ("_names", "_offsets", "_lengths", "_index")

    def __init__(self, names: tuple[str, ...], offsets: array[int], lengths: array[int]) -> None:
        self._names = names
        self._offsets = offsets
        self._lengths = lengths
        self._index: dict[str, int] | None = None

    def __getitem__(self, name: str) -> Span:
        if self._index is None:
            self._index = {n: i for i, n in enumerate(self._names)}
        i = self._index[name]
        return Span(self._offsets[i], self._lengths[i])

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __reduce__(self) -> tuple[object, ...]:
        return _Spans, (self._names, self._offsets, self._lengths)

    def __repr__(self) -> str:
        return repr(dict(self))


def read(path: AnyPath | Source, *, file_label: str = "") -> Inventory:
    with locate.opened(path) as src:
        header = _parse(src)
        name = src.name
    tensors = _records(header, name, file_label)
    spans = _Spans(header.names, array("Q", map(header.start.__add__, header.begins)), array("Q", map(sub, header.ends, header.begins)))
    layout = Layout("safetensors", spans)
    meta: dict[str, object] = {"safetensors_metadata": header.metadata}
    return Inventory(name, "safetensors", tensors, (), meta, layout=layout)


def _records(header: Header, path: str, file: str) -> tuple[TensorRecord, ...]:
    plain = _PLAIN_CODES
    out = []
    for name, code, shape, begin, end in zip(header.names, header.codes, header.shapes, header.begins, header.ends, strict=True):
        dtype = plain.get(code)
        if dtype is not None and (not shape or max(shape) <= _I64_MAX):  # nearly every tensor
            out.append(TensorRecord(name, dtype, shape, end - begin, "unknown", file, None, begin))
        else:
            out.append(_unusual_record(HeaderEntry(name, code, shape, begin, end), path, file))
    return tuple(out)
