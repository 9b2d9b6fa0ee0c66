"""Value checks before writing (float16 range), the cast's errors, and ``scan --values``."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

from .. import dtypes
from ..formats.storage import Span
from ..inventory import Finding, Inventory, Severity
from ..torchcast import Caster, chunks, load_torch
from ..values import (
    CHILD_MIN_BYTES,
    UNDERFLOW_BLOCK_FRACTION,
    ValueCheck,
    ValueJob,
    ValueStats,
    count_nonfinite,
    finish_value_checks,
    measures_errors,
    start_value_checks,
)
from .plan import CASTABLE, Plan, TensorPlan, make_plan, unit_of
from .source import Progress, Source, source_files


def check_values(
    plan: Plan,
    sources: dict[str, Source],
    progress_for: Callable[[int], Progress] | None = None,
    *,
    meanwhile: Callable[[], object] | None = None,
) -> dict[str, ValueStats]:
    """Before anything is written, from the values' bits and without casting (see values.py): for every
    unit bound for float16, NaN/Inf, overflow, underflow and subnormals; for float32 units bound for
    float16 or bfloat16, the errors the cast will make.

    Every unit to cast gets its ValueStats here; errors not measured here are measured as the cast is
    made, by the writer or by ``measure_errors``. ``meanwhile`` (loading torch for the cast) runs while
    the checks do: large checks go to a child process so that the two share no core. ``progress_for``
    is given the number of bytes to check (when there are any) and returns the progress callback.
    """
    results: dict[str, ValueStats] = {}
    jobs: dict[str, tuple[Source, ValueJob]] = {}
    for unit, (src, dtype, span, names, target) in units_to_cast(plan, sources).items():
        results[unit] = ValueStats(", ".join(names), dtype, target)
        if _checked(dtype, target):
            jobs[unit] = (src, ValueJob(unit, str(src.path), dtype, target, span.offset, span.length))
    plan.values = results
    to_check = sum(job.length for _, job in jobs.values())
    progress = progress_for(to_check) if progress_for and to_check else None
    child = None
    if meanwhile is not None and to_check >= CHILD_MIN_BYTES:
        child = start_value_checks([job for _, job in jobs.values()], clamp=plan.clamp)
    try:
        if meanwhile is not None:
            meanwhile()
        if child is not None and finish_value_checks(child, {u: results[u] for u in jobs}, progress):
            return results
    finally:
        if child is not None and child.poll() is None:  # interrupted, or ``meanwhile`` failed: leave no orphan
            child.kill()
            child.wait()
    check = ValueCheck()
    for unit, (src, job) in jobs.items():
        check.run(results[unit], src.mm, job, clamp=plan.clamp, progress=progress)
    return results


def _checked(dtype: str, target: str) -> bool:
    # float16 is the narrow range; bfloat16 and float32 keep float32's exponent.
    return (target == "float16" and dtype != "float16") or measures_errors(dtype, target)


def measure_errors(plan: Plan, sources: dict[str, Source]) -> None:
    """Make every planned cast without writing it, folding its errors into ``plan.values`` (dry runs, ``scan --values``)."""
    for unit, (src, dtype, span, _, target) in units_to_cast(plan, sources).items():
        stats = plan.values.get(unit)
        if stats is None or stats.errors_measured:
            continue
        cast = Caster(dtype, target, clamp=plan.clamp, stats=stats)
        itemsize = dtypes.get(dtype).itemsize
        for x in chunks(src.mm, dtype, span.offset, span.length // itemsize, itemsize):
            cast(x)


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
        bad = count_nonfinite(src.mm, t.dtype, span.offset, span.length // dtypes.get(t.dtype).itemsize)
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
        checked = check_values(plan, sources, meanwhile=load_torch)
        measure_errors(plan, sources)
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
