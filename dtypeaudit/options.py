"""A run's settings, resolved once and checked before any checkpoint byte is read: which policy, hardware target,
failing severity and strictness apply (``effective`` -> ``ScanSettings``, the one resolver of ``--policy``,
``--preset``, ``--target``, ``--fail-on`` and ``--strict``), and what a conversion does (``convert_settings`` ->
``ConvertSettings``: the one home of convert's option checks).

scan, convert and trace on the command line, ``scan()``, ``convert()``, ``trace()``, ``audit``/``Auditor`` and the
pytest plugin in the library ask it; YAML and the target table load only when one is named.
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
class ScanSettings:
    """The policy, hardware target, failing severity and strictness a run applies."""

    policy: Policy | None
    target: Target | None
    """``--target``, else the policy's own ``target:``, else None."""
    fail_on: Severity = "error"
    """The severity at or above which a finding fails the run (``inventory.failing``): ``--fail-on``, else the
    policy's ``fail_on``, else ``error`` (``fail_on_for``)."""
    trace_fail_on: Severity = "error"
    """A trace's: ``--fail-on``, else the policy's ``trace: fail_on``, else its ``fail_on``, else ``error``."""
    strict: bool = False
    """Every finding a loader might read differently is an error (``checks.strict_findings``): ``strict_for``."""

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


Effective = ScanSettings
"""The name trace, live audits and the pytest plugin know it by."""


def strict_for(policy: Policy | None, asked: bool | None = None) -> bool:
    """Whether a run is strict: ``asked`` (``--strict``; None or False when not given), else the policy's
    ``strict:``. The one place it is decided."""
    return bool(asked) or bool(policy is not None and policy.strict)


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
    strict: bool | None = None,
) -> ScanSettings:
    """The policy (a ``Policy``, a YAML file or a preset name; ``preset`` the same as ``--preset``, not both), the
    hardware target (``target`` by name or as a ``Target``, else the policy's ``target:``) and the failing severity
    (``fail_on``, else the policy's, else ``error``: ``fail_on_for``) and strictness (``strict_for``).

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
    return ScanSettings(loaded, chosen, fail_on_for(loaded, fail_on), fail_on_for(loaded, fail_on, trace=True), strict_for(loaded, strict))


@dataclass(frozen=True)
class ConvertSettings:
    """What one conversion does, every option checked (``convert_settings``); one value for every source of a
    ``convert SOURCE...`` (it travels to its workers)."""

    to: str
    """The target dtype, by torch's name (``float16``): ``--to`` parsed once (``dtypes.conversion_target``)."""
    policy: Policy | None = None
    """What the planned output is checked against: the policy, without its own ``target:`` where ``--target``
    checks the plan instead."""
    hardware: Target | None = None
    """``--target`` (a dry run's): the planned output's hardware section."""
    fail_on: Severity = "error"
    """The severity at which the hardware section fails the run: the policy's ``fail_on``, else ``error``."""
    strict: bool = False
    """``strict_for``: the planned output is checked as ``scan --strict`` would check it."""
    keep: tuple[str, ...] = ()
    include_optimizer: bool = False
    strip_optimizer: bool = False
    clamp: bool = False
    keep_unsafe: bool = False
    dry_run: bool = False
    read_values: bool = True
    """False only for a metadata-only dry run (the command line's ``--dry-run`` without ``--check-values``)."""
    force: bool = False
    in_place: bool = False
    max_shard_size: int | None = None
    """``--max-shard-size`` in bytes (``parse_size``)."""
    model: str | None = None
    materialize_ties: bool = False
    keep_quantized: bool = False
    exclude: tuple[str, ...] = ()
    """``--exclude``: globs of a folder's files that are not read and not written to the output."""
    fp8_reference: str | None = None
    """``--fp8-reference``: which reference an FP8 block weight is dequantized by where the two part (one of
    ``FP8_REFERENCES``); None refuses such a weight (``quant.dequant.loader_refusal``)."""


FP8_REFERENCES = ("transformers", "deepseek")
"""``--fp8-reference``'s choices: transformers' from_pretrained (the block from the scale grid, which must divide the
weight) and DeepSeek-V3's ``weight_dequant`` (the config's ``weight_block_size``, partial edge blocks)."""


def convert_settings(
    to: str,
    *,
    policy: Policy | str | None = None,
    preset: str | None = None,
    target: Target | str | None = None,
    strict: bool | None = None,
    keep: tuple[str, ...] | list[str] = (),
    include_optimizer: bool = False,
    strip_optimizer: bool = False,
    clamp: bool = False,
    keep_unsafe: bool = False,
    dry_run: bool = False,
    read_values: bool | None = None,
    force: bool = False,
    in_place: bool = False,
    max_shard_size: str | int | None = None,
    model: str | None = None,
    materialize_ties: bool = False,
    keep_quantized: bool = False,
    output: object = None,
    exclude: tuple[str, ...] | list[str] = (),
    fp8_reference: str | None = None,
) -> ConvertSettings:
    """A conversion's settings, each misuse a ``UsageError`` or ``PolicyError`` (exit 2) before any checkpoint is
    opened: a ``--to`` that is no target dtype, a policy that does not load, options that contradict each other.
    ``read_values``: None reads them (a conversion always does; a dry run too, unless False); True without
    ``dry_run`` is ``--check-values`` without ``--dry-run``. ``output`` is only checked against ``in_place``."""
    from .dtypes import conversion_target

    dtype = conversion_target(to)
    if in_place and output is not None:
        raise UsageError("give --in-place or --output, not both")
    if include_optimizer and strip_optimizer:
        raise UsageError("--include-optimizer and --strip-optimizer contradict each other")
    if exclude and in_place:  # the folder that replaces the source holds no excluded file: they would be gone
        raise UsageError("--exclude with --in-place would delete the files it leaves out; write the output elsewhere with -o")
    if target is not None and not dry_run:
        raise UsageError("--target checks a plan: give --dry-run too")
    if fp8_reference is not None and fp8_reference not in FP8_REFERENCES:
        raise UsageError(f"--fp8-reference must be transformers or deepseek, not '{fp8_reference}'")
    if read_values and not dry_run:
        raise UsageError("--check-values reads the values for a plan: give --dry-run too (a conversion always checks them)")
    size = parse_size(max_shard_size) if isinstance(max_shard_size, str) else max_shard_size
    chosen = effective(policy, preset=preset, target=target, strict=strict)
    if model:
        from .extras import require

        require("torch", "dtypeaudit convert --model")
    return ConvertSettings(
        dtype,
        # --target replaces the policy's own `target:`, as for scan: its findings are the plan's hardware section
        policy=chosen.policy_alone if target is not None else chosen.policy,
        hardware=chosen.target if target is not None else None,
        fail_on=chosen.fail_on,
        strict=chosen.strict,
        keep=tuple(keep),
        include_optimizer=include_optimizer,
        strip_optimizer=strip_optimizer,
        clamp=clamp,
        keep_unsafe=keep_unsafe,
        dry_run=dry_run,
        read_values=read_values is not False or not dry_run,
        force=force,
        in_place=in_place,
        max_shard_size=size,
        model=model,
        materialize_ties=materialize_ties,
        keep_quantized=keep_quantized,
        exclude=tuple(exclude),
        fp8_reference=fp8_reference,
    )


def parse_size(text: str) -> int:
    """``5GB``, ``500MB``, ``2GiB``, ``10KB`` or a plain byte count, as transformers' max_shard_size reads them."""
    import re

    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*", text, re.I)
    if not m:
        raise UsageError(f"--max-shard-size must look like 5GB, 500MB or 2GiB, not '{text}'")
    unit = (m.group(2) or "B").upper()
    scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}[unit]
    return int(float(m.group(1)) * scale)
