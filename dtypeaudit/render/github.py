"""GitHub Actions workflow commands: each finding becomes an annotation on the run."""

from __future__ import annotations

from ..inventory import Report

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
        for f in c.findings:
            title = _prop(f"dtypeaudit {f.rule}")
            text = f"{f.tensor}: {f.message}" if f.tensor else f.message
            lines.append(f"::{_COMMAND[f.severity]} file={_prop(c.path)},title={title}::{_data(text)}")
    readable = [c for c in report.checkpoints if not c.error]
    lines.append(f"dtypeaudit: {len(report.checkpoints)} checkpoint(s), {len(readable)} readable, {len(report.findings)} finding(s)")
    return "\n".join(lines) + "\n"
