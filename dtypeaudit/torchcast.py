"""torch's cast, a chunk at a time: the one place conversion loads torch to make the bytes it writes, for the
casts whose errors are measured as they are made (float64, bfloat16 and float16 sources) and views that must be
gathered; float32 to float16/bfloat16 is npcast's (its errors measured before writing by values.py). Verification
recasts its samples with a second implementation, not torch (conversion/verify.py ``reference_cast``).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from .values import CHUNK_BYTES, ValueStats


def load_torch() -> None:
    """Import torch, which makes every cast: about a second, worth overlapping with other work."""
    import torch  # noqa: F401


@contextmanager
def one_thread() -> Iterator[None]:
    """torch's casts and comparisons on one thread while the body runs; the caller's setting comes back after.

    A cast is memory-bound: a second intra-op thread gains little on an idle machine, and on a busy
    one (cores shared with other processes, or with our own writer and fsync threads) OpenMP's
    threads wait on each other: measured on 2 shared cores, float32 -> float16 of 1 MiB chunks took
    3.4 s/GB with 2 threads against 0.08 s/GB with one.
    """
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def frombuffer(buffer: Any, dtype: str, count: int, offset: int) -> Any:
    """A read-only tensor over ``buffer`` (an mmap); torch warns that it is not writable, and we never write."""
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buffer, dtype=getattr(torch, dtype), count=count, offset=offset)


def chunks(buffer: Any, dtype: str, offset: int, numel: int, itemsize: int, chunk_bytes: int = CHUNK_BYTES) -> Iterator[Any]:
    """Tensors over consecutive pieces of ``numel`` elements at ``offset`` in ``buffer``."""
    if numel:
        yield from frombuffer(buffer, dtype, numel, offset).split(max(1, chunk_bytes // itemsize))


class TorchCaster:
    """torch's cast from ``source`` to ``target`` a chunk at a time, into reused buffers, measuring its errors.

    The returned chunk is only valid until the next call: the caller hands its bytes on at once.
    """

    def __init__(self, source: str, target: str, *, clamp: bool, stats: ValueStats | None = None) -> None:
        import torch

        self._torch = torch
        src, dst = getattr(torch, source), getattr(torch, target)
        step = max(1, CHUNK_BYTES // src.itemsize)
        self._out = torch.empty(step, dtype=dst)
        self._diff = torch.empty(step, dtype=src)
        self._scale = torch.empty(step, dtype=src)
        self._limit = float(torch.finfo(dst).max) if clamp and torch.finfo(dst).max < torch.finfo(src).max else None
        # Clamped in the source's dtype, as torch.clamp, except bfloat16: it cannot hold float16's 65504 (it
        # rounds to 65536, which the cast makes inf), so it is clamped widened to float32, as npcast clamps.
        self._clamped = torch.empty(step if self._limit is not None else 0, dtype=torch.float32 if src == torch.bfloat16 else src)
        self._tiny = float(torch.finfo(src).tiny)
        self.stats = stats

    def __call__(self, x: Any) -> Any:
        n = x.numel()
        y = self._out[:n]
        if self._limit is not None:
            clamped = self._clamped[:n]
            clamped.copy_(x)
            y.copy_(clamped.clamp_(-self._limit, self._limit))
        else:
            y.copy_(x)
        if self.stats is not None and n:
            self._measure(self.stats, x, y)
        return y

    def _measure(self, stats: ValueStats, x: Any, y: Any) -> None:
        """Fold the max absolute and relative error of ``y`` against ``x`` into ``stats``."""
        n = x.numel()
        diff = self._diff[:n]
        diff.copy_(y)
        diff.sub_(x)
        worst = self._max_magnitude(diff)
        finite = math.isfinite(worst)
        if not finite:  # NaN/Inf in the source (clamped or kept): measure the finite values only
            diff.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
            worst = self._max_magnitude(diff)
        stats.max_abs_error = max(stats.max_abs_error, worst)
        # Rounding to nearest (or saturating) never moves a value further than zero is: |y - x| <= |x|.
        # So the relative error is at most 1, and once it reaches 1 no later chunk can raise it.
        if stats.max_rel_error < 1.0:
            scale = self._torch.abs(x, out=self._scale[:n]).clamp_min_(self._tiny)
            rel = diff.abs_().div_(scale)
            if not finite:
                rel.nan_to_num_(nan=0.0)
            stats.max_rel_error = max(stats.max_rel_error, float(rel.max()))

    def _max_magnitude(self, t: Any) -> float:
        low, high = self._torch.aminmax(t)
        return max(-float(low), float(high))
