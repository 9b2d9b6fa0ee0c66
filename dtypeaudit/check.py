"""Inventory x Policy -> findings. Pure functions; no I/O.

Some checks need no policy: tensors of one module that disagree in floating dtype, and a Hugging Face
config.json whose dtype disagrees with the weights.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import TYPE_CHECKING

from . import dtypes
from .inventory import Finding, Inventory, TensorRecord

if TYPE_CHECKING:  # the policy module (and YAML) load only when a policy is in use
    from .policy import Decision, Policy

Check = Callable[[Inventory], list[Finding]]

# What a loader might read differently from dtypeaudit: harmless for ordinary files, fatal for a security gate.
STRICT_RULES = frozenset({"loader-divergence", "foreign-global", "trailing-data", "unused-weights"})
STRICT_MARKER = " (strict)"

# Statistics that may legitimately stay fp32 beside half-precision weights (cuDNN's batch norm takes them so).
_STAT_SUFFIXES = ("running_mean", "running_var")


def _expected_text(expected: frozenset[str] | None) -> str:
    return "any dtype" if expected is None else " or ".join(sorted(expected))


def decision_message(d: Decision) -> str:
    origin = f"rule {d.rule.label}" if d.rule else "the policy's default"
    text = f"is {d.tensor.dtype}, expected {_expected_text(d.expected)} ({origin})"
    if d.rule and d.rule.reason:
        text += f": {d.rule.reason}"
    return text


def policy_findings(inv: Inventory, policy: Policy) -> list[Finding]:
    from .policy import decide

    out = []
    for t in inv.tensors:
        d = decide(policy, t)
        if not d.ok:
            out.append(
                Finding(
                    "dtype-mismatch",
                    d.severity,
                    decision_message(d),
                    tensor=t.name,
                    file=t.file or None,
                    expected=tuple(sorted(d.expected or ())),
                    actual=t.dtype,
                )
            )
    return out


def tied_conflicts(inv: Inventory, policy: Policy) -> list[Finding]:
    """Names that share one storage but whose rules allow no common dtype."""
    from .policy import decide

    out = []
    seen: set[frozenset[str]] = set()
    by = inv.by_name()
    for t in inv.tensors:
        if not t.shares_with:
            continue
        group = frozenset((t.name, *t.shares_with))
        if group in seen:
            continue
        seen.add(group)
        members = [by[n] for n in sorted(group) if n in by]
        if any(m.dtype != members[0].dtype or m.shape != members[0].shape for m in members):
            continue  # a view of a different shape is not a tie
        allowed: frozenset[str] | None = None
        for m in members:
            d = decide(policy, m)
            if d.skipped is None and d.expected is not None:
                allowed = d.expected if allowed is None else allowed & d.expected
        if allowed is not None and not allowed:
            wants = "; ".join(f"{m.name} -> {_expected_text(decide(policy, m).expected)}" for m in members)
            out.append(
                Finding(
                    "tied-dtype-conflict",
                    "error",
                    f"tied tensors share one storage but the policy wants different dtypes: {wants}",
                    tensor=members[0].name,
                )
            )
    return out


def module_dtype_mix(inv: Inventory) -> list[Finding]:
    """Tensors of one module with different floating dtypes: the forward pass would fail."""
    groups: dict[tuple[str, str], list[TensorRecord]] = defaultdict(list)
    for t in inv.tensors:
        if t.region != "model" or "." not in t.name or t.layout != "strided":
            continue
        if t.dtype not in dtypes.DTYPES or not dtypes.get(t.dtype).is_floating or t.name.endswith(_STAT_SUFFIXES):
            continue
        groups[(t.file, t.name.rsplit(".", 1)[0])].append(t)
    out = []
    for (file, module), members in groups.items():
        kinds = {m.dtype for m in members}
        if len(kinds) > 1:
            listing = ", ".join(f"{m.name.rsplit('.', 1)[1]} {m.dtype}" for m in members)
            out.append(
                Finding(
                    "module-dtype-mix",
                    "error",
                    f"module mixes floating dtypes ({listing}); a forward pass fails with 'expected scalar type ... but found ...'",
                    tensor=module,
                    file=file or None,
                )
            )
    return out


def config_dtype(inv: Inventory) -> list[Finding]:
    """A Hugging Face config.json that names another dtype than the weights hold."""
    declared = inv.metadata.get("config_dtype")
    if not isinstance(declared, str) or declared == "auto":
        return []
    name = dtypes.canonical(declared)
    weights = Counter()  # type: Counter[str]
    for t in inv.tensors:
        if t.dtype in dtypes.DTYPES and dtypes.get(t.dtype).is_floating:
            weights[t.dtype] += t.nbytes
    if not weights or name is None:
        return []
    dominant = weights.most_common(1)[0][0]
    if dominant == name:
        return []
    return [
        Finding(
            "config-dtype-mismatch",
            "warning",
            f"config.json says {declared} but the weights are mostly {dominant}; from_pretrained(torch_dtype='auto') would cast them",
            file="config.json",
            expected=(name,),
            actual=dominant,
        )
    ]


def checks_for(policy: Policy | None) -> list[Check]:
    """Every check to run: the policy-free ones, plus the policy's when there is one."""
    checks: list[Check] = [module_dtype_mix, config_dtype]
    if policy is not None:
        checks += [lambda inv: policy_findings(inv, policy), lambda inv: tied_conflicts(inv, policy)]
    return checks


def strict_findings(findings: Iterable[Finding]) -> list[Finding]:
    """Strict mode (``--strict``, ``strict: true``): every finding of a STRICT_RULES rule becomes an error.

    The message keeps its words and gains a "(strict)" marker, so a reader of any report sees why a
    warning now fails the run.
    """
    return [
        replace(f, severity="error", message=f.message + STRICT_MARKER) if f.rule in STRICT_RULES and f.severity != "error" else f
        for f in findings
    ]


def check(inv: Inventory, policy: Policy | None = None, *, strict: bool = False) -> list[Finding]:
    """All findings for one inventory: the reader's own, then each check's; promoted by ``strict``."""
    out = list(inv.findings)
    for c in checks_for(policy):
        out.extend(c(inv))
    return strict_findings(out) if strict else out
