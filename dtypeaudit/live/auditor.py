"""Auditing live objects: ``audit`` once, or an ``Auditor`` again and again (``dtype-drift`` in between)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from ..checks import checks_for, policy_findings
from ..inventory import Finding, Severity, failing
from ..options import Effective, effective
from .collection import LiveInventory, collect
from .findings import Snapshot, batch_findings, default_dtype_findings, drift_findings, snapshot
from .verdict import render_findings

if TYPE_CHECKING:
    from ..hardware import Target
    from ..policy import Policy
    from ..render.humanize import FindingGroup


def as_policy(policy: Policy | str | None) -> Policy | None:
    """A policy given by name or file, loaded (``options.effective`` decides, as it does for the command line)."""
    return effective(policy).policy


def findings_for(live: LiveInventory, chosen: Effective) -> list[Finding]:
    """Every finding for a collected object: the pipeline's structure and checks (``pipeline.audit_inventory``, as
    for a scanned checkpoint) on its model and optimizer tensors under the policy, the policy on its batch, the
    effective target (``options.effective``) on everything, the batch against the first layer, the default dtype,
    and unused policy rules."""
    from ..hardware import target_findings
    from ..pipeline import audit_inventory  # the pipeline a scanned checkpoint goes through, after its read

    model = live.part(batch=False)
    batch = live.part(batch=True)
    policy = chosen.policy
    out = audit_inventory(model, checks_for(chosen.policy_alone))[1] if model.tensors or policy is not None else []
    if policy is not None and batch.tensors:
        out += policy_findings(batch, policy)
    if chosen.target is not None:
        out += target_findings(live.inventory, chosen.target)
    out += batch_findings(live)
    out += default_dtype_findings(live.inventory, policy)
    if policy is not None:
        out += policy.unused_rules([live.inventory])
    return out


class Findings(list[Finding]):
    """What ``audit`` returns: every finding, a list as before; ``groups``, ``str()`` and the repr put the findings
    that share a rule and a cause together (six ``emulated-dtype`` warnings about one cause are one line)."""

    @property
    def groups(self) -> list[FindingGroup]:
        from ..render.humanize import group_findings

        return group_findings(self)

    def __str__(self) -> str:
        return render_findings(self, title="dtypeaudit.audit")

    def __repr__(self) -> str:
        if not self:
            return "Findings([])"
        rows = [f"{g.severity} {g.rule} ×{g.count} ({g.places()}): {g.message()}" for g in self.groups]
        return f"Findings({len(self)} findings, {len(rows)} cause{'s' if len(rows) != 1 else ''}: " + "; ".join(rows) + ")"


def audit(obj: Any, policy: Policy | str | None = None, *, target: Target | str | None = None) -> Findings:
    """Audit a live ``nn.Module``, optimizer, ``GradScaler``, batch, or a dict of them; see the module's docstring.

    ``policy`` is a ``Policy``, a preset name or a YAML file; ``target`` a hardware target (``v100``, ``mps``;
    ``dtypeaudit targets`` lists them), else the policy's ``target:``. Returns the same ``Finding`` objects as
    ``check``, in a ``Findings`` list whose ``groups`` (and printout) put those sharing a rule and a cause
    together. Reads metadata only: auditing a 7B model on the meta device takes milliseconds and no memory
    proportional to the model.
    """
    chosen = effective(policy, target=target)
    live = collect(obj)
    return Findings(findings_for(live, chosen))


class Auditor:
    """Audits the same objects again and again, and reports what changed in between (``dtype-drift``).

    ``fail_on`` is the severity that makes ``enforce`` fail (default: the policy's, else ``error``), as for scan.
    """

    def __init__(
        self,
        policy: Policy | str | None = None,
        *,
        target: Target | str | None = None,
        fail_on: Severity | None = None,
        drift_severity: Severity = "warning",
    ) -> None:
        self.chosen = effective(policy, target=target, fail_on=fail_on)
        self.policy = self.chosen.policy
        self.target = self.chosen.target
        self.fail_on: Severity = self.chosen.fail_on
        self.drift_severity: Severity = drift_severity
        self.previous: Snapshot | None = None
        self.history: list[tuple[str, list[Finding]]] = []
        """``(label, findings)`` of every audit so far."""

    def audit(self, obj: Any = None, *, label: str = "the last audit", parts: Iterable[tuple[str, Any]] | None = None) -> list[Finding]:
        """Findings for ``obj`` now, plus ``dtype-drift`` against the previous audit; remembers this one as ``label``."""
        live = collect(obj, parts=parts)
        found = findings_for(live, self.chosen)
        now = snapshot(live, label)
        if self.previous is not None:
            found += drift_findings(self.previous, now, severity=self.drift_severity)
        self.previous = now
        self.history.append((label, found))
        return found

    def failing(self, findings: Iterable[Finding]) -> list[Finding]:
        """The findings at or above ``fail_on``."""
        return failing(findings, self.fail_on)
