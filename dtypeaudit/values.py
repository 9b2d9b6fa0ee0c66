"""What a cast does to values: range checks before anything is written, and the cast's errors as it is made.

The range checks for float16 never cast. Under round-to-nearest-even, whether a float32 becomes inf,
zero or a subnormal in float16 depends only on its magnitude, so thresholds on the bits of |x| decide
it (numpy, a few SIMD passes over a chunk, no torch import). The cast itself, and the errors measured
against it, use torch's own kernels, because the bytes written must be exactly torch's cast.

Storages are read through mmap a chunk at a time into reused buffers, so memory stays bounded by a
chunk, not the checkpoint.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

CHUNK_BYTES = 1 << 20
"""Source bytes per chunk: small enough that a chunk and its temporaries stay in cache."""
UNDERFLOW_BLOCK_FRACTION = 0.01
"""A tensor blocks conversion when more than this share of its non-zero values would become zero."""

# Magnitude thresholds for float32 -> float16 under round-to-nearest-even, as float32 bit patterns.
# The largest half is 65504 and the next step would be 65536, so the tie 65520 and above round to inf;
# the smallest subnormal is 2^-24, so 2^-25 (a tie, rounding to the even zero) and below become 0;
# the largest subnormal is 2^-14 - 2^-24, so below the tie 2^-14 - 2^-25 a value lands among subnormals.
F16_INF_FROM = 0x477FF000  # 65520
F16_ZERO_UPTO = 0x33000000  # 2^-25
F16_SUBNORMAL_BELOW = 0x387FE000  # 2^-14 - 2^-25
F32_NONFINITE_FROM = 0x7F800000  # inf; above it, NaN


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


_FINFO = {"float16": (65504.0, 2.0**-24), "bfloat16": (3.3895313892515355e38, 2.0**-133), "float32": (3.4028234663852886e38, 2.0**-149)}


def _max(target: str) -> float:
    return _FINFO[target][0]


def _tiny(target: str) -> float:
    """The smallest positive subnormal."""
    return _FINFO[target][1]


# -- range checks (numpy) ---------------------------------------------------------------------------


def float32_chunks(buffer: Any, dtype: str, offset: int, numel: int) -> Iterator[tuple[Any, Any]]:
    """``(as_float32, original)`` numpy chunks of the ``numel`` values at ``offset``.

    Widened or narrowed as torch does on the way to float16: float64 goes through float32 (torch's
    double-to-half cast rounds twice), bfloat16 and float16 widen exactly.
    """
    import numpy as np

    raw_type = {"float32": np.float32, "float64": np.float64, "bfloat16": np.uint16, "float16": np.float16}[dtype]
    itemsize = np.dtype(raw_type).itemsize
    step = CHUNK_BYTES // 4
    scratch = None if dtype == "float32" else np.empty(step, np.uint32)
    for start in range(0, numel, step):
        count = min(step, numel - start)
        raw = np.frombuffer(buffer, raw_type, count, offset + start * itemsize)
        if scratch is None:
            yield raw, raw
        elif dtype == "bfloat16":
            wide = scratch[:count]
            np.left_shift(raw, 16, out=wide, dtype=np.uint32)
            yield wide.view(np.float32), raw
        else:
            narrow = scratch[:count].view(np.float32)
            with np.errstate(over="ignore"):  # doubles beyond float32's range become inf, as in torch
                np.copyto(narrow, raw, casting="unsafe")
            yield narrow, raw


class RangeCheck:
    """Folds float32 chunks into the float16 range statistics of a ValueStats, on the bits of |x|."""

    def __init__(self) -> None:
        import numpy as np

        self._np = np
        self._magnitude = np.empty(CHUNK_BYTES // 4, np.uint32)
        self._mask = np.empty(CHUNK_BYTES // 4, np.bool_)

    def fold(self, stats: ValueStats, x: Any, original: Any, *, clamp: bool = False) -> None:
        np = self._np
        n = len(x)
        if not n:
            return
        magnitude = np.bitwise_and(x.view(np.uint32), np.uint32(0x7FFFFFFF), out=self._magnitude[:n])
        mask = self._mask[:n]

        def count(op: Any, threshold: int) -> int:
            return int(np.count_nonzero(op(magnitude, np.uint32(threshold), out=mask)))

        zeros = n - int(np.count_nonzero(magnitude))
        to_zero = count(np.less_equal, F16_ZERO_UPTO)
        stats.numel += n
        stats.nonzero += n - zeros
        stats.underflow += to_zero - zeros
        stats.subnormal += count(np.less, F16_SUBNORMAL_BELOW) - to_zero
        top = int(magnitude.max())
        if top >= F16_INF_FROM:  # rare: values at or beyond float16's range, or NaN/Inf
            if original.dtype == np.float64:  # finite doubles beyond float32's range are overflow, not NaN/Inf
                finite = np.isfinite(original)
                nonfinite = n - int(np.count_nonzero(finite))
                peak = float(np.abs(original[finite]).max()) if nonfinite < n else 0.0
            else:
                nonfinite = count(np.greater_equal, F32_NONFINITE_FROM)
                finite_top = int(magnitude[magnitude < F32_NONFINITE_FROM].max()) if nonfinite < n else 0
                peak = float(np.uint32(finite_top).view(np.float32))
            stats.nonfinite += nonfinite
            if not clamp:
                stats.overflow += count(np.greater_equal, F16_INF_FROM) - nonfinite
        else:
            peak = float(np.uint32(top).view(np.float32))
        stats.max_abs = max(stats.max_abs, peak)


# -- range checks in a child process ---------------------------------------------------------------

CHILD_MIN_BYTES = 64 << 20
"""Range checks over at least this many bytes run in a child process, beside the parent's torch import."""
_STATS_FIELDS = ("numel", "nonzero", "nonfinite", "overflow", "underflow", "subnormal", "max_abs")


@dataclass(frozen=True)
class RangeJob:
    """One storage to range-check: ``length`` bytes of ``dtype`` at ``offset`` in the file at ``path``."""

    unit: str
    path: str
    dtype: str
    offset: int
    length: int


def start_range_checks(jobs: list[RangeJob], *, clamp: bool) -> Any:
    """Start checking ``jobs`` in a child process (numpy only, no torch); None if it cannot start.

    Range checks and the torch import the cast needs are both about a second on a large checkpoint,
    and neither needs the other, but both need the GIL; a child puts them on separate cores.
    """
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parent.parent)
    code = f"import sys; sys.path.insert(0, {root!r}); from dtypeaudit.values import serve_range_checks; serve_range_checks()"
    request = json.dumps({"clamp": clamp, "jobs": [vars(j) for j in jobs]})
    try:
        proc = subprocess.Popen([sys.executable, "-I", "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert proc.stdin is not None
        proc.stdin.write(request.encode())
        proc.stdin.close()
    except OSError:
        return None
    return proc


def finish_range_checks(proc: Any, stats: dict[str, ValueStats], progress: Callable[[int], None] | None) -> bool:
    """Fold the child's results into ``stats``; False if it failed (the caller then checks in-process)."""
    import json

    assert proc.stdout is not None
    result = None
    for line in proc.stdout:
        kind, _, payload = line.decode().partition(" ")
        if kind == "progress" and progress:
            progress(int(payload))
        elif kind == "result":
            result = json.loads(payload)
    proc.stderr.read()
    if proc.wait() != 0 or not isinstance(result, dict) or set(result) != set(stats):
        return False
    for unit, values in result.items():
        for name, value in zip(_STATS_FIELDS, values, strict=True):
            setattr(stats[unit], name, value)
    return True


def serve_range_checks() -> None:
    """The child's side: a JSON request on stdin; ``progress N`` lines, then ``result {...}``, on stdout."""
    import json
    import mmap
    import sys

    request = json.loads(sys.stdin.read())
    check = RangeCheck()
    maps: dict[str, Any] = {}
    out: dict[str, list[float]] = {}
    for job in (RangeJob(**j) for j in request["jobs"]):
        if job.path not in maps:
            with open(job.path, "rb") as fh:
                maps[job.path] = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        stats = ValueStats(job.unit, job.dtype, "float16")
        itemsize = {"float32": 4, "float64": 8, "bfloat16": 2}[job.dtype]
        for x, original in float32_chunks(maps[job.path], job.dtype, job.offset, job.length // itemsize):
            check.fold(stats, x, original, clamp=request["clamp"])
        out[job.unit] = [getattr(stats, name) for name in _STATS_FIELDS]
        sys.stdout.write(f"progress {job.length}\n")
        sys.stdout.flush()
    sys.stdout.write(f"result {json.dumps(out)}\n")


def count_nonfinite(buffer: Any, dtype: str, offset: int, numel: int) -> int:
    """NaN and Inf among the floating values at ``offset``."""
    import numpy as np

    bad = 0
    for x, original in float32_chunks(buffer, dtype, offset, numel):
        values = original if original.dtype == np.float64 else x  # doubles beyond float32's range are still finite
        bad += len(values) - int(np.count_nonzero(np.isfinite(values)))
    return bad


# -- the cast and its errors (torch) ----------------------------------------------------------------


def load_torch() -> None:
    """Import torch, which makes every cast: about a second, worth overlapping with other work."""
    import torch  # noqa: F401


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
    """torch's cast of ``x`` to ``target``; with ``clamp``, values beyond the target's range saturate first."""
    import torch

    t = getattr(torch, target)
    if clamp and torch.finfo(t).max < torch.finfo(x.dtype).max:
        limit = float(torch.finfo(t).max)
        x = x.clamp(-limit, limit)
    return x.to(t)


class Caster:
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
        self._tiny = float(torch.finfo(src).tiny)
        self.stats = stats

    def __call__(self, x: Any) -> Any:
        n = x.numel()
        y = self._out[:n]
        if self._limit is not None:
            clamped = self._torch.clamp(x, -self._limit, self._limit, out=self._diff[:n])
            y.copy_(clamped)
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
        if not math.isfinite(worst):  # NaN/Inf in the source (clamped or kept): measure the finite values only
            diff.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
            worst = self._max_magnitude(diff)
        stats.max_abs_error = max(stats.max_abs_error, worst)
        # Rounding to nearest (or saturating) never moves a value further than zero is: |y - x| <= |x|.
        # So the relative error is at most 1, and once it reaches 1 no later chunk can raise it.
        if stats.max_rel_error < 1.0:
            scale = self._torch.abs(x, out=self._scale[:n]).clamp_min_(self._tiny)
            stats.max_rel_error = max(stats.max_rel_error, float(diff.abs_().div_(scale).max()))

    def _max_magnitude(self, t: Any) -> float:
        low, high = self._torch.aminmax(t)
        return max(-float(low), float(high))
