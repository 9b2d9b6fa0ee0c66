"""What a cast will do to values, known before anything is written, from the bits alone.

Under round-to-nearest-even, whether a float32 becomes inf, zero or a subnormal in float16, and how far
rounding moves it in float16 or bfloat16, depend only on its bit pattern. So the range checks and the
cast's errors are thresholds and integer arithmetic on the bits (numpy, a few SIMD passes over a
chunk, no torch). The cast itself is npcast's (bit-equal to torch's) or, where its errors must be measured
as it is made, torch's (torchcast.py); tests/test_values.py holds every figure here against torch's own cast.

Storages are read through mmap a chunk at a time into reused buffers, so memory stays bounded by a
chunk, not the checkpoint. ``pieces.py`` folds them piece by piece, on a pool of threads, as the conversion's bytes are made.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from typing import Any, NamedTuple

CHUNK_BYTES = 1 << 22
"""Source bytes per chunk: a chunk and its temporaries (about 17 bytes per value) stay in the last-level cache, and
each numpy call, which hands the GIL to the other threads, does enough work that the hand-overs stay cheap (a
1.5 GB fp16 conversion: 1.7 s with 1 MB chunks, 1.3 s with 4 MB, 1.4-2.1 s with 8 and 16 MB; benchmarks/CONVERT.md,
round 10)."""
UNDERFLOW_BLOCK_FRACTION = 0.01
"""A tensor blocks conversion when more than this share of its non-zero values would become zero."""
UNDERFLOW_WARN_FRACTION = 0.001
"""``scan --values`` warns of a tensor when more than this share of its non-zero values would become zero (and
at most ``UNDERFLOW_BLOCK_FRACTION``); fewer is an info: a trained tensor holds a few values below 2^-24 by chance."""

# Magnitude thresholds for float32 -> float16 under round-to-nearest-even, as float32 bit patterns.
# The largest half is 65504 and the next step would be 65536, so the tie 65520 and above round to inf;
# the smallest subnormal is 2^-24, so 2^-25 (a tie, rounding to the even zero) and below become 0;
# the largest subnormal is 2^-14 - 2^-24, so below the tie 2^-14 - 2^-25 a value lands among subnormals.
F16_INF_FROM = 0x477FF000  # 65520
F16_ZERO_UPTO = 0x33000000  # 2^-25
F16_SUBNORMAL_BELOW = 0x387FE000  # 2^-14 - 2^-25
F16_NORMAL_FROM = 0x38800000  # 2^-14, float16's smallest normal
F32_NONFINITE_FROM = 0x7F800000  # inf; above it, NaN
# bfloat16 keeps float32's exponent: only values within half a step of float32's top become inf.
BF16_INF_FROM = 0x7F7F8000
INF_FROM = {"float16": F16_INF_FROM, "bfloat16": BF16_INF_FROM, "float32": F32_NONFINITE_FROM}
"""Per target, the float32 magnitude from which a value becomes inf (for float32, only doubles narrowed to inf)."""
F32_TINY_BITS = 0x00800000  # 2^-126, float32's smallest normal


@dataclass
class ValueStats:
    """What casting one tensor (or storage) from ``source`` to ``target`` does to its values."""

    name: str
    source: str
    target: str
    numel: int = 0
    nonzero: int = 0
    """Non-zero values, counted for float16 targets (the only ones checked for underflow)."""
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
    errors_measured: bool = False
    """The two errors above are final (measured from the bits before the write), not yet to be measured."""
    findings: list[str] = field(default_factory=list)

    @property
    def underflow_fraction(self) -> float:
        return self.underflow / self.nonzero if self.nonzero else 0.0

    @property
    def unsafe(self) -> bool:
        """Conversion would lose this tensor: overflow, NaN/Inf, or a real share of values flushed to zero."""
        return bool(self.overflow or self.nonfinite or self.underflow_fraction > UNDERFLOW_BLOCK_FRACTION)

    def merge(self, other: ValueStats) -> None:
        """Fold in the statistics of another part of the same values (a piece made elsewhere): counts add,
        maxima combine, so parts folded chunk by chunk give what one pass over the same chunks gives."""
        for name in _SUMMED:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.max_abs = max(self.max_abs, other.max_abs)
        self.max_abs_error = max(self.max_abs_error, other.max_abs_error)
        self.max_rel_error = max(self.max_rel_error, other.max_rel_error)
        self.errors_measured = self.errors_measured or other.errors_measured

    def to_fields(self) -> list[Any]:
        """The figures alone, in a fixed order, to cross a process boundary as JSON."""
        return [getattr(self, name) for name in _STATS_FIELDS]

    @classmethod
    def from_fields(cls, source: str, target: str, values: list[Any]) -> ValueStats:
        return cls("", source, target, **dict(zip(_STATS_FIELDS, values, strict=True)))

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


class Looked(NamedTuple):
    """What a fold learned of a chunk of float32 values, for a cast of the same values to use instead of learning
    it again: the largest ``|x|``'s bits (``top``), for a float16 target the indices of the values below float16's
    smallest normal, in order (``small``; else None), and ``scratch``, a uint32 buffer of the chunk's length that
    the fold is done with (the cast may write in it). Valid until the next fold."""

    scratch: Any
    top: int
    small: Any


class ValueCheck:
    """Folds float32 chunks into a ValueStats from the bits of |x|: NaN/Inf and overflow for every target,
    float16's range statistics (underflow, subnormals) for float16 targets, and,
    for float32 sources, the errors of the cast to float16 or bfloat16.

    The errors need no cast either. Round-to-nearest-even to 11 or 8 significant bits is integer
    arithmetic on the bit pattern (add half a step less one, plus the kept part's lowest bit, then
    drop the step), and the difference from x is exact (Sterbenz); below float16's normal range the
    step is fixed at 2^-24 and numpy's rint (also ties to even) rounds instead.

    Most values need no look at all. Everything the range checks count lies below float16's smallest
    normal, so they count a small subset. A value in the target's normal range errs by at most half
    its binade's step, so the largest error is found among the values of the top binade (and the small
    ones) unless it is smaller than half a step of the binade below, which real weights never are; and
    the relative error of a normal value stays under 2^-bits, so only the small values can exceed it;
    when none does (always, for a bfloat16 target), the normal values' largest relative error is found
    from its integer form among a few candidates (``_normal_relative``). When the top binade's shortcut
    fails, every value is measured. tests/test_values.py holds all of this against torch's own cast.
    """

    def __init__(self) -> None:
        import numpy as np

        self._np = np
        self._magnitude = np.empty(CHUNK_BYTES // 4, np.uint32)
        self._mask = np.empty(CHUNK_BYTES // 4, np.bool_)
        self._half = np.empty(CHUNK_BYTES // 4, np.uint16)

    def fold(self, stats: ValueStats, x: Any, original: Any, *, clamp: bool = False) -> Looked | None:
        """Fold one chunk into ``stats``; returns what it learned of the chunk on the way (``Looked``), which a cast
        of the same float32 values can use instead of learning it again."""
        np = self._np
        n = len(x)
        if not n:
            return None
        magnitude = np.bitwise_and(x.view(np.uint32), np.uint32(0x7FFFFFFF), out=self._magnitude[:n])
        top = int(magnitude.max())
        stats.numel += n
        errors = measures_errors(stats.source, stats.target)
        if (stats.source, stats.target) in WIDENING:  # exact: no error to measure
            stats.errors_measured = True
            errors = False
        with np.errstate(invalid="ignore", over="ignore"):  # NaN/Inf bits pass through, then are left out
            # NaN/Inf and overflow, for every target: a NaN is as lost in bfloat16 as in float16.
            self._fold_specials(stats, magnitude, top, original, clamp)
            if stats.target != "float16" and not errors:
                return Looked(magnitude, top, None)
            # The values worth a look: the small ones, and (for the errors) those of the top binade.
            small_below = F16_NORMAL_FROM if stats.target == "float16" else F32_TINY_BITS
            high_from = top & 0x7F800000 if errors else 0xFFFFFFFF
            if high_from > small_below:  # one pass: below ``small_below`` wraps around past ``high_from``
                # in place: the buffer's low bits stay |x|'s (``small_below`` is a multiple of 2^16), which is all
                # the rest of the fold reads of it whole
                shifted = np.subtract(magnitude, np.uint32(small_below), out=magnitude)
                picked = np.flatnonzero(np.greater_equal(shifted, np.uint32(high_from - small_below), out=self._mask[:n]))
                looks = shifted[picked] + np.uint32(small_below)
            else:
                picked = np.arange(n)
                looks = magnitude.copy()
            is_small = looks < small_below
            if stats.target == "float16":
                self._fold_range(stats, n, looks[is_small])
            if errors:
                self._fold_errors(stats, x.view(np.uint32), magnitude, top, looks[is_small], looks[~is_small], small_below, clamp)
        return Looked(magnitude, top, picked[is_small] if stats.target == "float16" else None)

    def _fold_specials(self, stats: ValueStats, magnitude: Any, top: int, original: Any, clamp: bool) -> None:
        """NaN/Inf already present, finite values the cast makes inf, and the largest finite |x|."""
        np = self._np
        n = len(magnitude)
        inf_from = INF_FROM.get(stats.target, F32_NONFINITE_FROM)
        if top >= inf_from:  # rare: values at or beyond the target's range, or NaN/Inf
            if original.dtype == np.float64:  # finite doubles beyond float32's range are overflow, not NaN/Inf
                finite = np.isfinite(original)
                nonfinite = n - int(np.count_nonzero(finite))
                peak = float(np.abs(original[finite]).max()) if nonfinite < n else 0.0
            else:
                nonfinite = int(np.count_nonzero(magnitude >= F32_NONFINITE_FROM))
                finite_top = int(magnitude[magnitude < F32_NONFINITE_FROM].max()) if nonfinite < n else 0
                peak = float(np.uint32(finite_top).view(np.float32))
            stats.nonfinite += nonfinite
            if not clamp and stats.source != stats.target:  # a tensor written as it is cannot overflow
                stats.overflow += int(np.count_nonzero(magnitude >= inf_from)) - nonfinite
        else:
            peak = float(np.uint32(top).view(np.float32))
        stats.max_abs = max(stats.max_abs, peak)

    def _fold_range(self, stats: ValueStats, n: int, small: Any) -> None:
        """float16's narrow range: ``small`` holds the magnitudes below its smallest normal, where zeros,
        underflow and subnormals all lie, of a chunk of ``n`` values."""
        np = self._np
        zeros = len(small) - int(np.count_nonzero(small))
        to_zero = int(np.count_nonzero(small <= F16_ZERO_UPTO))
        stats.nonzero += n - zeros
        stats.underflow += to_zero - zeros
        stats.subnormal += int(np.count_nonzero(small < F16_SUBNORMAL_BELOW)) - to_zero

    def _fold_errors(self, stats: ValueStats, bits: Any, low: Any, top: int, small: Any, high: Any, small_below: int, clamp: bool) -> None:
        """The max absolute and relative error of torch's cast of the float32 values ``bits``, as torch's own
        float32 arithmetic (``|y.float() - x|``, then over ``max(|x|, tiny)``) would measure them. ``small`` and
        ``high``: the magnitudes below ``small_below`` and those of the top binade; ``low``: a buffer whose low 16
        bits are those of ``|x|``, which this may overwrite."""
        np = self._np
        bits_kept = 11 if stats.target == "float16" else 8
        inf_from = F16_INF_FROM if stats.target == "float16" else BF16_INF_FROM
        worst = relative = -1.0
        if top < inf_from:
            looks = np.concatenate([small, high])
            error = self._errors(looks, stats.target, clamp)
            # Below the top binade, a normal value errs by at most half a step of the binade under it.
            if len(error) and float(error.max()) >= 2.0 ** ((top >> 23) - 128 - bits_kept):
                worst = float(error.max())
            # the top binade's values are normal ones: their relative errors are a floor for the rest's
            relative = self._relative(error, looks)
        known = max(relative, stats.max_rel_error)  # this tensor's largest so far: only a larger one matters
        if worst >= 0 and known < 2.0**-bits_kept:  # the largest error is known: only a normal value's relative one is left
            relative = max(relative, self._normal_relative(bits, low, small_below, 24 - bits_kept, known))
        elif worst < 0:
            magnitude = np.bitwise_and(bits, np.uint32(0x7FFFFFFF), out=low)
            error = self._errors(magnitude, stats.target, clamp)
            worst = float(error.max())
            relative = self._relative(error, magnitude)
        stats.max_abs_error = max(stats.max_abs_error, worst)
        stats.max_rel_error = max(stats.max_rel_error, relative)
        stats.errors_measured = True

    def _normal_relative(self, bits: Any, low: Any, small_below: int, drop: int, known: float) -> float:
        """The largest relative error of rounding the float32 values ``bits`` (all finite, below the target's
        overflow) to ``24 - drop`` significant bits, of those from ``small_below`` up (the target's normal range),
        where it is above ``known`` (a float32 figure; else 0). ``low``: a buffer whose low ``drop`` bits are
        those of ``bits``, overwritten here.

        For a normal value the exponent cancels: x = (2^23 + m) 2^k and its error is e 2^k, where e, the
        distance from the low ``drop`` bits of the mantissa m to the nearer multiple of 2^drop (a tie is half
        a step either way), so the relative error is e / (2^23 + m). Both are exact in float32 (2^23 + m is the
        float32 whose bits are m under 2^23's exponent), so one float32 division per value rounds each ratio
        exactly as torch's ``|y - x| / |x|`` does, and the maximum keeps their order. Since 2^23 + m >= 2^23, a
        ratio above ``known`` needs e > known 2^23: three integer passes find those few candidates (e near half a
        step), and only they are divided. ``known`` is the tensor's largest so far (the top binade's, earlier
        chunks'), so after a chunk or two the candidates are a few in a thousand.
        """
        np = self._np
        step = 1 << drop
        floor = int(known * 2**23)  # e <= floor: a ratio of at most known, which changes no maximum
        if floor >= step // 2:
            return 0.0
        # floor < e = min(low, step - low) is floor < low < step - floor: one unsigned comparison after a
        # subtraction, on the low 16 bits alone (half the bytes of a pass over 32)
        half = self._half[: len(low)]
        np.copyto(half, low, casting="unsafe")
        if drop < 16:
            np.bitwise_and(half, np.uint16(step - 1), out=half)
        np.subtract(half, np.uint16(floor + 1), out=half)
        candidates = np.flatnonzero(np.less(half, np.uint16(step - 2 * floor - 1), out=self._mask[: len(low)]))
        m = bits[candidates] & np.uint32(0x7FFFFFFF)
        m = m[m >= small_below]
        if not len(m):
            return 0.0
        low = m & np.uint32(step - 1)
        e = np.minimum(low, np.uint32(step) - low).astype(np.float32)
        den = (m & np.uint32(0x7FFFFF)) | np.uint32(150 << 23)  # 2^23 + m, as float32 bits
        return float((e / den.view(np.float32)).max())

    def _errors(self, magnitude: Any, target: str, clamp: bool) -> Any:
        """|torch's cast - x| in float32 for these magnitudes (float32 bit patterns), NaN/Inf left at 0."""
        np = self._np
        drop, largest, inf_from = (13, 65504.0, F16_INF_FROM) if target == "float16" else (16, _max("bfloat16"), BF16_INF_FROM)
        rounded = (magnitude >> np.uint32(drop)) & np.uint32(1)
        rounded += np.uint32((1 << (drop - 1)) - 1)
        rounded += magnitude
        rounded &= np.uint32((0xFFFFFFFF >> drop) << drop)
        error = np.abs(rounded.view(np.float32) - magnitude.view(np.float32))
        if target == "float16":  # below the smallest normal, float16's step is 2^-24 whatever the exponent
            small = np.flatnonzero(magnitude < F16_NORMAL_FROM)
            scaled = magnitude[small].view(np.float32) * np.float32(2.0**24)
            error[small] = np.abs(np.rint(scaled) - scaled) * np.float32(2.0**-24)
        beyond = np.flatnonzero(magnitude >= inf_from)
        if len(beyond):  # values the cast makes inf (torch leaves inf differences out) or, clamped, saturates
            finite = magnitude[beyond] < F32_NONFINITE_FROM
            saturated = magnitude[beyond].view(np.float32) - np.float32(largest)
            error[beyond] = np.where(finite & clamp, saturated, np.float32(0))
        return error

    def _relative(self, error: Any, magnitude: Any) -> float:
        """max(error / max(|x|, tiny)); never above 1, since rounding to nearest (or saturating) moves no
        value further than zero is. max(|x|, tiny) is taken on the bits, which order like the values;
        NaN bits (error 0) become inf."""
        np = self._np
        if not len(error):
            return 0.0
        scale = np.clip(magnitude, np.uint32(F32_TINY_BITS), np.uint32(F32_NONFINITE_FROM)).view(np.float32)
        return float(np.divide(error, scale, out=scale).max())


WIDENING = frozenset(
    {("float16", "float32"), ("bfloat16", "float32"), ("float16", "float64"), ("bfloat16", "float64"), ("float32", "float64")}
)
"""Casts that keep every value exactly: their errors are 0, known without a look."""


def measures_errors(source: str, target: str) -> bool:
    """Whether ValueCheck measures this cast's errors (else the writer measures them on torch's cast)."""
    return source == "float32" and target in ("float16", "bfloat16") or (source, target) in WIDENING


_STATS_FIELDS = tuple(f.name for f in fields(ValueStats) if f.name not in ("name", "source", "target", "findings"))
_SUMMED = ("numel", "nonzero", "nonfinite", "overflow", "underflow", "subnormal")


def count_nonfinite(buffer: Any, dtype: str, offset: int, numel: int) -> int:
    """NaN and Inf among the floating values at ``offset``."""
    import numpy as np

    bad = 0
    for x, original in float32_chunks(buffer, dtype, offset, numel):
        values = original if original.dtype == np.float64 else x  # doubles beyond float32's range are still finite
        bad += len(values) - int(np.count_nonzero(np.isfinite(values)))
    return bad


MAX_VIEW_RUNS = 1 << 16
"""The most runs ``viewed_runs`` lists for one storage; beyond it the whole storage is judged (as it is written)."""

View = tuple[int, tuple[int, ...], "tuple[int, ...] | None"]
"""A tensor's view of its storage, in elements: offset, shape, strides (None: contiguous)."""


def viewed_runs(views: list[View], numel: int) -> list[tuple[int, int]] | None:
    """The runs ``(first, count)`` of a storage's ``numel`` elements that some view sees, sorted and merged; None
    where that is the whole storage, no views are known, or too many runs to list (then the whole storage is judged).

    torch.save writes a view's whole storage, and a conversion carries it whole, but the values a loaded model
    holds are only the viewed ones: bytes outside every view are no tensor's and are not judged."""
    import numpy as np

    if not views:
        return None
    starts: list[Any] = []
    lengths: list[int] = []
    listed = 0
    for offset, shape, stride in views:
        if 0 in shape:
            continue
        if stride is None:
            stride = tuple(int(np.prod(shape[k + 1 :], dtype=np.int64)) for k in range(len(shape)))
        dims = [(size, step) for size, step in zip(shape, stride, strict=True) if size > 1]
        run = 1
        while dims and dims[-1][1] == run:  # the innermost dims that are contiguous make one run
            run *= dims.pop()[0]
        count = int(np.prod([size for size, _ in dims], dtype=np.int64)) if dims else 1
        listed += count
        if listed > MAX_VIEW_RUNS:
            return None
        first = np.array([offset], dtype=np.int64)
        for size, step in dims:
            first = (first[:, None] + np.arange(size, dtype=np.int64) * step).ravel()
        starts.append(first)
        lengths.extend([run] * len(first))
    if not starts:
        return []
    begin = np.concatenate(starts)
    end = begin + np.array(lengths, dtype=np.int64)
    order = np.argsort(begin, kind="stable")
    merged: list[tuple[int, int]] = []
    for b, e in zip(begin[order].tolist(), end[order].tolist(), strict=True):
        b, e = max(0, b), min(numel, e)
        if e <= b:
            continue
        if merged and b <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], e))
        else:
            merged.append((b, e))
    if merged == [(0, numel)]:
        return None
    return [(b, e - b) for b, e in merged]


def runs_of(views: list[View], numel: int) -> list[tuple[int, int]]:
    """``viewed_runs``, with the whole storage as its one run where that is what is judged."""
    runs = viewed_runs(views, numel)
    return [(0, numel)] if runs is None else runs


def figures_of_runs(buffer: Any, dtype: str, target: str, offset: int, runs: list[tuple[int, int]]) -> ValueStats:
    """The value figures of the elements in ``runs`` of the storage at ``offset``: which view of a storage sees
    the values that make it unsafe."""
    from .dtypes import get

    stats, check, size = ValueStats("", dtype, target), ValueCheck(), get(dtype).itemsize
    for first, n in runs:
        for x, original in float32_chunks(buffer, dtype, offset + first * size, n):
            check.fold(stats, x, original)
    return stats
