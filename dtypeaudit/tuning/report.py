"""A tune's report, one pure function per format: ``TuneResult`` -> string. None decides an exit code."""

from __future__ import annotations

import html
import json
import math
from typing import Any

from .result import ModuleStats, TuneResult, finite_or_none


def as_dict(result: TuneResult) -> dict[str, Any]:
    """The ``dtypeaudit.tune/1`` document: numbers that are not finite are null."""
    return {
        "schema": result.schema,
        "to": result.to,
        "tolerance": result.tolerance,
        "metric": result.metric,
        "modules": [
            {
                "name": m.name,
                "type": m.type,
                "calls": m.calls,
                "input_abs_max": m.input_abs_max,
                "output_abs_max": m.output_abs_max,
                "output_abs_min": finite_or_none(m.output_abs_min),
                "headroom": finite_or_none(m.headroom),
                "shadow_error": finite_or_none(m.shadow_error),
            }
            for m in result.modules
        ],
        "first_overflow": result.first_overflow,
        "keep": list(result.keep),
        "output_error": finite_or_none(result.output_error),
        "all_low_error": finite_or_none(result.all_low_error),
        "forward_passes": result.forward_passes,
        "passed": result.passed,
        "failing": list(result.failing),
        "notes": list(result.notes),
    }


def to_json(result: TuneResult) -> str:
    return json.dumps(as_dict(result), indent=2) + "\n"


def _num(x: float) -> str:
    if math.isinf(x):
        return "inf"
    return f"{x:.3g}"


def to_text(result: TuneResult, *, all_modules: bool = False) -> str:
    """A plain table of the modules (only those that matter, unless ``all_modules``) and the verdict."""
    kept = set(result.keep)
    rows = [
        m
        for m in result.modules
        if m.name
        and m.calls
        and (all_modules or m.name in kept or not m.fits or m.shadow_error > result.tolerance or m.name == result.first_overflow)
    ]
    header = ("module", "type", "in abs max", "out abs max", "headroom", "shadow error", "")
    table = [header] + [
        (
            m.name,
            m.type,
            _num(m.input_abs_max),
            _num(m.output_abs_max),
            _num(m.headroom),
            _num(m.shadow_error),
            "keep" if m.name in kept else ("overflows" if not m.fits else ""),
        )
        for m in rows
    ]
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    out = [f"tune to {result.to}: metric {result.metric}, tolerance {result.tolerance:g}"]
    if rows:
        for i, r in enumerate(table):
            out.append("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
            if i == 0:
                out.append("  ".join("-" * w for w in widths).rstrip())
    out.append(f"first overflow: {result.first_overflow or 'none'}")
    out.append(f"all in {result.to}: error {_num(result.all_low_error)}")
    out.append(f"keep in fp32: {', '.join(result.keep) or 'nothing'}; error {_num(result.output_error)}")
    out.append(f"forward passes: {result.forward_passes}")
    out.extend(f"note: {n}" for n in result.notes)
    if result.passed:
        out.append(f"✓ passes: within {result.tolerance:g} with {len(result.keep)} module(s) in fp32")
    else:
        worst = ", ".join(f"{n} ({_num(result.module(n).shadow_error)})" for n in result.failing[:5])
        out.append(f"✗ no keep set passes: error {_num(result.output_error)} > {result.tolerance:g}; still failing: {worst or 'the model'}")
    return "\n".join(out) + "\n"


def _colour(m: ModuleStats, tolerance: float) -> str:
    """Red where the module's output does not fit or its own error is over the tolerance, amber within ten times
    under it, green below that."""
    if not m.fits or m.shadow_error > tolerance:
        return "#f4c7c3"
    if m.shadow_error > tolerance / 10:
        return "#fce8b2"
    return "#d9ead3"


def to_html(result: TuneResult) -> str:
    """A self-contained page: the module tree, each module coloured by its shadow error and headroom, kept ones marked."""
    kept = set(result.keep)
    rows = []
    for m in result.modules:
        if not m.calls:
            continue
        depth = m.name.count(".") + 1 if m.name else 0
        mark = " <b>keep in fp32</b>" if m.name in kept else (" <b>first overflow</b>" if m.name == result.first_overflow else "")
        rows.append(
            f'<tr style="background:{_colour(m, result.tolerance)}"><td style="padding-left:{depth * 1.2 + 0.3:.1f}em">'
            f"{html.escape(m.name or '(model)')}{mark}</td><td>{html.escape(m.type)}</td><td>{_num(m.input_abs_max)}</td>"
            f"<td>{_num(m.output_abs_max)}</td><td>{_num(m.headroom)}</td><td>{_num(m.shadow_error)}</td></tr>"
        )
    verdict = "passes" if result.passed else "does not pass"
    summary = (
        f"keep in fp32: {html.escape(', '.join(result.keep) or 'nothing')}; error {_num(result.output_error)} "
        f"({verdict} {result.tolerance:g}); all in {result.to}: {_num(result.all_low_error)}; "
        f"first overflow: {html.escape(result.first_overflow or 'none')}; {result.forward_passes} forward passes"
    )
    return (
        '<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>dtypeaudit tune</title>'
        "<style>body{font:14px sans-serif}table{border-collapse:collapse}td,th{padding:2px 8px;text-align:right}"
        "td:first-child,th:first-child{text-align:left}</style></head><body>"
        f"<h1>tune to {result.to}</h1><p>{summary}</p><table><tr><th>module</th><th>type</th><th>in abs max</th>"
        f"<th>out abs max</th><th>headroom</th><th>shadow error</th></tr>{''.join(rows)}</table></body></html>\n"
    )
