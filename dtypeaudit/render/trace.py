"""Reports of ``dtypeaudit trace``: the scan renderers, plus the trace section (modules, activations, operations).

JSON is ``dtypeaudit.report/1`` with a ``trace`` object in the checkpoint; HTML is scan's page with the trace in
each checkpoint's section; SARIF, GitHub and JUnit carry the findings exactly as for ``scan``. Pure functions,
report -> str; no torch.
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Callable, Iterable
from typing import Any

from ..inventory import Report, dtype_summary
from ..trace.result import ModuleSummary, OpRecord, TraceCheckpointReport, TraceSummary
from . import OutputFormat, Renderer
from . import renderer_for as scan_renderer_for
from .humanize import fold_label, human_bytes, human_count, name_parts, wrap_name

TRACE_LISTS = frozenset({"ops", "modules", "grads", "activations", "inputs"})
"""Lists of the trace section written one item per line."""
FULL_LISTING_LIMIT = 60
_LAYER = re.compile(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)")


def renderer_for(fmt: OutputFormat, *, width: int = 120, verbose: bool = False, quiet: bool = False) -> Renderer:
    """``quiet``: each model's headline and findings only, then the verdict (the text formats; the others are
    for machines and stay whole)."""
    if fmt is OutputFormat.json:
        return render_json
    if fmt in (OutputFormat.table, OutputFormat.plain):
        color = fmt is OutputFormat.table
        return lambda r: render_text(r, color=color, width=width, verbose=verbose, quiet=quiet)
    if fmt is OutputFormat.markdown:
        return lambda r: render_markdown(r, verbose=verbose)
    if fmt is OutputFormat.html:
        return render_html
    return scan_renderer_for(fmt, width=width, verbose=verbose)


def _traces(report: Report) -> list[TraceSummary | None]:
    return [c.trace if isinstance(c, TraceCheckpointReport) else None for c in report.checkpoints]


# -- JSON ------------------------------------------------------------------------------------------


def render_json(report: Report) -> str:
    from .json import dumps, report_dict

    doc = report_dict(report)
    sections: dict[str, str] = {}
    for i, (c, summary) in enumerate(zip(doc["checkpoints"], _traces(report), strict=True)):
        if summary is not None:
            marker = f"\x00trace{i}\x00"
            c["trace"] = marker
            sections[json.dumps(marker)] = _section(summary.to_dict(), "      ")
    text = dumps(doc)
    for marker, section in sections.items():
        text = text.replace(marker, section, 1)
    return text + "\n"


def _section(d: dict[str, object], indent: str) -> str:
    """The trace object: its long lists one item per line (fast at 20,000 operations), the rest as ``dumps`` writes it."""
    from .json import dumps

    inner = indent + "  "
    items = []
    for key, value in d.items():
        if key in TRACE_LISTS and isinstance(value, list) and value:
            body = ",\n".join(inner + "  " + json.dumps(x, ensure_ascii=False) for x in value)
            items.append(f"{inner}{json.dumps(key)}: [\n{body}\n{inner}]")
        else:
            items.append(f"{inner}{json.dumps(key)}: {dumps(value, inner)}")
    return "{\n" + ",\n".join(items) + "\n" + indent + "}"


# -- text ------------------------------------------------------------------------------------------


def render_text(report: Report, *, color: bool = True, width: int = 120, verbose: bool = False, quiet: bool = False) -> str:
    from rich import box
    from rich.table import Table
    from rich.text import Text

    from . import blocks, text

    buffer = io.StringIO()
    console = text.console_for(buffer, color=color, width=width)

    def table(title: str) -> Table:
        return Table(box=box.SIMPLE_HEAD, title=title, title_justify="left", title_style="bold", show_edge=False, pad_edge=False)

    for c, summary in zip(report.checkpoints, _traces(report), strict=True):
        if c.error or summary is None:
            text.checkpoint_section(console, c, verbose=verbose)
            continue
        console.print(Text.assemble((c.path, "bold"), ("  trace", "dim"), f"  {headline(summary)}"))
        for line in settings_lines(summary):
            console.print(Text(f"  {line}", style="dim"))
        if c.findings:
            console.print()
            text.findings_section(console, c, verbose=verbose)
        if quiet:
            continue
        rows = module_rows(summary.modules, verbose)
        if rows:
            console.print()
            folded = len(rows) < len(summary.modules)
            title = "Modules" + (" (repeated layers folded, figures of the first; --verbose lists each)" if folded else "")
            _modules_section(console, title, rows, table)
        if summary.activations:
            console.print()
            t = table("Activations by dtype")
            for name, justify in (("dtype", "left"), ("bytes", "right"), ("share", "right")):
                t.add_column(name, justify=justify)  # type: ignore[arg-type]
            total = sum(n for _, n in summary.activations) or 1
            for dtype, n in summary.activations:
                t.add_row(Text(dtype, style=blocks.DTYPE_STYLE.get(dtype, "")), human_bytes(n), f"{n / total:.1%}")
            console.print(t)
        if c.tensors:
            console.print()
            t = table("Parameters and buffers by dtype")
            for name, justify in (("dtype", "left"), ("tensors", "right"), ("elements", "right"), ("bytes", "right"), ("share", "right")):
                t.add_column(name, justify=justify)  # type: ignore[arg-type]
            for row in dtype_summary(c.tensors):
                t.add_row(
                    Text(row.dtype, style=blocks.DTYPE_STYLE.get(row.dtype, "")),
                    str(row.tensors),
                    human_count(row.numel),
                    human_bytes(row.nbytes),
                    f"{row.share:.1%}",
                )
            console.print(t)
        if verbose and summary.ops:
            console.print()
            t = table(f"Operations ({len(summary.ops)})")
            for name in ("#", "phase", "module", "op", "inputs", "outputs", "note"):
                t.add_column(name, overflow="fold")
            for o in summary.ops:
                t.add_row(str(o.index), o.phase, o.module or "(root)", o.name, ", ".join(o.inputs), ", ".join(o.outputs), op_note(o))
            console.print(t)
    console.print()
    console.print(Text(verdict(report), style="bold red" if _failing(report) else "green"))
    return buffer.getvalue()


def _modules_section(console: Any, title: str, rows: list[tuple[str, ModuleSummary]], table: Callable[[str], Any]) -> None:
    """The per-module table. Type names are never cut; dtype lists wrap between their items only where the line is
    too narrow for them whole; module names break after a dot, never inside a name. Where even that does not fit,
    a list: each module's name, then its type and dtypes indented."""
    from rich.text import Text

    from . import blocks

    cells = [(label, m.type, _short(m.inputs), _short(m.compute), _short(m.outputs), _bytes(m.activation_bytes)) for label, m in rows]
    headers = ("module", "type", "in", "compute", "out", "activations")
    whole = [max(len(headers[i]), *(len(r[i]) for r in cells)) for i in range(2, 6)]
    parts = [max(len(headers[i]), *(len(p) + 1 for r in cells for p in r[i].split(", "))) for i in range(2, 6)]  # p + ","
    type_w = max(len("type"), *(len(r[1]) for r in cells))
    longest = max(len(r[0]) for r in cells)
    component = max(len(part) for r in cells for part in name_parts(r[0]))
    gaps = blocks.GAP * (len(headers) - 1)
    widths = whole if console.width - type_w - sum(whole) - gaps >= min(longest, 24) else parts
    module_w = min(console.width - type_w - sum(widths) - gaps, longest)
    if module_w < component:
        console.print(Text(title, style="bold"))
        for label, type_name, inputs, compute, outputs, activations in cells:
            console.print(Text(wrap_name(label, console.width)), overflow="fold")
            console.print(
                Text(f"    {type_name}  in {inputs}  compute {compute}  out {outputs}  activations {activations}"), overflow="fold"
            )
        return
    t = table(title)
    t.add_column("module", width=module_w, overflow="fold")
    t.add_column("type", width=type_w, no_wrap=True)
    for name, w in zip(("in", "compute", "out"), widths, strict=False):
        t.add_column(name, width=w)
    t.add_column("activations", justify="right", width=widths[3])
    for label, *rest in cells:
        t.add_row(wrap_name(label, module_w), *rest)
    console.print(t)


def headline(s: TraceSummary) -> str:
    parts = [s.model, f"{s.device} kernels"]
    parts.append(f"autocast {s.autocast} ({s.device} rules)" if s.autocast else "no autocast")
    parts.append("forward+backward" if s.backward else "forward")
    parts.append(f"{human_count(len(s.ops))} operations")
    errors = sum(1 for o in s.ops if o.error)
    if errors:
        parts.append(f"{errors} failing")
    return " · ".join(parts)


def settings_lines(s: TraceSummary) -> list[str]:
    inputs = ", ".join(f"{i.name + '=' if i.name else ''}{'x'.join(map(str, i.shape)) or 'scalar'} {i.dtype}" for i in s.inputs)
    lines = [f"inputs: {inputs or 'none'}; output: {', '.join(s.output) or 'none'}; default dtype {s.default_dtype}"]
    if s.checkpoint:
        lines.append(f"dtypes from checkpoint {s.checkpoint}")
    if s.autocast_copies:
        casts = sum(1 for o in s.ops if o.autocast_cast)
        made = ", ".join(f"{human_bytes(n)} {d}" for d, n in s.autocast_copies)
        lines.append(f"autocast casts: {casts} ({made} of copies, not counted as activations)")
    if s.loss_dtype:
        lines.append(f"loss: {s.loss} in {s.loss_dtype}")
    if s.stopped:
        lines.append(f"stopped early: {s.stopped}")
    return lines


def op_note(o: OpRecord) -> str:
    if o.error:
        return f"FAILS: {o.error} (went on in {o.continued_as})"
    notes = []
    if o.autocast_cast:
        notes.append("autocast cast")
    if o.autocast_casts:
        notes.append("autocast: " + ", ".join(f"{a}->{b}" for a, b in o.autocast_casts))
    if o.promotion:
        notes.append(f"promotes {o.promotion[0]} to {o.promotion[1]}")
    return "; ".join(notes)


def module_rows(modules: Iterable[ModuleSummary], verbose: bool) -> list[tuple[str, ModuleSummary]]:
    """Rows of the module table; above FULL_LISTING_LIMIT, modules that differ only in layer numbers and not in
    dtypes share a row (``layers.{0..31}.mlp ×32``)."""
    modules = list(modules)
    if verbose or len(modules) <= FULL_LISTING_LIMIT:
        return [(m.module or "(root)", m) for m in modules]
    buckets: dict[tuple[object, ...], list[ModuleSummary]] = {}
    for m in modules:
        key = (_LAYER.sub("*", m.module), m.type, m.inputs, m.compute, m.outputs, tuple(d for d, _ in m.activation_bytes))
        buckets.setdefault(key, []).append(m)
    rows = []
    for members in buckets.values():
        label = fold_label([m.module for m in members]) or "(root)"
        rows.append((f"{label}  ×{len(members)}" if len(members) > 1 else label, members[0]))
    return rows


def _short(items: tuple[str, ...]) -> str:
    """``fp32, bf16``: the module table is wide."""
    return ", ".join(_SHORT.get(d, d) for d in items) if items else "-"


def _dtypes(items: tuple[str, ...]) -> str:
    return ", ".join(items) if items else "-"


_SHORT = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float64": "fp64", "int64": "i64", "int32": "i32"}


def _bytes(items: tuple[tuple[str, int], ...]) -> str:
    """``380M bf16, 156M fp32``: compact, since the table is wide; JSON has the exact figures."""
    return ", ".join(f"{_short_bytes(n)} {_SHORT.get(d, d)}" for d, n in items) if items else "-"


def _short_bytes(n: int) -> str:
    for limit, suffix in ((1 << 40, "T"), (1 << 30, "G"), (1 << 20, "M"), (1 << 10, "K")):
        if n >= limit:
            value = n / limit
            return f"{value:.0f}{suffix}" if value >= 100 else f"{value:.1f}{suffix}" if value >= 10 else f"{value:.2f}{suffix}"
    return f"{n}B"


def _failing(report: Report) -> bool:
    return any(c.error for c in report.checkpoints) or bool(report.failing())


def verdict(report: Report) -> str:
    counts = {s: sum(1 for f in report.findings if f.severity == s) for s in ("error", "warning", "info")}
    parts = [f"{n} {s}{'s' if n != 1 else ''}" for s, n in counts.items() if n]
    if any(c.error for c in report.checkpoints):
        return "✗ trace failed"
    if _failing(report):
        return f"✗ trace: {', '.join(parts)} (failing at --fail-on {report.fail_on})"
    if parts:
        return f"✓ trace: {', '.join(parts)}, none at or above --fail-on {report.fail_on}"
    return "✓ trace: no findings"


# -- markdown --------------------------------------------------------------------------------------


def render_markdown(report: Report, *, verbose: bool = False) -> str:
    from . import markdown

    out = [markdown.render(report, verbose=verbose).rstrip("\n"), ""]
    for c, summary in zip(report.checkpoints, _traces(report), strict=True):
        if summary is None:
            continue
        out += [f"### Trace of `{c.path}`", "", headline(summary) + ".", ""]
        out += [f"- {markdown.table_cell(line)}" for line in settings_lines(summary)] + [""]
        out += ["| module | type | in | compute | out | activations |", "|---|---|---|---|---|---:|"]
        for label, m in module_rows(summary.modules, verbose):
            out.append(
                f"| `{markdown.table_cell(label)}` | {m.type} | {_dtypes(m.inputs)} | {_dtypes(m.compute)} | {_dtypes(m.outputs)} | "
                f"{_bytes(m.activation_bytes)} |"
            )
        out.append("")
        if summary.activations:
            total = sum(n for _, n in summary.activations) or 1
            out += ["| activation dtype | bytes | share |", "|---|---:|---:|"]
            out += [f"| `{d}` | {human_bytes(n)} | {n / total:.1%} |" for d, n in summary.activations]
            out.append("")
    return "\n".join(out) + "\n"


# -- HTML --------------------------------------------------------------------------------------------


def render_html(report: Report) -> str:
    """Scan's page (the parameters' dtype map, bytes by dtype, findings, the tensor table), each traced model's
    section followed by its trace: the settings, activations by dtype, every module and every operation."""
    from . import html

    return html.render(report, title="dtypeaudit trace", extra=_trace_html)


def _trace_html(n: int, c: Any, dtypes: set[str]) -> str:
    from html import escape

    from .html import bytes_bar

    summary = c.trace if isinstance(c, TraceCheckpointReport) else None
    if summary is None:
        return ""
    dtypes.update(d for d, _ in summary.activations)
    settings = "".join(f"<li>{escape(line)}</li>" for line in settings_lines(summary))
    out = [f'<h3 id="ck{n}-th">Trace</h3><p>{escape(headline(summary))}</p><ul>{settings}</ul>']
    total = sum(b for _, b in summary.activations)
    out.append(f'<h3 id="ck{n}-ah">Activations by dtype ({escape(human_bytes(total))})</h3>')
    if summary.activations:
        legend = [f"{human_bytes(b)} ({b:,} bytes, {b / (total or 1):.1%})" for _, b in summary.activations]
        out.append(bytes_bar(summary.activations, "activation bytes by dtype", legend))
    else:
        out.append("<p>No activations: the forward pass made no new tensor.</p>")
    by_module: dict[str, list[str]] = {}
    for f in c.findings:
        if f.tensor:
            by_module.setdefault(f.tensor, []).append(f"{f.severity}: {f.rule}")
    modules = [
        [
            label,
            m.type,
            str(m.calls),
            _dtypes(m.inputs),
            _dtypes(m.compute),
            _dtypes(m.outputs),
            ", ".join(f"{human_bytes(b)} {d}" for d, b in m.activation_bytes) or "-",
            "; ".join(by_module.get(label, [])),
        ]
        for label, m in module_rows(summary.modules, verbose=True)
    ]
    out.append(
        _html_table(
            f"ck{n}-mh",
            f"Modules ({len(modules)})",
            ("module", "type", "calls", "in", "compute", "out", "activations", "findings"),
            [("", r) for r in modules],
            numeric={2},
        )
    )
    ops = [
        (
            "sev-error" if o.error else "",
            [str(o.index), o.phase, o.module or "(root)", o.name, _dtypes(o.inputs), _dtypes(o.outputs), f"{o.nbytes:,}", op_note(o)],
        )
        for o in summary.ops
    ]
    heads = ("#", "phase", "module", "op", "inputs", "outputs", "bytes made", "note")
    out.append(_html_table(f"ck{n}-oh", f"Operations ({len(ops)})", heads, ops, numeric={0, 6}))
    return "".join(out)


def _html_table(hid: str, title: str, heads: tuple[str, ...], rows: list[tuple[str, list[str]]], *, numeric: set[int]) -> str:
    """A heading and its table, in a box that scrolls (and takes keyboard focus to) where it is long; every cell escaped."""
    from html import escape

    if not rows:
        return f'<h3 id="{hid}">{escape(title)}</h3><p>None.</p>'
    head = "".join(f'<th scope="col">{escape(h)}</th>' for h in heads)
    body = []
    for cls, cells in rows:
        tds = "".join(f'<td class="num">{escape(v)}</td>' if i in numeric else f"<td>{escape(v)}</td>" for i, v in enumerate(cells))
        body.append(f'<tr class="{cls}">{tds}</tr>' if cls else f"<tr>{tds}</tr>")
    return (
        f'<h3 id="{hid}">{escape(title)}</h3><div class="scrollbox" tabindex="0" role="region" aria-labelledby="{hid}">'
        f'<table class="tensors"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table></div>'
    )
