"""The exit-code ladder, decided here and nowhere else.

0  clean: nothing at or above the failing severity
1  findings at or above the failing severity (or values unsafe to convert)
2  an input could not be read, a policy is invalid, the command was misused, or a conversion was refused
3  internal error: a bug in dtypeaudit itself (pre-commit's convention), reported with the version
130 interrupted (Ctrl-C)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from .inventory import Report

if TYPE_CHECKING:
    from .conversion.result import Result
    from .diff import InventoryDiff

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


def for_result(result: Result, *, unfit: bool = False) -> int:
    """A conversion's: refused outright for what the checkpoint holds (``Result.refused``) is 2; a planned output that
    fails its policy, values unsafe to convert, or (``unfit``) a ``--target`` that cannot compute the plan are 1."""
    if result.refused:
        return ERROR
    if result.failed or result.unsafe or unfit:
        return FINDINGS
    return CLEAN


def for_diff(diff: InventoryDiff) -> int:
    """Two checkpoints that differ are 1, as findings are."""
    return FINDINGS if diff.differs else CLEAN


def for_tune(passed: bool) -> int:
    """``tune``: 1 where no keep set brings the outputs within the tolerance."""
    return CLEAN if passed else FINDINGS


def for_explained(passed: Iterable[bool]) -> int:
    """``scan --explain``: 1 where the policy's decision fails the tensor in any checkpoint."""
    return CLEAN if all(passed) else FINDINGS


def worst(codes: Iterable[int]) -> int:
    """Several outcomes in one run (``convert SOURCE...``): the worst decides."""
    return max(codes, default=CLEAN)
