"""Value checks before writing: range (float16) and the cast's errors; and ``scan --values``."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

from .. import dtypes
from ..formats.storage import Span
from ..inventory import Finding, Inventory, Severity
from ..values import UNDERFLOW_BLOCK_FRACTION, ValueStats, cast_chunk, chunks, errors, update
from .plan import CASTABLE, Plan, TensorPlan, make_plan, unit_of
from .source import Progress, Source, source_files


def check_values(plan: Plan, sources: dict[str, Source], progress: Progress | None = None) -> dict[str, ValueStats]:
    """Before anything is written: range checks for every unit bound for float16 (NaN/Inf, overflow,
    underflow, subnormals), and the max absolute and relative error of every cast."""
    results: dict[str, ValueStats] = {}
    for unit, (src, dtype, span, names, target) in units_to_cast(plan, sources).items():
        stats = ValueStats(", ".join(names), dtype, target)
        # float16 is the narrow range; bfloat16 and float32 keep float32's exponent.
        ranged = target == "float16" and dtype != "float16"
        itemsize = dtypes.get(dtype).itemsize
        for x in chunks(src.mm, dtype, span.offset, span.length // itemsize, itemsize):
            y = update(stats, x, clamp=plan.clamp) if ranged else cast_chunk(x, target, clamp=plan.clamp)
            errors(stats, x, y)
            if progress:
                progress(x.numel() * itemsize)
        results[unit] = stats
    plan.values = results
    return results


def units_to_cast(plan: Plan, sources: dict[str, Source]) -> dict[str, tuple[Source, str, Span, list[str], str]]:
    units: dict[str, tuple[Source, str, Span, list[str], str]] = {}
    for p in plan.tensors:
        if p.action != "cast":
            continue
        t = p.tensor
        src = sources[t.file]
        unit = unit_of(t)
        if unit in units:
            units[unit][3].append(t.name)
            continue
        span = src.storage(t.storage) if t.storage is not None else src.storage(t.name)
        units[unit] = (src, t.dtype, span, [t.name], p.target)
    return units


def apply_value_policy(plan: Plan, *, keep_unsafe: bool) -> list[ValueStats]:
    """With --keep-unsafe, unsafe units stay as they are; returns the unsafe units left blocking."""
    unsafe = {u: s for u, s in plan.values.items() if s.unsafe and not (plan.clamp and not s.nonfinite and not _underflow_blocks(s))}
    if not unsafe:
        return []
    if not keep_unsafe:
        return list(unsafe.values())
    for i, p in enumerate(plan.tensors):
        if p.action == "cast" and unit_of(p.tensor) in unsafe:
            plan.tensors[i] = TensorPlan(p.tensor, p.tensor.dtype, "keep", "unsafe values kept at full precision (--keep-unsafe)")
    for u in unsafe:
        plan.values.pop(u)
    return []


def _underflow_blocks(s: ValueStats) -> bool:
    return s.underflow_fraction > UNDERFLOW_BLOCK_FRACTION


def _nonfinite_elsewhere(plan: Plan, sources: dict[str, Source], checked: set[str]) -> dict[str, int]:
    """NaN/Inf counts for floating tensors that no cast check read (already float16, kept, left)."""
    import torch

    out: dict[str, int] = {}
    seen = set(checked)
    for p in plan.tensors:
        t = p.tensor
        unit = unit_of(t)
        if unit in seen or t.dtype not in CASTABLE or t.layout != "strided":
            continue
        seen.add(unit)
        src = sources[t.file]
        span = src.storage(t.storage) if t.storage is not None else src.storage(t.name)
        itemsize = dtypes.get(t.dtype).itemsize
        bad = sum(x.numel() - int(torch.isfinite(x).sum()) for x in chunks(src.mm, t.dtype, span.offset, span.length // itemsize, itemsize))
        if bad:
            out[t.name] = bad
    return out


def value_findings(inv: Inventory) -> list[Finding]:
    """What a cast to float16 would do to each floating tensor, as findings (``scan --values``)."""
    if inv.format not in ("torch-zip", "torch-legacy", "safetensors", "hf-directory"):
        return []
    plan = make_plan(inv, "fp16", include_optimizer=True)
    out: list[Finding] = []
    with ExitStack() as stack:
        sources = {label: Source(path, sub, stack) for label, (path, sub) in source_files(Path(inv.path), inv).items()}
        checked = check_values(plan, sources)
        for name, count in _nonfinite_elsewhere(plan, sources, set(checked)).items():
            out.append(Finding("non-finite", "error", f"{count} NaN/Inf values already present", tensor=name))
        for stats in checked.values():
            first = stats.name.split(", ")[0]
            figures = f"max |x| {stats.max_abs:.4g}, max abs error {stats.max_abs_error:.3g}, max rel error {stats.max_rel_error:.3g}"
            if stats.nonfinite:
                out.append(Finding("non-finite", "error", f"{stats.nonfinite} NaN/Inf values already present", tensor=first))
            if stats.overflow:
                out.append(
                    Finding(
                        "fp16-overflow",
                        "error",
                        f"{stats.overflow} of {stats.numel} values would become inf in {plan.target} ({figures})",
                        tensor=first,
                    )
                )
            if stats.underflow:
                severity: Severity = "error" if stats.underflow_fraction > UNDERFLOW_BLOCK_FRACTION else "warning"
                out.append(
                    Finding(
                        "fp16-underflow",
                        severity,
                        f"{stats.underflow} non-zero values ({stats.underflow_fraction:.2%}) would become 0 in {plan.target} ({figures})",
                        tensor=first,
                    )
                )
            if stats.subnormal and not stats.underflow:
                out.append(
                    Finding(
                        "fp16-subnormal",
                        "info",
                        f"{stats.subnormal} values land in {plan.target}'s subnormal range ({figures})",
                        tensor=first,
                    )
                )
    return out
