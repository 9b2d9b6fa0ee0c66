"""The exit-code ladder, decided here and nowhere else.

0  clean: nothing at or above the failing severity
1  findings at or above the failing severity (or values unsafe to convert)
2  an input could not be read, a policy is invalid, or the command was misused
130 interrupted (Ctrl-C)
"""

from __future__ import annotations

from .inventory import Report, severity_rank

CLEAN = 0
FINDINGS = 1
ERROR = 2
INTERRUPTED = 130


def for_report(report: Report) -> int:
    """The worst outcome over every checkpoint in the report."""
    if any(c.error for c in report.checkpoints):
        return ERROR
    threshold = severity_rank(report.fail_on)
    if any(severity_rank(f.severity) >= threshold for f in report.findings):
        return FINDINGS
    return CLEAN
