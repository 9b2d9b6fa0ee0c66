"""Value checks before writing (float16 range), the cast's errors, and ``scan --values``."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path

from .. import dtypes
from ..formats.training import is_training_state
from ..inventory import Finding, Inventory, Severity, Span, format_of, unique_tensors
from ..pieces import Job, Workers
from ..torchcast import TorchCaster, chunks, load_torch, one_thread
from ..values import (
    UNDERFLOW_BLOCK_FRACTION,
    UNDERFLOW_WARN_FRACTION,
    ValueStats,
    View,
    count_nonfinite,
    figures_of_runs,
    measures_errors,
    runs_of,
    viewed_runs,
)
from .mapped import MappedCheckpoint, Progress, open_sources, views_by_unit
from .plan import Plan, TensorPlan, make_plan, unit_of


class ValueChecks:
    """The value checks a plan needs, and their statistics as they are folded: every unit cast (its weights;
    training state goes unchecked, see ``is_training_state``) and the model's floating units written as they
    are (``units_held``: NaN/Inf in them still blocks). Each unit is folded once, from its whole storage: by
    the writer that casts or copies exactly those bytes (``claim``), or else by a check alone (``remaining``).
    """

    def __init__(self, plan: Plan, sources: dict[str, MappedCheckpoint]) -> None:
        self.results: dict[str, ValueStats] = {}
        self.held: dict[str, ValueStats] = {}
        self._where: dict[str, tuple[str, Span, str]] = {}
        self._unclaimed: dict[tuple[str, int, int], str] = {}
        self._runs: dict[str, list[tuple[int, int]]] = {}  # units that views see in part: only those parts judged
        self._partial: dict[str, tuple[MappedCheckpoint, dict[str, View]]] = {}
        views = views_by_unit(plan)
        for unit, (src, dtype, span, names, target) in units_to_cast(plan, sources, weights_only=True).items():
            self.results[unit] = ValueStats(", ".join(names), dtype, target)
            self._add(unit, src, dtype, span, views[unit])
        for unit, (src, dtype, span, names) in units_held(plan, sources).items():
            self.held[unit] = ValueStats(", ".join(names), dtype, dtype)
            self._add(unit, src, dtype, span, views[unit])

    def _add(self, unit: str, src: MappedCheckpoint, dtype: str, span: Span, views: dict[str, View]) -> None:
        self._where[unit] = (str(src.path), span, dtype)
        runs = viewed_runs(list(views.values()), span.length // dtypes.get(dtype).itemsize)
        if runs is None:
            self._unclaimed[(str(src.path), span.offset, span.length)] = unit
        else:  # the writer carries the whole storage unchecked; the viewed runs are checked alone
            self._runs[unit] = runs
            self._partial[unit] = (src, views)

    @property
    def every(self) -> dict[str, ValueStats]:
        return {**self.results, **self.held}

    def claim(self, source: str, offset: int, length: int) -> str | None:
        """The unit whose checks are exactly these source bytes, the first time they are asked for (a writer
        about to read them all), else None."""
        return self._unclaimed.pop((source, offset, length), None)

    def remaining(self) -> list[Job]:
        """A check-only job for every unit no writer claimed."""
        jobs = []
        for unit in self._unclaimed.values():
            source, span, dtype = self._where[unit]
            jobs.append(Job(source, span.offset, span.length, dtype, self.every[unit].target, unit=unit))
        for unit, runs in self._runs.items():
            source, span, dtype = self._where[unit]
            size = dtypes.get(dtype).itemsize
            jobs.extend(Job(source, span.offset + first * size, n * size, dtype, self.every[unit].target, unit=unit) for first, n in runs)
        self._unclaimed.clear()
        self._runs.clear()
        return jobs

    def outcome(self) -> dict[str, ValueStats]:
        """``plan.values``: every cast unit's statistics, and the held units that hold NaN/Inf (to block the write)."""
        results = dict(self.results)
        results.update((unit, stats) for unit, stats in self.held.items() if stats.nonfinite)
        for unit, (src, views) in self._partial.items():  # an unsafe storage seen in parts: named by the views that see it
            stats = results.get(unit)
            if stats is not None and stats.unsafe:
                _, span, dtype = self._where[unit]
                numel = span.length // dtypes.get(dtype).itemsize
                seeing = [
                    n for n, v in views.items() if figures_of_runs(src.mm, dtype, stats.target, span.offset, runs_of([v], numel)).unsafe
                ]
                stats.name = ", ".join(seeing) or stats.name
        return results


def workers_for(plan: Plan, sources: Mapping[str, MappedCheckpoint], checks: ValueChecks | None) -> Workers:
    """The threads making pieces of ``plan``'s bytes from ``sources``, folding ``checks``: the one place a
    conversion sets its workers up."""
    by_path = {str(src.path): src for src in sources.values()}  # a writer's are by path already
    return Workers(
        clamp=plan.clamp,
        view=lambda path, offset, length: by_path[path].bytes_at(offset, length),
        checks=checks.every if checks is not None else {},
        claim=checks.claim if checks is not None else None,
    )


def check_values(
    plan: Plan,
    sources: dict[str, MappedCheckpoint],
    progress_for: Callable[[int], Progress] | None = None,
    *,
    meanwhile: Callable[[], object] | None = None,
) -> dict[str, ValueStats]:
    """Before anything is written, from the values' bits and without casting (see values.py): for every
    unit cast, NaN/Inf and overflow; for units bound for float16, underflow and subnormals too; for
    float32 units bound for float16 or bfloat16, the errors the cast will make; for the model's floating
    units written as they are, NaN/Inf (see ``ValueChecks``).

    Returns ``Plan.values`` (the caller derives the plan that holds them). Every unit to cast gets its
    ValueStats here; errors not measured here are measured as the cast is
    made, by the writer or by ``measure_errors``. ``meanwhile`` (loading torch for the cast) runs here while
    the threads start on the checks (``pieces.Workers``).
    ``progress_for`` is given the number of bytes to check (when there are any) and returns the progress callback.
    """
    checks = ValueChecks(plan, sources)
    jobs = checks.remaining()
    to_check = sum(job.length for job in jobs)
    progress = progress_for(to_check) if progress_for and to_check else None
    with workers_for(plan, sources, checks) as w:
        w.run(jobs, progress=progress, meanwhile=meanwhile)
    return checks.outcome()


def units_held(plan: Plan, sources: dict[str, MappedCheckpoint]) -> dict[str, tuple[MappedCheckpoint, str, Span, list[str]]]:
    """The model's floating units written as they are (``leave``, ``keep``): NaN/Inf in them still blocks."""
    cast = {unit_of(p.tensor) for p in plan.tensors if p.action == "cast"}
    units: dict[str, tuple[MappedCheckpoint, str, Span, list[str]]] = {}
    for p in plan.tensors:
        t = p.tensor
        unit = unit_of(t)
        if p.action not in ("leave", "keep") or t.region != "model" or is_training_state(t):
            continue
        if t.dtype not in dtypes.CASTABLE or t.layout != "strided" or unit in cast:
            continue
        if unit in units:
            units[unit][3].append(t.name)
            continue
        src = sources[t.file]
        units[unit] = (src, t.dtype, src.storage(t.storage) if t.storage is not None else src.storage(t.name), [t.name])
    return units


def measure_errors(plan: Plan, sources: dict[str, MappedCheckpoint]) -> None:
    """Make every planned cast whose errors the value checks did not measure from the bits (float64's), without
    writing it, folding its errors into ``plan.values`` (dry runs, ``scan --values``). Imports torch only then."""
    todo = [
        (unit, (stats, src, dtype, span, target))
        for unit, (src, dtype, span, _, target) in units_to_cast(plan, sources).items()
        if (stats := plan.values.get(unit)) is not None and not stats.errors_measured
    ]
    if not todo:
        return
    views = views_by_unit(plan)
    with one_thread():
        for unit, (stats, src, dtype, span, target) in todo:
            cast = TorchCaster(dtype, target, clamp=plan.clamp, stats=stats)
            itemsize = dtypes.get(dtype).itemsize
            for first, n in runs_of(list(views[unit].values()), span.length // itemsize):
                for x in chunks(src.mm, dtype, span.offset + first * itemsize, n, itemsize):
                    cast(x)


def units_to_cast(
    plan: Plan, sources: dict[str, MappedCheckpoint], *, weights_only: bool = False
) -> dict[str, tuple[MappedCheckpoint, str, Span, list[str], str]]:
    """The storage units the plan casts; ``weights_only`` leaves out training state (see ``is_training_state``)."""
    units: dict[str, tuple[MappedCheckpoint, str, Span, list[str], str]] = {}
    for p in plan.tensors:
        if p.action != "cast" or (weights_only and is_training_state(p.tensor)):
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


def blocking_values(values: Mapping[str, ValueStats], *, clamp: bool) -> dict[str, ValueStats]:
    """The units whose values block the conversion, cast or dequantized (``--clamp`` excuses overflow, not NaN/Inf
    or underflow): the one rule every path asks."""
    return {u: s for u, s in values.items() if s.unsafe and not (clamp and not s.nonfinite and not _underflow_blocks(s))}


def apply_value_policy(plan: Plan, *, keep_unsafe: bool) -> tuple[Plan, list[ValueStats]]:
    """The one verdict on values that block a cast: refused (the unsafe units returned: nothing is written, exit 1,
    ``--clamp`` offered for overflow), or, with --keep-unsafe, the plan derived with those units kept as they are."""
    unsafe = blocking_values(plan.values, clamp=plan.clamp)
    if not unsafe:
        return plan, []
    if not keep_unsafe:
        return plan, list(unsafe.values())
    kept = "unsafe values kept at full precision (--keep-unsafe)"
    tensors = [
        TensorPlan(p.tensor, p.tensor.dtype, "keep", kept) if p.action == "cast" and unit_of(p.tensor) in unsafe else p
        for p in plan.tensors
    ]
    notes = [*plan.notes, *(f"{s.name}: {'; '.join(s.problems())}; kept as it is (--keep-unsafe)" for s in unsafe.values())]
    values = {u: s for u, s in plan.values.items() if u not in unsafe}
    return replace(plan, tensors=tensors, notes=notes, values=values), []


def _underflow_blocks(s: ValueStats) -> bool:
    return s.underflow_fraction > UNDERFLOW_BLOCK_FRACTION


def _nonfinite_elsewhere(plan: Plan, sources: dict[str, MappedCheckpoint], checked: set[str]) -> dict[str, int]:
    """NaN/Inf counts for floating tensors that no cast check read (already float16, kept, left)."""
    out: dict[str, int] = {}
    seen = set(checked)
    views = views_by_unit(plan)
    for p in plan.tensors:
        t = p.tensor
        unit = unit_of(t)
        if unit in seen or t.dtype not in dtypes.CASTABLE or t.layout != "strided":
            continue
        seen.add(unit)
        src = sources[t.file]
        span = src.storage(t.storage) if t.storage is not None else src.storage(t.name)
        size, numel = dtypes.get(t.dtype).itemsize, span.length // dtypes.get(t.dtype).itemsize
        parts = views[unit] if viewed_runs(list(views[unit].values()), numel) is not None else {t.name: None}
        for name, view in parts.items():  # a storage seen in parts: each view's own NaN/Inf, under its name
            runs = runs_of([view], numel) if view is not None else [(0, numel)]
            bad = sum(count_nonfinite(src.mm, t.dtype, span.offset + first * size, n) for first, n in runs)
            if bad:
                out[name] = bad
    return out


WIDE = frozenset({"float32", "float64"})
"""The dtypes ``scan --values`` holds to float16's range: the ones a conversion to float16 narrows."""


def half_target(inv: Inventory) -> str:
    """The half precision a checkpoint is bound for: bfloat16 when its model tensors hold more bfloat16 than
    float16 bytes, else float16 (float32 checkpoints included: the narrower range is the one to know)."""
    held = {"float16": 0, "bfloat16": 0}
    for t in unique_tensors(inv.tensors):
        if t.region == "model" and t.dtype in held:
            held[t.dtype] += t.nbytes
    return "bfloat16" if held["bfloat16"] > held["float16"] else "float16"


def value_findings(inv: Inventory, *, include_optimizer: bool = False) -> list[Finding]:
    """Tensor values as findings (``scan --values``), judged against the target that matters.

    NaN/Inf in any floating tensor is an error. float32 and float64 tensors of a checkpoint bound for
    float16 (see ``half_target``) are held to float16's range: overflow (error), underflow (error above
    ``UNDERFLOW_BLOCK_FRACTION`` of the non-zero values, warning above ``UNDERFLOW_WARN_FRACTION``, else info; below
    the block share one message per band, which the report folds into one row), subnormals (info). float16 tensors already are what they
    are; bfloat16 keeps float32's exponent, so a bfloat16 checkpoint gets NaN/Inf only. Optimizer state,
    which ``convert`` leaves as it is, gets info findings unless ``include_optimizer``.
    """
    if not ((fmt := format_of(inv.format)) and fmt.casts):
        return []
    planned = make_plan(inv, "fp16", include_optimizer=True)
    to_fp16 = half_target(inv) == "float16"
    tensors = [
        p if p.action != "cast" or (to_fp16 and p.tensor.dtype in WIDE) else TensorPlan(p.tensor, p.tensor.dtype, "leave")
        for p in planned.tensors
    ]
    plan = replace(planned, tensors=tensors)
    by_name = inv.by_name()
    model_units = {unit_of(t) for t in inv.tensors if t.region == "model"}
    optimizer_units = {unit_of(t) for t in inv.tensors if t.region == "optimizer"} - model_units
    training_names = {t.name for t in inv.tensors if is_training_state(t)}
    out: list[Finding] = []

    def add(rule: str, severity: Severity, message: str, name: str, optimizer: bool) -> None:
        if name in training_names:
            severity = "info"
            message += "; training state (callbacks, loops, schedulers, scaler) that the model never reads"
        elif optimizer and not include_optimizer:
            severity = "info"
            message += "; optimizer state, which convert leaves as it is (scan --include-optimizer holds it to the same bar)"
        out.append(Finding(rule, severity, message, tensor=name))

    with ExitStack() as stack:
        sources = open_sources(Path(inv.path), inv, stack)
        # numpy measures float32's cast errors from the bits; only a float64 cast's need torch's own cast
        casts = any(not measures_errors(dtype, target) for _, dtype, _, _, target in units_to_cast(plan, sources).values())
        if casts:
            from ..extras import require

            require("torch", "dtypeaudit scan --values on float64 tensors")
        checked = check_values(plan, sources, meanwhile=load_torch if casts else None)
        plan = replace(plan, values=checked)
        if casts:
            measure_errors(plan, sources)
        read = set(checked) | set(units_held(plan, sources))
        for name, count in _nonfinite_elsewhere(plan, sources, read).items():
            add("non-finite", "error", f"{count} NaN/Inf values already present", name, by_name[name].region == "optimizer")
        for unit, stats in checked.items():
            first = stats.name.split(", ")[0]
            optimizer = unit in optimizer_units
            figures = f"max |x| {stats.max_abs:.4g}, max abs error {stats.max_abs_error:.3g}, max rel error {stats.max_rel_error:.3g}"
            if stats.nonfinite:
                add("non-finite", "error", f"{stats.nonfinite} NaN/Inf values already present", first, optimizer)
            if stats.target != "float16":
                continue
            if stats.overflow:
                message = f"{stats.overflow} of {stats.numel} values would become inf in float16 ({figures})"
                add("fp16-overflow", "error", message, first, optimizer)
            if stats.underflow and stats.underflow_fraction > UNDERFLOW_BLOCK_FRACTION:
                message = f"{stats.underflow} non-zero values ({stats.underflow_fraction:.2%}) would become 0 in float16 ({figures})"
                add("fp16-underflow", "error", message, first, optimizer)
            elif stats.underflow:
                # below the block share, one message per band, so that the report folds the tensors into one row
                warn = stats.underflow_fraction > UNDERFLOW_WARN_FRACTION
                band = f"more than {UNDERFLOW_WARN_FRACTION:.1%} (at most {UNDERFLOW_BLOCK_FRACTION:.0%})"
                band = band if warn else f"at most {UNDERFLOW_WARN_FRACTION:.1%}"
                message = f"{band} of the non-zero values are below 2^-24 and would become 0 in float16"
                add("fp16-underflow", "warning" if warn else "info", message, first, optimizer)
            if stats.subnormal and not stats.underflow:
                add("fp16-subnormal", "info", f"{stats.subnormal} values land in float16's subnormal range ({figures})", first, optimizer)
    return out
