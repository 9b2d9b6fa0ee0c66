"""The exit-code ladder, decided here and nowhere else.

0  clean: nothing at or above the failing severity
1  findings at or above the failing severity (or values unsafe to convert)
2  an input could not be read, a policy is invalid, the command was misused, or a conversion was refused
3  internal error: a bug in dtypeaudit itself (pre-commit's convention), reported with the version
130 interrupted (Ctrl-C)
"""

from __future__ import annotations

from .inventory import Report

CLEAN = 0
FINDINGS = 1
ERROR = 2
INTERNAL = 3
INTERRUPTED = 130


def for_report(report: Report) -> int:
    """The worst outcome over every checkpoint in the report."""
    if any(c.error for c in report.checkpoints):
        return ERROR
    if report.failing():
        return FINDINGS
    return CLEAN
