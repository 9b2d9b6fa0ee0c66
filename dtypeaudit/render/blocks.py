"""The text report as blocks: paragraphs and tables with their styles, and every column width, decided once.

``text.py`` draws them with Rich (``-f table`` in colour, ``-f plain`` without); ``trace.py`` and live audits
reuse its sections. No Rich here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple, Union

from ..inventory import CheckpointReport, DtypeTotals, Report, TensorRecord, dtype_summary
from . import quant_view
from .humanize import FindingGroup, group_findings, group_tensors, human_bytes, human_count, name_parts, shape_text, wrap_name

if TYPE_CHECKING:
    from ..quant.model import QuantView

SEVERITY_STYLE = {"error": "bold red", "warning": "yellow", "info": "cyan"}
DTYPE_STYLE = {"float32": "blue", "float16": "green", "bfloat16": "magenta", "float64": "bright_blue"}
FULL_LISTING_LIMIT = 60
"""Up to this many tensors every one is listed; above it, layers that repeat are folded into one row."""
TABLE_ROWS = 40
"""A table (findings, tensors) shows this many rows and says how many more there are, unless ``--all`` or
``--verbose``: a header of a million tensors is a million rows, which no terminal wants and Rich takes minutes
to lay out."""
GAP = 3
"""Columns between two cells of a table below: a cell's right padding, the rule's blank, the next one's left padding."""
MIN_NAME_WIDTH = 24
MIN_MESSAGE_WIDTH = 20


class Styled(NamedTuple):
    text: str
    style: str = ""


class Line(NamedTuple):
    """One paragraph: wrapped between words at the page's width, a word wider than the page folded."""

    spans: tuple[Styled, ...]


class Column(NamedTuple):
    """A table column, with Rich's column settings: ``width`` fixes the content's width, ``no_wrap`` keeps each
    line whole, ``overflow`` is what happens to a word wider than the column (``fold`` it, or cut it with ``…``)."""

    header: str
    justify: str = "left"
    width: int | None = None
    max_width: int | None = None
    no_wrap: bool = False
    overflow: str = "ellipsis"


class Grid(NamedTuple):
    """A table without borders: the title above it, a header row, a rule under the header, no rules between rows."""

    title: str
    columns: tuple[Column, ...]
    rows: Sequence[tuple[Styled, ...]]


Block = Union[Line, Grid]
BLANK = Line(())


def line(*spans: Styled | str) -> Line:
    return Line(tuple(s if isinstance(s, Styled) else Styled(s) for s in spans))


def _spans(*texts: str) -> tuple[Styled, ...]:
    return tuple(Styled(t) for t in texts)


def report_blocks(report: Report, *, width: int, verbose: bool, quiet: bool, all_rows: bool = True) -> list[Block]:
    """The report; ``quiet`` shows only the checkpoints with findings or errors, and no tensor tables; without
    ``all_rows`` (or ``verbose``) each table its first ``TABLE_ROWS`` rows."""
    blocks: list[Block] = []
    shown = [c for c in report.checkpoints if not quiet or c.error or c.findings]
    for i, checkpoint in enumerate(shown):
        if i:
            blocks.append(BLANK)
        blocks += checkpoint_blocks(checkpoint, width=width, verbose=verbose, quiet=quiet, all_rows=all_rows)
    if shown and (len(report.checkpoints) > 1 or report.findings):
        blocks.append(BLANK)
    blocks.append(verdict(report))
    return blocks


def checkpoint_blocks(c: CheckpointReport, *, width: int, verbose: bool, quiet: bool = False, all_rows: bool = True) -> list[Block]:
    title = Styled(c.path, "bold")
    if c.error:
        return [line(title, "  ", Styled("unreadable", "bold red")), line(Styled(f"  {c.error}", "red"))]
    tensors = c.tensors
    by_dtype = dtype_summary(tensors)  # each tensor once (``unique_tensors``), as the totals count them
    read = f"  ({human_bytes(c.inventory.bytes_read)} read)" if verbose and c.inventory and c.inventory.bytes_read is not None else ""
    size = f"{human_count(sum(r.numel for r in by_dtype))} elements · {human_bytes(sum(r.nbytes for r in by_dtype))}"
    blocks: list[Block] = [line(title, Styled(f"  {c.format}", "dim"), f"  {len(tensors)} tensors · {size}", Styled(read, "dim"))]
    if c.findings:
        blocks += [BLANK, *findings_blocks(c, width=width, verbose=verbose, all_rows=all_rows)]
    if tensors and not quiet:
        quant = quant_view(c.inventory)
        blocks += [BLANK, _summary(by_dtype)]
        if quant:
            blocks += [BLANK, _scheme_summary(c, quant)]
        blocks += [BLANK, *_tensors(c, width=width, verbose=verbose, quant=quant, all_rows=all_rows)]
    return blocks


def _shown(rows: int, *, verbose: bool, all_rows: bool) -> int:
    """How many of a table's ``rows`` to show."""
    return rows if all_rows or verbose else min(rows, TABLE_ROWS)


def _more(hidden: int, of: str = "") -> list[Block]:
    """The line under a table that shows only its first rows."""
    rows = "row" if hidden == 1 else "rows"
    return [line(Styled(f"… {hidden} more {rows}{of} (--all shows every one)", "dim"))] if hidden else []


def findings_blocks(c: CheckpointReport, *, width: int, verbose: bool, all_rows: bool = True) -> list[Block]:
    """Findings, worst first; findings that share a rule and a cause share one row, with a count and the first names.
    Without ``all_rows`` (or ``verbose``), the first ``TABLE_ROWS`` rows: the worst.

    A table where the names' longest dotted component fits its column; on a terminal too narrow for that, a list
    (the finding's line, then its names indented), so that no name is cut inside a component.
    """
    every = group_findings(c.findings)
    groups = every[: _shown(len(every), verbose=verbose, all_rows=all_rows)]
    hidden = _more(len(every) - len(groups), " of findings")
    places = {g: g.first(every=verbose) for g in groups}
    severity_w = max(len("severity"), *(len(g.severity) for g in groups))
    rule_w = max(len("rule"), *(len(_rule_cell(g)) for g in groups))
    rest = max(width - severity_w - rule_w - 3 * GAP, MIN_NAME_WIDTH)
    longest = max((len(part) for names, _ in places.values() for n in names for part in name_parts(n)), default=0)
    # as wide as the names need, up to two fifths of what is left (more only for one long dotted component)
    full = max((len(n) for names, _ in places.values() for n in names), default=0)
    where_w = max(len("where"), min(full, max(rest * 2 // 5, min(longest, rest - MIN_MESSAGE_WIDTH))))
    if longest > where_w:
        return _findings_list(groups, places, width) + hidden
    columns = (
        Column("severity", no_wrap=True),
        Column("rule", no_wrap=True),
        Column("where", overflow="fold", width=where_w),
        Column("message", overflow="fold", width=rest - where_w),
    )
    rows = []
    for g in groups:
        names, more = places[g]
        where = "\n".join([*(wrap_name(n, where_w) for n in names), *([f"and {more} more"] if more else [])])
        rows.append((Styled(g.severity, SEVERITY_STYLE[g.severity]), Styled(_rule_cell(g)), Styled(where), Styled(g.message())))
    return [Grid("Findings", columns, rows), *hidden]


def _rule_cell(g: FindingGroup) -> str:
    return f"{g.rule} ×{g.count}" if g.count > 1 else g.rule


def _findings_list(groups: list[FindingGroup], places: dict[FindingGroup, tuple[list[str], int]], width: int) -> list[Block]:
    blocks: list[Block] = [line(Styled("Findings", "bold"))]
    for g in groups:
        blocks.append(line(Styled(g.severity, SEVERITY_STYLE[g.severity]), "  ", _rule_cell(g), ": ", g.message()))
        names, more = places[g]
        for n in names:
            blocks += [line("    " + part) for part in wrap_name(n, width - 4).split("\n")]
        if more:
            blocks.append(line(f"    and {more} more"))
    return blocks


def _summary(by_dtype: list[DtypeTotals]) -> Grid:
    columns = (Column("dtype"), *(Column(name, justify="right") for name in ("tensors", "elements", "bytes", "share")))
    rows = [
        (
            Styled(row.dtype, DTYPE_STYLE.get(row.dtype, "")),
            *_spans(str(row.tensors), human_count(row.numel), human_bytes(row.nbytes), f"{row.share:.1%}"),
        )
        for row in by_dtype
    ]
    return Grid("By dtype", columns, rows)


def _scheme_summary(c: CheckpointReport, quant: QuantView) -> Grid:
    assert c.inventory is not None
    from ..quant.group import scheme_summary  # only a quantized checkpoint's report has this block

    columns = (Column("scheme"), *(Column(name, justify="right") for name in ("weights", "elements", "bytes", "bits/weight", "share")))
    rows = [
        _spans(
            row.scheme, str(row.weights), human_count(row.numel), human_bytes(row.nbytes), f"{row.bits_per_weight:g}", f"{row.share:.1%}"
        )
        for row in scheme_summary(c.inventory, quant)
    ]
    return Grid("By scheme", columns, rows)


def _logical_rows(c: CheckpointReport, quant: QuantView) -> list[TensorRecord]:
    """The tensors as the model holds them: each quantized weight once, its dtype cell ``int4 (gptq g128) → float16``."""
    assert c.inventory is not None
    from ..quant.group import policy_records

    schemes = {w.name: w.scheme for w in quant.weights}
    out = []
    for t in policy_records(c.inventory, quant):
        scheme = schemes.get(t.name) if t.scheme else None
        out.append(t.with_(dtype=f"{scheme.display} → {t.dtype}") if scheme is not None else t)
    return out


def _tensors(c: CheckpointReport, *, width: int, verbose: bool, quant: QuantView | None = None, all_rows: bool = True) -> list[Block]:
    tensors: tuple[TensorRecord, ...] | list[TensorRecord] = _logical_rows(c, quant) if quant else c.tensors
    fold = not verbose and len(tensors) > FULL_LISTING_LIMIT
    groups = group_tensors(tensors) if fold else None
    title = ("Weights (quantized ones with their scales; JSON lists the storage)" if quant else "Tensors") + (
        f" ({len(tensors)}, repeated layers folded; --verbose lists each)" if fold else ""
    )
    show_file = any(t.file for t in tensors)
    rows: list[tuple[str, str, str, str, str, str]] = []
    total = len(groups) if groups is not None else len(tensors)
    shown = _shown(total, verbose=verbose, all_rows=all_rows)
    if groups is not None:
        for g in groups[:shown]:
            label = f"{g.label}  ×{g.count}" if g.count > 1 else g.label
            rows.append((label, g.dtype, shape_text(g.shape), g.kind, human_bytes(g.nbytes), g.members[0].file or ""))
    else:
        for t in tensors[:shown]:
            name = t.name + (f"  (shares storage with {', '.join(t.shares_with)})" if t.shares_with and verbose else "")
            rows.append((name, t.dtype, shape_text(t.shape), t.kind, human_bytes(t.nbytes), t.file or ""))
    headers = ("name", "dtype", "shape", "kind", "size", "file")[: 6 if show_file else 5]
    # Names get what the other columns leave, and break after a dot: never in the middle of a component.
    others = sum(max(len(headers[i]), *(len(r[i]) for r in rows)) for i in range(1, len(headers)))
    name_w = max(width - others - GAP * (len(headers) - 1), MIN_NAME_WIDTH)
    columns = (
        Column("name", overflow="fold", max_width=name_w),
        Column("dtype", no_wrap=True),
        Column("shape", no_wrap=True),
        Column("kind", no_wrap=True),
        Column("size", justify="right", no_wrap=True),
        *([Column("file", overflow="fold")] if show_file else []),
    )
    cells = [
        (Styled(wrap_name(name, name_w)), Styled(dtype, DTYPE_STYLE.get(dtype, "")), *_spans(shape, kind, size, file))[: len(columns)]
        for name, dtype, shape, kind, size, file in rows
    ]
    return [Grid(title, columns, cells), *_more(total - shown)]


def verdict(report: Report) -> Line:
    unreadable = sum(1 for c in report.checkpoints if c.error)
    counts = {s: sum(1 for f in report.findings if f.severity == s) for s in ("error", "warning", "info")}
    parts = [f"{n} {s}{'s' if n != 1 else ''}" for s, n in counts.items() if n]
    failing = report.failing()
    scanned = f"{len(report.checkpoints)} checkpoint{'s' if len(report.checkpoints) != 1 else ''}"
    if unreadable:
        return line(Styled(f"✗ {unreadable} of {scanned} could not be read" + (f"; {', '.join(parts)}" if parts else ""), "bold red"))
    if failing:
        return line(Styled(f"✗ {scanned}: {', '.join(parts)} (failing at --fail-on {report.fail_on})", "bold red"))
    if parts:
        return line(Styled(f"✓ {scanned}: {', '.join(parts)}, none at or above --fail-on {report.fail_on}", "green"))
    return line(Styled(f"✓ {scanned}: no findings", "green"))
