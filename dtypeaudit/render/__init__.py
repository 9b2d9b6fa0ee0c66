"""Renderers: one pure function per output format, report -> str. None of them decides an exit code."""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum

from ..inventory import Report


class OutputFormat(str, Enum):
    """What ``--format`` accepts."""

    table = "table"
    plain = "plain"
    json = "json"
    sarif = "sarif"
    github = "github"
    junit = "junit"
    markdown = "markdown"


Renderer = Callable[[Report], str]


def renderer_for(fmt: OutputFormat, *, width: int = 120, verbose: bool = False) -> Renderer:
    """The renderer for a format; every OutputFormat has one (a test holds this exhaustive)."""
    from . import github, json, junit, markdown, sarif, text

    table: dict[OutputFormat, Renderer] = {
        OutputFormat.table: lambda r: text.render(r, color=True, width=width, verbose=verbose),
        OutputFormat.plain: lambda r: text.render(r, color=False, width=width, verbose=verbose),
        OutputFormat.json: json.render,
        OutputFormat.sarif: sarif.render,
        OutputFormat.github: github.render,
        OutputFormat.junit: junit.render,
        OutputFormat.markdown: lambda r: markdown.render(r, verbose=verbose),
    }
    return table[fmt]
