"""GitHub Actions workflow commands: an annotation on the run per rule and cause, with its count and first names."""

from __future__ import annotations

from ..inventory import Report
from .humanize import group_findings, locator

_COMMAND = {"error": "error", "warning": "warning", "info": "notice"}


def _data(text: str) -> str:
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _prop(text: str) -> str:
    return _data(text).replace(":", "%3A").replace(",", "%2C")


def render(report: Report) -> str:
    lines = []
    for c in report.checkpoints:
        if c.error:
            lines.append(f"::error file={_prop(c.path)},title={_prop('dtypeaudit unreadable')}::{_data(c.error)}")
        # GitHub shows ten annotations of a kind per step: one per cause keeps every cause visible.
        located = locator(c)
        for g in group_findings(c.findings):
            title = _prop(f"dtypeaudit {g.rule}" + (f" ({g.count})" if g.count > 1 else ""))
            places = g.places()
            text = f"{places}: {g.message()}" if places else g.message()
            where = located(g.subjects)  # the file that holds the tensors, inside a folder
            lines.append(f"::{_COMMAND[g.severity]} file={_prop(where)},title={title}::{_data(text)}")
    readable = [c for c in report.checkpoints if not c.error]
    lines.append(f"dtypeaudit: {len(report.checkpoints)} checkpoint(s), {len(readable)} readable, {len(report.findings)} finding(s)")
    return "\n".join(lines) + "\n"
