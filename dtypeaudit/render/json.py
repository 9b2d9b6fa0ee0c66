"""The ``dtypeaudit.report/1`` JSON contract. Fields may be added; renaming or removing one is a new version."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from itertools import islice
from typing import TYPE_CHECKING, Any, Optional

from .._version import __version__
from ..inventory import CheckpointReport, Finding, Report, TensorRecord, dtype_summary
from . import quant_view

if TYPE_CHECKING:
    from ..quant.model import LogicalWeight, QuantView

SCHEMA = "dtypeaudit.report/1"


def tensor_dict(t: TensorRecord) -> dict[str, Any]:
    return {
        "name": t.name,
        "dtype": t.dtype,
        "shape": list(t.shape),
        "kind": t.kind,
        "nbytes": t.nbytes,
        "numel": t.numel,
        "file": t.file or None,
        "storage": t.storage,
        "offset": t.offset,
        "stride": list(t.stride) if t.stride is not None else None,
        "layout": t.layout,
        "region": t.region,
        "module": t.module,
        "shares_with": list(t.shares_with),
        "module_guess": t.module_guess,
    }


_string = json.encoder.encode_basestring
_ONLY_INT = frozenset({int})
_ONLY_STR = frozenset({str})


def _tensor_line(t: TensorRecord) -> str:
    """``_encode(tensor_dict(t))`` of one record (``_tensor_lines``)."""
    return next(_tensor_lines((t,)))


_CACHED_TEXTS = 1 << 12
"""At most this many shapes' texts, and this many distinct field strings (dtypes, kinds, files, module types...),
remembered by ``_tensor_lines``."""


def _tensor_lines(tensors: Iterable[TensorRecord]) -> Iterator[str]:
    """``_encode(tensor_dict(t))`` of each record, written out for the usual record (no stride, no shared storage, plain
    integers, string fields), each shape's text and each field string's JSON made once, not once per record: a
    million-tensor header's lines were most of its JSON report's time. Any other record goes through the encoder."""
    shapes: dict[tuple[int, ...], tuple[str, int]] = {}
    texts: dict[str | None, str] = {None: "null"}
    string = _string
    for t in tensors:
        shape = t.shape
        # the types each time, not only the first: (True, 2) == (1, 2), and the encoder writes each its own way
        plain_shape = type(shape) is tuple and _ONLY_INT.issuperset(map(type, shape))
        known = shapes.get(shape) if plain_shape else None
        if plain_shape and known is None:
            known = (", ".join(map(str, shape)), math.prod(shape))
            if len(shapes) < _CACHED_TEXTS:
                shapes[shape] = known
        nbytes, offset = t.nbytes, t.offset
        if known is None or t.stride is not None or t.shares_with or type(nbytes) is not int or type(offset) is not int:
            yield _encode(tensor_dict(t))
            continue
        dtype, kind, file, storage, layout, region, module, guess = (
            t.dtype, t.kind, t.file or None, t.storage, t.layout, t.region, t.module, t.module_guess,
        )  # fmt: skip
        try:
            yield (
                f'{{"name": {string(t.name)}, "dtype": {texts[dtype]}, "shape": [{known[0]}], "kind": {texts[kind]}, '
                f'"nbytes": {nbytes}, "numel": {known[1]}, "file": {texts[file]}, "storage": {texts[storage]}, '
                f'"offset": {offset}, "stride": null, "layout": {texts[layout]}, "region": {texts[region]}, '
                f'"module": {texts[module]}, "shares_with": [], "module_guess": {texts[guess]}}}'
            )
        except (KeyError, TypeError):  # a field string not met yet (or no string: the encoder's path, every time)
            for value in (dtype, kind, file, storage, layout, region, module, guess):
                if type(value) is str and value not in texts and len(texts) < _CACHED_TEXTS:
                    texts[value] = string(value)
            yield _encode(tensor_dict(t))


def _maybe(value: str | None) -> str:
    return "null" if value is None else _string(value)


def finding_dict(f: Finding) -> dict[str, Any]:
    return {
        "rule": f.rule,
        "severity": f.severity,
        "tensor": f.tensor,
        "message": f.message,
        "file": f.file,
        "expected": list(f.expected) if f.expected is not None else None,
        "actual": f.actual,
    }


_FINDING_PARTS = 1 << 12
"""At most this many kinds of finding (rule, severity, message, expected, actual) remembered by ``_finding_lines``."""


def _finding_lines(findings: Iterable[Finding]) -> Iterator[str]:
    """``_encode(finding_dict(f))`` of each finding: alike findings (thousands of modules' with one message) share their
    text but for the tensor and the file, so only those are written for each; any field of another type than the
    usual goes through the encoder."""
    parts: dict[tuple[object, ...], tuple[str, str, str]] = {}
    for f in findings:
        tensor, file, expected, actual = f.tensor, f.file, f.expected, f.actual
        # only strings (or None) where values meet: (1,) and (True,) are one key, and encode two ways
        plain = (
            (tensor is None or type(tensor) is str)
            and (file is None or type(file) is str)
            and (actual is None or type(actual) is str)
            and (expected is None or (type(expected) is tuple and _ONLY_STR.issuperset(map(type, expected))))
        )
        key = (f.rule, f.severity, f.message, expected, actual)
        known = parts.get(key) if plain else None
        if known is None:
            line = _encode(finding_dict(f))
            if plain and len(parts) < _FINDING_PARTS:
                parts[key] = (
                    f'{{"rule": {_encode(f.rule)}, "severity": {_encode(f.severity)}, "tensor": ',
                    f', "message": {_encode(f.message)}, "file": ',
                    f', "expected": {_encode(list(expected) if expected is not None else None)}, "actual": {_encode(actual)}}}',
                )
            yield line
        else:
            head, mid, tail = known
            yield head + _maybe(tensor) + mid + _maybe(file) + tail


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


def weight_dict(w: LogicalWeight) -> dict[str, Any]:
    """A quantized logical weight; ``storage`` lists its tensors by role (each also in ``tensors``)."""
    s = w.scheme
    return {
        "name": w.name,
        "module": w.module,
        "scheme": s.name,
        "family": s.family,
        "value": s.value,
        "bits": s.bits,
        "group": list(s.group) if s.group is not None else None,
        "symmetric": s.symmetric,
        "logical_shape": list(w.shape) if w.shape is not None else None,
        "numel": w.numel,
        "dequantizes_to": w.dequantizes_to,
        "bits_per_weight": w.bits_per_weight,
        "file": w.file or None,
        "storage": [{"role": role, "name": name} for role, name in w.storage.items()],
        "missing": list(w.missing),
    }


def _quant_fields(c: CheckpointReport, quant: Optional[QuantView]) -> dict[str, Any]:
    """Added only for quantized checkpoints, so an unquantized one's JSON is unchanged."""
    if not quant or c.inventory is None:
        return {}
    from ..quant.group import scheme_summary

    return {
        "quantized": [weight_dict(w) for w in quant.weights],
        "by_scheme": [
            {
                "scheme": r.scheme,
                "weights": r.weights,
                "numel": r.numel,
                "nbytes": r.nbytes,
                "bits_per_weight": r.bits_per_weight,
                "share": round(r.share, 6),
            }
            for r in scheme_summary(c.inventory, quant)
        ],
    }


def _tensor_dicts(tensors: tuple[TensorRecord, ...], quant: Optional[QuantView]) -> Iterator[dict[str, Any]]:
    if not quant:
        yield from map(tensor_dict, tensors)
        return
    owner = quant.by_storage()
    for t in tensors:
        d = tensor_dict(t)
        w = owner.get(t.name)
        if w is not None:
            role = next(r for r, n in w.storage.items() if n == t.name)
            d["quant"] = {"weight": w.name, "role": role, "scheme": w.scheme.name}
        yield d


class _Later:
    """A list the writer makes item by item as it writes it (``chunks``): a million tensors' dicts, never all at once;
    ``lines``, where given, makes each item's JSON text itself."""

    def __init__(self, count: int, items: Callable[[], Iterable[Any]], lines: Callable[[], Iterable[str]] | None = None) -> None:
        self.count = count
        self.items = items
        self.lines = lines


def checkpoint_dict(c: CheckpointReport) -> dict[str, Any]:
    """The checkpoint's part of the report, every list made."""
    return {key: list(value.items()) if isinstance(value, _Later) else value for key, value in _checkpoint_doc(c).items()}


def _checkpoint_doc(c: CheckpointReport) -> dict[str, Any]:
    tensors = c.tensors
    by_dtype = dtype_summary(tensors)  # over each tensor once (``unique_tensors``), as the totals are
    quant = quant_view(c.inventory)
    return {
        "path": c.path,
        "format": c.format,
        "error": c.error,
        "bytes_read": c.inventory.bytes_read if c.inventory else None,
        "summary": {
            "tensors": len(tensors),
            "numel": sum(r.numel for r in by_dtype),
            "nbytes": sum(r.nbytes for r in by_dtype),
            "by_dtype": [
                {"dtype": r.dtype, "tensors": r.tensors, "numel": r.numel, "nbytes": r.nbytes, "share": round(r.share, 6)} for r in by_dtype
            ],
        },
        "tensors": _Later(len(tensors), lambda: _tensor_dicts(tensors, quant), None if quant else lambda: _tensor_lines(tensors)),
        **_quant_fields(c, quant),
        "findings": _Later(len(c.findings), lambda: map(finding_dict, c.findings), lambda: _finding_lines(c.findings)),
        "metadata": _jsonable(dict(c.inventory.metadata)) if c.inventory else {},
    }


def report_dict(report: Report) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "tool": {"name": "dtypeaudit", "version": __version__},
        "fail_on": report.fail_on,
        "policy": report.policy,
        "strict": report.strict,
        "checkpoints": [checkpoint_dict(c) for c in report.checkpoints],
    }


# Lists whose items are written one per line: readable at 10 tensors, and fast at a million, since each
# line comes from json's C encoder (an indented dump goes through its pure-Python encoder instead).
ONE_PER_LINE = frozenset({"tensors", "findings", "by_dtype", "quantized", "by_scheme"})
_encoder = json.JSONEncoder(ensure_ascii=False)
_make_c_encoder = getattr(json.encoder, "c_make_encoder", None)  # None where Python is built without _json
_c_encoder = (
    _make_c_encoder(None, _encoder.default, json.encoder.encode_basestring, None, ": ", ", ", False, False, True)
    if _make_c_encoder
    else None
)


def _encode(value: Any) -> str:
    """``JSONEncoder(ensure_ascii=False).encode``, without the encoder it makes again for each value (a line per tensor
    of a million-tensor header): its C encoder, made once."""
    if _c_encoder is None or isinstance(value, str):
        return _encoder.encode(value)
    return "".join(_c_encoder(value, 0))


_BATCH = 4096
"""Lines of a ONE_PER_LINE list joined at once by ``_pieces``."""


def dumps(value: Any, indent: str = "") -> str:
    """JSON with two-space indentation, except that items of ONE_PER_LINE lists stay on one line each."""
    return "".join(_pieces(value, indent))


def _pieces(value: Any, indent: str) -> Iterator[str]:
    """``dumps(value, indent)`` in pieces, a ``_Later`` list's items made one by one."""
    inner = indent + "  "
    if isinstance(value, dict) and value:
        for i, (key, item) in enumerate(value.items()):
            yield f",\n{inner}{_encode(key)}: " if i else f"{{\n{inner}{_encode(key)}: "
            encoded = False
            if isinstance(item, _Later):
                encoded = item.lines is not None
                rows: Iterable[Any] | None = (item.lines() if item.lines is not None else item.items()) if item.count else None
                item = []
            else:
                rows = item if key in ONE_PER_LINE and isinstance(item, list) and item else None
            if rows is not None:
                yield "[\n"
                # joined a batch at a time, not a piece per line (a million-tensor header's lines): a batch's text
                # is held, never the whole list's
                lines = iter(rows if encoded else map(_encode, rows))
                sep = f",\n{inner}  "
                lead = f"{inner}  "
                while batch := list(islice(lines, _BATCH)):
                    yield lead + sep.join(batch)
                    lead = sep
                yield f"\n{inner}]"
            else:
                yield from _pieces(item, inner)
        yield "\n" + indent + "}"
    elif isinstance(value, list) and value:
        for i, x in enumerate(value):
            yield f",\n{inner}" if i else f"[\n{inner}"
            yield from _pieces(x, inner)
        yield "\n" + indent + "]"
    else:
        yield _encode(value)


def render(report: Report) -> str:
    """The whole report as one string (``chunks`` joined)."""
    return "".join(chunks(report))


def chunks(report: Report, *, size: int = 1 << 20) -> Iterator[str]:
    """The report in pieces of about ``size`` characters, made as they are written: a checkpoint at a time (the
    dicts of a 10,000-checkpoint report would take five times the memory of the text they become), and a
    checkpoint's tensors a line at a time (a million-tensor header's would take gigabytes)."""
    head = report_dict(replace(report, checkpoints=()))
    if not report.checkpoints or list(head)[-1] != "checkpoints":
        yield dumps(report_dict(report)) + "\n"
        return
    del head["checkpoints"]
    pending: list[str] = [dumps(head)[:-2], ',\n  "checkpoints": [\n']
    held = 0
    for i, c in enumerate(report.checkpoints):
        pending.append(",\n    " if i else "    ")
        for piece in _pieces(_checkpoint_doc(c), "    "):
            pending.append(piece)
            held += len(piece)
            if held >= size:
                yield "".join(pending)
                pending, held = [], 0
    pending.append("\n  ]\n}\n")
    yield "".join(pending)
