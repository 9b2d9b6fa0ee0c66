"""A tune's keep set as a policy in the existing language: the target dtype for everything, ``keep_in_fp32`` for
the keep set, with a comment per kept module saying why. ``convert --policy`` writes a checkpoint that keeps
exactly those modules' tensors in fp32, ``scan --policy`` passes it, and ``apply`` makes a live model run that way.
"""

from __future__ import annotations

import json

from .result import TuneResult, finite_or_none


def policy_text(result: TuneResult) -> str:
    """The policy YAML for ``result`` (comments included)."""
    error = finite_or_none(result.output_error)
    lines = [
        f"# Written by `dtypeaudit tune --to {result.to}` (metric {result.metric}, tolerance {result.tolerance:g}):",
        f"# {len(result.keep)} module(s) kept in fp32; the model's error with them {_number(error)}, "
        f"all in {result.to} {_number(finite_or_none(result.all_low_error))}.",
        "# A kept module's parameters and buffers are float32, its floating inputs are cast to float32 on entry and",
        f"# its floating outputs back to {result.to} on exit (dtypeaudit.apply); everything else is {result.to}.",
    ]
    if not result.passed:
        lines.append(f"# This keep set does NOT pass the tolerance; still failing: {', '.join(result.failing) or 'the model as a whole'}.")
    lines += ["version: 1", f"default: {result.to}"]
    if result.keep:
        lines.append("keep_in_fp32:")
        lines += [f"  - {json.dumps(name)}  # {result.why_kept(name)}" for name in result.keep]
    return "\n".join(lines) + "\n"


def _number(value: float | None) -> str:
    return "not finite" if value is None else f"{value:.3g}"
