"""Renderers: one pure function per output format, report -> str. None of them decides an exit code."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from enum import Enum
from importlib import import_module
from typing import TYPE_CHECKING, Optional

from ..inventory import Inventory, Report
from ..quant.hints import might_be_quantized

if TYPE_CHECKING:
    from ..quant.model import QuantView


class OutputFormat(str, Enum):
    """What ``--format`` accepts."""

    table = "table"
    plain = "plain"
    json = "json"
    sarif = "sarif"
    github = "github"
    junit = "junit"
    markdown = "markdown"
    html = "html"


Renderer = Callable[[Report], str]
Writer = Callable[[Report], Iterable[str]]


def quant_view(inv: Optional[Inventory]) -> Optional[QuantView]:
    """The logical weights a report shows for a checkpoint (``quant.group.view``); None for one without any, found
    without importing quant/ where nothing hints at quantization (most checkpoints)."""
    if inv is None or not might_be_quantized(inv):
        return None
    from ..quant.group import view

    return view(inv) or None


def renderer_for(fmt: OutputFormat, *, width: int = 120, verbose: bool = False, quiet: bool = False, all_rows: bool = True) -> Renderer:
    """The renderer for a format; every OutputFormat has one (a test holds this exhaustive).

    ``quiet``: findings only (the text and markdown reports leave out clean checkpoints and tensor tables);
    ``all_rows=False``: the text report's tables show their first rows and how many more (``scan`` without
    ``--all``); machine formats carry everything whatever they say.

    Each renderer module is imported only when chosen: ``table`` and ``plain`` load Rich, the machine formats do not.
    """
    if fmt in (OutputFormat.table, OutputFormat.plain):
        from . import text

        color = fmt is OutputFormat.table
        return lambda r: text.render(r, color=color, width=width, verbose=verbose, quiet=quiet, all_rows=all_rows)
    if fmt is OutputFormat.markdown:
        from . import markdown

        return lambda r: markdown.render(r, verbose=verbose, quiet=quiet)
    module = import_module(f"{__name__}.{fmt.value}")
    return module.render


def writer_for(fmt: OutputFormat, *, width: int = 120, verbose: bool = False, quiet: bool = False, all_rows: bool = True) -> Writer:
    """``renderer_for``'s report in pieces to write as they are made: JSON's a few thousand tensors at a time (its
    ``chunks``), so that a million-tensor report is never one string; every other format in one piece."""
    if fmt is OutputFormat.json:
        from .json import chunks

        return chunks
    render = renderer_for(fmt, width=width, verbose=verbose, quiet=quiet, all_rows=all_rows)
    return lambda r: (render(r),)
