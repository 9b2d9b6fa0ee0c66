"""Training loops: the part the Lightning and transformers callbacks share."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..checks import policy_findings
from ..errors import DtypeAuditError
from ..inventory import Finding, Severity
from .auditor import Auditor
from .collection import collect
from .findings import batch_findings
from .verdict import AuditFailed, render_findings

if TYPE_CHECKING:
    from ..hardware import Target
    from ..policy import Policy


def parse_when(when: str) -> int | None:
    """``fit`` -> None (fit start only), ``epoch`` -> 0 (every epoch), ``step:N`` -> N (every N optimizer steps)."""
    if when in ("fit", "epoch"):
        return None if when == "fit" else 0
    head, _, count = when.partition(":")
    if head == "step" and count.isdigit() and int(count) > 0:
        return int(count)
    raise DtypeAuditError(f"when={when!r}: use 'fit' (fit start only), 'epoch' or 'step:N' (N > 0)")


class TrainingAudit:
    """Audits a model (and its optimizers) at fit start, then every epoch or every N steps, and its first batch.

    Failing findings (at or above ``fail_on``, as for scan) raise ``AuditFailed``, which stops the run, or with
    ``on_failure="warn"`` are logged as a warning on the ``dtypeaudit`` logger; findings below ``fail_on`` are
    logged at INFO. Every audit's findings stay in ``history``.
    """

    def __init__(
        self,
        policy: Policy | str | None = None,
        *,
        target: Target | str | None = None,
        when: str = "fit",
        fail_on: Severity | None = None,
        on_failure: str = "raise",
        drift_severity: Severity = "warning",
        check_batch: bool = True,
    ) -> None:
        import logging

        if on_failure not in ("raise", "warn"):
            raise DtypeAuditError(f"on_failure={on_failure!r}: use 'raise' or 'warn'")
        self.every = parse_when(when)
        self.when = when
        self.on_failure = on_failure
        self.check_batch = check_batch
        self.auditor = Auditor(policy, target=target, fail_on=fail_on, drift_severity=drift_severity)
        self.batch_seen = False
        self.last_step: int | None = None
        self._log = logging.getLogger("dtypeaudit")  # not self.log: Lightning sets a log() on callbacks

    @property
    def history(self) -> list[tuple[str, list[Finding]]]:
        return self.auditor.history

    @property
    def findings(self) -> list[Finding]:
        """Every finding of every audit so far."""
        return [f for _, found in self.auditor.history for f in found]

    def run(self, label: str, parts: list[tuple[str, Any]]) -> list[Finding]:
        """Audit ``parts`` (``(prefix, object)``; the model under ``""``), report, and fail if asked to."""
        found = self.auditor.audit(parts=parts, label=label)
        self.enforce(found, label)
        return found

    def wants_epoch(self) -> bool:
        return self.every == 0

    def wants_step(self, step: int) -> bool:
        """Whether optimizer step ``step`` is one to audit at (once per step, whatever the accumulation)."""
        if not self.every or step <= 0 or step % self.every or step == self.last_step:
            return False
        self.last_step = step
        return True

    def first_batch(self, model: Any, batch: Any) -> list[Finding]:
        """The first batch against the model's first layer, the policy and the target; once per run."""
        if self.batch_seen or not self.check_batch:
            return []
        self.batch_seen = True
        live = collect(None, parts=[("", model), ("batch", batch)])
        a = self.auditor
        found = batch_findings(live)
        batch = live.part(batch=True)
        if a.policy is not None and batch.tensors:
            found += policy_findings(batch, a.policy)
        if a.target is not None:
            from ..hardware import target_findings

            found += target_findings(batch, a.target)
        a.history.append(("the first batch", found))
        self.enforce(found, "the first batch")
        return found

    def enforce(self, found: list[Finding], label: str) -> None:
        if not found:
            return
        a = self.auditor
        failing = a.failing(found)
        title = f"dtypeaudit: {label}"
        if failing and self.on_failure == "raise":
            raise AuditFailed(found, title=title, fail_on=a.fail_on)
        table = render_findings(found, title=title, fail_on=a.fail_on)
        self._log.log(30 if failing else 20, "%s", table)
