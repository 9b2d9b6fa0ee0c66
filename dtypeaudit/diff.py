"""``diff A B``: what changed between two checkpoints' tensors: names, dtypes, shapes, values and ties.

Names are matched after a wrapper prefix (``module.``, ``_orig_mod.``, ``state_dict.``,
``model_state_dict.`` ...) is taken off either side, so a DataParallel or ``torch.compile`` state_dict
matches the plain one. Values are compared from the bytes the readers located (``Inventory.layout``),
through mmap a chunk at a time: by default the CRC-32 of each tensor's elements in C order, so views
and ties compare by what they hold, not how they are stored; with a tolerance, by the largest absolute
difference (numpy; bfloat16 and float8 decoded from their bits). Nothing here imports torch.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Iterable, Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, Literal

from . import dtypes
from .inventory import Format, Inventory, TensorRecord, unique_tensors
from .structure import WRAPPER_PREFIXES

CHUNK_ELEMENTS = 1 << 20
"""Elements compared at a time: memory stays bounded by a chunk, whatever the tensor's size."""

ValueState = Literal["equal", "differ", "unknown"]


@dataclass(frozen=True)
class Values:
    """How two tensors' values compare."""

    state: ValueState
    """``equal`` (same bytes, or within the tolerance), ``differ``, or ``unknown`` (not compared)."""
    max_abs_diff: float | None = None
    """The largest absolute difference, where it was measured (values that differ, or any under a tolerance)."""
    reason: str = ""
    """Why the values were not compared, for ``unknown``."""


@dataclass(frozen=True)
class Change:
    """One tensor in both checkpoints whose dtype, shape or values differ."""

    name: str
    """The name both sides share once their wrapper prefix is off."""
    before: TensorRecord
    after: TensorRecord
    values: Values | None = None
    """None when values were not asked for (``--no-values``) or cannot compare (the shape changed)."""

    @property
    def dtype_changed(self) -> bool:
        return self.before.dtype != self.after.dtype

    @property
    def shape_changed(self) -> bool:
        return self.before.shape != self.after.shape

    @property
    def values_differ(self) -> bool:
        return self.values is not None and self.values.state == "differ"


@dataclass(frozen=True)
class TieChange:
    """Tensors that share one storage on one side and not on the other."""

    names: tuple[str, ...]
    broken: bool
    """True: one storage in A, not in B (a tie broken); False: a tie created in B."""
    views: bool = False
    """True when they view their storage in different ways (slices, transposes), not as one tensor."""


@dataclass(frozen=True)
class InventoryDiff:
    a: Inventory
    b: Inventory
    added: tuple[TensorRecord, ...]
    """Only in B, under their matched names."""
    removed: tuple[TensorRecord, ...]
    """Only in A, under their matched names."""
    changed: tuple[Change, ...]
    """In both, with a dtype, shape or values that differ; A's order."""
    ties: tuple[TieChange, ...] = ()
    prefix_a: str = ""
    """The wrapper prefix taken off A's names to match them ("" for none)."""
    prefix_b: str = ""
    tolerance: float | None = None
    """Values within this absolute difference are equal; None: equal means the same bytes."""
    compared: tuple[Change, ...] = ()
    """Every tensor in both whose values were compared, equal ones included (same dtype and shape, or any under a tolerance)."""
    not_compared: tuple[Change, ...] = ()
    """Tensors in both whose values could not be compared, with the reason."""
    values_read: bool = True
    """False under ``--no-values``: names, dtypes, shapes and ties only."""

    @property
    def differs(self) -> bool:
        return bool(self.added or self.removed or self.changed or self.ties)

    @property
    def bytes_before(self) -> int:
        return sum(t.nbytes for t in unique_tensors(self.a.tensors))

    @property
    def bytes_after(self) -> int:
        return sum(t.nbytes for t in unique_tensors(self.b.tensors))

    @property
    def max_equal_diff(self) -> float:
        """The largest difference among tensors found equal within the tolerance."""
        found = [c.values.max_abs_diff for c in self.compared if c.values and c.values.state == "equal" and c.values.max_abs_diff]
        return max(found, default=0.0)


# -- names ----------------------------------------------------------------------------------------


def wrapper_chain(names: Iterable[str]) -> list[str]:
    """The wrapper prefixes every one of ``names`` starts with, shortest first, "" included."""
    names = list(names)
    chain = [""]
    while names:
        prefix = chain[-1]
        head = names[0][len(prefix) :].split(".", 1)[0] + "."
        if head not in WRAPPER_PREFIXES or not all(n.startswith(prefix + head) and len(n) > len(prefix + head) for n in names):
            break
        chain.append(prefix + head)
    return chain


def _strip(names: Sequence[str], prefix: str) -> dict[str, str] | None:
    """Matched name -> original, with ``prefix`` off the names that carry it; None if two names collide."""
    out: dict[str, str] = {}
    for n in names:
        key = n[len(prefix) :] if prefix and n.startswith(prefix) else n
        if key in out:
            return None
        out[key] = n
    return out


def prefix_pairs(a: Inventory, b: Inventory, tried: int = 4) -> list[tuple[str, str]]:
    """Prefix pairs to take off A's and B's names: wrapper chains on each side, and the rewrites ``scan --model``
    accepts between the two (``formats.factory.match_names``), such as a LightningModule's ``state_dict.net.``
    against a bare state_dict, tried both ways round."""
    from .formats.factory import match_names as model_match

    pairs = [
        (pa, pb)
        for pa in wrapper_chain(t.name for t in a.tensors if t.region == "model")
        for pb in wrapper_chain(t.name for t in b.tensors if t.region == "model")
    ]
    model_a = Inventory(a.path, a.format, tuple(t for t in a.tensors if t.region == "model"))
    model_b = Inventory(b.path, b.format, tuple(t for t in b.tensors if t.region == "model"))
    pairs += [(p, q) for p, q, _, same in model_match(model_a, model_b).prefixes[:tried] if same]
    pairs += [(q, p) for p, q, _, same in model_match(model_b, model_a).prefixes[:tried] if same]
    return list(dict.fromkeys(pairs))


def match_names(a: Inventory, b: Inventory) -> tuple[str, str, dict[str, str], dict[str, str]]:
    """The prefixes to take off A's and B's names (the pair that matches the most names, the least stripped
    on a tie) and, for each side, matched name -> original name. Names without the prefix keep theirs."""
    a_names, b_names = [t.name for t in a.tensors], [t.name for t in b.tensors]
    best: tuple[int, int, str, str, dict[str, str], dict[str, str]] | None = None
    for pa, pb in prefix_pairs(a, b):
        ka, kb = _strip(a_names, pa), _strip(b_names, pb)
        if ka is None or kb is None:
            continue
        score = (len(ka.keys() & kb.keys()), -(pa.count(".") + pb.count(".")))
        if best is None or score > best[:2]:
            best = (*score, pa, pb, ka, kb)
    if best is None:  # only when a name collides with itself stripped, which no "" prefix does
        raise AssertionError("no prefix pair")
    return best[2], best[3], best[4], best[5]


# -- tensor bytes ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class _File:
    buffer: Any
    storages: dict[str, tuple[int, int]]
    big_endian: bool


class TensorBytes:
    """The elements of one checkpoint's tensors, read through mmap where its reader's layout says they lie."""

    def __init__(self, inv: Inventory, stack: ExitStack) -> None:
        self.inv = inv
        self._stack = stack
        self._files: dict[str, _File | str] = {}
        self._crcs: dict[tuple[object, ...], int] = {}

    def _file(self, label: str) -> _File | str:
        if label not in self._files:
            self._files[label] = self._open(label)
        return self._files[label]

    def _open(self, label: str) -> _File | str:
        inv = self.inv
        if inv.format == Format.HF_DIRECTORY:
            from .formats import directory, read_checkpoint

            root = Path(inv.path)
            inv = read_checkpoint(directory.confine(root, label, origin=root))
        if inv.layout is None:
            return f"the {inv.format} reader does not locate tensor bytes"
        path = Path(inv.path)
        with path.open("rb") as fh:
            size = path.stat().st_size
            buffer = self._stack.enter_context(mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)) if size else b""
        return _File(buffer, dict(inv.layout.storages), inv.metadata.get("byteorder", "little") == "big")

    def why_not(self, t: TensorRecord) -> str | None:
        """Why ``t``'s values cannot be read, or None."""
        if t.layout != "strided":
            return f"{t.layout} tensor"
        if not t.numel:
            return None  # nothing to read
        f = self._file(t.file)
        if isinstance(f, str):
            return f
        span = f.storages.get(t.storage if t.storage is not None else t.name)
        if span is None:
            return "its bytes were not located"
        if (_first(t) + _extent(t) + 1) * dtypes.get(t.dtype).itemsize > span[1]:
            return "the view reaches past its storage"
        return None

    def _place(self, t: TensorRecord) -> tuple[_File, int, int, int]:
        """(file, where the first element lies, the itemsize, the word a byte swap works on)."""
        f = self._file(t.file)
        assert isinstance(f, _File)
        dt = dtypes.get(t.dtype)
        offset, _ = f.storages[t.storage if t.storage is not None else t.name]
        word = dt.itemsize // 2 if dt.family == "complex" else dt.itemsize
        return f, offset + _first(t) * dt.itemsize, dt.itemsize, word

    def words(self, t: TensorRecord, step: int = CHUNK_ELEMENTS) -> Iterator[Any]:
        """``t``'s elements in C order as little-endian unsigned words (two per complex element), ``step`` elements a chunk."""
        import numpy as np

        if not t.numel:
            return
        f, start, itemsize, word = self._place(t)
        per = itemsize // word
        kind = np.dtype(f"{'>' if f.big_endian else '<'}u{word}")
        if _contiguous(t):
            for first in range(0, t.numel, step):
                count = min(step, t.numel - first)
                raw = np.frombuffer(f.buffer, kind, count * per, start + first * itemsize)
                yield raw.astype(kind.newbyteorder("<")) if f.big_endian else raw
            return
        # A strided view: gathered whole (it costs its own size, as conversion's gathering does).
        flat = np.frombuffer(f.buffer, np.dtype(f"V{itemsize}"), _extent(t) + 1, start)
        strides = [s * itemsize for s in t.stride or ()]
        gathered = np.ascontiguousarray(np.lib.stride_tricks.as_strided(flat, t.shape, strides, writeable=False)).reshape(-1)
        raw = gathered.view(kind)
        if f.big_endian:
            raw = raw.astype(kind.newbyteorder("<"))
        for first in range(0, t.numel, step):
            yield raw[first * per : (first + step) * per]

    def crc(self, t: TensorRecord) -> int:
        """CRC-32 of ``t``'s elements in C order (little-endian), once per view however many names share it."""
        from .crc import crc32

        key = (t.file, t.storage, t.name if t.storage is None else None, t.offset, t.shape, t.stride, t.dtype)
        if not t.numel:
            return 0
        if key not in self._crcs:
            f, start, itemsize, _ = self._place(t)
            crc = 0
            if _contiguous(t) and not f.big_endian:
                view = memoryview(f.buffer)
                try:
                    end = start + t.numel * itemsize
                    for first in range(start, end, CHUNK_ELEMENTS * 8):
                        crc = crc32(view[first : min(end, first + CHUNK_ELEMENTS * 8)], crc)
                finally:
                    view.release()
            else:
                for chunk in self.words(t):
                    crc = crc32(chunk.tobytes(), crc)
            self._crcs[key] = crc
        return self._crcs[key]


def _first(t: TensorRecord) -> int:
    """The element a view starts at in its storage (a safetensors entry is a storage of its own)."""
    return t.offset if t.storage is not None else 0


def _extent(t: TensorRecord) -> int:
    """Elements from a view's first to its last (0 for one element)."""
    if t.stride is None or t.storage is None:
        return max(t.numel - 1, 0)
    return sum((d - 1) * s for d, s in zip(t.shape, t.stride, strict=True) if d > 0)


def _contiguous(t: TensorRecord) -> bool:
    if t.stride is None or t.storage is None:
        return True
    run, expected = 1, []
    for size in reversed(t.shape):
        expected.append(run)
        run *= size
    pairs = zip(t.stride, reversed(expected), t.shape, strict=True)
    return all(s == e for s, e, d in pairs if d > 1)


# -- numbers --------------------------------------------------------------------------------------

_NUMPY = {
    "float64": "<f8", "float32": "<f4", "float16": "<f2",
    "int64": "<i8", "int32": "<i4", "int16": "<i2", "int8": "i1",
    "uint64": "<u8", "uint32": "<u4", "uint16": "<u2", "uint8": "u1", "bool": "?",
    "complex64": "<c8", "complex128": "<c16",
}  # fmt: skip
# float8 formats: (exponent bits, mantissa bits, bias, specials), after torch's definitions (c10/util/Float8_*.h).
_MINIFLOATS = {
    "float8_e4m3fn": (4, 3, 7, "fn"),  # no inf; S.1111.111 is NaN
    "float8_e4m3fnuz": (4, 3, 8, "fnuz"),  # no inf, no -0; 0x80 is NaN
    "float8_e5m2": (5, 2, 15, "ieee"),  # inf and NaN as IEEE
    "float8_e5m2fnuz": (5, 2, 16, "fnuz"),
}


@cache
def minifloat_table(dtype: str) -> Any:
    """The 256 values of a float8 format as float64, decoded from the bits."""
    import numpy as np

    out = np.empty(256, np.float64)
    for code in range(256):
        if dtype == "float8_e8m0fnu":  # an unsigned exponent: 2^(e-127), 0xFF is NaN
            out[code] = math.nan if code == 0xFF else math.ldexp(1.0, code - 127)
            continue
        ebits, mbits, bias, specials = _MINIFLOATS[dtype]
        sign = -1.0 if code & 0x80 else 1.0
        e, m = (code >> mbits) & ((1 << ebits) - 1), code & ((1 << mbits) - 1)
        top = (1 << ebits) - 1
        if specials == "fnuz" and code == 0x80:
            out[code] = math.nan
        elif specials == "ieee" and e == top:
            out[code] = sign * math.inf if m == 0 else math.nan
        elif specials == "fn" and e == top and m == (1 << mbits) - 1:
            out[code] = math.nan
        elif e == 0:
            out[code] = sign * math.ldexp(m, 1 - bias - mbits)
        else:
            out[code] = sign * math.ldexp((1 << mbits) + m, e - bias - mbits)
    return out


def decodable(dtype: str) -> bool:
    return dtype in _NUMPY or dtype in ("bfloat16", "complex32", "float8_e8m0fnu") or dtype in _MINIFLOATS


def decode(words: Any, dtype: str) -> Any:
    """The values of little-endian words (from ``TensorBytes.words``) as float64, or complex128 for complex dtypes."""
    import numpy as np

    with np.errstate(invalid="ignore"):  # NaN bit patterns widen as NaN
        return _decode(np, words, dtype)


def _decode(np: Any, words: Any, dtype: str) -> Any:
    if dtype == "bfloat16":
        return np.left_shift(words.astype(np.uint32), 16).view(np.float32).astype(np.float64)
    if dtype == "complex32":
        parts = words.view(np.float16)
        out = np.empty(len(parts) // 2, np.complex128)
        out.real, out.imag = parts[0::2], parts[1::2]  # not a + 1j * b, which turns a NaN part into two
        return out
    if dtype in _NUMPY:
        values = words.view(_NUMPY[dtype])
        return values.astype(np.complex128 if dtypes.get(dtype).family == "complex" else np.float64)
    return minifloat_table(dtype)[words]


def max_abs_diff(a: TensorBytes, ta: TensorRecord, b: TensorBytes, tb: TensorRecord) -> float:
    """max |a - b| over the two tensors' elements; NaN against NaN and inf against the same inf count as
    equal, NaN against a number as an infinite difference."""
    import numpy as np

    worst = 0.0
    with np.errstate(invalid="ignore", over="ignore"):
        for wa, wb in zip(a.words(ta), b.words(tb), strict=True):
            x, y = decode(wa, ta.dtype), decode(wb, tb.dtype)
            d = np.abs(x - y)
            d[(x == y) | (np.isnan(x) & np.isnan(y))] = 0.0
            d[np.isnan(d)] = np.inf
            if len(d):
                worst = max(worst, float(d.max()))
    return worst


def compare_values(a: TensorBytes, ta: TensorRecord, b: TensorBytes, tb: TensorRecord, tolerance: float | None) -> Values | None:
    """How ``ta`` and ``tb`` (of one shape) compare; None when there is nothing to compare (dtypes differ, no tolerance)."""
    why = a.why_not(ta) or b.why_not(tb)
    if why:
        return Values("unknown", reason=why)
    same_dtype = ta.dtype == tb.dtype
    if same_dtype and a.crc(ta) == b.crc(tb):
        return Values("equal", 0.0 if tolerance is not None else None)
    if not same_dtype and tolerance is None:
        return None
    if not (decodable(ta.dtype) and decodable(tb.dtype)):
        if same_dtype:
            return Values("differ")
        return Values("unknown", reason=f"{ta.dtype} and {tb.dtype} values cannot be compared as numbers")
    worst = max_abs_diff(a, ta, b, tb)
    if tolerance is not None and worst <= tolerance:
        return Values("equal", worst)
    return Values("differ", worst)


# -- ties -----------------------------------------------------------------------------------------


def _sharing(inv: Inventory, keys: dict[str, str]) -> dict[str, tuple[str, str]]:
    """Matched name -> the storage it views, for tensors that share theirs with another."""
    original = {v: k for k, v in keys.items()}
    return {original[t.name]: (t.file, t.storage) for t in inv.tensors if t.shares_with and t.storage is not None}


def _groups(storage_of: dict[str, tuple[str, str]], names: set[str]) -> set[frozenset[str]]:
    groups: dict[tuple[str, str], set[str]] = {}
    for n, key in storage_of.items():
        if n in names:
            groups.setdefault(key, set()).add(n)
    return {frozenset(g) for g in groups.values() if len(g) > 1}


def tie_changes(a: Inventory, ka: dict[str, str], b: Inventory, kb: dict[str, str]) -> list[TieChange]:
    """Storage sharing among the names both sides hold: groups one side has and the other does not keep whole."""
    common = ka.keys() & kb.keys()
    in_a, in_b = _groups(_sharing(a, ka), common), _groups(_sharing(b, kb), common)

    def views(inv: Inventory, keys: dict[str, str], group: frozenset[str]) -> bool:
        records = inv.by_name()
        return len({(records[keys[n]].offset, records[keys[n]].shape, records[keys[n]].stride) for n in group}) > 1

    out = [TieChange(tuple(sorted(g)), True, views(a, ka, g)) for g in in_a if not any(g <= h for h in in_b)]
    out += [TieChange(tuple(sorted(g)), False, views(b, kb, g)) for g in in_b if not any(g <= h for h in in_a)]
    order = {n: i for i, n in enumerate(ka)}
    return sorted(out, key=lambda c: (not c.broken, min(order.get(n, 0) for n in c.names)))


# -- the diff -------------------------------------------------------------------------------------


def diff(a: Inventory, b: Inventory, *, tolerance: float | None = None, values: bool = True) -> InventoryDiff:
    """Compare two inventories; with ``values``, read both checkpoints' tensor bytes to compare values too."""
    pa, pb, ka, kb = match_names(a, b)
    rec_a, rec_b = a.by_name(), b.by_name()
    added = tuple(rec_b[n].with_(name=k) for k, n in kb.items() if k not in ka)
    removed = tuple(rec_a[n].with_(name=k) for k, n in ka.items() if k not in kb)
    changed: list[Change] = []
    compared: list[Change] = []
    not_compared: list[Change] = []
    with ExitStack() as stack:
        bytes_a, bytes_b = TensorBytes(a, stack), TensorBytes(b, stack)
        for k, na in ka.items():
            if k not in kb:
                continue
            ta, tb = rec_a[na], rec_b[kb[k]]
            result = None
            if values and ta.shape == tb.shape:
                result = compare_values(bytes_a, ta, bytes_b, tb, tolerance)
            change = Change(k, ta, tb, result)
            if result is not None:
                (not_compared if result.state == "unknown" else compared).append(change)
            if change.dtype_changed or change.shape_changed or change.values_differ:
                changed.append(change)
    return InventoryDiff(
        a,
        b,
        added,
        removed,
        tuple(changed),
        tuple(tie_changes(a, ka, b, kb)),
        pa,
        pb,
        tolerance,
        tuple(compared),
        tuple(not_compared),
        values,
    )
