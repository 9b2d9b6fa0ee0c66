"""pytest plugin (registered through the ``pytest11`` entry point): the ``dtype_audit`` fixture.

::

    def test_release_dtypes(dtype_audit):
        dtype_audit.assert_clean(build_model(), policy="configs/release.yaml")

``assert_clean`` fails the test with the findings table when any finding is at or above ``fail_on`` (default:
the policy's, else ``error``) and returns the findings otherwise. The ini options ``dtype_audit_policy`` and
``dtype_audit_target`` give defaults for a project's tests. Loading the plugin imports neither torch nor YAML.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from .hardware import Target
    from .inventory import Finding, Severity
    from .policy import Policy


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini("dtype_audit_policy", "dtypeaudit: the default policy (a preset name or a YAML file) for dtype_audit.assert_clean")
    parser.addini("dtype_audit_target", "dtypeaudit: the default hardware target for dtype_audit.assert_clean (dtypeaudit targets)")


class DtypeAudit:
    """What the ``dtype_audit`` fixture gives a test."""

    def __init__(self, policy: str | None = None, target: str | None = None) -> None:
        self.policy = policy or None
        self.target = target or None

    def audit(self, obj: Any, policy: Policy | str | None = None, *, target: Target | str | None = None) -> list[Finding]:
        """``dtypeaudit.audit`` with the project's default policy and target."""
        from .live import audit

        return audit(obj, policy if policy is not None else self.policy, target=target if target is not None else self.target)

    def assert_clean(
        self, obj: Any, policy: Policy | str | None = None, *, target: Target | str | None = None, fail_on: Severity | None = None
    ) -> list[Finding]:
        """Fail the test, with the findings table as its message, if ``obj`` has findings at or above ``fail_on``."""
        from .inventory import failing
        from .live import describe, render_findings
        from .options import effective

        chosen = effective(policy if policy is not None else self.policy, fail_on=fail_on)
        pol = chosen.policy
        found = self.audit(obj, pol, target=target)
        if failing(found, chosen.fail_on):
            where = f" against {pol.source}" if pol is not None else ""
            pytest.fail(render_findings(found, title=f"dtype audit of {describe(obj)}{where}", fail_on=chosen.fail_on), pytrace=False)
        return found


@pytest.fixture
def dtype_audit(request: pytest.FixtureRequest) -> DtypeAudit:
    """Audit live models in a test: ``dtype_audit.assert_clean(model, policy=...)``."""
    return DtypeAudit(request.config.getini("dtype_audit_policy"), request.config.getini("dtype_audit_target"))
