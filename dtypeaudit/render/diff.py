"""Renderers for ``diff``: text for people (repeated layers folded as ``scan`` folds them), JSON
(``dtypeaudit.diff/1``, every tensor) for machines."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ..diff import Change, InventoryDiff
from ..inventory import TensorRecord
from .humanize import change_parts, group_tensors, human_bytes, shape_text
from .json import tensor_dict


def render_json(d: InventoryDiff) -> str:
    doc = {
        "schema": "dtypeaudit.diff/1",
        "a": {"path": d.a.path, "format": d.a.format, "nbytes": d.bytes_before, "prefix": d.prefix_a or None},
        "b": {"path": d.b.path, "format": d.b.format, "nbytes": d.bytes_after, "prefix": d.prefix_b or None},
        "differs": d.differs,
        "values": "crc32" if d.values_read and d.tolerance is None else "tolerance" if d.values_read else None,
        "tolerance": d.tolerance,
        "added": [tensor_dict(t) for t in d.added],
        "removed": [tensor_dict(t) for t in d.removed],
        "changed": [_change_dict(c) for c in d.changed],
        "ties": [{"names": list(t.names), "change": "broken" if t.broken else "created", "views": t.views} for t in d.ties],
        "not_compared": [{"name": c.name, "reason": c.values.reason if c.values else ""} for c in d.not_compared],
        "compared": len(d.compared),
    }
    return json.dumps(doc, indent=2) + "\n"


def _change_dict(c: Change) -> dict[str, Any]:
    return {
        "name": c.name,
        "names": [c.before.name, c.after.name],
        "dtype": [c.before.dtype, c.after.dtype],
        "shape": [list(c.before.shape), list(c.after.shape)],
        "nbytes": [c.before.nbytes, c.after.nbytes],
        "values": c.values.state if c.values else None,
        "max_abs_diff": c.values.max_abs_diff if c.values else None,
    }


@dataclass
class _Row:
    """One line of the text diff: a sign, the names it stands for, what happened, and the differences measured."""

    sign: str
    names: list[str]
    text: str
    diffs: list[float] = field(default_factory=list)


def _view(t: TensorRecord) -> tuple[object, ...] | None:
    """What a tie shares: one storage viewed the same way (None for a tensor that shares nothing)."""
    return (t.file, t.storage, t.offset, t.shape, t.stride) if t.shares_with else None


def _rows(d: InventoryDiff) -> list[_Row]:
    """Rows before folding; names tied on both sides that changed alike are one row (``a = b``)."""
    rows: dict[tuple[object, ...], _Row] = {}

    def add(sign: str, name: str, text: str, views: tuple[object, ...], diff: float | None = None) -> None:
        key = (sign, text, views) if any(v is not None for v in views) else (sign, text, name)
        row = rows.setdefault(key, _Row(sign, [], text))
        row.names.append(name)
        if diff is not None:
            row.diffs.append(diff)

    for t in d.removed:
        add("-", t.name, f"{t.dtype} {shape_text(t.shape)}", (_view(t),))
    for t in d.added:
        add("+", t.name, f"{t.dtype} {shape_text(t.shape)}", (_view(t),))
    for c in d.changed:
        parts = change_parts(c, tolerance=d.tolerance)
        add("~", c.name, "; ".join(parts), (_view(c.before), _view(c.after)), c.values.max_abs_diff if c.values else None)
    for c in d.not_compared:
        add("?", c.name, f"values not compared: {c.values.reason if c.values else ''}", (_view(c.before), _view(c.after)))
    return list(rows.values())


def _fold(rows: list[_Row]) -> list[tuple[str, int, _Row, list[float]]]:
    """Rows that differ only in layer numbers, folded by ``scan``'s own grouping: (label, count, first row, diffs)."""
    stand_ins = [TensorRecord(name=" = ".join(r.names), dtype=r.text, shape=(), nbytes=0, file=r.sign) for r in rows]
    row_of = {id(s): r for s, r in zip(stand_ins, rows, strict=True)}
    out = []
    for g in group_tensors(stand_ins):
        members = [row_of[id(m)] for m in g.members]
        out.append((g.label, g.count, members[0], [x for r in members for x in r.diffs]))
    return out


def _numbers(diffs: list[float], count: int) -> str:
    if not diffs:
        return ""
    worst = max(diffs)
    return f" (max abs diff {'up to ' if count > 1 and min(diffs) != worst else ''}{worst:.3g})"


def render_text(d: InventoryDiff, *, verbose: bool = False) -> str:
    lines = [_side("---", d.a.path, d.a.format, d.prefix_a), _side("+++", d.b.path, d.b.format, d.prefix_b)]
    rows = _rows(d)
    folded = [(" = ".join(r.names), 1, r, r.diffs) for r in rows] if verbose else _fold(rows)
    for label, count, row, diffs in folded:
        times = f"  ×{count}" if count > 1 else ""
        lines.append(f"{row.sign} {label}{times}  {row.text}{_numbers(diffs, count)}")
    for tie in d.ties:
        where = "one storage in A, separate in B" if tie.broken else "separate in A, one storage in B"
        what, names = ("storage sharing", ", ".join(tie.names)) if tie.views else ("tie", " = ".join(tie.names))
        lines.append(f"! {what} {'broken' if tie.broken else 'created'}: {names} ({where})")
    lines.append(summary_line(d))
    return "\n".join(lines) + "\n"


def _side(mark: str, path: str, fmt: str, prefix: str) -> str:
    return f"{mark} {path} ({fmt}{f'; names compared without {prefix!r}' if prefix else ''})"


def summary_line(d: InventoryDiff) -> str:
    """The diff's last line: counts of what changed and the size before and after (text and HTML both)."""
    before, after = d.bytes_before, d.bytes_after
    ratio = f" ({after / before:.2f}x)" if before else ""
    size = f"size {human_bytes(before)} -> {human_bytes(after)}{ratio}"
    if d.differs:
        kinds = [
            f"{n} {what}"
            for what, n in (
                ("dtype", sum(c.dtype_changed for c in d.changed)),
                ("shape", sum(c.shape_changed for c in d.changed)),
                ("values", sum(c.values_differ for c in d.changed)),
            )
            if n
        ]
        counts = f"{len(d.added)} added, {len(d.removed)} removed, {len(d.changed)} changed"
        counts += f" ({', '.join(kinds)})" if kinds else ""
        broken, created = sum(t.broken for t in d.ties), sum(not t.broken for t in d.ties)
        counts += "".join(f", {n} {'tie' if n == 1 else 'ties'} {what}" for what, n in (("broken", broken), ("created", created)) if n)
        return f"{counts}; {size}"
    n = len(d.a.tensors)
    if not d.values_read:
        return f"same names, dtypes, shapes and ties for {n} tensors (values not read: --no-values); {size}"
    if d.not_compared:
        return f"same names, dtypes, shapes and ties; values equal for {len(d.compared)}, not compared for {len(d.not_compared)}; {size}"
    how = "CRC-32" if d.tolerance is None else f"within {d.tolerance:g}, max abs diff {d.max_equal_diff:.3g}"
    return f"identical: {n} tensors, same names, dtypes, shapes, ties and values ({how}); {size}"
