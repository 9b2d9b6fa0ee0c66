"""The text report: the blocks of ``blocks.py`` drawn with Rich, in colour on a terminal (``-f table``) or without
colour for a pipe or a log (``-f plain``: no ANSI, and no trailing blanks, for logs, diffs and golden files).
"""

from __future__ import annotations

import io

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..inventory import CheckpointReport, Report
from .blocks import Block, Grid, checkpoint_blocks, findings_blocks, report_blocks


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


def render(
    report: Report, *, color: bool = True, width: int = 120, verbose: bool = False, quiet: bool = False, all_rows: bool = True
) -> str:
    """The report; ``quiet`` shows only the checkpoints with findings or errors, and no tensor tables; without
    ``all_rows``, each table its first rows and how many more (``blocks.TABLE_ROWS``)."""
    buffer = io.StringIO()
    console = console_for(buffer, color=color, width=width)
    draw(console, report_blocks(report, width=width, verbose=verbose, quiet=quiet, all_rows=all_rows))
    text = buffer.getvalue()
    return text if color else "".join(line.rstrip() + "\n" for line in text.splitlines())


def checkpoint_section(console: Console, c: CheckpointReport, *, verbose: bool, quiet: bool = False) -> None:
    draw(console, checkpoint_blocks(c, width=console.width, verbose=verbose, quiet=quiet))


def findings_section(console: Console, c: CheckpointReport, *, verbose: bool) -> None:
    draw(console, findings_blocks(c, width=console.width, verbose=verbose))


def draw(console: Console, blocks: list[Block]) -> None:
    for block in blocks:
        if isinstance(block, Grid):
            console.print(_table(block))
        elif block.spans:
            console.print(Text.assemble(*((s.text, s.style) for s in block.spans)))
        else:
            console.print()


def _table(grid: Grid) -> Table:
    table = Table(box=box.SIMPLE_HEAD, title=grid.title, title_justify="left", title_style="bold", show_edge=False, pad_edge=False)
    for c in grid.columns:
        table.add_column(c.header, justify=c.justify, width=c.width, max_width=c.max_width, no_wrap=c.no_wrap, overflow=c.overflow)  # type: ignore[arg-type]
    for row in grid.rows:
        # Text, not str: a name with brackets is a name, not Rich markup
        table.add_row(*(Text(s.text, style=s.style) for s in row))
    return table
