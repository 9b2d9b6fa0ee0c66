"""Failing and telling: ``AuditFailed`` and the findings table it (and a training loop's log) shows."""

from __future__ import annotations

import io
from collections import Counter
from collections.abc import Iterable

from ..inventory import Finding, Severity, failing
from .collection import LIVE_FORMAT


class AuditFailed(AssertionError):
    """Findings at or above the failing severity; ``str()`` is the findings table.

    A verdict, not a bad input: it is no ``DtypeAuditError``. An ``AssertionError``, so pytest shows it as a failed
    check and training loops stop on it."""

    def __init__(self, findings: Iterable[Finding], *, title: str, fail_on: Severity = "error") -> None:
        self.findings = list(findings)
        self.table = render_findings(self.findings, title=title, fail_on=fail_on)
        super().__init__(f"dtype audit failed: {title}")

    def __str__(self) -> str:
        return self.table


def render_findings(findings: Iterable[Finding], *, title: str, fail_on: Severity = "error", width: int = 120) -> str:
    """The findings as the text report's findings table (plain, no colour), with a one-line verdict."""
    from rich.text import Text

    from ..inventory import CheckpointReport
    from ..render.text import console_for, findings_section

    items = tuple(findings)
    buffer = io.StringIO()
    console = console_for(buffer, color=False, width=width)
    console.print(Text(title, style="bold"))
    if items:
        findings_section(console, CheckpointReport(title, LIVE_FORMAT, None, None, items), verbose=False)
    failed = failing(items, fail_on)
    counts = Counter(f.severity for f in items)
    summary = (
        ", ".join(f"{counts[s]} {s}{'s' if counts[s] != 1 else ''}" for s in ("error", "warning", "info") if counts[s]) or "no findings"
    )
    verdict = f"✗ {summary} (failing at {fail_on})" if failed else f"✓ {summary}, none at or above {fail_on}"
    console.print(verdict)
    return "\n".join(line.rstrip() for line in buffer.getvalue().split("\n"))
