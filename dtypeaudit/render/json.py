"""The ``dtypeaudit.report/1`` JSON contract. Fields may be added; renaming or removing one is a new version."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Optional

from .._version import __version__
from ..inventory import CheckpointReport, Finding, Report, TensorRecord, dtype_summary, unique_tensors
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


def _tensor_dicts(tensors: tuple[TensorRecord, ...], quant: Optional[QuantView]) -> list[dict[str, Any]]:
    if not quant:
        return [tensor_dict(t) for t in tensors]
    owner = quant.by_storage()
    out = []
    for t in tensors:
        d = tensor_dict(t)
        w = owner.get(t.name)
        if w is not None:
            role = next(r for r, n in w.storage.items() if n == t.name)
            d["quant"] = {"weight": w.name, "role": role, "scheme": w.scheme.name}
        out.append(d)
    return out


def checkpoint_dict(c: CheckpointReport) -> dict[str, Any]:
    tensors = c.tensors
    unique = unique_tensors(tensors)
    quant = quant_view(c.inventory)
    return {
        "path": c.path,
        "format": c.format,
        "error": c.error,
        "bytes_read": c.inventory.bytes_read if c.inventory else None,
        "summary": {
            "tensors": len(tensors),
            "numel": sum(t.numel for t in unique),
            "nbytes": sum(t.nbytes for t in unique),
            "by_dtype": [
                {"dtype": r.dtype, "tensors": r.tensors, "numel": r.numel, "nbytes": r.nbytes, "share": round(r.share, 6)}
                for r in dtype_summary(tensors)
            ],
        },
        "tensors": _tensor_dicts(tensors, quant),
        **_quant_fields(c, quant),
        "findings": [finding_dict(f) for f in c.findings],
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
_encode = json.JSONEncoder(ensure_ascii=False).encode


def dumps(value: Any, indent: str = "") -> str:
    """JSON with two-space indentation, except that items of ONE_PER_LINE lists stay on one line each."""
    inner = indent + "  "
    if isinstance(value, dict) and value:
        items = []
        for key, item in value.items():
            if key in ONE_PER_LINE and isinstance(item, list) and item:
                body = ",\n".join(inner + "  " + _encode(x) for x in item)
                items.append(f"{inner}{_encode(key)}: [\n{body}\n{inner}]")
            else:
                items.append(f"{inner}{_encode(key)}: {dumps(item, inner)}")
        return "{\n" + ",\n".join(items) + "\n" + indent + "}"
    if isinstance(value, list) and value:
        return "[\n" + ",\n".join(inner + dumps(x, inner) for x in value) + "\n" + indent + "]"
    return _encode(value)


def render(report: Report) -> str:
    """``dumps(report_dict(report))``, made a checkpoint at a time: the dicts of a 10,000-checkpoint report
    would take five times the memory of the text they become."""
    head = report_dict(replace(report, checkpoints=()))
    if not report.checkpoints or list(head)[-1] != "checkpoints":
        return dumps(report_dict(report)) + "\n"
    del head["checkpoints"]
    body = ",\n".join("    " + dumps(checkpoint_dict(c), "    ") for c in report.checkpoints)
    return dumps(head)[:-2] + ',\n  "checkpoints": [\n' + body + "\n  ]\n}\n"
