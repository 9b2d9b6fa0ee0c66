"""What a conversion comes to (``Result``) and the decision every path shares before it reads: what refuses a
checkpoint outright (``refusals``).

A leaf of ``conversion/``: the local, remote and dequantizing paths import it, and it imports none of them, so
no path leans on the package's ``__init__`` (which imports them all).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import ConversionError
from ..inventory import Finding, Inventory, format_of
from ..safety import reader_refusals
from ..values import ValueStats
from .plan import Plan

if TYPE_CHECKING:
    from .verify import Written


@dataclass
class Result:
    plan: Plan
    """What happens to each tensor; empty when the conversion was ``refused``."""
    output: Path | str | None
    """What was written (a remote output: its URL, credentials redacted), or None (a dry run, unsafe values, a refusal)."""
    unsafe: list[ValueStats]
    """Tensors whose values block the conversion; nothing was written."""
    dry_run: bool = False
    values_read: bool = True
    """False for a metadata-only dry run: ``plan.values`` is empty because no value was read, not because none was unsafe."""
    refused: tuple[Finding, ...] = ()
    """The reader's findings that forbid converting this checkpoint at all (see ``refusals``); nothing was written."""
    failed: tuple[Finding, ...] = ()
    """The planned output's findings that would fail ``scan`` with the same policy (see ``plan.with_findings``);
    the plan could not be made to pass, so nothing was written. ``plan.causes`` groups them by cause, with the ways through."""
    written: dict[str, Written] = field(default_factory=dict)
    """What each weight file written holds, as its writer recorded it and ``verify.verify_written`` read it back:
    its name in the output directory (a single file: the output's own name) -> its ``Written``; empty when
    nothing was written. Without ``origins``: a Result outlives the source's maps they point into, and crosses
    processes (``fleet``)."""

    def __post_init__(self) -> None:
        self.written = {name: replace(w, origins={}) for name, w in self.written.items()}

    @property
    def blocked(self) -> bool:
        """Nothing was written because of the checkpoint itself, its plan or its values: the command fails (exit 1)."""
        return bool(self.refused or self.failed or self.unsafe)


# A rewrite would carry what hides after the pickle along or silently drop it: either way it launders it.
def refusals(inv: Inventory) -> tuple[Finding, ...]:
    """What makes ``convert`` refuse ``inv`` before anything is written (or, for a remote source, downloaded):
    the one decision, for local and remote sources alike, from the reader's inventory alone.

    First the reader's findings that forbid it, returned for ``Result.refused`` (exit 1, like a scan that fails,
    and shown as a scan shows them): every error the reader raises (a code-running global, a pickled whole
    module, an index that disagrees with its shards) and trailing data. A hostile bare pickle is refused for
    its global, not for its format. Without those, a format convert cannot convert at all
    (``Format.convert_refusal``: TorchScript, a bare pickle, DCP ...) is bad input: ``ConversionError`` (exit 2),
    the format's reason as its message.
    """
    refused = reader_refusals(inv)
    fmt = format_of(inv.format)
    if not refused and fmt is not None and fmt.convert_refusal:
        raise ConversionError(fmt.convert_refusal, path=inv.path)
    return refused


def pickled_module_files(findings: Iterable[Finding]) -> list[str | None]:
    """The files (None: the checkpoint itself) that the reader found to pickle a whole nn.Module."""
    out: list[str | None] = []
    for f in findings:
        if f.rule == "pickled-module" and f.file not in out:
            out.append(f.file)
    return out
