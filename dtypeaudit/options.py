"""Which policy, which hardware target and which failing severity apply: the one resolver of ``--policy``,
``--preset``, ``--target`` and ``--fail-on``.

scan, convert and trace on the command line, ``trace()``, ``audit``/``Auditor`` and the pytest plugin in the library
ask it; YAML and the target table load only when one is named.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from .errors import UsageError
from .inventory import SEVERITIES, Severity

if TYPE_CHECKING:
    from .checks import Check
    from .hardware import Target
    from .policy import Policy


@dataclass(frozen=True)
class Effective:
    """The policy and the hardware target a run applies."""

    policy: Policy | None
    target: Target | None
    """``--target``, else the policy's own ``target:``, else None."""
    fail_on: Severity = "error"
    """The severity at or above which a finding fails the run (``inventory.failing``): ``--fail-on``, else the
    policy's ``fail_on``, else ``error`` (``fail_on_for``)."""
    trace_fail_on: Severity = "error"
    """A trace's: ``--fail-on``, else the policy's ``trace: fail_on``, else its ``fail_on``, else ``error``."""

    @property
    def policy_alone(self) -> Policy | None:
        """The policy without its own ``target:``: the effective target is checked apart, once."""
        return replace(self.policy, target=None) if self.policy is not None and self.policy.target else self.policy

    def checks(self) -> list[Check]:
        """Every per-checkpoint check: ``checks_for`` the policy, with the effective target's in place of its own."""
        from .checks import checks_for

        if self.target is None:
            return checks_for(self.policy_alone)
        from .hardware import check_for

        return [*checks_for(self.policy_alone), check_for(self.target)]


def fail_on_for(policy: Policy | None, asked: str | None = None, *, trace: bool = False) -> Severity:
    """The severity at or above which findings fail: ``asked`` (``--fail-on``), else the policy's (for a trace, its
    ``trace: fail_on`` first), else ``error``. ``UsageError`` (exit 2) for an ``asked`` that is no severity."""
    if asked is not None:
        if asked not in SEVERITIES:
            raise UsageError(f"--fail-on must be error, warning or info, not '{asked}'")
        return asked
    if policy is not None:
        own = (policy.trace.fail_on or policy.fail_on) if trace else policy.fail_on
        if own:
            return own
    return "error"


def effective(
    policy: Policy | str | None = None,
    *,
    preset: str | None = None,
    target: Target | str | None = None,
    fail_on: str | None = None,
) -> Effective:
    """The policy (a ``Policy``, a YAML file or a preset name; ``preset`` the same as ``--preset``, not both), the
    hardware target (``target`` by name or as a ``Target``, else the policy's ``target:``) and the failing severity
    (``fail_on``, else the policy's, else ``error``: ``fail_on_for``).

    ``PolicyError`` (exit 2) for a policy that does not load, ``UsageError`` (exit 2) for both a policy and a preset,
    an unknown target or a ``fail_on`` that is no severity; the policy is loaded first, so its error is the one told
    when several are wrong.
    """
    if policy and preset:
        raise UsageError("give --policy or --preset, not both (a policy file can say `extends: PRESET`)")
    if policy is None or isinstance(policy, str):
        name = policy or preset
        if name:
            from .policy import load_policy  # YAML loads only when a policy is asked for

            policy = load_policy(name)
        else:
            policy = None
    loaded = policy
    chosen = target if target is not None else (loaded.target if loaded is not None else None)
    if isinstance(chosen, str):
        from .hardware import resolve

        chosen = resolve(chosen)
    return Effective(loaded, chosen, fail_on_for(loaded, fail_on), fail_on_for(loaded, fail_on, trace=True))
