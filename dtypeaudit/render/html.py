"""``--format html``: one self-contained page with a dtype map, bytes by dtype, findings and a tensor table.

Pure functions, report -> str; no torch. The page loads nothing: its CSS and script are inline, and its
Content-Security-Policy forbids every fetch and allows only the one script whose hash it names, so even a
name that slipped past escaping could not run code. Everything from the checkpoint (names, paths, messages)
reaches the page either through ``html.escape`` or as JSON inside a ``<script type="application/json">``
that the script reads with ``JSON.parse`` and writes with ``textContent``.

The map: a tensor name's first numeric component is its layer (``model.layers.7.mlp.up_proj.weight`` is layer 7
of the stack ``model.layers``, module column ``mlp.up_proj.weight``). Each stack is a grid, one row per layer, one
column per module; consecutive layers whose cells all match (dtype and mark) fold into one row (``layers 0-31``),
which a button expands. Names without a number sit in a list of their own.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from html import escape
from typing import TYPE_CHECKING, Any

from ..inventory import CheckpointReport, Finding, Inventory, Report, TensorRecord, dtype_summary, severity_rank, unique_tensors

if TYPE_CHECKING:
    from ..diff import InventoryDiff
from .humanize import change_parts, human_bytes, human_count, shape_text

# -- colours -----------------------------------------------------------------------------------------

# Okabe & Ito's colour-blind-safe palette; each cell also prints its dtype's short name, so colour is never
# the only cue. Text colour is black or white, whichever passes WCAG's 4.5:1 contrast on that background.
_COLOURS: dict[str, tuple[str, str]] = {
    "float32": ("#0072B2", "#FFFFFF"),  # blue
    "float16": ("#E69F00", "#000000"),  # orange
    "bfloat16": ("#56B4E9", "#000000"),  # sky blue
    "float64": ("#CC79A7", "#000000"),  # reddish purple
    "float8": ("#D55E00", "#000000"),  # vermillion: every float8 variant
    "int8": ("#009E73", "#000000"),  # bluish green: 8-bit integers (quantized weights)
    "uint8": ("#009E73", "#000000"),
    "bool": ("#F0E442", "#000000"),  # yellow
    "int": ("#BBBBBB", "#000000"),  # grey: other integers (indices, counters)
}
_OTHER = ("#000000", "#FFFFFF")


def dtype_colours(dtype: str) -> tuple[str, str]:
    """(background, text) for a dtype's cells."""
    if dtype in _COLOURS:
        return _COLOURS[dtype]
    if dtype.startswith("float8"):
        return _COLOURS["float8"]
    if dtype.startswith(("int", "uint")):
        return _COLOURS["int"]
    return _OTHER


def dtype_abbrev(dtype: str) -> str:
    """``f32``, ``bf16``, ``f8e4`` (float8_e4m3fn), ``i64``: what a cell prints."""
    short = dtype.replace("bfloat", "bf").replace("float", "f").replace("uint", "u").replace("int", "i").replace("complex", "c")
    head, _, tail = short.partition("_")
    return head + tail[:2]


# -- the map -----------------------------------------------------------------------------------------

_LAYERED = re.compile(r"^(?:(.*?)\.)?(\d+)\.(.+)$")
"""``<stack>.<layer>.<module>``: the first numeric component, with something after it."""


@dataclass(frozen=True)
class Mark:
    """What a cell is marked with: a finding's severity, or a diff's change."""

    kind: str
    """CSS class suffix and rank key: ``error``, ``warning``, ``info``, ``changed``, ``added``, ``removed``."""
    glyph: str
    """Printed in the cell, so a mark does not depend on colour."""
    text: str
    """For the cell's title and screen readers."""


_SEVERITY_MARK = {
    "error": Mark("error", "!", "error"),
    "warning": Mark("warning", "!", "warning"),
    "info": Mark("info", "i", "info"),
}


@dataclass
class _Stack:
    prefix: str
    columns: list[str] = field(default_factory=list)
    rows: dict[int, dict[str, int]] = field(default_factory=dict)
    """layer -> column -> record index."""


@dataclass
class MapModel:
    """Where each record of one checkpoint sits on its map, and the id of the cell that shows it."""

    stacks: list[_Stack]
    loose: list[int]
    """Records with no layer number (or whose grid cell another record took), in file order."""
    cell_of: dict[int, str] = field(default_factory=dict)
    """Record index -> id of the visible cell that shows it (a folded row's cell where it is folded)."""


def _layout(tensors: Sequence[TensorRecord]) -> MapModel:
    stacks: dict[str, _Stack] = {}
    loose = []
    for i, t in enumerate(tensors):
        m = _LAYERED.match(t.name)
        if m is None:
            loose.append(i)
            continue
        prefix, layer, column = m.group(1) or "", int(m.group(2)), m.group(3)
        stack = stacks.setdefault(prefix, _Stack(prefix))
        row = stack.rows.setdefault(layer, {})
        if column in row:  # the same name twice (two files of one directory): list it apart
            loose.append(i)
            continue
        if column not in stack.columns:
            stack.columns.append(column)
        row[column] = i
    return MapModel(list(stacks.values()), loose)


def _ranges(numbers: list[int]) -> str:
    """``0–15, 17, 20–31`` for sorted layer numbers."""
    runs: list[list[int]] = []
    for n in numbers:
        if runs and n == runs[-1][-1] + 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    return ", ".join(f"{r[0]}\u2013{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


class _MapWriter:
    """Writes one checkpoint's map as HTML, filling ``model.cell_of``; ids start with ``base``."""

    def __init__(self, base: str, tensors: Sequence[TensorRecord], marks: dict[int, Mark]):
        self.base = base
        self.tensors = tensors
        self.marks = marks
        self.model = _layout(tensors)

    def _cell(self, cell_id: str, records: list[int], *, label: str | None = None, tag: str = "td") -> str:
        first = self.tensors[records[0]]
        mark = self.marks.get(records[0])
        names = [self.tensors[i].name for i in records]
        title = f"{names[0]}" if len(names) == 1 else f"{names[0]} \u2026 {names[-1]} ({len(names)} tensors)"
        title += f": {first.dtype} {shape_text(first.shape)}"
        if mark:
            title += f"; {mark.text}"
        classes = f"cell dt-{_css_key(first.dtype)}" + (" chip" if tag != "td" else "") + (f" mark mark-{mark.kind}" if mark else "")
        text = escape(dtype_abbrev(first.dtype)) + (f'<span class="glyph" aria-hidden="true">{mark.glyph}</span>' if mark else "")
        body = f'<span class="cname">{escape(label)}</span>{text}' if label is not None else text
        return (
            f'<{tag} id="{cell_id}" class="{classes}" data-dtype="{escape(first.dtype)}" data-names="{escape(chr(10).join(names))}"'
            f' title="{escape(title)}">{body}</{tag}>'
        )

    def write(self) -> str:
        out = []
        for s, stack in enumerate(self.model.stacks):
            out.append(self._stack(s, stack))
        if self.model.loose:
            out.append(self._loose())
        return "\n".join(out)

    def _signature(self, row: dict[str, int], columns: list[str]) -> tuple[object, ...]:
        return tuple(
            (self.tensors[row[c]].dtype, self.tensors[row[c]].shape, self.marks.get(row[c])) if c in row else None for c in columns
        )

    def _stack(self, s: int, stack: _Stack) -> str:
        layers = sorted(stack.rows)
        groups: list[list[int]] = []
        for layer in layers:
            sig = self._signature(stack.rows[layer], stack.columns)
            if groups and self._signature(stack.rows[groups[-1][0]], stack.columns) == sig:
                groups[-1].append(layer)
            else:
                groups.append([layer])
        name = stack.prefix or "(top level)"
        caption = f"{name}: {len(layers)} layer{'s' if len(layers) != 1 else ''} \u00d7 {len(stack.columns)} tensors"
        if len(groups) < len(layers):
            caption += f", folded into {len(groups)} row{'s' if len(groups) != 1 else ''}"
        head = "".join(f'<th scope="col"><span class="vh">{escape(c)}</span></th>' for c in stack.columns)
        rows = []
        for g, members in enumerate(groups):
            gid = f"{self.base}-s{s}-g{g}"
            folded = len(members) > 1
            cells = []
            for c, column in enumerate(stack.columns):
                if column not in stack.rows[members[0]]:
                    cells.append('<td class="empty"></td>')
                    continue
                records = [stack.rows[layer][column] for layer in members]
                cell_id = f"{gid}-c{c}"
                cells.append(self._cell(cell_id, records))
                for i in records:
                    self.model.cell_of[i] = cell_id
            label = f"layers {_ranges(members)}" if folded else f"layer {members[0]}"
            if folded:
                th = (
                    f'<th scope="row"><button type="button" class="fold" aria-expanded="false" data-group="{gid}">'
                    f"{escape(label)}</button></th>"
                )
            else:
                th = f'<th scope="row">{escape(label)}</th>'
            rows.append(f'<tr class="group">{th}{"".join(cells)}</tr>')
            if folded:
                for layer in members:
                    inner = []
                    for c, column in enumerate(stack.columns):
                        record = stack.rows[layer].get(column)
                        cell = self._cell(f"{gid}-l{layer}-c{c}", [record]) if record is not None else '<td class="empty"></td>'
                        inner.append(cell)
                    rows.append(f'<tr class="member" data-group="{gid}" hidden><th scope="row">layer {layer}</th>{"".join(inner)}</tr>')
        return (
            f'<div class="mapwrap"><table class="map"><caption>{escape(caption)}</caption>'
            f'<thead><tr><th scope="col">layer</th>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table></div>'
        )

    def _loose(self) -> str:
        """Tensors outside the repeated layers, one row per module: its path, then a chip per tensor."""
        modules: dict[str, list[int]] = {}
        for i in self.model.loose:
            parent, _, _ = self.tensors[i].name.rpartition(".")
            modules.setdefault(parent, []).append(i)
        rows = []
        n = 0
        for parent, records in modules.items():
            chips = []
            for i in records:
                cell_id = f"{self.base}-o{n}"
                n += 1
                self.model.cell_of[i] = cell_id
                leaf = self.tensors[i].name[len(parent) + 1 :] if parent else self.tensors[i].name
                chips.append(self._cell(cell_id, [i], label=leaf, tag="span"))
            rows.append(f'<tr><th scope="row">{escape(parent or "(top level)")}</th><td class="chips">{"".join(chips)}</td></tr>')
        count = len(self.model.loose)
        return (
            f'<table class="map loose"><caption>Outside the repeated layers: {count} tensor{"s" if count != 1 else ""}</caption>'
            f'<thead><tr><th scope="col">module</th><th scope="col">tensors and dtypes</th></tr></thead>'
            f"<tbody>{''.join(rows)}</tbody></table>"
        )


def _css_key(dtype: str) -> str:
    return re.sub(r"[^a-z0-9_]", "_", dtype.lower())


# -- findings on tensors -----------------------------------------------------------------------------


def names_index(tensors: Sequence[TensorRecord]) -> dict[str, list[int]]:
    """Every tensor name and every module path above it (``model``, ``model.fc``, ``model.fc.weight``) -> records,
    so that finding a finding's tensors costs one lookup, even at a finding per tensor of 10,000."""
    index: dict[str, list[int]] = {}
    for i, t in enumerate(tensors):
        parts = t.name.split(".")
        for k in range(1, len(parts) + 1):
            index.setdefault(".".join(parts[:k]), []).append(i)
    return index


def finding_targets(f: Finding, tensors: Sequence[TensorRecord], index: dict[str, list[int]] | None = None) -> list[int]:
    """The records a finding points at: the tensor it names, or every tensor of the module it names
    (``module-dtype-mix`` names ``model.fc``); within its file where it names one."""
    if not f.tensor:
        return []
    hits = (index if index is not None else names_index(tensors)).get(f.tensor, [])
    return [i for i in hits if not (f.file and tensors[i].file and f.file != tensors[i].file)]


def _severity_marks(findings: Iterable[Finding], tensors: Sequence[TensorRecord]) -> tuple[dict[int, Mark], list[list[int]]]:
    """The worst finding's mark per record, and each finding's records."""
    marks: dict[int, Mark] = {}
    targets = []
    index = names_index(tensors)
    for f in findings:
        hit = finding_targets(f, tensors, index)
        targets.append(hit)
        for i in hit:
            if i not in marks or severity_rank(f.severity) > severity_rank(marks[i].kind):
                marks[i] = _SEVERITY_MARK[f.severity]
    return marks, targets


# -- pieces of the page ------------------------------------------------------------------------------


def _bytes_bar(tensors: Sequence[TensorRecord], label: str) -> str:
    rows = dtype_summary(tensors)
    legend = [
        f"{r.tensors} tensor{'s' if r.tensors != 1 else ''}, {human_count(r.numel)} elements, {human_bytes(r.nbytes)} ({r.share:.1%})"
        for r in rows
    ]
    return bytes_bar([(r.dtype, r.nbytes) for r in rows], label, legend)


def bytes_bar(parts: Sequence[tuple[str, int]], label: str, legend: Sequence[str]) -> str:
    """A bar of bytes by dtype, ``(dtype, bytes)`` largest first, and its legend: ``legend[i]`` says ``parts[i]``."""
    total = sum(n for _, n in parts)
    segments = []
    for dtype, n in parts:
        width = 100 * n / total if total else 100 / len(parts)
        segments.append(f'<span class="seg dt-{_css_key(dtype)}" style="width:{width:.3f}%"></span>')
    said = ", ".join(f"{dtype} {human_bytes(n)} ({n / (total or 1):.1%})" for dtype, n in parts)
    items = "".join(
        f'<li><span class="swatch dt-{_css_key(dtype)}" aria-hidden="true"></span>{escape(dtype)}: {escape(text)}</li>'
        for (dtype, _), text in zip(parts, legend, strict=True)
    )
    bar = f'<div class="bar" role="img" aria-label="{escape(label)}: {escape(said)}">{"".join(segments)}</div>'
    return f'{bar}<ul class="barlegend">{items}</ul>'


def _legend(dtypes: Iterable[str], marks: Iterable[Mark]) -> str:
    items = [f'<li><span class="cell dt-{_css_key(d)} swatchcell">{escape(dtype_abbrev(d))}</span> {escape(d)}</li>' for d in dtypes]
    items += [f'<li><span class="cell mark mark-{m.kind} swatchcell plain">{m.glyph}</span> {escape(m.text)}</li>' for m in marks]
    return f'<ul class="legend" aria-label="legend">{"".join(items)}</ul>'


def _dtype_css(dtypes: Iterable[str]) -> str:
    rules = []
    for d in sorted(set(dtypes)):
        bg, fg = dtype_colours(d)
        rules.append(f".dt-{_css_key(d)}{{background:{bg};color:{fg}}}")
    return "\n".join(rules)


def _json_script(element_id: str, value: Any) -> str:
    """JSON a script reads with JSON.parse; ``<``, ``>`` and ``&`` escaped so no name can close the element."""
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    for ch, esc in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"), ("\u2028", "\\u2028"), ("\u2029", "\\u2029")):
        text = text.replace(ch, esc)
    return f'<script type="application/json" id="{element_id}">{text}</script>'


def _page(title: str, body: str, *, dtypes: Iterable[str], data: Any) -> str:
    digest = base64.b64encode(hashlib.sha256(_SCRIPT.encode()).digest()).decode()
    csp = f"default-src 'none'; style-src 'unsafe-inline'; script-src 'sha256-{digest}'; img-src data:; base-uri 'none'; form-action 'none'"
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f'<meta http-equiv="Content-Security-Policy" content="{csp}">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f"<title>{escape(title)}</title>\n<style>\n{_CSS}\n{_dtype_css(dtypes)}\n</style>\n</head>\n<body>\n"
        f"{body}\n{_json_script('dtypeaudit-data', data)}\n<script>{_SCRIPT}</script>\n</body>\n</html>\n"
    )


def _tensor_table(multi: bool) -> str:
    """The table's frame; the script fills it a page at a time from the JSON data."""
    columns = (["checkpoint"] if multi else []) + ["name", "dtype", "shape", "bytes", "kind", "module", "layout", "findings"]
    head = "".join(f'<th scope="col" aria-sort="none"><button type="button" class="sort" data-key="{c}">{c}</button></th>' for c in columns)
    return f"""<section aria-labelledby="tensors-h">
<h2 id="tensors-h">Tensors</h2>
<div class="controls">
<label for="search">Search names, dtypes, modules</label>
<input id="search" type="search" placeholder="e.g. float16 or layers.3.">
<button type="button" id="prev">Previous page</button>
<button type="button" id="next">Next page</button>
<span id="status" role="status" aria-live="polite"></span>
</div>
<table id="tensors" class="tensors"><thead><tr>{head}</tr></thead><tbody></tbody></table>
</section>"""


# -- scan report -------------------------------------------------------------------------------------


CheckpointExtra = Callable[[int, CheckpointReport, set[str]], str]
"""More of one checkpoint's section (``trace``: its modules, operations and activations), given the checkpoint's
number and report; it adds the dtypes it colours to the set."""


def render(report: Report, *, title: str = "dtypeaudit report", extra: CheckpointExtra | None = None) -> str:
    """The whole report as one page; ``extra`` adds to each readable checkpoint's section."""
    multi = len(report.checkpoints) > 1
    failing = report.failing()
    unreadable = [c for c in report.checkpoints if c.error]
    verdict = "failed" if failing or unreadable else "passed"
    n_findings = len(report.findings)
    counts = f"{len(report.checkpoints)} checkpoint{'s' if multi else ''}, {n_findings} finding{'s' if n_findings != 1 else ''}"
    policy = f", policy {escape(report.policy)}" if report.policy else ""
    sections = []
    rows: list[list[object]] = []
    dtypes: set[str] = set()
    used_marks: dict[str, Mark] = {}
    for n, c in enumerate(report.checkpoints):
        sections.append(_checkpoint_section(n, c, rows, dtypes, used_marks, extra))
    legend = _legend(sorted(dtypes), [m for k, m in sorted(used_marks.items(), key=lambda kv: -severity_rank(kv[0]))])
    body = f"""<header>
<h1>{escape(title)}</h1>
<p class="verdict verdict-{verdict}"><strong>{verdict}</strong>: {counts}, failing at {escape(report.fail_on)}{policy}.</p>
</header>
<main>
<section aria-labelledby="legend-h"><h2 id="legend-h">Legend</h2>{legend}</section>
{"".join(sections)}
{_tensor_table(multi)}
</main>"""
    data = {"checkpoints": [c.path for c in report.checkpoints], "multi": multi, "rows": rows}
    return _page(f"dtypeaudit: {', '.join(c.path for c in report.checkpoints)}", body, dtypes=dtypes, data=data)


def _checkpoint_section(
    n: int, c: CheckpointReport, rows: list[list[object]], dtypes: set[str], used: dict[str, Mark], extra: CheckpointExtra | None = None
) -> str:
    hid = f"ck{n}-h"
    head = f'<section class="checkpoint" aria-labelledby="{hid}"><h2 id="{hid}"><code>{escape(c.path)}</code></h2>'
    if c.error:
        return f'{head}<p class="unreadable"><strong>unreadable</strong>: {escape(c.error)}</p></section>'
    tensors = c.tensors
    unique = unique_tensors(tensors)
    dtypes.update(t.dtype for t in tensors)
    marks, targets = _severity_marks(c.findings, tensors)
    for m in marks.values():
        used[m.kind] = m
    writer = _MapWriter(f"ck{n}", tensors, marks)
    grid = writer.write()
    facts = (
        f"{escape(c.format or '')}, {len(tensors)} tensors, {human_count(sum(t.numel for t in unique))} elements, "
        f"{human_bytes(sum(t.nbytes for t in unique))}"
    )
    findings = _findings_list(n, c.findings, targets, writer.model.cell_of, tensors)
    found: dict[int, list[str]] = {}
    for f, hit in zip(c.findings, targets, strict=True):
        for i in hit:
            found.setdefault(i, []).append(f"{f.severity}: {f.rule}")
    for i, t in enumerate(tensors):
        # The quantization scheme joins ``layout`` here once TensorRecord carries one.
        rows.append(
            [
                n,
                t.name,
                t.dtype,
                shape_text(t.shape),
                t.nbytes,
                t.kind,
                t.module or t.module_guess or "",
                t.layout,
                "; ".join(found.get(i, [])),
                writer.model.cell_of.get(i, ""),
            ]
        )
    return (
        f"{head}<p>{facts}</p>"
        f'<h3>Dtype map</h3><div class="maps">{grid}</div>'
        f"<h3>Bytes by dtype</h3>{_bytes_bar(tensors, 'bytes by dtype')}"
        f'<h3 id="ck{n}-fh">Findings ({len(c.findings)})</h3>{findings}{extra(n, c, dtypes) if extra else ""}</section>'
    )


def _findings_list(
    n: int, findings: Sequence[Finding], targets: list[list[int]], cell_of: dict[int, str], tensors: Sequence[TensorRecord]
) -> str:
    if not findings:
        return "<p>No findings.</p>"
    order = sorted(range(len(findings)), key=lambda k: -severity_rank(findings[k].severity))
    items = []
    for k in order:
        f = findings[k]
        where = f.tensor or f.file or ""
        if targets[k]:
            cell = cell_of[targets[k][0]]
            where_html = f'<a class="to-cell" href="#{cell}" data-cell="{cell}">{escape(where)}</a>'
        else:
            where_html = escape(where) if where else "(whole checkpoint)"
        items.append(
            f'<li class="finding sev-{f.severity}" id="ck{n}-f{k}"><span class="sev">{f.severity}</span> '
            f"<code>{escape(f.rule)}</code> {where_html}: {escape(f.message)}</li>"
        )
    # A long list scrolls in its own box, so the map stays in view; the box takes keyboard focus to scroll.
    return f'<div class="scrollbox" tabindex="0" role="region" aria-labelledby="ck{n}-fh"><ul class="findings">{"".join(items)}</ul></div>'


# -- diff --------------------------------------------------------------------------------------------

_CHANGE_MARKS = {
    "changed": Mark("changed", "\u0394", "changed"),
    "added": Mark("added", "+", "only in B"),
    "removed": Mark("removed", "\u2212", "only in A"),
}


def render_diff(d: InventoryDiff) -> str:
    """``diff A B --format html``: both maps side by side, the cells that differ marked, each change linked to them."""
    from .diff import summary_line

    a, b = d.a.tensors, d.b.tensors
    index_a = {t.name: i for i, t in enumerate(a)}
    index_b = {t.name: i for i, t in enumerate(b)}

    def original(index: dict[str, int], prefix: str, matched: str) -> int | None:
        return index.get(prefix + matched) if prefix and prefix + matched in index else index.get(matched)

    marks_a: dict[int, Mark] = {}
    marks_b: dict[int, Mark] = {}
    changes: list[tuple[str, str, int | None, int | None]] = []
    for t in d.removed:
        i = original(index_a, d.prefix_a, t.name)
        if i is not None:
            marks_a[i] = _CHANGE_MARKS["removed"]
        changes.append(("removed", f"{t.name}: {t.dtype} {shape_text(t.shape)}", i, None))
    for t in d.added:
        j = original(index_b, d.prefix_b, t.name)
        if j is not None:
            marks_b[j] = _CHANGE_MARKS["added"]
        changes.append(("added", f"{t.name}: {t.dtype} {shape_text(t.shape)}", None, j))
    for c in d.changed:
        i, j = index_a.get(c.before.name), index_b.get(c.after.name)
        if i is not None:
            marks_a[i] = _CHANGE_MARKS["changed"]
        if j is not None:
            marks_b[j] = _CHANGE_MARKS["changed"]
        parts = change_parts(c, arrow="\u2192")
        changes.append(("changed", f"{c.name}: {'; '.join(parts)}", i, j))
    writer_a, writer_b = _MapWriter("a", a, marks_a), _MapWriter("b", b, marks_b)
    grid_a, grid_b = writer_a.write(), writer_b.write()
    items = []
    for kind, text, i, j in changes:
        links = []
        if i is not None:
            links.append(f'<a class="to-cell" href="#{writer_a.model.cell_of[i]}" data-cell="{writer_a.model.cell_of[i]}">in A</a>')
        if j is not None:
            links.append(f'<a class="to-cell" href="#{writer_b.model.cell_of[j]}" data-cell="{writer_b.model.cell_of[j]}">in B</a>')
        items.append(f'<li class="change change-{kind}"><span class="sev">{kind}</span> {escape(text)} ({", ".join(links)})</li>')
    for tie in d.ties:
        what = ("storage sharing" if tie.views else "tie") + (" broken" if tie.broken else " created")
        items.append(f'<li class="change change-tie"><span class="sev">{what}</span> {escape(" = ".join(tie.names))}</li>')
    change_list = (
        f'<div class="scrollbox" tabindex="0" role="region" aria-labelledby="changes-h"><ul class="findings">{"".join(items)}</ul></div>'
        if items
        else "<p>No changes.</p>"
    )
    dtypes = {t.dtype for t in a} | {t.dtype for t in b}
    used = sorted({m.kind: m for m in [*marks_a.values(), *marks_b.values()]}.values(), key=lambda m: m.kind)

    def side(label: str, inv: Inventory, prefix: str, grid: str) -> str:
        note = f"; names compared without <code>{escape(prefix)}</code>" if prefix else ""
        return (
            f'<section class="side" aria-labelledby="side-{label}"><h2 id="side-{label}">{label}: <code>{escape(inv.path)}</code></h2>'
            f"<p>{escape(inv.format)}, {len(inv.tensors)} tensors{note}</p>"
            f'{_bytes_bar(inv.tensors, f"bytes by dtype in {label}")}<div class="maps">{grid}</div></section>'
        )

    body = f"""<header>
<h1>dtypeaudit diff</h1>
<p class="verdict verdict-{"failed" if d.differs else "passed"}">{escape(summary_line(d))}</p>
</header>
<main>
<section aria-labelledby="legend-h"><h2 id="legend-h">Legend</h2>{_legend(sorted(dtypes), used)}</section>
<section aria-labelledby="changes-h"><h2 id="changes-h">Changes ({len(items)})</h2>{change_list}</section>
<div class="sides">{side("A", d.a, d.prefix_a, grid_a)}{side("B", d.b, d.prefix_b, grid_b)}</div>
</main>"""
    return _page(f"dtypeaudit diff: {d.a.path} vs {d.b.path}", body, dtypes=dtypes, data={"checkpoints": [], "multi": False, "rows": []})


# -- style and script --------------------------------------------------------------------------------

_CSS = """
:root{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:#1a1a1a;background:#fff}
body{margin:0 auto;padding:0 1rem 2rem;max-width:110rem;line-height:1.4}
h1{font-size:1.5rem;margin:.8rem 0 .2rem} h2{font-size:1.2rem;margin:1.2rem 0 .4rem} h3{font-size:1rem;margin:.8rem 0 .3rem}
code{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;word-break:break-all}
.verdict-failed strong{color:#a00000} .verdict-passed strong{color:#006400}
.legend,.barlegend,.findings{list-style:none;padding:0;margin:.3rem 0;display:flex;flex-wrap:wrap;gap:.3rem 1.2rem}
.findings{display:block} .findings li{margin:.2rem 0}
.scrollbox{max-height:16rem;overflow-y:auto;border:1px solid #ddd;padding:0 .5rem}
.sev{display:inline-block;min-width:4.5rem;font-weight:600}
.sev-error .sev{color:#a00000} .sev-warning .sev{color:#7a4a00} .sev-info .sev{color:#00507a}
.bar{display:flex;height:1.4rem;border:1px solid #555;max-width:60rem}
.seg{display:block;height:100%;min-width:2px}
.swatch{display:inline-block;width:.9rem;height:.9rem;margin-right:.3rem;vertical-align:middle;border:1px solid #555}
.mapwrap{overflow-x:auto;max-width:100%}
table.map{border-collapse:separate;border-spacing:2px;margin:.4rem 0 1rem;font-size:.75rem}
table.map caption{text-align:left;font-weight:600;font-size:.85rem;padding:.2rem 0;white-space:nowrap}
table.map th{font-weight:500;text-align:left;white-space:nowrap;padding:0 .4rem 0 0}
table.map thead th{vertical-align:bottom}
table.map thead th .vh{writing-mode:vertical-rl;transform:rotate(180deg);display:inline-block;max-height:14rem;overflow:hidden;
  text-overflow:ellipsis;font-family:ui-monospace,Menlo,Consolas,monospace}
.cell{min-width:2.4rem;height:1.5rem;text-align:center;font-family:ui-monospace,Menlo,Consolas,monospace;font-weight:600;
  padding:0 .2rem;white-space:nowrap}
.empty{background:repeating-linear-gradient(45deg,#f4f4f4,#f4f4f4 3px,#fff 3px,#fff 6px)}
.mark{outline:3px solid #000;outline-offset:-3px}
.mark-warning{outline-style:dashed} .mark-info{outline-style:dotted}
.mark-added,.mark-removed{outline-style:double;outline-width:4px}
.glyph{margin-left:.15rem}
.swatchcell{display:inline-block;padding:.1rem .3rem} .plain{background:#fff;color:#000}
.cname{font-weight:400;margin-right:.5rem}
table.loose td.chips{display:flex;flex-wrap:wrap;gap:2px}
.chip{display:inline-block;line-height:1.5rem}
td:target,td.flash{box-shadow:0 0 0 4px #000,0 0 0 7px #fff}
button.fold{font:inherit;background:#fff;border:1px solid #555;border-radius:3px;cursor:pointer;padding:0 .3rem}
button.fold[aria-expanded=true]::after{content:" \\25B4"} button.fold[aria-expanded=false]::after{content:" \\25BE"}
.controls{display:flex;flex-wrap:wrap;gap:.5rem;align-items:center;margin:.4rem 0}
.controls input{min-width:18rem;padding:.2rem}
table.tensors{border-collapse:collapse;font-size:.85rem;width:100%}
table.tensors th,table.tensors td{border-bottom:1px solid #ddd;padding:.15rem .5rem;text-align:left;vertical-align:top}
table.tensors td.num{text-align:right}
table.tensors th button{font:inherit;font-weight:600;background:none;border:none;padding:0;cursor:pointer;color:inherit}
table.tensors th[aria-sort=ascending] button::after{content:" \\25B2"}
table.tensors th[aria-sort=descending] button::after{content:" \\25BC"}
a{color:#0050a0}
:focus-visible{outline:3px solid #0050a0;outline-offset:2px}
.sides{display:grid;grid-template-columns:repeat(auto-fit,minmax(30rem,1fr));gap:1.5rem}
.sides .side{min-width:0}
.unreadable{color:#a00000}
tr.sev-error td{color:#a00000}
"""

_SCRIPT = r"""
(function () {
  "use strict";
  var data = JSON.parse(document.getElementById("dtypeaudit-data").textContent);
  // Folded rows: the button shows or hides the layers it stands for.
  document.addEventListener("click", function (ev) {
    var t = ev.target;
    if (!(t instanceof Element)) return;
    var fold = t.closest("button.fold");
    if (fold) {
      var open = fold.getAttribute("aria-expanded") !== "true";
      fold.setAttribute("aria-expanded", open ? "true" : "false");
      var members = document.querySelectorAll('tr.member[data-group="' + fold.getAttribute("data-group") + '"]');
      members.forEach(function (r) { r.hidden = !open; });
      return;
    }
    var link = t.closest("a.to-cell");
    if (link) {
      var cell = document.getElementById(link.getAttribute("data-cell"));
      if (cell) { cell.classList.add("flash"); setTimeout(function () { cell.classList.remove("flash"); }, 1500); }
    }
  });
  var table = document.getElementById("tensors");
  if (!table) return;
  var rows = data.rows, multi = data.multi, PAGE = 100;
  var KEYS = {checkpoint: 0, name: 1, dtype: 2, shape: 3, bytes: 4, kind: 5, module: 6, layout: 7, findings: 8};
  var shown = rows.map(function (r, i) { return i; });
  var page = 0, sortKey = null, sortDir = 1;
  var collator = new Intl.Collator("en", {numeric: true});  // layers.2 before layers.10
  var search = document.getElementById("search"), status = document.getElementById("status");
  var prev = document.getElementById("prev"), next = document.getElementById("next");
  var body = table.tBodies[0];
  var haystack = rows.map(function (r) {
    return [data.checkpoints[r[0]], r[1], r[2], r[6], r[7], r[8]].join("\n").toLowerCase();
  });
  function td(text, cls) {
    var c = document.createElement("td");
    c.textContent = text;
    if (cls) c.className = cls;
    return c;
  }
  function draw() {
    var pages = Math.max(1, Math.ceil(shown.length / PAGE));
    if (page >= pages) page = pages - 1;
    var start = page * PAGE, end = Math.min(shown.length, start + PAGE);
    var frag = document.createDocumentFragment();
    for (var k = start; k < end; k++) {
      var r = rows[shown[k]], tr = document.createElement("tr");
      tr.setAttribute("data-name", r[1]);
      if (multi) tr.appendChild(td(data.checkpoints[r[0]]));
      var name = document.createElement("td");
      if (r[9]) {
        var a = document.createElement("a");
        a.href = "#" + r[9];
        a.className = "to-cell";
        a.setAttribute("data-cell", r[9]);
        a.textContent = r[1];
        name.appendChild(a);
      } else {
        name.textContent = r[1];
      }
      tr.appendChild(name);
      tr.appendChild(td(r[2]));
      tr.appendChild(td(r[3]));
      tr.appendChild(td(String(r[4]), "num"));
      tr.appendChild(td(r[5]));
      tr.appendChild(td(r[6]));
      tr.appendChild(td(r[7]));
      tr.appendChild(td(r[8]));
      frag.appendChild(tr);
    }
    body.replaceChildren(frag);
    status.textContent = shown.length ? "tensors " + (start + 1) + "\u2013" + end + " of " + shown.length +
      (shown.length !== rows.length ? " matching (" + rows.length + " in all)" : "") + ", page " + (page + 1) + " of " + pages
      : "no tensor matches";
    prev.disabled = page === 0;
    next.disabled = page >= pages - 1;
  }
  function filter() {
    var q = search.value.trim().toLowerCase();
    shown = [];
    for (var i = 0; i < rows.length; i++) if (!q || haystack[i].indexOf(q) !== -1) shown.push(i);
    order();
    page = 0;
    draw();
  }
  function order() {
    if (sortKey === null) return;
    var k = KEYS[sortKey];
    shown.sort(function (x, y) {
      var a = k === 0 ? data.checkpoints[rows[x][0]] : rows[x][k], b = k === 0 ? data.checkpoints[rows[y][0]] : rows[y][k];
      var c = typeof a === "number" ? a - b : collator.compare(a, b);
      return c !== 0 ? c * sortDir : x - y;
    });
  }
  table.tHead.addEventListener("click", function (ev) {
    var b = ev.target instanceof Element ? ev.target.closest("button.sort") : null;
    if (!b) return;
    var key = b.getAttribute("data-key");
    sortDir = sortKey === key ? -sortDir : 1;
    sortKey = key;
    table.tHead.querySelectorAll("th").forEach(function (th) { th.setAttribute("aria-sort", "none"); });
    b.parentElement.setAttribute("aria-sort", sortDir === 1 ? "ascending" : "descending");
    order();
    page = 0;
    draw();
  });
  search.addEventListener("input", filter);
  prev.addEventListener("click", function () { if (page > 0) { page--; draw(); } });
  next.addEventListener("click", function () { page++; draw(); });
  draw();
})();
"""
