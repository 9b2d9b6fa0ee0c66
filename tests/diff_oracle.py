"""Differential oracle: what torch loads against what dtypeaudit reports, for checkpoints torch writes and mutates.

Shared by ``tests/test_differential.py`` and ``fuzz/fuzz_differential.py``. Three parts:

* **Reference** (:func:`torch_view`): ``torch.load(weights_only=True)``; where that refuses, ``torch.load`` with
  CPython's real unpickler behind an allowlist (:data:`SAFE`), which is what ``weights_only=False`` would
  do without ever running anything outside the list; ``.safetensors`` paths go through torch.load's own
  routing to ``safetensors.torch.load_file``. Nothing here calls ``pickle.load``, unrestricted
  ``torch.load`` or ``torch.jit.load`` on a generated file.
* **Cases** (:func:`make_case`): seeded, reproducible checkpoints written by torch.save (zip and legacy,
  pickle protocols 0-5) or safetensors, then optionally one structural mutation of the pickle, the zip
  directory or the safetensors header.
* **Verdicts** (:func:`evaluate`, :func:`compare`): MATCH, REFUSED-BY-US, BOTH-REFUSE, TORCH-REFUSES-WE-READ,
  CONVENTION (only names differ, at a place where dtypeaudit's naming is a convention: tensors as dict
  keys, object attributes, sets), DIFFERENTIAL (both read, inventories differ) and CRASH.

``python -m tests.diff_oracle --worker`` is the isolated worker process :class:`Runner` drives (memory
capped, killed on a hang), so that a mutated file cannot take the test process or the machine down.
"""

from __future__ import annotations

import _compat_pickle
import codecs
import collections
import copyreg
import functools
import io
import json
import os
import pickle
import pickletools
import random
import select
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import traceback
import types
import warnings
import zipfile
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .oracle import SAVABLE_DTYPES

ROOT = Path(__file__).resolve().parent.parent

MATCH = "MATCH"
REFUSED_BY_US = "REFUSED-BY-US"
BOTH_REFUSE = "BOTH-REFUSE"
TORCH_REFUSES = "TORCH-REFUSES-WE-READ"
CONVENTION = "CONVENTION"
DIFFERENTIAL = "DIFFERENTIAL"
CRASH = "CRASH"
ORACLE_FAILED = "ORACLE-FAILED"
"""The reference itself hung or died (a torch problem, or a file too big for the oracle's memory cap)."""
OUTCOMES = (MATCH, REFUSED_BY_US, BOTH_REFUSE, TORCH_REFUSES, CONVENTION, DIFFERENTIAL, CRASH, ORACLE_FAILED)
BAD_OUTCOMES = (DIFFERENTIAL, CRASH)

# dtypes the legacy (pre-1.6) format can write: the ones with a typed storage class.
LEGACY_DTYPES = [
    "float64", "float32", "float16", "bfloat16", "complex64", "complex128", "int64", "int32", "int16", "int8", "uint8", "bool",
]  # fmt: skip
# dtypes safetensors writes; F8_E8M0 and F4 go through safe_open (load_file) but not safetensors.torch.load(bytes).
SAFETENSORS_DTYPES = [
    "float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz",
    "float8_e8m0fnu", "float4_e2m1fn_x2", "complex64", "int64", "int32", "int16", "int8", "uint64", "uint32", "uint16", "uint8",
    "bool",
]  # fmt: skip
SAFETENSORS_CODES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "float8_e4m3fn": "F8_E4M3",
    "float8_e4m3fnuz": "F8_E4M3FNUZ", "float8_e5m2": "F8_E5M2", "float8_e5m2fnuz": "F8_E5M2FNUZ", "float8_e8m0fnu": "F8_E8M0",
    "float4_e2m1fn_x2": "F4", "complex64": "C64", "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint64": "U64",
    "uint32": "U32", "uint16": "U16", "uint8": "U8", "bool": "BOOL",
}  # fmt: skip
STORAGE_CLASSES = [
    "DoubleStorage", "FloatStorage", "HalfStorage", "BFloat16Storage", "LongStorage", "IntStorage", "ShortStorage", "CharStorage",
    "ByteStorage", "BoolStorage", "ComplexFloatStorage", "ComplexDoubleStorage", "QInt8Storage", "QUInt8Storage", "QInt32Storage",
]  # fmt: skip


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# -- the reference: torch's own loaders ---------------------------------------------------------------


def _safe_allowlist() -> dict[str, Any]:
    """torch's weights_only allowlist plus the few builtins CPython's pickler itself spells, minus mutable Python classes.

    Functions are handed out wrapped in a fresh ``functools.partial`` per lookup, so that a BUILD whose target
    is the function (``setattr(f, "__defaults__", ...)``) changes a throwaway object rather than this
    process's torch. ``collections.Counter`` is left out (torch.save never writes it, and a BUILD could set
    its class attributes); the Python classes that stay (Tensor, Parameter, the storage classes) are
    fingerprinted around every load (:func:`_fingerprint`), so a load that changes them is caught.
    """
    from torch._weights_only_unpickler import _get_allowed_globals

    allowed = dict(_get_allowed_globals())
    allowed.pop("collections.Counter", None)
    allowed.update(
        {
            "builtins.set": set,
            "builtins.frozenset": frozenset,
            "builtins.bytearray": bytearray,
            "builtins.bytes": bytes,
            "builtins.complex": complex,
            "builtins.slice": slice,
            "builtins.object": object,
            "builtins.dict": dict,
            "builtins.list": list,
            "builtins.tuple": tuple,
            "copyreg._reconstructor": copyreg._reconstructor,
            "_codecs.encode": codecs.encode,
            "collections.OrderedDict": collections.OrderedDict,
            "torch.Size": torch.Size,
            "torch.device": torch.device,
        }
    )
    for name in dir(torch):
        value = getattr(torch, name, None)
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format, torch.qscheme)):
            allowed[f"torch.{name}"] = value
    return allowed


_SAFE_GLOBALS: dict[str, Any] | None = None


class OracleRefusal(pickle.UnpicklingError):
    """The allowlisted unpickler met a global outside its list."""


class SafeUnpickler(pickle.Unpickler):
    """CPython's C unpickler (real opcode semantics) whose ``find_class`` resolves only an explicit allowlist."""

    def __init__(self, file: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(file, *args, **kwargs)
        self._fix_imports = kwargs.get("fix_imports", True)
        # CPython maps Python 2 names only below protocol 3; the protocol is the stream's first opcode.
        self._proto = 0
        try:
            pos = file.tell()
            head = file.read(2)
            file.seek(pos)
            if head[:1] == b"\x80" and len(head) == 2:
                self._proto = head[1]
        except (AttributeError, OSError, ValueError):
            pass

    def find_class(self, module: str, name: str) -> Any:
        global _SAFE_GLOBALS
        if _SAFE_GLOBALS is None:
            _SAFE_GLOBALS = _safe_allowlist()
        if self._proto < 3 and self._fix_imports:
            if (module, name) in _compat_pickle.NAME_MAPPING:
                module, name = _compat_pickle.NAME_MAPPING[(module, name)]
            elif module in _compat_pickle.IMPORT_MAPPING:
                module = _compat_pickle.IMPORT_MAPPING[module]
        qualname = f"{module}.{name}"
        if qualname not in _SAFE_GLOBALS:
            raise OracleRefusal(f"global {qualname} is outside the oracle's allowlist")
        value = _SAFE_GLOBALS[qualname]
        return functools.partial(value) if isinstance(value, types.FunctionType) else value


def _safe_load(file: Any, **kwargs: Any) -> Any:
    return SafeUnpickler(file, **kwargs).load()


SAFE = types.ModuleType("diff_oracle_safe_pickle")
"""A ``pickle_module`` for torch.load: CPython's unpickler, allowlisted globals only."""
SAFE.Unpickler = SafeUnpickler  # type: ignore[attr-defined]
SAFE.load = _safe_load  # type: ignore[attr-defined]
SAFE.UnpicklingError = pickle.UnpicklingError  # type: ignore[attr-defined]


class OracleTainted(RuntimeError):
    """A load changed state of this process (a class attribute); later verdicts could not be trusted."""


def _fingerprint() -> int:
    classes = (torch.Tensor, torch.nn.Parameter, torch.storage.UntypedStorage, torch.storage.TypedStorage)
    return hash(tuple((k, id(v)) for c in classes for k, v in vars(c).items()))


def _refuse_torchscript(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("the oracle never runs torch.jit.load")


@contextmanager
def _no_torchscript() -> Any:
    # torch.load(weights_only=False) hands archives holding constants.pkl to torch.jit.load, which runs code.
    saved = torch.jit.load
    torch.jit.load = _refuse_torchscript  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.jit.load = saved  # type: ignore[assignment]


Entry = tuple[str, str, tuple[int, ...], str]
"""(name, dtype, shape, kind): what both sides must agree on."""


@dataclass
class View:
    """What one side made of a file."""

    status: str
    """``read``, ``refused`` or ``crash``."""
    entries: list[Entry] = field(default_factory=list)
    sharing: set[frozenset[str]] | None = None
    """Groups of names sharing one storage; None where names repeat, so groups are not comparable."""
    flags: set[str] = field(default_factory=set)
    """Places holding tensors where names are a convention (reference side only)."""
    how: str = ""
    """The loader that produced it: ``weights_only``, ``full_pickle``, ``safetensors``, ``dtypeaudit``."""
    error: str = ""
    error_findings: tuple[str, ...] = ()
    """dtypeaudit's error-severity findings (rule names): with one, its gate fails anyway."""


class _TooBig(Exception):
    pass


def describe(obj: Any, *, max_visits: int = 200_000) -> tuple[list[Entry], set[frozenset[str]] | None, set[str]]:
    """Every tensor under ``obj`` by dotted key path (dtypeaudit's convention), the sharing groups, and flags."""
    entries: list[Entry] = []
    tensors: list[tuple[str, torch.Tensor]] = []
    flags: set[str] = set()
    visits = 0

    def join(prefix: str, key: Any) -> str:
        if isinstance(key, str):
            part = key
        elif isinstance(key, torch.Tensor) or _holds_tensor(key):
            part = "<tensor key>"  # str() of a tensor formats its values, which some dtypes cannot do
        else:
            try:
                part = str(key)
            except Exception:
                part = f"<{type(key).__name__}>"
        return f"{prefix}.{part}" if prefix else part

    def go(value: Any, name: str, on_path: frozenset[int]) -> int:
        nonlocal visits
        visits += 1
        if visits > max_visits:
            raise _TooBig
        if isinstance(value, torch.Tensor):
            kind = "parameter" if isinstance(value, torch.nn.Parameter) else "unknown"
            try:
                shape = tuple(int(d) for d in value.shape)
            except (RuntimeError, TypeError, ValueError):
                shape = (-1,)  # a nested (jagged) tensor has no single size (see ours_view)
            entries.append((name, dtype_name(value.dtype), shape, kind))
            tensors.append((name, value))
            found = 1
            attrs = getattr(value, "__dict__", None) or {}
            inner = sum(go(v, join(name, k), on_path) for k, v in list(attrs.items()))
            # torch's rebuild functions set the pickled backward_hooks on the tensor: what they hold is loaded too
            hooks = getattr(value, "_backward_hooks", None)
            if hooks is not None and id(hooks) not in on_path:
                inner += go(hooks, join(name, "_backward_hooks"), on_path | {id(value)})
            if inner:
                flags.add("tensor-attribute")
            return found + inner
        if isinstance(value, (str, bytes, bytearray, int, float, complex, type(None), torch.dtype, torch.device)):
            return 0
        if id(value) in on_path:
            flags.add("cycle")
            return 0
        path = on_path | {id(value)}
        count = 0
        if isinstance(value, dict):
            for k, v in list(value.items()):
                if go(k, join(name, "<key>"), path):
                    flags.add("tensor-key")
                n = go(v, join(name, k), path)
                if n and (isinstance(k, bool) or not isinstance(k, (str, int))):
                    flags.add("odd-key")
                count += n
            attrs = getattr(value, "__dict__", None) or {}
            n = sum(go(v, join(name, k), path) for k, v in list(attrs.items()))
            if n:
                flags.add("container-attribute")
            count += n
        elif isinstance(value, (list, tuple)):
            count += sum(go(v, join(name, i), path) for i, v in enumerate(value))
            attrs = getattr(value, "__dict__", None) or {}
            n = sum(go(v, join(name, k), path) for k, v in list(attrs.items()))
            if n:
                flags.add("container-attribute")
            count += n
        elif isinstance(value, (set, frozenset)):
            n = sum(go(v, join(name, i), path) for i, v in enumerate(value))
            if n:
                flags.add("set")
            count += n
        elif isinstance(value, slice):
            n = sum(go(v, join(name, i), path) for i, v in enumerate((value.start, value.stop, value.step)))
            if n:
                flags.add("slice")
            count += n
        elif hasattr(value, "__dict__") and not isinstance(value, (type, types.FunctionType, functools.partial, types.ModuleType)):
            n = sum(go(v, join(name, k), path) for k, v in list(vars(value).items()))
            if n:
                flags.add("object")
            count += n
        return count

    try:
        go(obj, "", frozenset())
    except _TooBig:
        flags.add("too-big")
    except RecursionError:
        flags.add("too-deep")
    names = [e[0] for e in entries]
    sharing: set[frozenset[str]] | None = None
    if len(set(names)) == len(names):
        groups: dict[int, set[str]] = {}
        for name, t in tensors:
            try:
                if t.layout != torch.strided or t.is_meta or t.numel() == 0:
                    continue  # empty tensors have no memory to share (their data pointers are all null)
                groups.setdefault(t.untyped_storage().data_ptr(), set()).add(name)
            except (RuntimeError, NotImplementedError):
                continue
        sharing = {frozenset(g) for g in groups.values() if len(g) > 1}
    return entries, sharing, flags


def _holds_tensor(value: Any, depth: int = 0) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if depth < 20 and isinstance(value, (tuple, frozenset)):
        return any(_holds_tensor(v, depth + 1) for v in value)
    return False


def _short_error(exc: BaseException) -> str:
    text = [t.strip() for t in str(exc).strip().splitlines() if t.strip()]
    line = text[0] if text else ""
    if "Weights only load failed" in line:
        why = next((t for t in text if "WeightsUnpickler error:" in t), "")
        line = why.split("WeightsUnpickler error:", 1)[1].strip() if why else line
    return f"{type(exc).__name__}: {line[:200]}"


def torch_view(path: Path) -> View:
    """The reference: what torch (or safetensors, for ``.safetensors`` paths) loads from ``path``."""
    errors: list[str] = []
    if path.suffix == ".safetensors":
        # torch.load routes a .safetensors path to safetensors.torch.load_file, whatever the content; so does transformers.
        loaders: list[tuple[str, Callable[[], Any]]] = [("safetensors", lambda: torch.load(path, weights_only=True, map_location="cpu"))]
    else:
        loaders = [
            ("weights_only", lambda: torch.load(path, weights_only=True, map_location="cpu")),
            ("full_pickle", lambda: torch.load(path, weights_only=False, pickle_module=SAFE, map_location="cpu")),
        ]
    with warnings.catch_warnings(), _no_torchscript():
        warnings.simplefilter("ignore")
        for how, load in loaders:
            before = _fingerprint()
            try:
                obj = load()
            except Exception as exc:  # torch raises every kind of error on a damaged file
                errors.append(f"{how}: {_short_error(exc)}")
                continue
            finally:
                if _fingerprint() != before:
                    raise OracleTainted(f"loading {path} changed a class of this process")
            entries, sharing, flags = describe(obj)
            return View("read", entries, sharing, flags, how)
    return View("refused", how="torch", error="; ".join(errors))


def ours_view(path: Path) -> View:
    """What dtypeaudit's public entry point reports for ``path``."""
    from dtypeaudit.errors import DtypeAuditError
    from dtypeaudit.formats import read_checkpoint

    try:
        inv = read_checkpoint(path)
    except DtypeAuditError as exc:
        return View("refused", how="dtypeaudit", error=exc.one_line().replace(str(path), "FILE"))
    except Exception:
        return View("crash", how="dtypeaudit", error=traceback.format_exc())
    # A nested (jagged) tensor has no single size in torch; dtypeaudit reports its buffer's. Compare dtype and name only.
    entries = [(t.name, t.dtype, (-1,) if t.layout == "nested" else tuple(t.shape), t.kind) for t in inv.tensors]
    names = [e[0] for e in entries]
    sharing: set[frozenset[str]] | None = None
    if len(set(names)) == len(names):
        # empty and meta tensors have no memory to share; the reference leaves them out the same way
        empty = {t.name for t in inv.tensors if t.numel == 0 or t.layout == "meta"}
        groups = {frozenset((t.name, *t.shares_with)) - empty for t in inv.tensors if t.shares_with and t.name not in empty}
        sharing = {g for g in groups if len(g) > 1}
    errors = tuple(sorted({f.rule for f in inv.findings if f.severity == "error"}))
    return View("read", entries, sharing, set(), "dtypeaudit", error_findings=errors)


# -- comparison ---------------------------------------------------------------------------------------


@dataclass
class Verdict:
    outcome: str
    subclass: str = ""
    """For DIFFERENTIAL: which facts differ (``dtype``, ``shape``, ``kind``, ``missing``, ``extra``, ``names``, ``sharing``)."""
    detail: str = ""

    def to_json(self) -> dict[str, str]:
        return {"outcome": self.outcome, "subclass": self.subclass, "detail": self.detail}


def _fmt(entries: Iterable[Entry], limit: int = 4) -> str:
    items = sorted(entries, key=repr)
    text = ", ".join(f"{n!r}:{d}{list(s)}{'(param)' if k == 'parameter' else ''}" for n, d, s, k in items[:limit])
    return text + (f" +{len(items) - limit} more" if len(items) > limit else "")


def compare(ref: View, ours: View) -> Verdict:
    """The verdict for one file, from the reference's view and dtypeaudit's."""
    if ours.status == "crash":
        return Verdict(CRASH, "exception", ours.error.strip().splitlines()[-1][:300] if ours.error.strip() else "")
    if ref.status != "read":
        if ours.status == "refused":
            return Verdict(BOTH_REFUSE, "", f"torch: {ref.error[:200]} | ours: {ours.error[:200]}")
        gate = "flagged" if ours.error_findings else "silent"
        return Verdict(
            TORCH_REFUSES, gate, f"torch: {ref.error[:200]} | ours: {len(ours.entries)} tensors, errors {list(ours.error_findings)}"
        )
    if ours.status == "refused":
        return Verdict(REFUSED_BY_US, "", ours.error[:300])
    ct, co = Counter(ref.entries), Counter(ours.entries)
    if ct == co:
        if ref.sharing is not None and ours.sharing is not None and ref.sharing != ours.sharing:
            only_t, only_o = ref.sharing - ours.sharing, ours.sharing - ref.sharing
            detail = f"torch shares {sorted(map(sorted, only_t))[:3]}; ours {sorted(map(sorted, only_o))[:3]}"
            return Verdict(DIFFERENTIAL, "sharing", detail)
        return Verdict(MATCH)
    only_t, only_o = ct - co, co - ct
    detail = f"torch: {_fmt(only_t.elements())} | ours: {_fmt(only_o.elements())} (via {ref.how})"
    if ours.error_findings:
        detail += f" [ours also raises {','.join(ours.error_findings)}]"

    def unnamed(c: Counter[Entry]) -> Counter[tuple[str, tuple[int, ...], str]]:
        return Counter((d, s, k) for _, d, s, k in c.elements())

    if unnamed(ct) == unnamed(co):
        if ref.flags - {"too-big", "too-deep"}:
            return Verdict(CONVENTION, "+".join(sorted(ref.flags)), detail)
        return Verdict(DIFFERENTIAL, "names", detail)
    by_t: dict[str, list[Entry]] = {}
    by_o: dict[str, list[Entry]] = {}
    for e in only_t.elements():
        by_t.setdefault(e[0], []).append(e)
    for e in only_o.elements():
        by_o.setdefault(e[0], []).append(e)
    parts: set[str] = set()
    for name in by_t.keys() & by_o.keys():
        for a, b in zip(by_t[name], by_o[name], strict=False):
            parts.update(f for f, x, y in (("dtype", a[1], b[1]), ("shape", a[2], b[2]), ("kind", a[3], b[3])) if x != y)
        if len(by_t[name]) > len(by_o[name]):
            parts.add("missing")
        elif len(by_t[name]) < len(by_o[name]):
            parts.add("extra")
    if by_t.keys() - by_o.keys():
        parts.add("missing")
    if by_o.keys() - by_t.keys():
        parts.add("extra")
    if ref.flags:
        parts.add("at:" + "+".join(sorted(ref.flags)))
    return Verdict(DIFFERENTIAL, "+".join(sorted(parts)), detail)


# -- generators: checkpoints written by torch itself ----------------------------------------------------

ODD_KEYS = [
    "", ".", "a.b", "..", " ", "é", "e\u0301", "ключ", "键", "🙂", "\x00", "\n", "a\nb", "x" * 300, "\ud800", "\udfff",
    "_metadata", "state", "param_groups", "__state__", "__arg0__", "0", "1", "-1", "None", "True", "b'x'", "weight",
    "ÿ", "\u0100", "\x80", "\\", "'", '"', "a/b", "data.pkl", "storage", "\t",
]  # fmt: skip
PLAIN_KEYS = ["weight", "bias", "w", "b", "layer", "fc", "conv", "norm", "embed", "head", "x", "y", "model", "module", "blocks"]
SHAPES = [(), (0,), (1,), (3,), (2, 3), (4, 0, 2), (2, 2, 2), (5,), (1, 1, 1, 1), (7,), (3, 1), (0, 0), (2, 5)]


def _keyed_rng(*parts: object) -> random.Random:
    return random.Random(":".join(map(str, parts)))


def make_tensor(rng: random.Random, dtypes: list[str]) -> torch.Tensor:
    dtype = getattr(torch, rng.choice(dtypes))
    shape = rng.choice(SHAPES) if rng.random() < 0.8 else tuple(rng.randint(0, 4) for _ in range(rng.randint(0, 4)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = torch.empty(shape, dtype=dtype)
    if t.numel():
        t.untyped_storage().fill_(rng.randrange(256))
    return t


_VIEWS: list[tuple[str, Callable[[torch.Tensor, random.Random], torch.Tensor]]] = [
    ("slice", lambda t, r: t.reshape(-1)[r.randrange(max(t.numel(), 1)) :]),
    ("step", lambda t, r: t[..., :: r.randint(1, 3)]),
    ("transpose", lambda t, r: t.transpose(0, -1)),
    ("select", lambda t, r: t[r.randrange(t.shape[0])]),
    ("expand", lambda t, r: t.unsqueeze(0).expand(r.randint(1, 3), *t.shape)),
    ("narrow", lambda t, r: t.narrow(0, 0, r.randint(0, t.shape[0]))),
    ("flatten", lambda t, r: t.view(-1)),
    ("unsqueeze", lambda t, r: t.unsqueeze(-1)),
    ("diagonal", lambda t, r: t.diagonal()),
]


SPECIAL_TENSORS = [
    "sparse_coo",
    "sparse_csr",
    "sparse_csc",
    "sparse_bsr",
    "quantized",
    "per_channel",
    "meta",
    "conj",
    "channels_last",
    "nested",
]


def special_tensor(rng: random.Random, dtypes: list[str], *, nested: bool = True) -> torch.Tensor | None:
    """A tensor that is not a plain strided one: sparse layouts, quantized, meta, conjugate views, nested."""
    kind = rng.choice([k for k in SPECIAL_TENSORS if nested or k != "nested"])
    floats = [x for x in dtypes if x in ("float32", "float64", "float16", "bfloat16")] or ["float32"]
    dt = getattr(torch, rng.choice(floats))
    n = rng.randint(1, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sparse/quantized/nested creation warns about beta status
        return _special(kind, dt, n, rng, dtypes)


def _special(kind: str, dt: torch.dtype, n: int, rng: random.Random, dtypes: list[str]) -> torch.Tensor | None:
    try:
        if kind == "sparse_coo":
            return torch.sparse_coo_tensor(torch.tensor([[0, 1], [1, 0]]), torch.ones(2, dtype=dt), (2, n + 1))
        if kind in ("sparse_csr", "sparse_csc"):
            eye = torch.eye(n, dtype=dt)
            return eye.to_sparse_csr() if kind == "sparse_csr" else eye.to_sparse_csc()
        if kind == "sparse_bsr":
            return torch.ones(2 * n, 4, dtype=dt).to_sparse_bsr((2, 2))
        if kind == "quantized":
            return torch.quantize_per_tensor(torch.ones(n), 0.1, 0, rng.choice([torch.qint8, torch.quint8, torch.qint32]))
        if kind == "per_channel":
            return torch.quantize_per_channel(torch.ones(2, n), torch.tensor([0.1, 0.2]), torch.tensor([0, 1]), 0, torch.quint8)
        if kind == "meta":
            return torch.empty(rng.choice(SHAPES), dtype=getattr(torch, rng.choice(dtypes)), device="meta")
        if kind == "conj":
            return torch.ones(n, dtype=torch.complex64).conj()
        if kind == "channels_last":
            return torch.ones(1, 2, n, 2, dtype=dt).to(memory_format=torch.channels_last)
        return torch.nested.nested_tensor([torch.ones(2, dtype=dt), torch.ones(n, dtype=dt)])
    except (RuntimeError, NotImplementedError, TypeError):
        return None


class ObjectGen:
    """Random checkpoint objects: nested containers of tensors with views, ties, parameters and odd keys."""

    def __init__(
        self, rng: random.Random, dtypes: list[str], *, odd: float = 0.15, exotic: float = 0.05, special: float = 0.0, legacy: bool = False
    ) -> None:
        self.rng = rng
        self.special = special
        self.legacy = legacy
        """No nested tensors in legacy files: torch.load reads their sizes from storage bytes it has not loaded yet."""
        """Chance that a fresh tensor is sparse, quantized, meta, conjugate or nested (nested only when exotic)."""
        self.dtypes = dtypes
        self.pool: list[torch.Tensor] = []
        self.odd = odd
        self.exotic = exotic
        """Chance of constructs whose names are a convention (tensor keys, attributes, sets)."""

    def key(self) -> Any:
        r = self.rng
        x = r.random()
        if x < self.odd:
            return r.choice(ODD_KEYS)
        if x < self.odd + 0.1:
            return r.choice([0, 1, 2, 7, -1, 2**40, 2**70])
        if x < self.odd + 0.1 + self.exotic:
            return r.choice([True, False, None, 1.5, b"k", ("t", 1), frozenset({1})])
        return r.choice(PLAIN_KEYS) + (str(r.randint(0, 9)) if r.random() < 0.5 else "")

    def scalar(self) -> Any:
        r = self.rng
        if r.random() < self.exotic:
            return r.choice([slice(1, 5, 2), torch.Size([2, 3]), torch.device("cpu"), torch.float16, 1 + 2j, bytearray(b"ab"), {1, 2}])
        return r.choice(
            [0, 1, -1, 2**31, 2**63, -(2**100), 3.5, float("nan"), float("inf"), None, True, False, "", "s", "é", b"", b"\x00\xff"]
        )

    def tensor(self) -> torch.Tensor:
        r = self.rng
        choice = r.choice(["fresh", "fresh", "fresh", "view", "same"]) if self.pool else "fresh"
        if choice == "fresh" and self.special and r.random() < self.special:
            odd = special_tensor(r, self.dtypes, nested=self.exotic > 0 and not self.legacy)
            if odd is not None:
                return odd
        if choice == "fresh":
            t = make_tensor(r, self.dtypes)
        elif choice == "same":
            return r.choice(self.pool)
        else:
            base = r.choice(self.pool).detach()
            name, view = r.choice(_VIEWS)
            try:
                t = view(base, r)
            except (RuntimeError, IndexError, ValueError, NotImplementedError):
                t = base
        if r.random() < 0.2 and not isinstance(t, torch.nn.Parameter):
            t = torch.nn.Parameter(t, requires_grad=t.dtype.is_floating_point and r.random() < 0.5 and t.dtype.itemsize > 1)
        if r.random() < self.exotic:
            try:
                t = t.detach() if not isinstance(t, torch.nn.Parameter) else t
                setattr(t, r.choice(["meta", "foo", "scale"]), make_tensor(r, self.dtypes) if r.random() < 0.6 else 3)
            except (RuntimeError, AttributeError):
                pass
        self.pool.append(t)
        return t

    def node(self, depth: int) -> Any:
        r = self.rng
        kinds = ["tensor", "tensor", "tensor", "dict", "list", "scalar"] if depth < 4 else ["tensor", "scalar"]
        kinds += ["tuple", "odict"] if depth < 4 else []
        kind = r.choice(kinds)
        if kind == "tensor":
            return self.tensor()
        if kind == "scalar":
            return self.scalar()
        if kind == "list":
            return [self.node(depth + 1) for _ in range(r.randint(0, 4))]
        if kind == "tuple":
            return tuple(self.node(depth + 1) for _ in range(r.randint(0, 3)))
        d: dict[Any, Any] = OrderedDict() if kind == "odict" else {}
        for _ in range(r.randint(0, 5)):
            d[self.key()] = self.node(depth + 1)
        if r.random() < self.exotic:
            if kind == "odict" and r.random() < 0.5:
                d.hidden = self.tensor()  # type: ignore[attr-defined]
            else:
                try:
                    d[self.tensor()] = "tensor as a key"
                except TypeError:
                    pass
        return d

    def root(self) -> Any:
        r = self.rng
        root: dict[Any, Any] = OrderedDict() if r.random() < 0.3 else {}
        for _ in range(r.randint(1, 6)):
            root[self.key()] = self.node(1)
        return root


def _model(rng: random.Random) -> torch.nn.Module:
    torch.manual_seed(rng.randrange(2**31))
    kind = rng.choice(["mlp", "cnn", "lm", "rnn"])
    if kind == "mlp":
        return torch.nn.Sequential(
            torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.LayerNorm(4), torch.nn.Linear(4, 2, bias=rng.random() < 0.5)
        )
    if kind == "cnn":
        return torch.nn.Sequential(torch.nn.Conv2d(2, 3, 2), torch.nn.BatchNorm2d(3), torch.nn.Flatten(), torch.nn.LazyLinear(2))
    if kind == "lm":
        emb = torch.nn.Embedding(11, 4)
        head = torch.nn.Linear(4, 11, bias=False)
        if rng.random() < 0.5:
            head.weight = emb.weight  # tied weights
        return torch.nn.ModuleDict({"embed": emb, "norm": torch.nn.LayerNorm(4), "head": head})
    return torch.nn.ModuleDict({"rnn": torch.nn.GRU(3, 2), "out": torch.nn.Linear(2, 1)})


def _materialize(model: torch.nn.Module) -> None:
    for m in model.modules():
        if isinstance(m, torch.nn.LazyLinear):
            m(torch.zeros(1, 3))  # fix the lazy input size (3 channels x 1 x 1 after the 2x2 conv on 2x2 inputs)


def model_state(rng: random.Random, dtypes: list[str], legacy: bool = False) -> Any:
    """A real module's state_dict (an OrderedDict with ``_metadata``), optionally cast, as users save them."""
    model = _model(rng)
    try:
        _materialize(model)
    except RuntimeError:
        pass
    target = rng.choice([None, None, "float16", "bfloat16", "float64"])
    if target in dtypes:
        model = model.to(getattr(torch, target))
    return model.state_dict(keep_vars=rng.random() < 0.2)


def training_state(rng: random.Random, dtypes: list[str], legacy: bool = False) -> Any:
    """model + optimizer state after one real step (+ scheduler, epoch, config): a training checkpoint."""
    model = _model(rng)
    try:
        _materialize(model)
    except RuntimeError:
        pass
    params = [p for p in model.parameters()]
    opt_kind = rng.choice(["sgd", "adam", "adamw", "rmsprop", "adagrad"])
    lr = rng.choice([0.1, 1e-3])
    opt: torch.optim.Optimizer
    if opt_kind == "sgd":
        opt = torch.optim.SGD(params, lr=lr, momentum=rng.choice([0.0, 0.9]))
    elif opt_kind == "adam":
        opt = torch.optim.Adam(params, lr=lr, amsgrad=rng.random() < 0.3)
    elif opt_kind == "adamw":
        opt = torch.optim.AdamW(params, lr=lr)
    elif opt_kind == "rmsprop":
        opt = torch.optim.RMSprop(params, lr=lr, momentum=0.5)
    else:
        opt = torch.optim.Adagrad(params, lr=lr)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    target = rng.choice([None, "float16", "bfloat16"])
    state = model.state_dict()
    if target is not None and target in dtypes:
        state = OrderedDict((k, v.to(getattr(torch, target)) if v.is_floating_point() else v) for k, v in state.items())
    out: dict[str, Any] = {"model": state, "optimizer": opt.state_dict(), "epoch": rng.randint(0, 99)}
    if rng.random() < 0.5:
        out["lr_scheduler"] = sched.state_dict()
    if rng.random() < 0.3:
        out["config"] = {"lr": lr, "name": "é-run", "betas": (0.9, 0.999), "tags": ["a", "b"], "seed": None}
    if rng.random() < 0.3:
        out = {"state_dict": out} if rng.random() < 0.5 else out
    return out


def params_state(rng: random.Random, dtypes: list[str], legacy: bool = False) -> Any:
    model = _model(rng)
    try:
        _materialize(model)
    except RuntimeError:
        pass
    if rng.random() < 0.5:
        return dict(model.named_parameters())
    return {"params": list(model.parameters()), "buffers": dict(model.named_buffers())}


GENERATORS: dict[str, Callable[..., Any]] = {
    "plain": lambda rng, dtypes, legacy=False: ObjectGen(rng, dtypes, exotic=0.0, special=0.03, legacy=legacy).root(),
    "nested": lambda rng, dtypes, legacy=False: ObjectGen(rng, dtypes, special=0.05, legacy=legacy).root(),
    "odd": lambda rng, dtypes, legacy=False: ObjectGen(rng, dtypes, odd=0.6, exotic=0.25, special=0.1, legacy=legacy).root(),
    "state_dict": model_state,
    "training": training_state,
    "params": params_state,
}
BENIGN_GENERATORS = ["plain", "state_dict", "training", "params"]
"""Generators whose files name every tensor by plain key paths (no tensor keys, attributes or sets)."""


def torch_bytes(obj: Any, *, legacy: bool, protocol: int) -> bytes:
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.save(obj, buf, _use_new_zipfile_serialization=not legacy, pickle_protocol=protocol)
    return buf.getvalue()


def safetensors_bytes(rng: random.Random, dtypes: list[str] | None = None) -> bytes:
    from safetensors.torch import save

    tensors: dict[str, torch.Tensor] = {}
    for _ in range(rng.randint(0, 6)):
        name = rng.choice(ODD_KEYS + PLAIN_KEYS) if rng.random() < 0.4 else f"{rng.choice(PLAIN_KEYS)}.{rng.randint(0, 9)}.weight"
        if "\ud800" in name or "\udfff" in name:
            name = name.replace("\ud800", "?").replace("\udfff", "?")
        tensors[name] = make_tensor(rng, dtypes or SAFETENSORS_DTYPES).contiguous()
    meta = {"format": "pt"} if rng.random() < 0.5 else None
    try:
        return save(tensors, metadata=meta)
    except Exception:  # safetensors cannot write some float4 shapes (0-dim): leave those out
        return save({k: v for k, v in tensors.items() if v.dtype != torch.float4_e2m1fn_x2}, metadata=meta)


# -- pickle surgery -------------------------------------------------------------------------------------

_OPS = {op.name: op for op in pickletools.opcodes}
_STRING_OPS = {"BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8", "UNICODE", "SHORT_BINSTRING", "BINSTRING", "STRING"}
_INT_OPS = {"BININT", "BININT1", "BININT2", "LONG1", "LONG4", "INT", "LONG"}
_GET_OPS = {"GET", "BINGET", "LONG_BINGET"}
_PUT_OPS = {"PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"}


@dataclass
class Op:
    name: str
    arg: Any
    raw: bytes


def parse_pickle(data: bytes, start: int = 0) -> tuple[list[Op], int]:
    """The opcodes of one pickle from ``start`` up to and including STOP, and the offset after it."""
    ops: list[Op] = []
    items = list(pickletools.genops(io.BytesIO(data[start:])))
    for i, (opcode, arg, pos) in enumerate(items):
        end = items[i + 1][2] if i + 1 < len(items) else pos + 1
        ops.append(Op(opcode.name, arg, data[start + pos : start + end]))
    return ops, start + (items[-1][2] + 1 if items else 0)


def _uint(fmt: str, n: int) -> bytes:
    return struct.pack(fmt, n)


def enc(name: str, arg: Any = None) -> bytes:
    """One opcode with its argument, as CPython's pickler spells it."""
    code = _OPS[name].code.encode("latin-1")
    if name in ("BININT1", "BINGET", "BINPUT", "PROTO"):
        return code + _uint("<B", arg)
    if name == "BININT2":
        return code + _uint("<H", arg)
    if name == "BININT":
        return code + struct.pack("<i", arg)
    if name in ("LONG_BINGET", "LONG_BINPUT"):
        return code + _uint("<I", arg)
    if name == "FRAME":
        return code + _uint("<Q", arg)
    if name == "LONG1":
        body = pickle.encode_long(arg)
        return code + _uint("<B", len(body)) + body
    if name in ("INT", "GET", "PUT"):
        return code + str(arg).encode("ascii") + b"\n"
    if name == "BINUNICODE":
        body = arg.encode("utf-8", "surrogatepass")
        return code + _uint("<I", len(body)) + body
    if name == "SHORT_BINUNICODE":
        body = arg.encode("utf-8", "surrogatepass")
        return code + _uint("<B", len(body)) + body
    if name == "BINUNICODE8":
        body = arg.encode("utf-8", "surrogatepass")
        return code + _uint("<Q", len(body)) + body
    if name == "UNICODE":
        return code + arg.encode("raw-unicode-escape") + b"\n"
    if name in ("SHORT_BINSTRING", "SHORT_BINBYTES"):
        body = arg.encode("utf-8", "surrogatepass") if isinstance(arg, str) else arg
        return code + _uint("<B", len(body)) + body
    if name in ("BINSTRING", "BINBYTES"):
        body = arg.encode("utf-8", "surrogatepass") if isinstance(arg, str) else arg
        return code + _uint("<I", len(body)) + body
    if name == "STRING":
        body = arg.encode("utf-8", "surrogatepass") if isinstance(arg, str) else arg
        return code + repr(body)[1:].encode("ascii") + b"\n"
    if name == "GLOBAL":
        module, qual = arg.split(" ", 1) if " " in arg else arg.rsplit(".", 1)
        return code + module.encode("utf-8") + b"\n" + qual.encode("utf-8") + b"\n"
    if _OPS[name].arg is None:
        return code
    raise ValueError(f"cannot encode {name}")


def int_op(value: int) -> bytes:
    if 0 <= value < 256:
        return enc("BININT1", value)
    if 0 <= value < 65536:
        return enc("BININT2", value)
    if -(2**31) <= value < 2**31:
        return enc("BININT", value)
    return enc("LONG1", value)


def fix_frames(ops: list[Op]) -> list[Op]:
    """Recompute FRAME lengths after an edit, so the mutation is the only thing that changed."""
    out = list(ops)
    for i, op in enumerate(out):
        if op.name != "FRAME":
            continue
        j = i + 1
        size = 0
        while j < len(out) and out[j].name != "FRAME":
            size += len(out[j].raw)
            j += 1
        out[i] = Op("FRAME", size, enc("FRAME", size))
    return out


def join_ops(ops: list[Op]) -> bytes:
    return b"".join(op.raw for op in fix_frames(ops))


def memo_map(ops: list[Op]) -> dict[int, int]:
    """op index of each memo store -> the memo index it writes (MEMOIZE counts as CPython does)."""
    out: dict[int, int] = {}
    memo: set[int] = set()
    for i, op in enumerate(ops):
        if op.name == "MEMOIZE":
            out[i] = len(memo)
        elif op.name in ("PUT", "BINPUT", "LONG_BINPUT"):
            out[i] = int(op.arg)
        else:
            continue
        memo.add(out[i])
    return out


def _get(index: int) -> bytes:
    return enc("BINGET", index) if index < 256 else enc("LONG_BINGET", index)


_PUSH1 = _STRING_OPS | _INT_OPS | _GET_OPS | {
    "GLOBAL", "NONE", "NEWTRUE", "NEWFALSE", "EMPTY_DICT", "EMPTY_LIST", "EMPTY_TUPLE", "EMPTY_SET", "BINFLOAT", "FLOAT",
    "SHORT_BINBYTES", "BINBYTES", "BINBYTES8", "BYTEARRAY8", "PERSID",
}  # fmt: skip
_EFFECT = {"STACK_GLOBAL": -1, "TUPLE1": 0, "TUPLE2": -1, "TUPLE3": -2, "REDUCE": -1, "BINPERSID": 0, "BUILD": -1, "NEWOBJ": -1}
_POPMARK_PUSH = {"TUPLE": 1, "LIST": 1, "DICT": 1, "FROZENSET": 1, "SETITEMS": 0, "APPENDS": 0, "ADDITEMS": 0, "POP_MARK": 0}


def element_end(ops: list[Op], i: int) -> int | None:
    """j such that ops[i:j] push exactly one value (memo stores after it included); None if unsure."""
    depth = 0
    level = 0
    j = i
    while j < len(ops):
        name = ops[j].name
        if name == "MARK":
            level += 1
        elif name in _POPMARK_PUSH:
            if level == 0:
                return None
            level -= 1
            if level == 0:
                depth += _POPMARK_PUSH[name]
        elif level == 0:
            if name in _PUSH1:
                depth += 1
            elif name in _EFFECT:
                depth += _EFFECT[name]
            elif name in _PUT_OPS or name == "FRAME":
                pass
            else:
                return None
        j += 1
        if level == 0 and depth == 1 and (j >= len(ops) or ops[j].name not in _PUT_OPS):
            return j
        if depth < 0:
            return None
    return None


def mark_start(ops: list[Op], tuple_at: int) -> int | None:
    """Index of the MARK matched by the pop-mark op at ``tuple_at``."""
    level = 0
    for j in range(tuple_at - 1, -1, -1):
        name = ops[j].name
        if name in _POPMARK_PUSH or name in ("OBJ", "INST"):
            level += 1
        elif name == "MARK":
            if level == 0:
                return j
            level -= 1
    return None


def _string_value(op: Op) -> str | None:
    if op.name in ("BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8", "UNICODE"):
        return op.arg
    if op.name in ("SHORT_BINSTRING", "BINSTRING", "STRING"):
        # pickletools shows these bytes as latin-1 text; torch.load decodes them as UTF-8 (its default encoding).
        raw = op.arg.encode("latin-1") if isinstance(op.arg, str) else op.arg
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return None
    return None


def _rand_string_op(rng: random.Random, value: str, *, allow_bytes: bool = False) -> bytes:
    choices = ["BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8", "UNICODE", "SHORT_BINSTRING", "BINSTRING", "STRING"]
    if allow_bytes:
        choices.append("SHORT_BINBYTES")
    name = rng.choice(choices)
    body = value.encode("utf-8", "surrogatepass")
    if name in ("SHORT_BINUNICODE", "SHORT_BINSTRING", "SHORT_BINBYTES") and len(body) > 255:
        name = "BINUNICODE"
    if name == "SHORT_BINBYTES":
        return enc(name, body)
    return enc(name, value)


STORAGE_DTYPES_OF = {
    "DoubleStorage": "float64", "FloatStorage": "float32", "HalfStorage": "float16", "BFloat16Storage": "bfloat16",
    "LongStorage": "int64", "IntStorage": "int32", "ShortStorage": "int16", "CharStorage": "int8", "ByteStorage": "uint8",
    "BoolStorage": "bool", "ComplexFloatStorage": "complex64", "ComplexDoubleStorage": "complex128",
}  # fmt: skip
REBUILD_GLOBALS = [
    "torch._utils _rebuild_tensor", "torch._utils _rebuild_tensor_v2", "torch._utils _rebuild_tensor_v3", "torch._utils _rebuild_parameter",
    "torch._utils _rebuild_parameter_with_state", "torch._utils _rebuild_device_tensor_from_cpu_tensor",
    "torch._utils _rebuild_qtensor", "torch._utils _rebuild_meta_tensor_no_storage", "torch._utils _rebuild_sparse_tensor",
    "torch._tensor _rebuild_from_type_v2", "collections OrderedDict", "builtins set", "builtins getattr", "posix system",
    "torch.nn.parameter Parameter", "torch Size", "__builtin__ set", "copy_reg _reconstructor", "torch.tensor _rebuild_from_type_v2",
]  # fmt: skip


def _global_sites(ops: list[Op]) -> list[tuple[int, str, str]]:
    """(op index to replace, module, name) for each global; for STACK_GLOBAL the index of its name string."""
    out = []
    for i, op in enumerate(ops):
        if op.name == "GLOBAL":
            module, name = op.arg.split(" ", 1)
            out.append((i, module, name))
        elif op.name == "STACK_GLOBAL":
            j = i - 1
            while j >= 0 and ops[j].name in _PUT_OPS:
                j -= 1
            if j >= 0 and _string_value(ops[j]) is not None:
                out.append((j, "?", _string_value(ops[j]) or ""))
    return out


def _persid_sites(ops: list[Op]) -> list[tuple[int, int]]:
    """(MARK index, BINPERSID index) of each storage record built from a fresh tuple."""
    out = []
    for i, op in enumerate(ops):
        if op.name != "BINPERSID":
            continue
        j = i - 1
        while j >= 0 and ops[j].name in _PUT_OPS:
            j -= 1
        if j >= 0 and ops[j].name == "TUPLE":
            start = mark_start(ops, j)
            if start is not None:
                out.append((start, i))
    return out


class Mutator:
    """Structural mutations of one pickle's opcodes. Each returns the new ops and a short description, or None."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def run(self, op_name: str, ops: list[Op]) -> tuple[list[Op], str] | None:
        result: tuple[list[Op], str] | None = getattr(self, "m_" + op_name.replace("-", "_"))(list(ops))
        return result

    @staticmethod
    def raw_op(raw: bytes) -> Op:
        return Op("RAW", None, raw)

    def m_opcode_delete(self, ops: list[Op]) -> tuple[list[Op], str] | None:
        i = self.rng.randrange(1, len(ops) - 1) if len(ops) > 2 else 0
        name = ops[i].name
        del ops[i]
        return ops, f"deleted {name} (op {i})"

    def m_opcode_dup(self, ops: list[Op]) -> tuple[list[Op], str] | None:
        i = self.rng.randrange(1, len(ops) - 1) if len(ops) > 2 else 0
        ops.insert(i, ops[i])
        return ops, f"duplicated {ops[i].name} (op {i})"

    def m_opcode_swap(self, ops: list[Op]) -> tuple[list[Op], str] | None:
        if len(ops) < 4:
            return None
        i = self.rng.randrange(1, len(ops) - 2)
        ops[i], ops[i + 1] = ops[i + 1], ops[i]
        return ops, f"swapped {ops[i + 1].name} and {ops[i].name} (op {i})"

    def m_opcode_insert(self, ops: list[Op]) -> tuple[list[Op], str] | None:
        r = self.rng
        mm = memo_map(ops)
        memo = sorted(set(mm.values()))
        palette: list[tuple[str, bytes]] = [
            ("BUILD", enc("BUILD")), ("POP", enc("POP")), ("DUP", enc("DUP")), ("MARK", enc("MARK")), ("TUPLE", enc("TUPLE")),
            ("EMPTY_DICT", enc("EMPTY_DICT")), ("NONE", enc("NONE")), ("SETITEM", enc("SETITEM")), ("APPEND", enc("APPEND")),
            ("EMPTY_LIST", enc("EMPTY_LIST")), ("NEWTRUE", enc("NEWTRUE")), ("BININT1", enc("BININT1", r.randrange(256))),
            ("STRING", _rand_string_op(r, r.choice(ODD_KEYS + PLAIN_KEYS))), ("REDUCE", enc("REDUCE")), ("TUPLE2", enc("TUPLE2")),
            ("GLOBAL", enc("GLOBAL", r.choice(REBUILD_GLOBALS))), ("STOP", enc("STOP")), ("POP_MARK", enc("POP_MARK")),
            ("EMPTY_TUPLE", enc("EMPTY_TUPLE")), ("SETITEMS", enc("SETITEMS")), ("NEWOBJ", enc("NEWOBJ")),
        ]  # fmt: skip
        if memo:
            palette.append(("BINGET", _get(r.choice(memo))))
        name, raw = r.choice(palette)
        i = r.randrange(1, len(ops))
        ops.insert(i, self.raw_op(raw))
        return ops, f"inserted {name} before op {i}"

    def m_int_arg(self, ops: list[Op]) -> tuple[list[Op], str] | None:
        sites = [i for i, op in enumerate(ops) if op.name in ("BININT", "BININT1", "BININT2", "LONG1", "INT")]
        if not sites:
            return None
        r = self.rng
        i = r.choice(sites)
        old = int(ops[i].arg) if not isinstance(ops[i].arg, bool) else int(ops[i].arg)
        new = r.choice([old + 1, old - 1, 0, 1, 2, old * 2, old + 7, 255, 256, 65535, 2**31 - 1, 2**32, 2**40, 2**62, -1, old // 2])
        ops[i] = self.raw_op(int_op(new))
        return ops, f"int {old} -> {new} (op {i})"

    def m_storage_type(self, ops: list[Op]) -> tuple[list[Op], str] | None:
        sites = [(i, m, n) for i, m, n in _global_sites(ops) if n.endswith("Storage")]
        if not sites:
            return None
        i, module, name = self.rng.choice(sites)
        new = self.rng.choice([s for s in [*STORAGE_CLASSES, "UntypedStorage", "Float8Storage", "floatstorage"] if s != name])
        if ops[i].name == "GLOBAL":
            ops[i] = self.raw_op(enc("GLOBAL", f"{module} {new}"))
        else:
            ops[i] = self.raw_op(enc(ops[i].name, new) if ops[i].name in _STRING_OPS else enc("SHORT_BINUNICODE", new))
        return ops, f"storage type {name} -> {new}"

    def m_retype_ref(self, ops: list[Op]) -> tuple[list[Op], str] | None:
        """A storage key declared a second time with another storage type (torch keeps the first it sees)."""
        r = self.rng
        sites = _persid_sites(ops)
        if not sites:
            return None
        mm = memo_map(ops)
        start, persid = r.choice(sites)
        span = ops[start : persid + 1]  # MARK 'storage' TYPE key location numel TUPLE [memo] BINPERSID
        first_end = element_end(span, 1)
        second_end = element_end(span, first_end) if first_end is not None else None
        if first_end is None or second_end is None:
            return None
        old_type = next((str(_string_value(o) or o.arg) for o in span[first_end:second_end] if o.name in ("GLOBAL", *_STRING_OPS)), "?")
        new = r.choice([s for s in STORAGE_CLASSES if not old_type.endswith(s)])
        # The copy stores nothing in the memo, so every later GET keeps its meaning.
        copy = [o for o in span[:first_end] if o.name not in _PUT_OPS]
        copy.append(self.raw_op(enc("GLOBAL", f"torch {new}")))
        copy += [o for o in span[second_end:] if o.name not in _PUT_OPS]
        storage_memo = mm.get(persid + 1)
        gets = [i for i, op in enumerate(ops) if op.name in _GET_OPS and storage_memo is not None and op.arg == storage_memo]
        variant = r.choice(["later-get", "before", "after"]) if gets else r.choice(["before", "after"])
        if variant == "later-get":
            at = r.choice(gets)
            ops[at : at + 1] = copy
            return ops, f"a later use of storage record (memo {storage_memo}) re-declares it as {new} (first declared {old_type})"
        if variant == "before":
            ops[start:start] = [*copy, self.raw_op(enc("POP"))]
            return ops, f"the storage key is first declared as {new} (dropped), then as {old_type}"
        at = persid + 1
        while at < len(ops) and ops[at].name in _PUT_OPS:
            at += 1
        ops[at:at] = [*copy, self.raw_op(enc("POP"))]
        return ops, f"the storage key declared as {old_type}, then again as {new} (dropped)"

    @staticmethod
    def _memos_after(ops: list[Op], opname: str, before: int) -> list[int]:
        """Memo indices holding the results of ``opname`` ops that run before op ``before``."""
        mm = memo_map(ops)
        return [mm[i + 1] for i, op in enumerate(ops[:before]) if op.name == opname and (i + 1) in mm and i + 1 < before]

    def _tensor_memos(self, ops: list[Op], before: int) -> list[int]:
        return self._memos_after(ops, "REDUCE", before)

    def _storage_memos(self, ops: list[Op], before: int) -> list[int]:
        return self._memos_after(ops, "BINPERSID", before)

    def m_build(self, ops: list[Op]) -> tuple[list[Op], str] | None:
        """A BUILD after a call: Tensor.set_ state, a 5-tuple that replaces ``data``, or an attribute holding a tensor."""
        r = self.rng
        sites = [i for i, op in enumerate(ops) if op.name in ("REDUCE", "NEWOBJ")]
        if not sites:
            return None
        i = r.choice(sites)
        while i + 1 < len(ops) and ops[i + 1].name in _PUT_OPS:
            i += 1
        tensors = self._tensor_memos(ops, i + 1)
        storages = self._storage_memos(ops, i + 1)
        variant = r.choice(["set", "data", "attr", "slots", "empty", "none"])
        state: bytes
        if variant == "set" and storages:
            n = r.randint(0, 4)
            state = (
                enc("MARK") + _get(r.choice(storages)) + int_op(0) + enc("MARK") + int_op(n) + enc("TUPLE")
                + enc("MARK") + int_op(1) + enc("TUPLE") + enc("TUPLE")
            )  # fmt: skip
        elif variant == "data" and tensors:
            state = enc("MARK") + _get(r.choice(tensors)) + enc("NONE") + enc("NONE") + enc("NEWFALSE") + enc("EMPTY_DICT") + enc("TUPLE")
        elif variant == "attr" and tensors:
            key = r.choice(["hidden", "data", "_metadata", "weight", "__dict__", "requires_grad"])
            state = enc("EMPTY_DICT") + enc("BINUNICODE", key) + _get(r.choice(tensors)) + enc("SETITEM")
        elif variant == "slots" and tensors:
            state = enc("NONE") + enc("EMPTY_DICT") + enc("BINUNICODE", "hidden") + _get(r.choice(tensors)) + enc("SETITEM") + enc("TUPLE2")
        elif variant == "none":
            state = enc("NONE")
        else:
            state = enc("EMPTY_DICT")
            variant = "empty"
        ops.insert(i + 1, self.raw_op(state + enc("BUILD")))
        return ops, f"BUILD ({variant}) after {ops[i].name} at op {i}"

    def m_wrap(self, ops: list[Op]) -> tuple[list[Op], str] | None:
        """Replace a rebuilt tensor by an allowlisted call on it that changes its dtype, kind or data."""
        r = self.rng
        mm = memo_map(ops)
        sites = [i for i, op in enumerate(ops) if op.name == "REDUCE" and (i + 1) in mm]
        if not sites:
            return None
        i = r.choice(sites)
        t = _get(mm[i + 1])
        dtype_text = r.choice(["float16", "float32", "bfloat16", "int8", "float64", "bool", "float8_e4m3fn"])
        dtype = Asm.g(f"torch {dtype_text}")
        g, tup, call = Asm.g, Asm.tup, Asm.call
        cast_args = (t, dtype, Asm.s("cpu"), Asm.FALSE)
        new_type = r.choice(["torch Tensor", "torch.nn.parameter Parameter"])
        meta_size = r.randint(0, 4)
        attr = r.choice(["data", "hidden", "_data"])
        variants: dict[str, bytes] = {
            "device-cast": call("torch._utils _rebuild_device_tensor_from_cpu_tensor", *cast_args),
            "parameter": call("torch._utils _rebuild_parameter", t, Asm.FALSE, Asm.odict()),
            "parameter-newobj": g("torch.nn.parameter Parameter") + tup(t, Asm.FALSE) + enc("NEWOBJ"),
            "parameter-call": call("torch.nn.parameter Parameter", t),
            "from-type": call(
                "torch._tensor _rebuild_from_type_v2",
                g("torch._utils _rebuild_device_tensor_from_cpu_tensor"),
                g(new_type),
                tup(*cast_args),
                enc("EMPTY_DICT"),
            ),
            "meta": call("torch._utils _rebuild_meta_tensor_no_storage", dtype, Asm.ints((meta_size,)), Asm.ints((1,)), Asm.FALSE),
            "set-attr-state": call("torch._utils _rebuild_parameter_with_state", t, Asm.FALSE, Asm.odict(), Asm.dict_((Asm.s(attr), t))),
        }
        storages = self._storage_memos(ops, i + 1)
        if storages:
            n = r.randint(0, 4)
            variants["v3"] = call(
                "torch._utils _rebuild_tensor_v3",
                _get(r.choice(storages)),
                Asm.i(0),
                Asm.ints((n,)),
                Asm.ints((1,)),
                Asm.FALSE,
                Asm.odict(),
                dtype,
            )
        name = r.choice(sorted(variants))
        at = i + 1
        while at < len(ops) and ops[at].name in _PUT_OPS:
            at += 1
        ops.insert(at, self.raw_op(enc("POP") + variants[name]))
        return ops, f"wrapped the value of op {i} ({name}, dtype {dtype_text})"

    def m_trailing(self, ops: list[Op]) -> tuple[list[Op], str] | None:
        """A second pickle after STOP: torch.load reads the first one only."""
        r = self.rng
        extra = r.choice(
            [
                pickle.dumps({"w": 1}, protocol=2),
                join_ops(ops),
                b"\x80\x02cposix\nsystem\nX\x04\x00\x00\x00true\x85R.",
                Asm.pickle_of(Asm.dict_((Asm.s("w"), Asm.tensor("0", "HalfStorage")))),
                b"\x00" * 8,
            ]
        )
        ops.append(self.raw_op(extra))
        return ops, f"{len(extra)} bytes after STOP ({extra[:12]!r})"

    def m_bool_flip(self, ops: list[Op]) -> tuple[list[Op], str] | None:
        """requires_grad and similar flags: NEWFALSE <-> NEWTRUE (or an int / None in their place)."""
        sites = [i for i, op in enumerate(ops) if op.name in ("NEWFALSE", "NEWTRUE")]
        if not sites:
            return None
        i = self.rng.choice(sites)
        old = ops[i].name
        new = self.rng.choice(["NEWTRUE" if old == "NEWFALSE" else "NEWFALSE", "NONE", "BININT1"])
        ops[i] = self.raw_op(enc(new, 1) if new == "BININT1" else enc(new))
        return ops, f"{old} -> {new} (op {i})"

    def m_multi(self, ops: list[Op]) -> tuple[list[Op], str] | None:
        notes = []
        for _ in range(self.rng.randint(2, 3)):
            name = self.rng.choice([m for m in PICKLE_MUTATIONS if m != "multi"])
            try:
                result = self.run(name, fix_frames(ops))
            except (ValueError, IndexError, KeyError, TypeError, struct.error):
                result = None
            if result is None:
                continue
            ops, note = result
            notes.append(f"{name}: {note}")
            try:  # the next mutation reads the opcodes again, as a decoder would
                ops, _ = parse_pickle(join_ops(ops))
            except (ValueError, IndexError, UnicodeDecodeError, struct.error):
                break
        return (ops, " / ".join(notes)) if notes else None

    def m_string_opcode(self, ops: list[Op]) -> tuple[list[Op], str] | None:
        sites = [i for i, op in enumerate(ops) if _string_value(op) is not None]
        if not sites:
            return None
        r = self.rng
        # prefer non-ASCII strings, where the spellings differ in meaning
        odd = [i for i in sites if not (_string_value(ops[i]) or "").isascii()]
        i = r.choice(odd) if odd and r.random() < 0.6 else r.choice(sites)
        value = _string_value(ops[i]) or ""
        try:
            raw = _rand_string_op(r, value, allow_bytes=r.random() < 0.1)
        except UnicodeEncodeError:
            return None
        old = ops[i].name
        ops[i] = self.raw_op(raw)
        return ops, f"string {value[:20]!r}: {old} -> {_OPS_BY_CODE.get(raw[:1], '?')}"

    def m_key_string(self, ops: list[Op]) -> tuple[list[Op], str] | None:
        sites = [i for i, op in enumerate(ops) if op.name in ("BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8")]
        if not sites:
            return None
        r = self.rng
        i = r.choice(sites)
        others = [_string_value(ops[j]) for j in sites if j != i]
        new = r.choice([*ODD_KEYS, *(o for o in others if o)]) if others else r.choice(ODD_KEYS)
        old = _string_value(ops[i])
        ops[i] = self.raw_op(enc("BINUNICODE", new))
        return ops, f"string {str(old)[:20]!r} -> {new[:20]!r}"

    def m_protocol_byte(self, ops: list[Op]) -> tuple[list[Op], str] | None:
        r = self.rng
        new = r.choice([0, 1, 2, 3, 4, 5, 6, 255])
        if ops and ops[0].name == "PROTO":
            if r.random() < 0.15:
                del ops[0]
                return ops, "PROTO removed"
            old = ops[0].arg
            ops[0] = self.raw_op(enc("PROTO", new))
            return ops, f"PROTO {old} -> {new}"
        ops.insert(0, self.raw_op(enc("PROTO", new)))
        return ops, f"PROTO {new} added"

    def m_memo_index(self, ops: list[Op]) -> tuple[list[Op], str] | None:
        gets = [i for i, op in enumerate(ops) if op.name in _GET_OPS]
        memo = sorted(set(memo_map(ops).values()))
        if not gets or not memo:
            return None
        r = self.rng
        i = r.choice(gets)
        new = r.choice(memo)
        old = ops[i].arg
        ops[i] = self.raw_op(_get(new))
        return ops, f"GET {old} -> {new}"

    def m_global_swap(self, ops: list[Op]) -> tuple[list[Op], str] | None:
        sites = [(i, m, n) for i, m, n in _global_sites(ops) if not n.endswith("Storage")]
        if not sites:
            return None
        r = self.rng
        i, module, name = r.choice(sites)
        new = r.choice(REBUILD_GLOBALS)
        if ops[i].name == "GLOBAL":
            ops[i] = self.raw_op(enc("GLOBAL", new))
        else:
            ops[i] = self.raw_op(enc("SHORT_BINUNICODE", new.split(" ", 1)[1]))
        return ops, f"global {module}.{name} -> {new.replace(' ', '.')}"

    def m_frame(self, ops: list[Op]) -> tuple[list[Op], str] | None:
        frames = [i for i, op in enumerate(ops) if op.name == "FRAME"]
        if not frames:
            return None
        i = self.rng.choice(frames)
        del ops[i]
        return ops, "FRAME removed"


_OPS_BY_CODE = {op.code.encode("latin-1"): op.name for op in pickletools.opcodes}
PICKLE_MUTATIONS = [
    "opcode-delete", "opcode-dup", "opcode-swap", "opcode-insert", "int-arg", "storage-type", "retype-ref", "build",
    "string-opcode", "key-string", "protocol-byte", "memo-index", "global-swap", "frame", "wrap", "multi", "bool-flip", "trailing",
]  # fmt: skip
# the semantic mutations, drawn more often than the generic ones
PICKLE_WEIGHTS = {"retype-ref": 3, "build": 3, "wrap": 3, "storage-type": 2, "string-opcode": 2, "int-arg": 2, "multi": 2, "global-swap": 2}


def byte_mutate(data: bytes, rng: random.Random, n: int | None = None) -> bytes:
    blob = bytearray(data)
    for _ in range(n or rng.randint(1, 4)):
        if not blob:
            break
        pos = rng.randrange(len(blob))
        op = rng.choice(("flip", "set", "cut", "dup", "insert"))
        if op == "flip":
            blob[pos] ^= 1 << rng.randrange(8)
        elif op == "set":
            blob[pos] = rng.randrange(256)
        elif op == "cut":
            del blob[pos : pos + rng.randint(1, 8)]
        elif op == "dup":
            blob[pos:pos] = blob[pos : pos + rng.randint(1, 8)]
        else:
            blob[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 4)))
    return bytes(blob)


# -- a small assembler, for crafted reproducers ------------------------------------------------------------


class Asm:
    """Pickle fragments that each push one value; ``pickle_of(root)`` closes a protocol-2 stream."""

    FALSE = enc("NEWFALSE")
    TRUE = enc("NEWTRUE")
    NONE = enc("NONE")

    @staticmethod
    def s(text: str) -> bytes:
        return enc("BINUNICODE", text)

    @staticmethod
    def i(value: int) -> bytes:
        return int_op(value)

    @staticmethod
    def g(qualname: str) -> bytes:
        return enc("GLOBAL", qualname)

    @staticmethod
    def tup(*items: bytes) -> bytes:
        return enc("MARK") + b"".join(items) + enc("TUPLE")

    @classmethod
    def ints(cls, values: Iterable[int]) -> bytes:
        return cls.tup(*(cls.i(v) for v in values))

    @classmethod
    def call(cls, qualname: str, *args: bytes) -> bytes:
        return cls.g(qualname) + cls.tup(*args) + enc("REDUCE")

    @classmethod
    def odict(cls) -> bytes:
        return cls.call("collections OrderedDict")

    @staticmethod
    def dict_(*pairs: tuple[bytes, bytes]) -> bytes:
        return enc("EMPTY_DICT") + (enc("MARK") + b"".join(k + v for k, v in pairs) + enc("SETITEMS") if pairs else b"")

    @staticmethod
    def put(index: int) -> bytes:
        return enc("BINPUT", index)

    @staticmethod
    def get(index: int) -> bytes:
        return enc("BINGET", index)

    @classmethod
    def storage(cls, key: str, storage_class: str = "FloatStorage", numel: int = 2) -> bytes:
        return cls.tup(cls.s("storage"), cls.g(f"torch {storage_class}"), cls.s(key), cls.s("cpu"), cls.i(numel)) + enc("BINPERSID")

    @classmethod
    def tensor(
        cls, key: str = "0", storage_class: str = "FloatStorage", size: tuple[int, ...] = (2,), *, storage: bytes | None = None
    ) -> bytes:
        """torch._utils._rebuild_tensor_v2 of a contiguous tensor, as torch.save writes it."""
        numel = 1
        for d in size:
            numel *= d
        stride = [1] * len(size)
        for k in range(len(size) - 2, -1, -1):
            stride[k] = stride[k + 1] * size[k + 1]
        src = storage if storage is not None else cls.storage(key, storage_class, numel)
        return cls.call("torch._utils _rebuild_tensor_v2", src, cls.i(0), cls.ints(size), cls.ints(stride), cls.FALSE, cls.odict())

    @staticmethod
    def pickle_of(root: bytes) -> bytes:
        return enc("PROTO", 2) + root + enc("STOP")


def torch_archive(pkl: bytes, storages: dict[str, bytes]) -> bytes:
    """A zip archive laid out as torch.save lays it out, around a crafted data.pkl."""
    members = [("archive/data.pkl", pkl, zipfile.ZIP_STORED), ("archive/byteorder", b"little", zipfile.ZIP_STORED)]
    members += [(f"archive/data/{k}", v, zipfile.ZIP_STORED) for k, v in storages.items()]
    members.append(("archive/version", b"3\n", zipfile.ZIP_STORED))
    return build_zip(members)


# -- containers: zip and legacy surgery ------------------------------------------------------------------


def zip_members(data: bytes) -> list[tuple[str, bytes, int]]:
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        return [(i.filename, zf.read(i), i.compress_type) for i in zf.infolist()]


def build_zip(members: Iterable[tuple[str, bytes, int]]) -> bytes:
    out = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # duplicate names are the point of some mutations
        with zipfile.ZipFile(out, "w") as zf:
            for name, body, compress in members:
                info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
                info.compress_type = compress
                zf.writestr(info, body)
    return out.getvalue()


def _pkl_name(members: list[tuple[str, bytes, int]]) -> str | None:
    return next((n for n, _, _ in members if n.endswith("data.pkl")), None)


def legacy_main_span(data: bytes) -> tuple[int, int]:
    """Offsets of a legacy file's main pickle (after magic, protocol and sys_info)."""
    pos = 0
    for _ in range(3):
        _, pos = parse_pickle(data, pos)
    _, end = parse_pickle(data, pos)
    return pos, end


@dataclass
class ZipRecord:
    name: str
    central: int
    """Offset of its central directory header."""
    local: int
    """Offset of its local header (as the central directory says)."""


def zip_layout(data: bytes) -> tuple[int, int, list[ZipRecord]] | None:
    """(EOCD offset, central directory offset, records); None for archives this simple parser does not handle."""
    eocd = data.rfind(b"PK\x05\x06")
    if eocd < 0 or eocd + 22 > len(data):
        return None
    count, cd_size, cd_off = struct.unpack("<HII", data[eocd + 10 : eocd + 20])
    if cd_off == 0xFFFFFFFF or count == 0xFFFF:
        return None
    records = []
    pos = cd_off
    for _ in range(count):
        if data[pos : pos + 4] != b"PK\x01\x02":
            return None
        n, m, k = struct.unpack("<HHH", data[pos + 28 : pos + 34])
        (local,) = struct.unpack("<I", data[pos + 42 : pos + 46])
        name = data[pos + 46 : pos + 46 + n].decode("utf-8", "replace")
        records.append(ZipRecord(name, pos, local))
        pos += 46 + n + m + k
    return eocd, cd_off, records


def _swapcase_one(name: str, rng: random.Random) -> str:
    letters = [i for i, c in enumerate(name) if c.isalpha()]
    if not letters:
        return name + "X"
    i = rng.choice(letters)
    return name[:i] + name[i].swapcase() + name[i + 1 :]


ZIP_MUTATIONS = [
    "zip-prefix", "zip-case", "zip-rename", "zip-swap-records", "zip-dup", "zip-drop", "zip-extra", "zip-compress", "zip-byteorder",
    "zip-cd-offset", "zip-local-name", "zip-central-name", "zip-local-offset", "zip-prepend", "zip-append", "zip-size", "zip-bytes",
]  # fmt: skip


def mutate_zip(data: bytes, op: str, rng: random.Random) -> tuple[bytes, str] | None:
    members = zip_members(data)
    names = [n for n, _, _ in members]
    pkl = _pkl_name(members)
    prefix = pkl[: -len("data.pkl")] if pkl else ""
    storages = [n for n in names if n.startswith(prefix + "data/")]
    if op == "zip-prefix":
        new = rng.choice(["other/", "a/", "archive.pt/", "ARCHIVE/", "x/y/", "", "é/"])
        which = rng.random() < 0.7
        out = [((new + n[len(prefix) :]) if (which or n == pkl) and n.startswith(prefix) else n, b, c) for n, b, c in members]
        return build_zip(out), f"prefix {prefix!r} -> {new!r} ({'all entries' if which else 'data.pkl only'})"
    if op == "zip-case":
        target = rng.choice([pkl, *storages, *names]) if pkl else rng.choice(names)
        new = _swapcase_one(target, rng)
        return build_zip([(new if n == target else n, b, c) for n, b, c in members]), f"renamed {target!r} -> {new!r}"
    if op == "zip-rename":
        target = rng.choice(storages or names)
        new = (
            target + rng.choice(["0", "/", " ", ".bak"])
            if rng.random() < 0.5
            else target.replace("data/", rng.choice(["data//", "Data/", "./data/"]))
        )
        return build_zip([(new if n == target else n, b, c) for n, b, c in members]), f"renamed {target!r} -> {new!r}"
    if op == "zip-swap-records" and len(storages) >= 2:
        a, b_ = rng.sample(storages, 2)
        out = [((b_ if n == a else a if n == b_ else n), body, c) for n, body, c in members]
        return build_zip(out), f"swapped the names of {a!r} and {b_!r}"
    if op == "zip-dup":
        target = rng.choice([pkl, *storages] if pkl else names)
        body = next(b for n, b, _ in members if n == target)
        other = rng.choice(
            [byte_mutate(body, rng), body + body, b"", *(b for n, b, _ in members if n in storages and n != target)]
            if target != pkl
            else [byte_mutate(body, rng), pickle.dumps({"w": 1}, protocol=2), body]
        )
        before = rng.random() < 0.5
        out = []
        for n, b, c in members:
            if n == target and before:
                out.append((n, other, zipfile.ZIP_STORED))
            out.append((n, b, c))
            if n == target and not before:
                out.append((n, other, zipfile.ZIP_STORED))
        return build_zip(out), f"entry {target!r} twice ({'new one first' if before else 'new one last'})"
    if op == "zip-drop":
        target = rng.choice(names)
        return build_zip([m for m in members if m[0] != target]), f"dropped {target!r}"
    if op == "zip-extra":
        extra = rng.choice(
            [
                (prefix + "constants.pkl", pickle.dumps((), protocol=2)),
                ("other/data.pkl", pickle.dumps({"w": 1}, protocol=2)),
                (prefix + "DATA.PKL", pickle.dumps({"w": 1}, protocol=2)),
                (prefix + "data.pkl/", b""),
                (prefix + "extra/data.pkl", b"junk"),
                ("README", b"hello"),
                (prefix + "data/999", b"\x00" * 16),
                (prefix + ".data/version", b"3\n"),
            ]
        )
        out = [*members, (*extra, zipfile.ZIP_STORED)] if rng.random() < 0.5 else [(*extra, zipfile.ZIP_STORED), *members]
        return build_zip(out), f"added {extra[0]!r}"
    if op == "zip-compress":
        target = rng.choice([pkl, *storages] if pkl else names)
        return build_zip([(n, b, zipfile.ZIP_DEFLATED if n == target else c) for n, b, c in members]), f"compressed {target!r}"
    if op == "zip-byteorder":
        value = rng.choice([b"big", b"little\n", b"BIG", b"", b"middle", None])
        target = prefix + "byteorder"
        if value is None:
            return build_zip([m for m in members if m[0] != target]), "byteorder record removed"
        out = [(n, value if n == target else b, c) for n, b, c in members]
        if target not in names:
            out.append((target, value, zipfile.ZIP_STORED))
        return build_zip(out), f"byteorder {value!r}"
    if op == "zip-bytes":
        return byte_mutate(data, rng), "random bytes in the archive"
    layout = zip_layout(data)
    if layout is None:
        return None
    eocd, cd_off, records = layout
    buf = bytearray(data)
    if op == "zip-cd-offset":
        delta = rng.choice([-46, -1, 1, 4, 22, -cd_off])
        struct.pack_into("<I", buf, eocd + 16, max(0, cd_off + delta))
        return bytes(buf), f"central directory offset {cd_off} -> {max(0, cd_off + delta)}"
    if op in ("zip-local-name", "zip-central-name"):
        rec = rng.choice(records)
        new = _swapcase_one(rec.name, rng) if rng.random() < 0.6 else rec.name[:-1] + ("1" if rec.name[-1:] != "1" else "2")
        raw = new.encode("utf-8")
        if len(raw) != len(rec.name.encode("utf-8")):
            return None
        at = rec.local + 30 if op == "zip-local-name" else rec.central + 46
        buf[at : at + len(raw)] = raw
        return bytes(buf), f"{'local' if op == 'zip-local-name' else 'central'} header name {rec.name!r} -> {new!r}"
    if op == "zip-local-offset" and len(records) >= 2:
        a, b_ = rng.sample(records, 2)
        struct.pack_into("<I", buf, a.central + 42, b_.local)
        return bytes(buf), f"central entry {a.name!r} points at the local header of {b_.name!r}"
    if op == "zip-prepend":
        junk = rng.choice(
            [b"\x00" * 16, b"PK\x03\x04" + b"\x00" * 26, b"GIF89a", torch_bytes({"x": torch.ones(1)}, legacy=False, protocol=2)]
        )
        return junk + data, f"{len(junk)} bytes prepended"
    if op == "zip-append":
        tail = rng.choice(
            [b"\x00" * 8, data, build_zip([(prefix + "data.pkl", pickle.dumps({"w": 1}, protocol=2), 0)]), b"PK\x05\x06" + b"\x00" * 18]
        )
        return data + tail, f"{len(tail)} bytes appended"
    if op == "zip-size":
        rec = rng.choice(records)
        (size,) = struct.unpack("<I", data[rec.central + 24 : rec.central + 28])
        new_size = rng.choice([0, size + 1, max(0, size - 1), size * 2, 0xFFFFFFFF])
        where = rng.choice(["central", "local", "both"])
        if where in ("central", "both"):
            struct.pack_into("<II", buf, rec.central + 20, new_size, new_size)
        if where in ("local", "both"):
            struct.pack_into("<II", buf, rec.local + 18, new_size, new_size)
        return bytes(buf), f"{where} size of {rec.name!r} {size} -> {new_size}"
    return None


LEGACY_MUTATIONS = ["legacy-keys", "legacy-count", "legacy-header", "legacy-trailing"]


def legacy_spans(data: bytes) -> list[tuple[int, int]]:
    """Offsets of a legacy file's five pickles: magic number, protocol, sys_info, main, storage keys."""
    spans = []
    pos = 0
    for _ in range(5):
        _, end = parse_pickle(data, pos)
        spans.append((pos, end))
        pos = end
    return spans


def mutate_legacy(data: bytes, op: str, rng: random.Random) -> tuple[bytes, str] | None:
    """Mutations of what surrounds a legacy file's main pickle: its header, storage-key list and storage records."""
    spans = legacy_spans(data)
    keys_start, keys_end = spans[4]
    keys = [str(o.arg) for o in parse_pickle(data, keys_start)[0] if o.name in _STRING_OPS]
    if op == "legacy-keys":
        choice = rng.choice(["reverse", "dup", "drop", "extra", "empty", "not-a-list"])
        new = list(keys)
        if choice == "reverse":
            new.reverse()
        elif choice == "dup" and new:
            new.insert(rng.randrange(len(new) + 1), rng.choice(new))
        elif choice == "drop" and new:
            new.pop(rng.randrange(len(new)))
        elif choice == "extra":
            new.append("999")
        elif choice == "empty":
            new = []
        body = (
            Asm.dict_((Asm.s("k"), Asm.s("v")))
            if choice == "not-a-list"
            else enc("EMPTY_LIST") + (enc("MARK") + b"".join(Asm.s(k) for k in new) + enc("APPENDS") if new else b"")
        )
        return data[:keys_start] + Asm.pickle_of(body) + data[keys_end:], f"storage keys {keys[:4]} -> {choice}"
    if op == "legacy-count":
        if keys_end + 8 > len(data):
            return None
        (count,) = struct.unpack("<q", data[keys_end : keys_end + 8])
        new = rng.choice([count + 1, count - 1, 0, count * 2, 2**40, -1])
        return data[:keys_end] + struct.pack("<q", new) + data[keys_end + 8 :], f"first storage record count {count} -> {new}"
    if op == "legacy-header":
        which = rng.choice(["magic", "protocol", "little_endian", "type_sizes", "sys_info"])
        start, end = spans[{"magic": 0, "protocol": 1}.get(which, 2)]
        if which == "magic":
            body = Asm.i(0x1950A86A20F9469CFC6C + rng.choice([1, -1]))
        elif which == "protocol":
            body = Asm.i(rng.choice([1000, 1002, 2]))
        else:
            sizes = Asm.dict_((Asm.s("short"), Asm.i(2)), (Asm.s("int"), Asm.i(4)), (Asm.s("long"), Asm.i(rng.choice([4, 8]))))
            little = Asm.FALSE if which == "little_endian" else Asm.TRUE
            body = (
                Asm.dict_((Asm.s("protocol_version"), Asm.i(1001)), (Asm.s("little_endian"), little), (Asm.s("type_sizes"), sizes))
                if which != "sys_info"
                else enc("EMPTY_LIST")
            )
        return data[:start] + Asm.pickle_of(body) + data[end:], f"header pickle '{which}' replaced"
    if op == "legacy-trailing":
        tail = rng.choice([b"\x00" * 8, data, pickle.dumps(["0"], protocol=2)])
        return data + tail, f"{len(tail)} bytes after the last storage"
    return None


def replace_pickle(data: bytes, legacy: bool, new_pickle: Callable[[bytes], bytes]) -> bytes:
    """Apply ``new_pickle`` to the checkpoint's main pickle only, re-packing the archive around it."""
    if legacy:
        start, end = legacy_main_span(data)
        return data[:start] + new_pickle(data[start:end]) + data[end:]
    members = zip_members(data)
    pkl = _pkl_name(members)
    return build_zip([(n, new_pickle(b) if n == pkl else b, c) for n, b, c in members])


# -- safetensors surgery --------------------------------------------------------------------------------

SAFETENSORS_MUTATIONS = [
    "st-dtype", "st-shape", "st-offsets", "st-pad", "st-len", "st-metadata", "st-dupkey", "st-extra-field", "st-escape",
    "st-trailing", "st-truncate", "st-order", "st-bom", "st-bytes", "st-name",
]  # fmt: skip
_ALL_CODES = sorted(set(SAFETENSORS_CODES.values()) | {"C128", "F8_E4M3FN", "f32", "F12", "I4", "U1", "BF8", ""})


def split_safetensors(data: bytes) -> tuple[dict[str, Any], bytes]:
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def join_safetensors(header_text: str | bytes, body: bytes, *, pad: bool = True) -> bytes:
    raw = header_text.encode("utf-8", "surrogatepass") if isinstance(header_text, str) else header_text
    if pad:
        raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + body


def mutate_safetensors(data: bytes, op: str, rng: random.Random) -> tuple[bytes, str] | None:
    header, body = split_safetensors(data)
    names = [k for k in header if k != "__metadata__"]
    if op == "st-dtype" and names:
        k = rng.choice(names)
        old = header[k]["dtype"]
        header[k]["dtype"] = rng.choice(_ALL_CODES)
        return join_safetensors(json.dumps(header), body), f"{k!r} dtype {old} -> {header[k]['dtype']}"
    if op == "st-shape" and names:
        k = rng.choice(names)
        old = list(header[k]["shape"])
        shape = list(old)
        choice = rng.choice(["reverse", "add1", "drop", "zero", "neg", "float", "str", "huge", "split"])
        if choice == "reverse":
            shape.reverse()
        elif choice == "add1":
            shape.insert(rng.randint(0, len(shape)), 1)
        elif choice == "drop" and shape:
            shape.pop(rng.randrange(len(shape)))
        elif choice == "zero":
            shape.append(0)
        elif choice == "neg":
            shape = [-1, *shape]
        elif choice == "float":
            shape = [float(d) for d in shape] or [1.0]
        elif choice == "str":
            shape = [str(d) for d in shape] or ["1"]
        elif choice == "huge":
            shape = [2**64 // 2, *shape]
        elif choice == "split" and shape and shape[-1] % 2 == 0 and shape[-1]:
            shape = [*shape[:-1], 2, shape[-1] // 2]
        header[k]["shape"] = shape
        return join_safetensors(json.dumps(header), body), f"{k!r} shape {old} -> {shape}"
    if op == "st-offsets" and names:
        k = rng.choice(names)
        old = list(header[k]["data_offsets"])
        choice = rng.choice(["shift", "swap", "overlap", "end", "reverse"])
        if choice == "shift":
            d = rng.choice([-1, 1, 8])
            header[k]["data_offsets"] = [old[0] + d, old[1] + d]
        elif choice == "swap" and len(names) > 1:
            other = rng.choice([n for n in names if n != k])
            header[k]["data_offsets"], header[other]["data_offsets"] = header[other]["data_offsets"], old
        elif choice == "overlap":
            header[k]["data_offsets"] = [0, old[1] - old[0]]
        elif choice == "end":
            header[k]["data_offsets"] = [old[0], old[1] + 1]
        else:
            header[k]["data_offsets"] = [old[1], old[0]]
        return join_safetensors(json.dumps(header), body), f"{k!r} offsets {old} -> {header[k]['data_offsets']}"
    if op == "st-pad":
        text = json.dumps(header)
        pad = rng.choice([" " * 8, "\n", "\t\t", "\x00" * 3, "\r\n", " " * 100])
        where = rng.choice(["after", "before"])
        text = text + pad if where == "after" else pad + text
        return join_safetensors(text, body, pad=False), f"header padded {where} with {pad[:4]!r}x{len(pad)}"
    if op == "st-len":
        (n,) = struct.unpack("<Q", data[:8])
        new = n + rng.choice([-8, -1, 1, 8, 2**32])
        return struct.pack("<Q", max(new, 0)) + data[8:], f"header length {n} -> {new}"
    if op == "st-metadata":
        meta = rng.choice([{"format": 1}, {"a": {"b": "c"}}, ["x"], None, {"format": "pt", "dtype": "float16"}, {"é": "ü"}, "str"])
        header["__metadata__"] = meta
        return join_safetensors(json.dumps(header), body), f"__metadata__ = {meta!r}"
    if op == "st-dupkey" and names:
        k = rng.choice(names)
        entry = dict(header[k])
        entry["dtype"] = rng.choice(_ALL_CODES[:8])
        text = json.dumps(header)
        dup = json.dumps({k: entry})[1:-1]
        text = text[:-1] + ", " + dup + "}" if rng.random() < 0.5 else "{" + dup + ", " + text[1:]
        return join_safetensors(text, body), f"{k!r} declared twice (other dtype {entry['dtype']})"
    if op == "st-extra-field" and names:
        k = rng.choice(names)
        field_ = rng.choice([("dtype_override", "F16"), ("offset", 4), ("shape2", [1]), ("Dtype", "F16")])
        header[k][field_[0]] = field_[1]
        return join_safetensors(json.dumps(header), body), f"{k!r} has extra field {field_[0]!r}"
    if op == "st-escape":
        return join_safetensors(
            json.dumps(header, ensure_ascii=rng.random() < 0.5).replace('"dtype"', '"d\\u0074ype"'), body
        ), "escaped 'dtype' key"
    if op == "st-name" and names:
        k = rng.choice(names)
        new = rng.choice(["__metadata__", "", k + " ", k.upper(), "a" * 1000, *names])
        header = {(new if n == k else n): v for n, v in header.items()}
        return join_safetensors(json.dumps(header), body), f"renamed {k!r} -> {new[:20]!r}"
    if op == "st-trailing":
        return data + bytes(rng.randint(1, 16)), "bytes after the data area"
    if op == "st-truncate" and len(body) > 0:
        return data[: -rng.randint(1, len(body))], "data area truncated"
    if op == "st-order" and len(names) > 1:
        items = list(header.items())
        rng.shuffle(items)
        return join_safetensors(json.dumps(dict(items)), body), "header entries reordered"
    if op == "st-bom":
        return join_safetensors("\ufeff" + json.dumps(header), body), "header starts with a BOM"
    if op == "st-bytes":
        (n,) = struct.unpack("<Q", data[:8])
        head = byte_mutate(data[8 : 8 + n], rng, 1)
        return struct.pack("<Q", len(head)) + head + data[8 + n :], "random bytes in the header"
    return None


# -- cases ----------------------------------------------------------------------------------------------


@dataclass
class Case:
    """One input, reproducible from ``key`` alone (:func:`make_case`)."""

    key: str
    container: str
    """``zip``, ``legacy`` or ``safetensors``."""
    protocol: int | None
    generator: str
    mutation: str
    """``none``, or ``family:op`` (``pickle:retype-ref``, ``zip:zip-case``, ``st:st-dtype``, ``confusion:...``)."""
    description: str
    data: bytes
    suffix: str

    @property
    def family(self) -> str:
        return f"{self.container}-p{self.protocol}" if self.protocol is not None else self.container

    @property
    def mutation_family(self) -> str:
        return self.mutation.split(":", 1)[0]


def torch_case(
    rng: random.Random,
    *,
    legacy: bool,
    protocol: int,
    generator: str,
    dtypes: list[str] | None = None,
) -> tuple[bytes, Any]:
    if dtypes is None:
        dtypes = LEGACY_DTYPES if legacy else SAVABLE_DTYPES
    obj = GENERATORS[generator](rng, dtypes, legacy)
    return torch_bytes(obj, legacy=legacy, protocol=protocol), obj


def make_case(
    seed: int | str,
    index: int,
    *,
    container: str | None = None,
    protocol: int | None = None,
    generator: str | None = None,
    mutation: str | None = None,
) -> Case:
    """Case ``index`` of run ``seed``; any of the choices can be pinned, the rest are drawn from the key."""
    key = f"{seed}:{index}"
    pins = ",".join(f"{k}={v}" for k, v in (("c", container), ("p", protocol), ("g", generator), ("m", mutation)) if v is not None)
    if pins:
        key += f":{pins}"
    rng = _keyed_rng("case", key)
    if mutation is None:
        x = rng.random()
        mutation = (
            "none" if x < 0.3 else
            f"pickle:{rng.choices(PICKLE_MUTATIONS, [PICKLE_WEIGHTS.get(m, 1) for m in PICKLE_MUTATIONS])[0]}" if x < 0.6 else
            f"zip:{rng.choice(ZIP_MUTATIONS)}" if x < 0.72 else
            f"st:{rng.choice(SAFETENSORS_MUTATIONS)}" if x < 0.84 else
            f"legacy:{rng.choice(LEGACY_MUTATIONS)}" if x < 0.88 else
            "bytes:pickle" if x < 0.93 else
            f"confusion:{rng.choice(['zip-as-safetensors', 'safetensors-as-pt', 'legacy-as-safetensors', 'pickle-as-pt'])}"
        )  # fmt: skip
    fam, _, op = mutation.partition(":")
    if container is None:
        if fam == "st":
            container = "safetensors"
        elif fam == "zip":
            container = "zip"
        elif fam == "legacy":
            container = "legacy"
        elif fam == "confusion":
            container = {"safetensors": "safetensors", "legacy": "legacy", "pickle": "pickle"}.get(op.split("-")[0], "zip")
        elif mutation == "none" and rng.random() < 0.15:
            container = "safetensors"
        else:
            container = "legacy" if rng.random() < 0.35 else "zip"
    if container in ("safetensors", "pickle"):
        protocol = None
    elif protocol is None:
        protocol = 2 if rng.random() < 0.4 else rng.choice([0, 1, 2, 3, 4, 5])
    if generator is None:
        generator = (
            "safetensors" if container == "safetensors" else rng.choice(["nested", "nested", "odd", "state_dict", "training", "params"])
        )
    suffix = ".safetensors" if container == "safetensors" else ".pt"
    legacy = container == "legacy"
    if container == "safetensors":
        data = safetensors_bytes(rng)
    elif container == "pickle":
        data = pickle.dumps({"w": [1, 2.5], "s": "x", "b": b"\x00"}, protocol=rng.choice([2, 3, 4, 5]))
    else:
        dtypes = None
        if legacy and rng.random() < 0.05:
            dtypes = SAVABLE_DTYPES  # the legacy format cannot write the newer dtypes; torch then fails to load its own file
        data, _ = torch_case(rng, legacy=legacy, protocol=protocol or 0, generator=generator, dtypes=dtypes)
    description = f"{generator} written as {container}" + (f" protocol {protocol}" if protocol is not None else "")
    if fam == "pickle":
        mutator = Mutator(rng)
        note = ""

        def mutate(pkl: bytes) -> bytes:
            nonlocal note
            try:
                ops, _ = parse_pickle(pkl)
            except (ValueError, IndexError, UnicodeDecodeError, struct.error):
                note = "unparsable pickle; random bytes instead"
                return byte_mutate(pkl, rng)
            result = mutator.run(op, ops)
            if result is None:
                note = f"{op} found no site; random bytes instead"
                return byte_mutate(pkl, rng)
            new_ops, note = result
            return join_ops(new_ops)

        data = replace_pickle(data, legacy, mutate)
        description += f"; pickle mutation {op}: {note}"
    elif fam == "bytes":
        data = replace_pickle(data, legacy, lambda pkl: byte_mutate(pkl, rng))
        description += "; random bytes in the main pickle"
    elif fam == "zip":
        result = mutate_zip(data, op, rng)
        if result is None:
            data = mutate_zip(data, "zip-bytes", rng)[0]  # type: ignore[index]
            description += f"; {op} not applicable, random archive bytes instead"
        else:
            data, note = result
            description += f"; zip mutation {op}: {note}"
    elif fam == "legacy":
        result = mutate_legacy(data, op, rng)
        if result is None:
            data = replace_pickle(data, True, lambda pkl: byte_mutate(pkl, rng))
            description += f"; {op} not applicable, random pickle bytes instead"
        else:
            data, note = result
            description += f"; legacy mutation {op}: {note}"
    elif fam == "st":
        result = mutate_safetensors(data, op, rng)
        if result is None:
            data = mutate_safetensors(data, "st-bytes", rng)[0]  # type: ignore[index]
            description += f"; {op} not applicable, random header bytes instead"
        else:
            data, note = result
            description += f"; safetensors mutation {op}: {note}"
    elif fam == "confusion":
        if op == "zip-as-safetensors":
            suffix = ".safetensors"
        elif op == "safetensors-as-pt":
            suffix = ".pt"
        elif op == "legacy-as-safetensors":
            suffix = ".safetensors"
        description += f"; named {suffix} ({op})"
    return Case(key, container, protocol, generator, mutation, description, data, suffix)


def evaluate(case: Case, workdir: Path, on_phase: Callable[[str], None] | None = None) -> tuple[Verdict, View, View]:
    """Write the case, load it both ways, compare."""
    path = workdir / f"case{case.suffix}"
    path.write_bytes(case.data)
    if on_phase:
        on_phase("torch")
    ref = torch_view(path)
    if on_phase:
        on_phase("dtypeaudit")
    ours = ours_view(path)
    if on_phase:
        on_phase("compare")
    return compare(ref, ours), ref, ours


def known_issue(case: Case, verdict: Verdict) -> str:
    """A hint that a verdict belongs to a class the lead already knows about (see the brief of issue 9)."""
    if verdict.outcome not in (*BAD_OUTCOMES, CONVENTION):
        return ""
    where = verdict.subclass + " " + verdict.detail
    if "tensor-key" in where:
        return "tensor-key"
    if "container-attribute" in where or "tensor-attribute" in where:
        return "build-ignored"
    if verdict.outcome == CONVENTION:
        return ""
    if case.container == "legacy" and case.protocol != 2 and case.mutation == "none":
        return "legacy-protocol"
    if "retype-ref" in case.mutation:
        return "two-storage-types"
    if "string-opcode" in case.mutation and "BINSTRING" in case.description:
        return "binstring-latin1"
    if "pickle:build" in case.mutation:
        return "build-ignored"
    if case.mutation in ("zip:zip-case", "zip:zip-local-name", "zip:zip-central-name"):
        return "zip-case"
    return ""


# -- the isolated worker --------------------------------------------------------------------------------

HANG_SECONDS = 10.0
ORACLE_SECONDS = 60.0
WORKER_MEMORY = 6 << 30


def _limit_memory() -> None:
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (WORKER_MEMORY, WORKER_MEMORY))
    except (ImportError, ValueError, OSError):
        pass


def _worker() -> None:
    """Read case requests (JSON lines) on stdin; answer phases and results (JSON lines) on stdout."""
    _limit_memory()
    torch.set_num_threads(1)
    out = sys.stdout
    sys.stdout = sys.stderr  # nothing but protocol on the real stdout
    workdir = Path(tempfile.mkdtemp(prefix="diffworker-"))
    try:
        for line in sys.stdin:
            req = json.loads(line)
            t0 = time.perf_counter()

            def phase(name: str) -> None:
                out.write(json.dumps({"phase": name}) + "\n")
                out.flush()

            try:
                case = make_case(req["seed"], req["index"], **req.get("pins", {}))
                case_path = workdir / f"case{case.suffix}"
                out.write(json.dumps({"phase": "generated", "path": str(case_path)}) + "\n")
                out.flush()
                verdict, ref, ours = evaluate(case, workdir, phase)
                result = {
                    "key": case.key,
                    "family": case.family,
                    "mutation": case.mutation,
                    "description": case.description,
                    "suffix": case.suffix,
                    "path": str(case_path),
                    "verdict": verdict.to_json(),
                    "ref_how": ref.how,
                    "known": known_issue(case, verdict),
                    "seconds": time.perf_counter() - t0,
                }
            except OracleTainted as exc:
                result = {
                    "key": f"{req['seed']}:{req['index']}",
                    "verdict": Verdict(ORACLE_FAILED, "tainted", str(exc)).to_json(),
                    "exit": True,
                }
            except Exception:
                tb = traceback.format_exc()
                result = {"key": f"{req['seed']}:{req['index']}", "verdict": Verdict(ORACLE_FAILED, "harness", tb[-400:]).to_json()}
            out.write(json.dumps({"result": result}) + "\n")
            out.flush()
            if result.get("exit"):
                return
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


class Runner:
    """Runs cases in a worker process with a memory cap; a hang or a death becomes a verdict, not a stuck run."""

    def __init__(self, *, hang_seconds: float = HANG_SECONDS, oracle_seconds: float = ORACLE_SECONDS, keep_dir: Path | None = None) -> None:
        self.hang_seconds = hang_seconds
        self.oracle_seconds = oracle_seconds
        self.keep_dir = keep_dir
        """Where the input of a case that hung or killed the worker is copied (it cannot be answered for)."""
        self.proc: subprocess.Popen[bytes] | None = None
        self.restarts = 0
        self._buf = b""

    def _start(self) -> subprocess.Popen[bytes]:
        env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.diff_oracle", "--worker"],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        self._buf = b""
        return self.proc

    def close(self) -> None:
        if self.proc is not None:
            try:
                self.proc.stdin.close()  # type: ignore[union-attr]
                self.proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
            self.proc = None

    def _kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None
            self.restarts += 1

    def _line(self, timeout: float) -> bytes | None:
        """The next line from the worker; b"" at its end; None on timeout."""
        assert self.proc is not None and self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return b""
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line

    def run(self, seed: int | str, index: int, **pins: Any) -> dict[str, Any]:
        proc = self.proc if self.proc is not None and self.proc.poll() is None else self._start()
        assert proc.stdin is not None
        proc.stdin.write((json.dumps({"seed": seed, "index": index, "pins": pins}) + "\n").encode())
        proc.stdin.flush()
        phase, since, path = "start", time.monotonic(), None
        while True:
            limit = self.hang_seconds if phase == "dtypeaudit" else self.oracle_seconds
            line = self._line(since + limit - time.monotonic())
            if not line:
                saved = self._save_lost(path)
                if line is None:
                    self._kill()
                    what = f"hang: no answer after {limit:.0f} s in phase {phase}"
                else:
                    code = proc.wait()
                    self.proc = None
                    self.restarts += 1
                    what = f"worker died (exit {code}) in phase {phase}"
                outcome = CRASH if phase == "dtypeaudit" else ORACLE_FAILED
                verdict = Verdict(outcome, "hang" if line is None else "died", what)
                return {"key": f"{seed}:{index}", "verdict": verdict.to_json(), "saved": saved}
            msg = json.loads(line)
            if "phase" in msg:
                phase, since = msg["phase"], time.monotonic()
                path = msg.get("path", path)
                continue
            result: dict[str, Any] = msg["result"]
            if result.get("exit"):
                self._kill()
            return result

    def _save_lost(self, path: str | None) -> str | None:
        if path is None or not os.path.exists(path) or self.keep_dir is None:
            return None
        self.keep_dir.mkdir(parents=True, exist_ok=True)
        dest = self.keep_dir / f"lost-{int(time.time() * 1000)}{Path(path).suffix}"
        shutil.copyfile(path, dest)
        return str(dest)

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


if __name__ == "__main__" and "--worker" in sys.argv:
    _worker()
