"""Value statistics over tensors bound for a narrower float: what the cast would lose, before it happens.

Reads storages through mmap in chunks, so memory stays bounded by the chunk, not the checkpoint.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

CHUNK_BYTES = 16 << 20
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
            out.append(f"{self.underflow} non-zero values below {_tiny(self.target):.3g} would become 0 ({self.underflow_fraction:.2%} of non-zero)")
        if self.subnormal:
            out.append(f"{self.subnormal} values fall in the subnormal range")
        return out


def _max(target: str) -> float:
    import torch

    return float(torch.finfo(getattr(torch, target)).max)


def _tiny(target: str) -> float:
    import torch

    return float(torch.finfo(getattr(torch, target)).smallest_normal) * float(torch.finfo(getattr(torch, target)).eps)


def frombuffer(buffer: Any, dtype: str, count: int, offset: int) -> Any:
    """A read-only tensor over ``buffer`` (an mmap); torch warns that it is not writable, and we never write."""
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buffer, dtype=getattr(torch, dtype), count=count, offset=offset)


def chunks(buffer: Any, dtype: str, offset: int, numel: int, itemsize: int) -> Iterator[Any]:
    """Tensors over consecutive pieces of ``numel`` elements at ``offset`` in ``buffer``."""
    step = max(1, CHUNK_BYTES // itemsize)
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
    """Fold one chunk into ``stats``; returns the cast chunk."""
    import torch

    y = cast_chunk(x, stats.target, clamp=clamp)
    xf = x.to(torch.float64) if x.dtype != torch.float64 else x
    finite = torch.isfinite(xf)
    stats.numel += x.numel()
    stats.nonfinite += int((~finite).sum())
    nonzero = xf != 0
    stats.nonzero += int(nonzero.sum())
    yf = y.to(torch.float64)
    stats.overflow += int((torch.isinf(yf) & finite).sum())
    stats.underflow += int(((yf == 0) & nonzero & finite).sum())
    tiny_normal = float(torch.finfo(y.dtype).smallest_normal)
    stats.subnormal += int(((yf != 0) & (yf.abs() < tiny_normal)).sum())
    ok = finite & torch.isfinite(yf)
    if bool(ok.any()):
        xs, ys = xf[ok], yf[ok]
        stats.max_abs = max(stats.max_abs, float(xs.abs().max()))
        err = (ys - xs).abs()
        stats.max_abs_error = max(stats.max_abs_error, float(err.max()))
        nz = xs != 0
        if bool(nz.any()):
            stats.max_rel_error = max(stats.max_rel_error, float((err[nz] / xs[nz].abs()).max()))
    return y
