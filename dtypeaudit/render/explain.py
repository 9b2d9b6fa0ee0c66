"""``--explain NAME``: which rule decided a tensor's expected dtype, and why the others did not."""

from __future__ import annotations

from ..inventory import TensorRecord
from ..policy import GLOB_RULE, Policy, decide
from .humanize import shape_text


def render(policy: Policy, t: TensorRecord) -> str:
    d = decide(policy, t)
    lines = [
        f"{t.name}: {t.dtype} {shape_text(t.shape)}, kind {t.kind}, region {t.region}, {_module(t)}",
        f"policy: {policy.source}" + (f" (extends {' -> '.join(policy.extends)})" if policy.extends else ""),
    ]
    if d.skipped:
        lines.append(f"not checked: {d.skipped}")
        return "\n".join(lines) + "\n"
    globs_missed = False
    for r in policy.rules:
        why = r.why_not(t)
        if why is None:
            how = r.how(t)
            lines.append(
                f"  ✓ {r.label}: matches{f' ({how})' if how else ''}, expects {_dt(r.dtypes)}" + (f" ({r.reason})" if r.reason else "")
            )
            break
        globs_missed = globs_missed or (why.startswith("name does not match") and any(not m.text.startswith("re:") for m in r.match))
        lines.append(f"  · {r.label}: skipped, {why}")
    else:
        lines.append(f"  ✓ no rule matched: the default applies, expecting {_dt(policy.default)}")
        if globs_missed:
            lines.append(f"  note: {GLOB_RULE}")
    verdict = "passes" if d.ok else f"fails ({d.severity})"
    lines.append(f"verdict: {t.dtype} {verdict}")
    return "\n".join(lines) + "\n"


def _dt(expected: frozenset[str] | None) -> str:
    return "any dtype" if expected is None else " or ".join(sorted(expected))


def _module(t: TensorRecord) -> str:
    """``module BatchNorm2d`` (from --model), ``module type guessed from names and shapes: RMSNorm``, or both."""
    guess = f"module type guessed from names and shapes: {t.module_guess}" if t.module_guess else None
    if t.module:
        return f"module {t.module}" + (f" ({guess})" if guess else "")
    return guess or "module unknown"
