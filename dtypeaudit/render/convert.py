"""The conversion report: the plan (what changes, size before and after), value problems, errors per tensor."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..conversion import Result, pickled_module_files
from ..conversion.causes import Cause, few
from ..conversion.plan import KEPT_FP32, WOULD_NOT_RUN
from ..conversion.verify import verified_line
from ..inventory import Finding, severity_rank
from .humanize import group_findings, human_bytes
from .json import finding_dict

STATE_DICT_ADVICE = "a pickled nn.Module is code, not weights: save its state_dict and convert that"


def refusal_lines(result: Result) -> list[str]:
    """What stderr says of a refused conversion, in one line: the reader's worst cause of refusal (which names its
    way through where there is one) and the rules of the others, which the report lists; or why the planned output
    fails."""
    source = Path(result.plan.source.path)
    out = []
    if result.refused:
        causes, advice = _refusal_causes(result), _module_advice(result)
        file, line = causes[0]  # the worst first
        where = source / file if file and source.is_dir() else source
        rest = [f"{f + ': ' if f and f != file else ''}{ln.split(':', 1)[0]}" for f, ln in causes[1:]]
        more = f"; and {few(rest)}, which the report on stdout lists" if rest else ""
        out.append(f"{where}: refusing to convert: {line}{more}{advice}")
    if result.failed:  # the report says why, by cause, and a way through: one line here
        n, causes_n = len(result.failed), len(result.plan.causes)
        why = f"{n} finding{'s' if n != 1 else ''}" + (f", {causes_n} cause{'s' if causes_n != 1 else ''}" if causes_n else "")
        way = " and a way through" if any(c.ways for c in result.plan.causes) else ""
        out.append(f"{source}: refusing to convert: the planned output {_fails(result)} ({why}); the report on stdout says why{way}")
    return out


def _refusal_causes(result: Result, *, verbose: bool = False) -> list[tuple[str | None, str]]:
    """The reader's refusals grouped by file, rule and cause as scan's report groups them, worst first: for each,
    the folder's file it is about (None: the source itself) and one line, ``rule[ xN (subjects)]: message``. The
    message names the way through where the reader knows one (``--exclude training_args.bin`` for a file no loader
    reads)."""
    by_file: dict[str | None, list[Finding]] = {}
    for f in result.refused:
        by_file.setdefault(f.file, []).append(replace(f, file=None))
    out: list[tuple[int, str | None, str]] = []
    for file, found in by_file.items():
        for g in group_findings(found):
            if g.count == 1:
                tensor = f"{g.subjects[0]}: " if g.subjects[0] and g.subjects[0] not in g.message() else ""
                line = f"{g.rule}: {tensor}{g.message()}"
            else:
                shown = f" ({g.places(every=verbose)})" if any(g.subjects) else ""
                line = f"{g.rule} \u00d7{g.count}{shown}: {g.message()}"
            out.append((-severity_rank(g.severity), file, line))
    return [(file, line) for _, file, line in sorted(out, key=lambda c: c[0])]


def _module_advice(result: Result) -> str:
    """For a whole pickled module, what to do instead (appended to a line)."""
    return f"; {STATE_DICT_ADVICE} (torch.save(model.state_dict(), PATH))" if pickled_module_files(result.refused) else ""


def _fails(result: Result) -> str:
    n = len(result.failed)
    runs = sum(WOULD_NOT_RUN in f.message for f in result.failed)
    return "fails scan with the same policy" if not runs else "would not run" if runs == n else "fails scan or would not run"


def _cause_lines(result: Result, *, verbose: bool) -> list[str]:
    """Each cause of a refused plan once: its findings' shared message and subjects, then its ways through."""
    # plan.with_findings derives the causes; a Result made otherwise shows its findings one by one
    causes = result.plan.causes or tuple(Cause(f.severity, f.rule, f.message, (f.tensor or "",)) for f in result.failed)
    lines = []
    for c in causes if verbose or len(causes) <= 10 else causes[:10]:
        named = [s for s in c.subjects if s]
        count = f" \u00d7{len(c.subjects)}" if len(c.subjects) > 1 else ""
        if len(named) == 1:
            lines.append(f"  {c.severity}: {c.rule}: {named[0]}: {c.message}")
        elif named and named[0] not in c.message:
            shown = ", ".join(named) if verbose else few(named)
            lines.append(f"  {c.severity}: {c.rule}{count}: {c.message} ({shown})")
        else:
            lines.append(f"  {c.severity}: {c.rule}{count}: {c.message}")
        lines.extend(f"    {'way through' if i == 0 else 'or'}: {w}" for i, w in enumerate(c.ways))
    if len(causes) > 10 and not verbose:
        lines.append(f"  and {len(causes) - 10} more (--verbose lists them all)")
    return lines


def render_text(result: Result, *, verbose: bool = False) -> str:
    plan = result.plan
    if result.refused:
        n = len(result.refused)
        forbid = f"{n} findings forbid" if n != 1 else "1 finding forbids"
        lines = [f"refused: {plan.source.path} (to {plan.target}): {forbid} converting it; nothing was written:"]
        lines.extend(f"  {file + ': ' if file else ''}{line}" for file, line in _refusal_causes(result, verbose=verbose))
        return "\n".join(lines) + "\n"
    lines = []
    head = "plan" if result.dry_run and not result.failed else ("refused" if result.blocked else "converted")
    where = f" -> {result.output}" if result.output else ""
    lines.append(f"{head}: {plan.source.path}{where} (to {plan.target})")
    if result.failed:
        n = len(result.failed)
        lines.append(f"the planned output {_fails(result)} ({n} finding{'s' if n != 1 else ''}); nothing was written:")
        lines.extend(_cause_lines(result, verbose=verbose))
    counts = plan.counts()
    parts = [
        f"{counts[a]} {label}"
        for a, label in (
            ("dequantize", "dequantized"),
            ("cast", "cast"),
            ("keep", "kept by rule"),
            ("leave", "left as they are"),
            ("drop", "dropped"),
        )
        if counts.get(a)
    ]
    before, after = plan.bytes_before, plan.bytes_after
    ratio = f" ({after / before:.2f}x)" if before else ""
    lines.append(f"tensors: {', '.join(parts) or 'none'}; size {human_bytes(before)} -> {human_bytes(after)}{ratio}")
    reasons: dict[str, list[str]] = {}
    for p in plan.tensors:
        if p.reason.startswith(KEPT_FP32):  # one line per list of the model class, stored float32 or not
            reasons.setdefault(p.reason, []).append(p.tensor.name)
        elif p.action in ("keep", "leave", "drop") and p.reason:
            reasons.setdefault(f"{p.action}: {p.reason}", []).append(p.tensor.name)
    for reason, names in reasons.items():
        shown = names if verbose or len(names) <= 4 else names[:3] + [f"and {len(names) - 3} more"]
        lines.append(f"  {reason}: {', '.join(shown)}")
    if verbose:
        for p in plan.tensors:
            if p.action == "cast":
                lines.append(f"  cast: {p.tensor.name} {p.tensor.dtype} -> {p.target}")
    if result.unsafe:
        lines.append("unsafe values (nothing was written; --clamp saturates, --keep-unsafe keeps these tensors as they are):")
        for s in result.unsafe:
            lines.append(f"  {s.name}: {'; '.join(s.problems())}")
    if not result.unsafe:
        noted = [s for s in plan.values.values() if s.problems()]
        if noted:
            lines.append("value notes (not blocking):")
            lines.extend(f"  {s.name}: {'; '.join(s.problems())}" for s in (noted if verbose else noted[:5]))
        if plan.values:
            ranked = sorted(plan.values.values(), key=lambda s: -s.max_rel_error)
            worst = ranked if verbose else ranked[:5]
            lines.append(f"cast error ({'all' if verbose else 'worst'} {len(worst)} of {len(ranked)}):")
            for s in worst:
                lines.append(f"  {s.name}: max abs error {s.max_abs_error:.3g}, max rel error {s.max_rel_error:.3g}")
    if not result.values_read:
        lines.append("values: not read (--check-values reads them: NaN/Inf, overflow, underflow and the cast's errors)")
    lines.extend(f"note: {n}" for n in plan.notes)
    if plan.config_json_dtype is not None:
        lines.append(f"note: config.json's dtype becomes {plan.config_json_dtype}, the dtype of the converted model's layers")
    if not result.failed:
        for f in plan.findings:
            lines.append(f"{f.severity}: the output will show {f.rule}: {f.tensor + ': ' if f.tensor else ''}{f.message}")
    if result.output and not result.dry_run and counts.get("dequantize"):
        lines.append("verified: names, shapes and dtypes as planned, and the bytes read back equal the dequantized weights written")
    elif result.output and not result.dry_run:
        lines.append(verified_line(list(result.written.values())))
    return "\n".join(lines) + "\n"


def convert_doc(result: Result) -> dict[str, Any]:
    """The ``dtypeaudit.convert/1`` document of a conversion (``--format json``; a list of them for several SOURCEs)."""
    plan = result.plan
    doc: dict[str, Any] = {
        "schema": "dtypeaudit.convert/1",
        "source": plan.source.path,
        "output": str(result.output) if result.output else None,
        "target": plan.target,
        "dry_run": result.dry_run,
        "values_read": result.values_read,
        "refused": result.blocked,
        "refusals": [finding_dict(f) for f in result.refused],
        "plan_failures": [finding_dict(f) for f in result.failed],
        "plan_causes": [
            {"severity": c.severity, "rule": c.rule, "message": c.message, "subjects": list(c.subjects), "ways": list(c.ways)}
            for c in plan.causes
        ],
        "plan_findings": [finding_dict(f) for f in plan.findings],
        "config_dtype": plan.config_json_dtype,
        "nbytes": [plan.bytes_before, plan.bytes_after],
        "tensors": [
            {"name": p.tensor.name, "from": p.tensor.dtype, "to": p.target, "action": p.action, "reason": p.reason} for p in plan.tensors
        ],
        "values": [
            {
                "tensors": s.name,
                "numel": s.numel,
                "nonfinite": s.nonfinite,
                "overflow": s.overflow,
                "underflow": s.underflow,
                "subnormal": s.subnormal,
                "max_abs_error": s.max_abs_error,
                "max_rel_error": s.max_rel_error,
                "unsafe": s.unsafe,
            }
            for s in plan.values.values()
        ],
        "unsafe": [s.name for s in result.unsafe],
        "notes": plan.notes,
    }
    return doc


def render_json(result: Result, *, hardware_target: dict[str, object] | None = None) -> str:
    """``convert --format json``; ``hardware_target``: ``convert --dry-run --target``'s section (``hardware.plan_json``)."""
    doc = convert_doc(result)
    if hardware_target is not None:
        doc["hardware_target"] = hardware_target
    return json.dumps(doc, indent=2) + "\n"
