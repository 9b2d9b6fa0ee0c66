"""Value statistics over tensors bound for a narrower float: what the cast would lose, before it happens.

Reads storages through mmap in chunks, so memory stays bounded by the chunk, not the checkpoint.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

CHUNK_BYTES = 1 << 20
"""For reductions: small enough that temporaries reuse heap memory instead of faulting in fresh pages."""
WRITE_CHUNK_BYTES = 8 << 20
"""For writing: fewer, larger writes; the only temporary is the cast chunk."""
UNDERFLOW_BLOCK_FRACTION = 0.01
"""A tensor blocks conversion when more than this share of its non-zero values would become zero."""


@dataclass
class ValueStats:
    """What casting one tensor (or storage) from ``source`` to ``target`` does to its values."""

    name: str
    source: str
    target: str
    numel: int = 0
    nonzero: int = 0
    nonfinite: int = 0
    """NaN or Inf already present."""
    overflow: int = 0
    """Finite values that become Inf."""
    underflow: int = 0
    """Non-zero values that become zero."""
    subnormal: int = 0
    """Values that land in the target's subnormal range (precision loss)."""
    max_abs: float = 0.0
    max_abs_error: float = 0.0
    max_rel_error: float = 0.0
    findings: list[str] = field(default_factory=list)

    @property
    def underflow_fraction(self) -> float:
        return self.underflow / self.nonzero if self.nonzero else 0.0

    @property
    def unsafe(self) -> bool:
        """Conversion would lose this tensor: overflow, NaN/Inf, or a real share of values flushed to zero."""
        return bool(self.overflow or self.nonfinite or self.underflow_fraction > UNDERFLOW_BLOCK_FRACTION)

    def problems(self) -> list[str]:
        out = []
        if self.nonfinite:
            out.append(f"{self.nonfinite} NaN/Inf already present")
        if self.overflow:
            out.append(f"{self.overflow} values beyond ±{_max(self.target):g} would become inf (max |x| {self.max_abs:.4g})")
        if self.underflow:
            out.append(
                f"{self.underflow} non-zero values below {_tiny(self.target):.3g} would become 0"
                f" ({self.underflow_fraction:.2%} of non-zero)"
            )
        if self.subnormal:
            out.append(f"{self.subnormal} values fall in the subnormal range")
        return out


@functools.cache
def _max(target: str) -> float:
    import torch

    return float(torch.finfo(getattr(torch, target)).max)


@functools.cache
def _smallest_normal(target: str) -> float:
    import torch

    return float(torch.finfo(getattr(torch, target)).smallest_normal)


def _tiny(target: str) -> float:
    import torch

    return float(torch.finfo(getattr(torch, target)).smallest_normal) * float(torch.finfo(getattr(torch, target)).eps)


def frombuffer(buffer: Any, dtype: str, count: int, offset: int) -> Any:
    """A read-only tensor over ``buffer`` (an mmap); torch warns that it is not writable, and we never write."""
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buffer, dtype=getattr(torch, dtype), count=count, offset=offset)


def chunks(buffer: Any, dtype: str, offset: int, numel: int, itemsize: int, chunk_bytes: int = CHUNK_BYTES) -> Iterator[Any]:
    """Tensors over consecutive pieces of ``numel`` elements at ``offset`` in ``buffer``."""
    step = max(1, chunk_bytes // itemsize)
    for start in range(0, numel, step):
        count = min(step, numel - start)
        yield frombuffer(buffer, dtype, count, offset + start * itemsize)


def cast_chunk(x: Any, target: str, *, clamp: bool) -> Any:
    import torch

    t = getattr(torch, target)
    if clamp and torch.finfo(t).max < torch.finfo(x.dtype).max:
        limit = float(torch.finfo(t).max)
        x = x.clamp(-limit, limit)
    return x.to(t)


def update(stats: ValueStats, x: Any, *, clamp: bool = False) -> Any:
    """Fold one chunk into the range statistics (NaN/Inf, overflow, underflow, subnormals); returns the cast chunk.

    Cheap on purpose: reductions that allocate nothing chunk-sized, and masks only on the rare paths
    (a chunk that overflows or holds NaN/Inf).
    """
    import torch

    y = cast_chunk(x, stats.target, clamp=clamp)
    n = x.numel()
    if not n:
        return y
    stats.numel += n
    low, high = torch.aminmax(x)
    peak = max(abs(float(low)), abs(float(high)))
    if not math.isfinite(peak):
        finite = torch.isfinite(x)
        stats.nonfinite += n - int(finite.sum())
        peak = float(x[finite].abs().max()) if bool(finite.any()) else 0.0
    stats.max_abs = max(stats.max_abs, peak)
    if peak > _max(stats.target) and not clamp:
        stats.overflow += int((torch.isinf(y) & torch.isfinite(x)).sum())
    nonzero_x = int(torch.count_nonzero(x))
    nonzero_y = int(torch.count_nonzero(y))
    stats.nonzero += nonzero_x
    stats.underflow += nonzero_x - nonzero_y
    stats.subnormal += int(torch.count_nonzero(y.abs() < _smallest_normal(stats.target))) - (n - nonzero_y)
    return y


def errors(stats: ValueStats, x: Any, y: Any) -> None:
    """Fold the cast's max absolute and relative error for one chunk (x the source, y its cast)."""
    import torch

    if not x.numel():
        return
    diff = y.to(x.dtype).sub_(x).abs_()
    worst = float(diff.max())
    if not math.isfinite(worst):  # NaN/Inf in the source (clamped or kept): measure the finite values only
        diff = torch.where(torch.isfinite(diff), diff, torch.zeros((), dtype=diff.dtype))
        worst = float(diff.max())
    stats.max_abs_error = max(stats.max_abs_error, worst)
    rel = diff.div_(x.abs().clamp_min_(float(torch.finfo(x.dtype).tiny)))
    stats.max_rel_error = max(stats.max_rel_error, float(rel.max()))
