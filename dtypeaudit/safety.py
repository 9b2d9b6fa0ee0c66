"""Which of a reader's findings make a checkpoint unfit to use at all, whatever the command: one decision for
scan's failing verdict on them, convert's refusal, and the commands that bless or compare a checkpoint
(``policy init``, ``diff``), so that no gate passes what scan fails for its safety."""

from __future__ import annotations

from .inventory import Finding, Inventory

REFUSED_WARNINGS = frozenset({"trailing-data"})
"""Warnings that still forbid using a checkpoint: bytes after the pickle that another loader may read."""


def reader_refusals(inv: Inventory) -> tuple[Finding, ...]:
    """The reader's findings that forbid using ``inv``: every error it raised (a code-running global, a pickled
    whole module, an index that disagrees with its shards) and trailing data."""
    return tuple(f for f in inv.findings if f.severity == "error" or f.rule in REFUSED_WARNINGS)


def refusal_line(inv: Inventory, refused: tuple[Finding, ...], command: str) -> str:
    """One line for stderr: which checkpoint, the first reason, how many more, and what to run to see them all."""
    first = refused[0]
    where = f" ({first.tensor})" if first.tensor else ""
    more = f" and {len(refused) - 1} more" if len(refused) > 1 else ""
    return (
        f"dtypeaudit: error: {inv.path}: {command} refuses it: {first.rule}{where}: {first.message}{more}; "
        f"`dtypeaudit scan {inv.path}` lists each"
    )
