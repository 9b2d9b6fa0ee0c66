"""From the operations a run recorded to findings and the per-module summary. No torch here: records only.

* ``runtime-dtype-error`` (error): an operation that fails with these dtypes, with PyTorch's message.
* ``implicit-promotion`` (warning): a half-precision tensor (or float32 against float64) meets a wider one in an
  operation that nobody asked to convert, so the result is silently wider.
* ``low-precision-reduction`` (warning): softmax, sums, means, norms, variances and losses computed and
  returned in float16 (overflow past 65504) or bfloat16 (8 bits of mantissa), which autocast would have upcast.
* ``autocast-fp32`` (info): an operation autocast ran in float32 by casting its half-precision inputs up.
* ``loss-dtype`` and ``grad-dtype`` with ``--backward``.
* ``unsupported-dtype`` (error) and ``emulated-dtype`` (warning) with a hardware target: a module whose operations
  compute in a dtype the target cannot compute, or only emulates (``targets.finding_for``), once per module and dtype.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from ..dtypes import DTYPES, is_floating
from ..inventory import Finding
from .result import LOSS, LOW_PRECISION, NOT_PROMOTION, ROOT, GradRecord, ModuleCall, ModuleSummary, OpRecord, unique

if TYPE_CHECKING:
    from ..hardware import Target

REDUCTIONS = frozenset(
    {
        "aten._softmax",
        "aten._log_softmax",
        "aten.softmax",
        "aten.log_softmax",
        "aten.sum",
        "aten.mean",
        "aten.nansum",
        "aten.nanmean",
        "aten.norm",
        "aten.linalg_vector_norm",
        "aten.var",
        "aten.var_mean",
        "aten.std",
        "aten.std_mean",
        "aten.logsumexp",
        "aten.cumsum",
        "aten.prod",
        "aten.nll_loss_forward",
        "aten.nll_loss2d_forward",
        "aten.mse_loss",
        "aten.l1_loss",
        "aten.smooth_l1_loss",
        "aten.huber_loss",
        "aten.binary_cross_entropy",
        "aten.binary_cross_entropy_with_logits",
        "aten.kl_div",
    }
)
"""Operations that add up many values: in float16 they overflow, in bfloat16 they lose precision."""


def where(module: str) -> str:
    """A module path as findings show it (``(root)`` for the model itself)."""
    return module if module != ROOT else "(root)"


def findings(
    ops: Sequence[OpRecord],
    *,
    grads: Sequence[GradRecord] = (),
    loss: str | None = None,
    loss_dtype: str | None = None,
    stopped: str | None = None,
    stopped_module: str | None = None,
    allow_promotion: Callable[[str], bool] | None = None,
    autocast: str | None = None,
) -> list[Finding]:
    out: list[Finding] = []
    out += runtime_errors(ops)
    if stopped is not None:
        out.append(
            Finding(
                "runtime-dtype-error",
                "error",
                f"the model's code raised: {stopped}; tracing stopped here, later operations were not traced",
                tensor=where(stopped_module or ROOT),
            )
        )
    out += implicit_promotions(ops, allow_promotion, autocast=autocast)
    out += low_precision_reductions(ops, synthetic_loss=loss in ("sum", "mean"))
    out += autocast_fp32(ops)
    if loss_dtype is not None:
        out.append(loss_finding(loss or "model", loss_dtype))
    out += grad_findings(grads)
    return out


def runtime_errors(ops: Iterable[OpRecord]) -> list[Finding]:
    seen: set[tuple[str, str, str, tuple[str, ...], str]] = set()
    out = []
    for o in ops:
        if o.error is None:
            continue
        key = (o.phase, o.module, o.name, o.inputs, o.error)
        if key in seen:
            continue
        seen.add(key)
        phase = " in backward" if o.phase == "backward" else ""
        went_on = f"; the trace went on with its inputs in {o.continued_as}" if o.continued_as else ""
        out.append(
            Finding(
                "runtime-dtype-error",
                "error",
                f"{o.name} fails{phase} with inputs ({', '.join(o.inputs)}): {o.error}{went_on}",
                tensor=where(o.module),
                actual=", ".join(o.floating_inputs) or None,
            )
        )
    return out


def implicit_promotions(
    ops: Iterable[OpRecord], allowed: Callable[[str], bool] | None = None, *, autocast: str | None = None
) -> list[Finding]:
    """Promotions nobody asked for. Under autocast, its own dtype meeting float32 is its design (half-precision matmul
    results join a float32 residual stream), so only other mixes count there."""
    seen: set[tuple[str, str, tuple[str, str]]] = set()
    out = []
    for o in ops:
        pair = o.promotion
        if pair is None or o.phase != "forward" or o.error is not None:
            continue
        if autocast is not None and pair[0] == autocast and pair[1] == "float32":
            continue
        if allowed is not None and allowed(o.module):
            continue
        key = (o.module, o.name, pair)
        if key in seen:
            continue
        seen.add(key)
        narrow, wide = pair
        out.append(
            Finding(
                "implicit-promotion",
                "warning",
                f"{o.name}: a {narrow} tensor meets a {wide} one and the result is {wide}; the {narrow} memory and speed are "
                f"lost from here on (cast the {wide} operand, or keep this module in {wide} on purpose)",
                tensor=where(o.module),
                expected=(narrow,),
                actual=wide,
            )
        )
    return out


def low_precision_reductions(ops: Iterable[OpRecord], *, synthetic_loss: bool = False) -> list[Finding]:
    seen: set[tuple[str, str, str]] = set()
    out = []
    for o in ops:
        if o.phase != "forward" or o.name not in REDUCTIONS or o.error is not None:
            continue
        if synthetic_loss and o.module == LOSS:
            continue
        low = [d for d in o.floating_inputs if d in LOW_PRECISION]
        if not low or not o.outputs or o.outputs[0] not in LOW_PRECISION:
            continue
        dtype = o.outputs[0]
        key = (o.module, o.name, dtype)
        if key in seen:
            continue
        seen.add(key)
        risk = (
            "float16 sums overflow past 65504 and its 10-bit mantissa drops small terms"
            if dtype == "float16"
            else "bfloat16 keeps 8 bits of mantissa, so a sum of many terms loses precision"
        )
        out.append(
            Finding(
                "low-precision-reduction",
                "warning",
                f"{o.name} reduces in {dtype}: {risk}; compute it in float32 (dtype=torch.float32, or .float() first)",
                tensor=where(o.module),
                actual=dtype,
            )
        )
    return out


def autocast_fp32(ops: Iterable[OpRecord]) -> list[Finding]:
    seen: set[tuple[str, str]] = set()
    out = []
    for o in ops:
        up = [src for src, dst in o.autocast_casts if dst in ("float32", "float64") and src in LOW_PRECISION]
        if not up:
            continue
        key = (o.module, o.name)
        if key in seen:
            continue
        seen.add(key)
        out.append(
            Finding(
                "autocast-fp32",
                "info",
                f"autocast runs {o.name} in {o.outputs[0] if o.outputs else 'float32'}, casting its {', '.join(unique(up))} inputs up",
                tensor=where(o.module),
            )
        )
    return out


def loss_finding(kind: str, dtype: str) -> Finding:
    how = "the model's own loss" if kind == "model" else f"--loss {kind} of the output"
    if dtype == "float16":
        return Finding(
            "loss-dtype",
            "warning",
            f"{how} is float16: its gradients underflow to zero without loss scaling (torch.amp.GradScaler); compute the loss in float32",
            tensor=LOSS,
            actual=dtype,
        )
    if dtype == "bfloat16":
        return Finding(
            "loss-dtype",
            "warning",
            f"{how} is bfloat16: 8 bits of mantissa; compute the loss in float32 (logits.float())",
            tensor=LOSS,
            actual=dtype,
        )
    return Finding("loss-dtype", "info", f"{how} is {dtype}", tensor=LOSS, actual=dtype)


def grad_findings(grads: Iterable[GradRecord]) -> list[Finding]:
    out = []
    for g in grads:
        if g.grad is None:
            out.append(
                Finding(
                    "grad-dtype",
                    "warning",
                    "gets no gradient from this loss (unused in the forward pass, or detached): an optimizer never updates it, "
                    "and DistributedDataParallel needs find_unused_parameters=True",
                    tensor=g.name,
                )
            )
        elif g.grad == "float16":
            out.append(
                Finding(
                    "grad-dtype",
                    "warning",
                    "gets float16 gradients: small ones underflow to zero and large ones overflow without loss scaling "
                    "(torch.amp.GradScaler), and an optimizer step in float16 loses small updates; keep float32 master weights",
                    tensor=g.name,
                    actual=g.grad,
                )
            )
        elif g.grad == "bfloat16":
            out.append(
                Finding(
                    "grad-dtype",
                    "info",
                    "gets bfloat16 gradients: updates smaller than 1/256 of a weight are lost unless the optimizer keeps "
                    "float32 master weights",
                    tensor=g.name,
                    actual=g.grad,
                )
            )
    return out


NO_ARITHMETIC = NOT_PROMOTION | {
    "aten.clone",
    "aten.lift_fresh",
    "aten.lift_fresh_copy",
    "aten.empty",
    "aten.empty_like",
    "aten.empty_strided",
    "aten.zeros",
    "aten.zeros_like",
    "aten.ones",
    "aten.ones_like",
    "aten.full",
    "aten.full_like",
    "aten.fill_",
    "aten.zero_",
    "aten.new_empty",
    "aten.new_empty_strided",
    "aten.new_zeros",
    "aten.new_ones",
    "aten.new_full",
    "aten.scalar_tensor",
    "aten.detach",
    "aten.set_",
}
"""Operations that convert, copy or fill memory but compute nothing in their result's dtype."""


def target_findings(ops: Iterable[OpRecord], target: Target, *, shown: int = 3) -> list[Finding]:
    """``unsupported-dtype`` / ``emulated-dtype`` at each module (forward and backward) whose operations compute in a
    dtype ``target`` does not compute natively: one finding per module and dtype, naming the first operations.

    An operation computes in the floating dtypes of its results. Views, conversions (``.to()``, autocast's casts),
    copies and fills compute nothing, and neither do operations that failed (those are ``runtime-dtype-error``).
    """
    from ..hardware import finding_for

    ops_at: dict[tuple[str, str], list[str]] = {}
    for o in ops:
        if o.error is not None or o.view or o.autocast_cast or o.name in NO_ARITHMETIC:
            continue
        for dtype in unique(d for d in o.outputs if is_floating(d)):
            names = ops_at.setdefault((o.module, dtype), [])
            if o.name not in names:
                names.append(o.name)
    out = []
    for (module, dtype), names in ops_at.items():
        f = finding_for(target, dtype, tensor=where(module))
        if f is None:
            continue
        more = f", and {len(names) - shown} more" if len(names) > shown else ""
        verb = "computes" if len(names) == 1 else "compute"
        out.append(replace(f, message=f"{', '.join(names[:shown])}{more} {verb} in {dtype} here: {f.message}"))
    return out


# -- the per-module summary ------------------------------------------------------------------------


def _ancestors(path: str) -> Iterable[str]:
    """``a.b.c`` -> ``a.b.c``, ``a.b``, ``a``, ``""``."""
    yield path
    while path:
        path = path.rpartition(".")[0]
        yield path


def summarize(
    ops: Sequence[OpRecord], calls: Sequence[ModuleCall], order: Sequence[str], types: dict[str, str]
) -> tuple[tuple[ModuleSummary, ...], tuple[tuple[str, int], ...], tuple[tuple[str, int], ...]]:
    """Per module (children included) and for the whole forward pass: dtypes in, computed, out; bytes made by dtype.

    Returns the module summaries, the activation bytes by dtype, and the bytes of autocast's casts by dtype (copies of
    weights and inputs, not activations: they are counted apart)."""
    called: dict[str, list[ModuleCall]] = defaultdict(list)
    for c in calls:
        called[c.module].append(c)
    compute: dict[str, list[str]] = defaultdict(list)
    made: dict[str, Counter[str]] = defaultdict(Counter)
    total: Counter[str] = Counter()
    copies: Counter[str] = Counter()
    for o in ops:
        if o.phase != "forward" or o.module.startswith("("):
            continue
        if o.autocast_cast:
            copies[o.outputs[0]] += o.nbytes
            continue
        dtype = o.outputs[0] if o.outputs else None
        floating = dtype is not None and is_floating(dtype) and o.nbytes > 0
        if o.nbytes and dtype is not None:
            total[dtype] += o.nbytes
        for path in _ancestors(o.module):
            if floating and dtype is not None and (not compute[path] or compute[path][-1] != dtype):
                compute[path].append(dtype)
            if o.nbytes and dtype is not None:
                made[path][dtype] += o.nbytes
    paths = [p for p in order if p in called] + [p for p in called if p not in order]
    summaries = []
    for p in paths:
        cs = called[p]
        summaries.append(
            ModuleSummary(
                module=p,
                type=types.get(p, cs[0].type),
                calls=len(cs),
                inputs=unique(d for c in cs for d in c.inputs),
                compute=unique(compute.get(p, ())),
                outputs=unique(d for c in cs for d in c.outputs),
                activation_bytes=tuple(sorted(made.get(p, Counter()).items(), key=lambda kv: (-kv[1], kv[0]))),
            )
        )
    return tuple(summaries), _largest_first(total), _largest_first(copies)


def _largest_first(counts: Counter[str]) -> tuple[tuple[str, int], ...]:
    return tuple(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def itemsize(dtype: str) -> int:
    d = DTYPES.get(dtype)
    return d.itemsize if d else 0
