"""How far a model's outputs in the target dtype are from its fp32 outputs: one number, lower is better.

Each metric takes the floating outputs of both runs (flattened from tensors, tuples, lists and dicts, in the same
order) and returns an error; a run whose outputs are not finite has an infinite error.

- ``max-abs-rel`` (the default): the largest absolute difference over all floating outputs, divided by the
  largest absolute fp32 output. Scale-free, and strict: one far-off element fails it.
- ``cosine``: one minus the cosine similarity of all outputs taken as one vector.
- ``sqnr``: the noise-to-signal power ratio, ``sum((out - ref)^2) / sum(ref^2)``, i.e. ``10^(-SQNR/10)``:
  a tolerance of 1e-4 asks for 40 dB.
- ``file.py:func`` or ``module:func``: the user's ``func(out, ref) -> float``, called with the two runs' outputs
  as the model returned them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..errors import UsageError

if TYPE_CHECKING:
    import torch

Metric = Callable[[Any, Any], float]
NAMES = ("max-abs-rel", "cosine", "sqnr")


def floating_leaves(value: Any) -> list[torch.Tensor]:
    """The floating tensors in ``value`` (a tensor, or tuples, lists and dicts of them), in order."""
    import torch

    if isinstance(value, torch.Tensor):
        return [value] if value.is_floating_point() else []
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in floating_leaves(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in floating_leaves(v)]
    return []


def _pairs(out: Any, ref: Any) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    a, b = floating_leaves(out), floating_leaves(ref)
    if len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b, strict=True)):
        return None
    return [(x.detach().float(), y.detach().float()) for x, y in zip(a, b, strict=True)]


def _comparable(out: Any, ref: Any) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """The output pairs as float32, or None where they cannot be compared or ``out`` is not finite (an inf error)."""
    import torch

    pairs = _pairs(out, ref)
    if pairs is None or not all(bool(torch.isfinite(x).all()) for x, _ in pairs):
        return None
    return pairs


def max_abs_rel(out: Any, ref: Any) -> float:
    pairs = _comparable(out, ref)
    if pairs is None:
        return math.inf
    if not pairs:
        return 0.0
    diff = max(float((x - y).abs().max()) if x.numel() else 0.0 for x, y in pairs)
    scale = max(float(y.abs().max()) if y.numel() else 0.0 for _, y in pairs)
    return diff / scale if scale > 0 else diff


def cosine(out: Any, ref: Any) -> float:
    import torch

    pairs = _comparable(out, ref)
    if pairs is None:
        return math.inf
    if not pairs:
        return 0.0
    x = torch.cat([a.flatten().double() for a, _ in pairs])
    y = torch.cat([b.flatten().double() for _, b in pairs])
    norm = float(x.norm() * y.norm())
    if norm == 0:
        return 0.0 if float(x.norm()) == float(y.norm()) else 1.0
    return max(0.0, 1.0 - float(x @ y) / norm)


def sqnr(out: Any, ref: Any) -> float:
    pairs = _comparable(out, ref)
    if pairs is None:
        return math.inf
    noise = sum(float(((x.double() - y.double()) ** 2).sum()) for x, y in pairs)
    signal = sum(float((y.double() ** 2).sum()) for _, y in pairs)
    return noise / signal if signal > 0 else noise


BUILTIN: dict[str, Metric] = {"max-abs-rel": max_abs_rel, "cosine": cosine, "sqnr": sqnr}


def resolve(spec: str | Metric) -> tuple[str, Metric]:
    """A metric's name and function: a built-in name, ``file.py:func`` / ``module:func``, or a callable."""
    if callable(spec):
        return getattr(spec, "__name__", "custom"), spec
    if spec in BUILTIN:
        return spec, BUILTIN[spec]
    if ":" not in spec:
        raise UsageError(f"--metric '{spec}': expected one of {', '.join(NAMES)}, or path/to/file.py:func")
    from .user import user_callable

    user: Metric = user_callable(spec, "--metric")

    def guarded(out: Any, ref: Any) -> float:
        value = float(user(out, ref))
        return value if not math.isnan(value) else math.inf

    return spec, guarded
