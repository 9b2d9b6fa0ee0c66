"""The tune itself: real fp32 and low-precision runs on the CPU, module statistics and shadow errors, the keep-set
search and the verifying run.

Memory: the model's fp32 weights and one copy in the target dtype, no more. The low copy is made tensor by tensor
(``copy.deepcopy`` given each cast tensor in advance), and a kept module's tensors in it are the fp32 model's own,
shared, not copied. Hooks record statistics (abs max and min, call counts, errors), never activations; the only
activations kept are the model's fp32 outputs, the reference.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from .. import dtypes
from ..errors import UsageError
from . import metrics
from .keep import cast_floating, hold_in_fp32, outermost
from .result import MAX_FINITE, ModuleStats, TuneResult

if TYPE_CHECKING:
    import torch

TARGETS = ("float16", "bfloat16")
DEFAULT_TOLERANCE = {"float16": 1e-2, "bfloat16": 4e-2}
PRUNE_LIMIT = 16  # members tried one by one for removal; a larger set keeps what the bisection found
Progress = Callable[[str], None]


def split_inputs(inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A model's call arguments from a tensor, a tuple or list (positional), a dict (keywords) or ``(args, kwargs)``."""
    if isinstance(inputs, dict):
        return (), dict(inputs)
    if isinstance(inputs, tuple) and len(inputs) == 2 and isinstance(inputs[0], (tuple, list)) and isinstance(inputs[1], dict):
        return tuple(inputs[0]), dict(inputs[1])
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    return (inputs,), {}


@dataclass
class _Stats:
    calls: int = 0
    input_abs_max: float = 0.0
    output_abs_max: float = 0.0
    output_abs_min: float = math.inf
    shadow_error: float = 0.0


def _abs_range(value: Any) -> tuple[float, float]:
    """The largest finite absolute value and the smallest non-zero one over ``value``'s floating tensors."""
    import torch

    top, bottom = 0.0, math.inf
    for t in metrics.floating_leaves(value):
        x = t.detach().abs()
        x = x[torch.isfinite(x)]
        if x.numel():
            top = max(top, float(x.max()))
            nonzero = x[x > 0]
            if nonzero.numel():
                bottom = min(bottom, float(nonzero.min()))
    return top, bottom


def _non_finite(value: Any) -> bool:
    import torch

    return any(not bool(torch.isfinite(t).all()) for t in metrics.floating_leaves(value))


def low_copy(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """``model`` with every floating parameter and buffer in ``dtype``, made without a second fp32 copy."""
    import copy

    import torch

    memo: dict[int, Any] = {}
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) in memo:
            continue
        if t.is_floating_point():
            cast = t.detach().to(dtype)
            memo[id(t)] = torch.nn.Parameter(cast, requires_grad=False) if isinstance(t, torch.nn.Parameter) else cast
        else:
            memo[id(t)] = t  # integer buffers are shared: nothing writes them in eval mode
    return copy.deepcopy(model, memo)


@dataclass
class _LowModel:
    """The low-precision copy, with a keep set applied as ``keep.hold_in_fp32`` defines it."""

    fp32: torch.nn.Module
    low: torch.nn.Module
    dtype: torch.dtype
    kept: dict[str, list[Any]] = field(default_factory=dict)

    def set_keep(self, names: Iterable[str]) -> None:
        wanted = set(outermost(names))
        for name in [n for n in self.kept if n not in wanted]:
            for handle in self.kept.pop(name):
                handle.remove()
            self._tensors(name, fp32=False)
        for name in wanted - set(self.kept):
            self._tensors(name, fp32=True)
            self.kept[name] = hold_in_fp32(self.low.get_submodule(name), self.dtype)

    def _tensors(self, name: str, *, fp32: bool) -> None:
        """A module's floating tensors in the low copy: the fp32 model's own (shared), or cast anew."""
        source, dest = self.fp32.get_submodule(name), self.low.get_submodule(name)
        for (_, a), (_, b) in zip(source.named_modules(), dest.named_modules(), strict=True):
            for table in ("_parameters", "_buffers"):
                for key, t in getattr(a, table).items():
                    held = getattr(b, table).get(key)
                    if t is not None and held is not None and t.is_floating_point():
                        held.data = t.data if fp32 else t.data.to(self.dtype)

    def run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return self.low(*cast_floating(args, self.dtype), **cast_floating(kwargs, self.dtype))


def tune(
    model: torch.nn.Module,
    inputs: Any,
    to: str = "float16",
    tolerance: float | None = None,
    metric: str | metrics.Metric = "max-abs-rel",
    progress: Progress | None = None,
    notes: Sequence[str] = (),
) -> TuneResult:
    """Which modules of ``model`` must run in fp32 for its outputs on ``inputs`` to stay within ``tolerance`` of
    fp32 when the rest runs in ``to`` (``fp16`` or ``bf16``). ``model`` is used as it is (fp32, eval mode) and is
    not changed; ``inputs`` are a tensor, a tuple, a dict or ``(args, kwargs)``. ``progress`` is told each step;
    ``notes`` (what the caller knows about the inputs) travel into the result."""
    import torch

    target = dtypes.canonical(to) if isinstance(to, str) else None
    if target not in TARGETS:
        raise UsageError(f"--to must be fp16 or bf16 (float16, bfloat16), not {to!r}")
    tol = DEFAULT_TOLERANCE[target] if tolerance is None else float(tolerance)
    if not tol >= 0:
        raise UsageError(f"--tolerance must be a number >= 0, not {tolerance!r}")
    metric_name, measure = metrics.resolve(metric)
    shadow_measure = metrics.BUILTIN.get(metric_name, metrics.max_abs_rel)
    say = progress or (lambda _text: None)
    low_dtype = getattr(torch, target)
    args, kwargs = split_inputs(inputs)
    args, kwargs = cast_floating(args, torch.float32), cast_floating(kwargs, torch.float32)
    was_training = model.training
    model.eval()
    config: Any = getattr(model, "config", None)
    use_cache = getattr(config, "use_cache", None)
    if use_cache:
        config.use_cache = False  # a cache object would be written by both runs of a shadowed attention
    try:
        with torch.no_grad():
            result = _tune(model, args, kwargs, target, low_dtype, tol, metric_name, measure, shadow_measure, say)
            return replace(result, notes=(*notes, *result.notes))
    finally:
        model.train(was_training)
        if use_cache:
            config.use_cache = use_cache


def _tune(
    model: torch.nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    target: str,
    low_dtype: torch.dtype,
    tol: float,
    metric_name: str,
    measure: metrics.Metric,
    shadow_measure: metrics.Metric,
    say: Progress,
) -> TuneResult:
    say(f"copying the weights to {target}")
    low = low_copy(model, low_dtype).eval()
    say("running in float32, each module shadowed in " + target)
    stats, reference = _reference_run(model, low, low_dtype, args, kwargs, shadow_measure)
    passes = 1
    runner = _LowModel(model, low, low_dtype)
    say(f"running in {target}")
    first, all_low_error = _all_low_run(runner, args, kwargs, reference, measure)
    passes += 1
    notes: list[str] = []
    stats[""].shadow_error = all_low_error
    limit = MAX_FINITE[target]
    modules = tuple(
        ModuleStats(
            name=n,
            type=type(m).__name__,
            calls=stats[n].calls,
            input_abs_max=stats[n].input_abs_max,
            output_abs_max=stats[n].output_abs_max,
            output_abs_min=stats[n].output_abs_min,
            headroom=limit / stats[n].output_abs_max if stats[n].output_abs_max > 0 else math.inf,
            shadow_error=stats[n].shadow_error,
        )
        for n, m in model.named_modules()
    )

    # 3. The keep set: rank, grow until a set passes, bisect the last step, prune what is not needed.
    tried: dict[frozenset[str], float] = {frozenset(): all_low_error}

    def attempt(names: list[str]) -> float:
        nonlocal passes
        key = frozenset(outermost(names))
        if key not in tried:
            runner.set_keep(key)
            tried[key] = _error(runner, args, kwargs, reference, measure)
            passes += 1
            say(f"try {len(tried) - 1}: {len(key)} module(s) in fp32, error {tried[key]:.3g}")
        return tried[key]

    ranked, unkeepable = rank(modules, tol, limit)
    notes += unkeepable
    keep: list[str] = []
    error = all_low_error
    if all_low_error > tol:
        keep, error = _search(ranked, tol, attempt, {m.name: m for m in modules})
    passed = error <= tol
    order = {m.name: i for i, m in enumerate(modules)}
    keep = sorted(outermost(keep), key=order.__getitem__)
    if keep:  # 4. The verifying run: the keep set applied afresh.
        runner.set_keep([])
        runner.set_keep(keep)
        say(f"verifying {len(keep)} module(s) in fp32")
        error = _error(runner, args, kwargs, reference, measure)
        passes += 1
        passed = error <= tol
    failing = () if passed else tuple(m.name for m in sorted(modules, key=lambda m: -m.shadow_error) if m.name and m.shadow_error > tol)
    runner.set_keep([])
    return TuneResult(
        to=target,
        tolerance=tol,
        metric=metric_name,
        modules=modules,
        first_overflow=first,
        keep=tuple(keep),
        output_error=error,
        all_low_error=all_low_error,
        forward_passes=passes,
        passed=passed,
        failing=failing,
        notes=tuple(notes),
    )


def _reference_run(
    model: torch.nn.Module,
    low: torch.nn.Module,
    low_dtype: torch.dtype,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    shadow_measure: metrics.Metric,
) -> tuple[dict[str, _Stats], Any]:
    """The fp32 run: every module's range, and its shadow (its fp32 inputs through its low copy); and the outputs."""
    low_modules = dict(low.named_modules())
    stats = {name: _Stats() for name, _ in model.named_modules()}

    def observe(name: str) -> Callable[..., None]:
        def hook(_module: Any, a: tuple[Any, ...], kw: dict[str, Any], output: Any) -> None:
            s = stats[name]
            s.calls += 1
            s.input_abs_max = max(s.input_abs_max, _abs_range((a, kw))[0])
            top, bottom = _abs_range(output)
            s.output_abs_max, s.output_abs_min = max(s.output_abs_max, top), min(s.output_abs_min, bottom)
            if name:  # the model's own shadow is the all-low run
                try:
                    shadow = low_modules[name](*cast_floating(a, low_dtype), **cast_floating(kw, low_dtype))
                    error = shadow_measure(shadow, output)
                except Exception:  # an op without a kernel in the target dtype: it cannot run there
                    error = math.inf
                s.shadow_error = max(s.shadow_error, error)

        return hook

    handles = [m.register_forward_hook(observe(n), with_kwargs=True) for n, m in model.named_modules()]
    try:
        reference = model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    if _non_finite(reference):
        raise UsageError("the model's fp32 outputs are not finite on these inputs: there is nothing to compare with")
    return stats, reference


def _all_low_run(
    runner: _LowModel, args: tuple[Any, ...], kwargs: dict[str, Any], reference: Any, measure: metrics.Metric
) -> tuple[str | None, float]:
    """The whole model in the target dtype: the first module to finish with finite floating inputs and a non-finite
    output (children finish before their parents, so it is the innermost), and the model's error."""
    first: list[str] = []

    def watch(name: str) -> Callable[..., None]:
        def hook(_module: Any, a: tuple[Any, ...], kw: dict[str, Any], output: Any) -> None:
            if not first and not _non_finite((a, kw)) and _non_finite(output):
                first.append(name)

        return hook

    handles = [m.register_forward_hook(watch(n), with_kwargs=True) for n, m in runner.low.named_modules()]
    try:
        error = _error(runner, args, kwargs, reference, measure)
    finally:
        for h in handles:
            h.remove()
    return (first[0] if first else None), error


def _error(runner: _LowModel, args: tuple[Any, ...], kwargs: dict[str, Any], reference: Any, measure: metrics.Metric) -> float:
    try:
        out = runner.run(args, kwargs)
    except Exception:  # a dtype the low model's code cannot mix: this keep set does not run
        return math.inf
    return measure(out, reference)


def keepable(name: str, by_name: dict[str, ModuleStats]) -> str | None:
    """The smallest module that holds ``name`` (itself first), is called, and whose output fits the target dtype;
    None where only the model itself would (it is never kept: that would be the fp32 model)."""
    while name:
        m = by_name.get(name)
        if m is not None and m.calls and m.fits:
            return name
        name = name.rpartition(".")[0]
    return None


def _bucket(error: float) -> float:
    if math.isinf(error) or math.isnan(error):
        return math.inf
    return math.floor(math.log2(error)) if error > 0 else -math.inf


def rank(modules: Iterable[ModuleStats], tolerance: float, limit: float) -> tuple[list[str], list[str]]:
    """The modules worth keeping, most needed first, and notes on culprits nothing can keep.

    Each called module with an error or an output that does not fit is mapped to ``keepable`` (its smallest enclosing
    module whose output fits); a module whose fp32 input already does not fit is a victim of its producer and is not
    a culprit. Ranked by shadow error in factors of two (overflow first), then innermost first, then least headroom.
    """
    modules = list(modules)
    by_name = {m.name: m for m in modules}
    score: dict[str, tuple[float, float]] = {}
    notes = []
    for m in modules:
        if not m.name or not m.calls:
            continue
        if m.input_abs_max >= limit:
            continue
        error = m.shadow_error if m.fits else math.inf
        if error <= 0:
            continue
        home = keepable(m.name, by_name)
        if home is None:
            if error > tolerance:
                notes.append(f"{m.name} ({m.type}) has error {error:.3g}, and no module that holds it has an output that fits")
            continue
        held = score.get(home, (-math.inf, math.inf))
        score[home] = (max(held[0], error), min(held[1], by_name[home].headroom))
    ranked = sorted(score, key=lambda n: (-_bucket(score[n][0]), -n.count("."), score[n][1], n))
    return ranked, notes


def _search(
    ranked: list[str], tol: float, attempt: Callable[[list[str]], float], by_name: dict[str, ModuleStats]
) -> tuple[list[str], float]:
    """Grow a prefix of the ranking in doubling steps until it passes, bisect the last step for the shortest passing
    prefix, then drop each member (not overflowing on its own) whose removal still passes."""
    if not ranked:
        return [], math.inf
    failed, size = 0, 1
    while True:
        size = min(size, len(ranked))
        error = attempt(ranked[:size])
        if error <= tol:
            break
        if size == len(ranked):
            return outermost(ranked), error
        failed, size = size, size * 2
    lo, hi = failed, size  # the prefix of lo fails, the prefix of hi passes
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if attempt(ranked[:mid]) <= tol:
            hi = mid
        else:
            lo = mid
    keep = outermost(ranked[:hi])
    error = attempt(keep)
    if len(keep) <= PRUNE_LIMIT:
        for name in list(keep[:-1]):  # the last member is the one the bisection found needed
            if math.isinf(by_name[name].shadow_error) or not by_name[name].fits:
                continue  # an overflow left in half precision fails the run; no pass is spent to learn it
            trial = [n for n in keep if n != name]
            e = attempt(trial)
            if e <= tol:
                keep, error = trial, e
    return keep, error
