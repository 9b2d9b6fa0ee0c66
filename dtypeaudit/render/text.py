"""The report for people: a Rich rendering, coloured on a terminal and plain in logs."""

from __future__ import annotations

import io

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..inventory import CheckpointReport, Report, TensorRecord, dtype_summary, severity_rank, unique_tensors
from ..quant.group import policy_records, scheme_summary, view
from ..quant.model import QuantView
from .humanize import FindingGroup, group_findings, group_tensors, human_bytes, human_count, name_parts, shape_text, wrap_name

SEVERITY_STYLE = {"error": "bold red", "warning": "yellow", "info": "cyan"}
DTYPE_STYLE = {"float32": "blue", "float16": "green", "bfloat16": "magenta", "float64": "bright_blue"}
FULL_LISTING_LIMIT = 60
"""Up to this many tensors every one is listed; above it, layers that repeat are folded into one row."""
GAP = 3
"""Columns between two cells of a table below: a cell's right padding, the rule's blank, the next one's left padding."""
MIN_NAME_WIDTH = 24


def console_for(buffer: io.StringIO, *, color: bool, width: int) -> Console:
    """A Rich console that writes a report into ``buffer``: colour only when asked, no markup guessing."""
    return Console(
        file=buffer,
        width=width,
        force_terminal=color,
        color_system="standard" if color else None,
        no_color=not color,
        highlight=False,
        emoji=False,
    )


def render(report: Report, *, color: bool = True, width: int = 120, verbose: bool = False, quiet: bool = False) -> str:
    """The report; ``quiet`` shows only the checkpoints with findings or errors, and no tensor tables."""
    buffer = io.StringIO()
    console = console_for(buffer, color=color, width=width)
    shown = [c for c in report.checkpoints if not quiet or c.error or c.findings]
    for i, checkpoint in enumerate(shown):
        if i:
            console.print()
        checkpoint_section(console, checkpoint, verbose=verbose, quiet=quiet)
    if shown and (len(report.checkpoints) > 1 or report.findings):
        console.print()
    console.print(_verdict(report))
    text = buffer.getvalue()
    # Rich pads every cell to its column's width: plain text keeps no trailing blanks (logs, diffs, golden files).
    return text if color else "\n".join(line.rstrip() for line in text.split("\n"))


def checkpoint_section(console: Console, c: CheckpointReport, *, verbose: bool, quiet: bool = False) -> None:
    title = Text(c.path, style="bold")
    if c.error:
        console.print(Text.assemble(title, "  ", ("unreadable", "bold red")))
        console.print(Text(f"  {c.error}", style="red"))
        return
    tensors = c.tensors
    unique = unique_tensors(tensors)
    console.print(
        Text.assemble(
            title,
            (f"  {c.format}", "dim"),
            f"  {len(tensors)} tensors · {human_count(sum(t.numel for t in unique))} elements"
            f" · {human_bytes(sum(t.nbytes for t in unique))}",
            (
                f"  ({human_bytes(c.inventory.bytes_read)} read)" if verbose and c.inventory and c.inventory.bytes_read is not None else "",
                "dim",
            ),
        )
    )
    if c.findings:
        console.print()
        findings_section(console, c, verbose=verbose)
    if tensors and not quiet:
        quant = view(c.inventory) if c.inventory else QuantView(())
        console.print()
        _summary(console, c)
        if quant:
            console.print()
            _scheme_summary(console, c, quant)
        console.print()
        _tensors(console, c, verbose=verbose, quant=quant)


def findings_section(console: Console, c: CheckpointReport, *, verbose: bool) -> None:
    """Findings, worst first; findings that share a rule and a cause share one row, with a count and the first names.

    A table where the names' longest dotted component fits its column; on a terminal too narrow for that, a list
    (the finding's line, then its names indented), so that no name is cut inside a component.
    """
    groups = group_findings(c.findings)
    places = {g: g.first(every=verbose) for g in groups}
    severity_w = max(len("severity"), *(len(g.severity) for g in groups))
    rule_w = max(len("rule"), *(len(_rule_cell(g)) for g in groups))
    rest = max(console.width - severity_w - rule_w - 3 * GAP, MIN_NAME_WIDTH)
    longest = max((len(part) for names, _ in places.values() for n in names for part in name_parts(n)), default=0)
    # as wide as the names need, up to two fifths of what is left (more only for one long dotted component)
    full = max((len(n) for names, _ in places.values() for n in names), default=0)
    where_w = max(len("where"), min(full, max(rest * 2 // 5, min(longest, rest - MIN_MESSAGE_WIDTH))))
    if longest > where_w:
        _findings_list(console, groups, places)
        return
    table = Table(box=box.SIMPLE_HEAD, title="Findings", title_justify="left", title_style="bold", show_edge=False, pad_edge=False)
    table.add_column("severity", no_wrap=True)
    table.add_column("rule", no_wrap=True)
    table.add_column("where", overflow="fold", width=where_w)
    table.add_column("message", overflow="fold", width=rest - where_w)
    for g in groups:
        names, more = places[g]
        where = "\n".join([*(wrap_name(n, where_w) for n in names), *([f"and {more} more"] if more else [])])
        table.add_row(Text(g.severity, style=SEVERITY_STYLE[g.severity]), _rule_cell(g), where, g.message())
    console.print(table)


MIN_MESSAGE_WIDTH = 20


def _rule_cell(g: FindingGroup) -> str:
    return f"{g.rule} ×{g.count}" if g.count > 1 else g.rule


def _findings_list(console: Console, groups: list[FindingGroup], places: dict[FindingGroup, tuple[list[str], int]]) -> None:
    console.print(Text("Findings", style="bold"))
    for g in groups:
        console.print(Text.assemble((g.severity, SEVERITY_STYLE[g.severity]), "  ", _rule_cell(g), ": ", g.message()))
        names, more = places[g]
        for n in names:
            for line in wrap_name(n, console.width - 4).split("\n"):
                console.print(Text("    " + line), overflow="fold")
        if more:
            console.print(Text(f"    and {more} more"))


def _summary(console: Console, c: CheckpointReport) -> None:
    table = Table(box=box.SIMPLE_HEAD, title="By dtype", title_justify="left", title_style="bold", show_edge=False, pad_edge=False)
    for name, justify in (("dtype", "left"), ("tensors", "right"), ("elements", "right"), ("bytes", "right"), ("share", "right")):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for row in dtype_summary(c.tensors):
        table.add_row(
            Text(row.dtype, style=DTYPE_STYLE.get(row.dtype, "")),
            str(row.tensors),
            human_count(row.numel),
            human_bytes(row.nbytes),
            f"{row.share:.1%}",
        )
    console.print(table)


def _scheme_summary(console: Console, c: CheckpointReport, quant: QuantView) -> None:
    assert c.inventory is not None
    table = Table(box=box.SIMPLE_HEAD, title="By scheme", title_justify="left", title_style="bold", show_edge=False, pad_edge=False)
    for name, justify in (("scheme", "left"), ("weights", "right"), ("elements", "right"), ("bytes", "right"), ("bits/weight", "right")):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    table.add_column("share", justify="right")
    for row in scheme_summary(c.inventory, quant):
        table.add_row(
            row.scheme, str(row.weights), human_count(row.numel), human_bytes(row.nbytes), f"{row.bits_per_weight:g}", f"{row.share:.1%}"
        )
    console.print(table)


def _logical_rows(c: CheckpointReport, quant: QuantView) -> list[TensorRecord]:
    """The tensors as the model holds them: each quantized weight once, its dtype cell ``int4 (gptq g128) → float16``."""
    assert c.inventory is not None
    schemes = {w.name: w.scheme for w in quant.weights}
    out = []
    for t in policy_records(c.inventory, quant):
        scheme = schemes.get(t.name) if t.scheme else None
        out.append(t.with_(dtype=f"{scheme.display} → {t.dtype}") if scheme is not None else t)
    return out


def _tensors(console: Console, c: CheckpointReport, *, verbose: bool, quant: QuantView | None = None) -> None:
    tensors: tuple[TensorRecord, ...] | list[TensorRecord] = _logical_rows(c, quant) if quant else c.tensors
    fold = not verbose and len(tensors) > FULL_LISTING_LIMIT
    groups = group_tensors(tensors) if fold else None
    title = ("Weights (quantized ones with their scales; JSON lists the storage)" if quant else "Tensors") + (
        f" ({len(tensors)}, repeated layers folded; --verbose lists each)" if fold else ""
    )
    show_file = any(t.file for t in tensors)
    rows: list[tuple[str, str, str, str, str, str]] = []
    if groups is not None:
        for g in groups:
            label = f"{g.label}  ×{g.count}" if g.count > 1 else g.label
            rows.append((label, g.dtype, shape_text(g.shape), g.kind, human_bytes(g.nbytes), g.members[0].file or ""))
    else:
        for t in tensors:
            name = t.name + (f"  (shares storage with {', '.join(t.shares_with)})" if t.shares_with and verbose else "")
            rows.append((name, t.dtype, shape_text(t.shape), t.kind, human_bytes(t.nbytes), t.file or ""))
    headers = ("name", "dtype", "shape", "kind", "size", "file")[: 6 if show_file else 5]
    # Names get what the other columns leave, and break after a dot: never in the middle of a component.
    others = sum(max(len(headers[i]), *(len(r[i]) for r in rows)) for i in range(1, len(headers)))
    name_w = max(console.width - others - GAP * (len(headers) - 1), MIN_NAME_WIDTH)
    table = Table(box=box.SIMPLE_HEAD, title=title, title_justify="left", title_style="bold", show_edge=False, pad_edge=False)
    table.add_column("name", overflow="fold", max_width=name_w)
    table.add_column("dtype", no_wrap=True)
    table.add_column("shape", no_wrap=True)
    table.add_column("kind", no_wrap=True)
    table.add_column("size", justify="right", no_wrap=True)
    if show_file:
        table.add_column("file", overflow="fold")
    for name, dtype, shape, kind, size, file in rows:
        row: list[str | Text] = [wrap_name(name, name_w), Text(dtype, style=DTYPE_STYLE.get(dtype, "")), shape, kind, size]
        if show_file:
            row.append(file)
        table.add_row(*row)
    console.print(table)


def _verdict(report: Report) -> Text:
    unreadable = sum(1 for c in report.checkpoints if c.error)
    counts = {s: sum(1 for f in report.findings if f.severity == s) for s in ("error", "warning", "info")}
    parts = [f"{n} {s}{'s' if n != 1 else ''}" for s, n in counts.items() if n]
    failing = [f for f in report.findings if severity_rank(f.severity) >= severity_rank(report.fail_on)]
    scanned = f"{len(report.checkpoints)} checkpoint{'s' if len(report.checkpoints) != 1 else ''}"
    if unreadable:
        return Text(f"✗ {unreadable} of {scanned} could not be read" + (f"; {', '.join(parts)}" if parts else ""), style="bold red")
    if failing:
        return Text(f"✗ {scanned}: {', '.join(parts)} (failing at --fail-on {report.fail_on})", style="bold red")
    if parts:
        return Text(f"✓ {scanned}: {', '.join(parts)}, none at or above --fail-on {report.fail_on}", style="green")
    return Text(f"✓ {scanned}: no findings", style="green")
