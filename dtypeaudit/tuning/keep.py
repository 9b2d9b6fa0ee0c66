"""What "kept in fp32" means at run time, the one definition that ``tune``, ``apply`` and a written policy share:

a kept module's parameters and buffers are float32, its floating inputs are cast to float32 on entry and its
floating outputs are cast back to the target dtype on exit; every other module runs in the target dtype. The casts
are forward hooks on the kept module, so the module itself is not replaced (its class, name and state dict stay).
A kept module inside another kept one is covered by it (its own exit cast would bring half precision back into
the fp32 module), so a keep set is reduced to its outermost members first.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from ..policy import Policy


def cast_floating(value: Any, dtype: torch.dtype) -> Any:
    """``value`` with every floating tensor in it (inside tuples, lists and dicts too) cast to ``dtype``."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
    if isinstance(value, tuple):
        items = [cast_floating(v, dtype) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, list):
        return [cast_floating(v, dtype) for v in value]
    if isinstance(value, dict):
        cast = {k: cast_floating(v, dtype) for k, v in value.items()}
        try:
            return type(value)(**cast) if type(value) is not dict else cast  # a ModelOutput keeps its class
        except TypeError:
            return cast
    return value


def outermost(names: Iterable[str]) -> list[str]:
    """The names none of the others contains (``a.b`` is inside ``a``), in their first order."""
    chosen = list(dict.fromkeys(names))
    return [n for n in chosen if not any(o != n and (o == "" or n.startswith(o + ".")) for o in chosen)]


def hold_in_fp32(module: torch.nn.Module, to: torch.dtype) -> list[Any]:
    """Hook ``module`` to cast its floating inputs to fp32 on entry and its floating outputs to ``to`` on exit; the
    hooks' handles (``.remove()`` undoes them). Its parameters are the caller's to set."""
    import torch

    def enter(_module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        return cast_floating(args, torch.float32), cast_floating(kwargs, torch.float32)

    def leave(_module: Any, _args: Any, output: Any) -> Any:
        return cast_floating(output, to)

    return [module.register_forward_pre_hook(enter, with_kwargs=True), module.register_forward_hook(leave)]


def apply(model: torch.nn.Module, policy: Policy | str, to: str | None = None) -> torch.nn.Module:
    """Make the live ``model`` follow ``policy`` (a ``Policy``, a file or a preset name) and return it.

    Each floating parameter and buffer takes the dtype the policy gives it (``to`` where the policy allows it, else
    the one it expects, float32 first); the policy's ``keep_in_fp32`` modules are float32 and hooked to cast at their
    boundary (see the module's docstring). ``to`` defaults to the policy's ``default`` dtype when it names one.
    """
    import torch

    from .. import dtypes
    from ..errors import UsageError
    from ..inventory import TensorRecord
    from ..policy import decide, load_policy

    chosen = load_policy(policy) if isinstance(policy, str) else policy
    target = dtypes.canonical(to) if to else _policy_dtype(chosen)
    if target not in ("float16", "bfloat16", "float32"):
        raise UsageError(f"apply: to must be float16, bfloat16 or float32 (or a policy whose default names one), not {to!r}")
    low = getattr(torch, target)
    names = [n for n, _ in model.named_modules()]
    kept = outermost(n for n in names if n and chosen.kept_in_fp32(n))
    owners = dict(model.named_modules())
    preference = ("float32", "bfloat16", "float16", "float64")
    for module_name, module in owners.items():
        for kind, table in (("parameter", module._parameters), ("buffer", module._buffers)):
            for leaf, t in table.items():
                if t is None or not t.is_floating_point():
                    continue
                name = f"{module_name}.{leaf}" if module_name else leaf
                record = TensorRecord(name, target, tuple(t.shape), 0, kind=kind, module=type(module).__name__)  # type: ignore[arg-type]
                d = decide(chosen, record)
                want = target if d.ok else next((p for p in preference if d.expected and p in d.expected), target)
                if t.dtype != getattr(torch, want):
                    t.data = t.data.to(getattr(torch, want))
    for name in kept:
        hold_in_fp32(owners[name], low)
    return model


def _policy_dtype(policy: Policy) -> str | None:
    default = policy.default
    if default is not None and len(default) == 1:
        return next(iter(default))
    return None
