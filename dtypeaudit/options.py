"""Which policy and which hardware target apply: the one resolver of ``--policy``, ``--preset`` and ``--target``.

scan, convert and trace on the command line, and ``trace()`` in the library, ask it; YAML and the target table load
only when one is named.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from .errors import UsageError

if TYPE_CHECKING:
    from .checks import Check
    from .policy import Policy
    from .targets import Target


@dataclass(frozen=True)
class Effective:
    """The policy and the hardware target a run applies."""

    policy: Policy | None
    target: Target | None
    """``--target``, else the policy's own ``target:``, else None."""

    @property
    def policy_alone(self) -> Policy | None:
        """The policy without its own ``target:``: the effective target is checked apart, once."""
        return replace(self.policy, target=None) if self.policy is not None and self.policy.target else self.policy

    def checks(self) -> list[Check]:
        """Every per-checkpoint check: ``checks_for`` the policy, with the effective target's in place of its own."""
        from .checks import checks_for

        if self.target is None:
            return checks_for(self.policy_alone)
        from .targets import check_for

        return [*checks_for(self.policy_alone), check_for(self.target)]


def effective(policy: Policy | str | None = None, *, preset: str | None = None, target: Target | str | None = None) -> Effective:
    """The policy (a ``Policy``, a YAML file or a preset name; ``preset`` the same as ``--preset``, not both) and the
    hardware target (``target`` by name or as a ``Target``, else the policy's ``target:``).

    ``PolicyError`` (exit 2) for a policy that does not load, ``UsageError`` (exit 2) for both a policy and a preset
    or an unknown target; the policy is loaded first, so its error is the one told when both are wrong.
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
        from .targets import resolve

        return Effective(loaded, resolve(chosen))
    return Effective(loaded, chosen)
