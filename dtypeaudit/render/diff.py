"""Renderers for ``diff``: text for people, JSON (``dtypeaudit.diff/1``) for machines."""

from __future__ import annotations

import json

from ..diff import InventoryDiff
from .humanize import human_bytes, shape_text
from .json import tensor_dict


def render_json(d: InventoryDiff) -> str:
    doc = {
        "schema": "dtypeaudit.diff/1",
        "a": {"path": d.a.path, "format": d.a.format, "nbytes": d.bytes_before},
        "b": {"path": d.b.path, "format": d.b.format, "nbytes": d.bytes_after},
        "differs": d.differs,
        "added": [tensor_dict(t) for t in d.added],
        "removed": [tensor_dict(t) for t in d.removed],
        "changed": [
            {
                "name": c.name,
                "dtype": [c.before.dtype, c.after.dtype],
                "shape": [list(c.before.shape), list(c.after.shape)],
                "nbytes": [c.before.nbytes, c.after.nbytes],
            }
            for c in d.changed
        ],
    }
    return json.dumps(doc, indent=2) + "\n"


def render_text(d: InventoryDiff) -> str:
    lines = [f"--- {d.a.path} ({d.a.format})", f"+++ {d.b.path} ({d.b.format})"]
    for t in d.removed:
        lines.append(f"- {t.name}  {t.dtype} {shape_text(t.shape)}")
    for t in d.added:
        lines.append(f"+ {t.name}  {t.dtype} {shape_text(t.shape)}")
    for c in d.changed:
        parts = []
        if c.dtype_changed:
            parts.append(f"{c.before.dtype} -> {c.after.dtype}")
        if c.shape_changed:
            parts.append(f"{shape_text(c.before.shape)} -> {shape_text(c.after.shape)}")
        lines.append(f"~ {c.name}  {'; '.join(parts)}")
    before, after = d.bytes_before, d.bytes_after
    ratio = f" ({after / before:.2f}x)" if before else ""
    counts = f"{len(d.added)} added, {len(d.removed)} removed, {len(d.changed)} changed"
    summary = f"{counts}; size {human_bytes(before)} -> {human_bytes(after)}{ratio}"
    lines.append(summary if d.differs else f"identical tensors; {summary}")
    return "\n".join(lines) + "\n"
