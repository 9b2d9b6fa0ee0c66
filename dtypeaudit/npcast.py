"""torch's CPU casts between float64, float32, float16 and bfloat16, computed with numpy from the bits.

Conversion makes the bytes it writes here, so that a plain cast does not import torch (about a second
of CPU, a third of a small conversion). Every finite and infinite value comes out bit-equal to torch's
``Tensor.to`` (``tests/test_npcast.py`` compares all 2^16 float16 and bfloat16 values and every float32
exponent at its rounding boundaries with torch; the slow run compares all 2^32 float32 values):

- float32 -> float16: IEEE round-to-nearest-even, overflow to inf, subnormals kept (numpy's cast is the
  same rounding);
- float32 -> bfloat16: round-to-nearest-even on the top 16 bits, as c10's ``round_to_nearest_even``;
- float64 -> float16 or bfloat16: through float32, rounding twice, as torch's CPU kernels do (c10's
  Half and BFloat16 are built from a float);
- float16 and bfloat16 widen exactly.

A NaN stays a NaN of the same sign; its payload bits are not promised (torch's own differ between its
vectorised and scalar loops, and between ISAs). With ``clamp``, values beyond the target's largest finite
value become that value (``torch.clamp`` in the source dtype, then the cast), NaN left as it is; a bfloat16
source is clamped widened to float32, because bfloat16 cannot hold float16's largest value (``torch.clamp``
in bfloat16 rounds 65504 to 65536, which the cast to float16 makes inf).
"""

from __future__ import annotations

from typing import Any

# The numpy dtype that holds each torch dtype's bytes: bfloat16 as its raw 16 bits.
_STORAGE = {"float64": "float64", "float32": "float32", "float16": "float16", "bfloat16": "uint16"}
CASTS = frozenset(_STORAGE)
"""The dtypes this module casts between (any pair)."""

_F32_MAX = 3.4028234663852886e38
_LARGEST = {"float16": 65504.0, "bfloat16": 3.3895313892515355e38, "float32": _F32_MAX, "float64": float("inf")}


def storage_dtype(dtype: str) -> Any:
    """The numpy dtype of a torch dtype's stored elements (``bfloat16`` as ``uint16`` bits)."""
    import numpy as np

    return np.dtype(_STORAGE[dtype])


# float32 magnitudes (bit patterns) whose float16 is normal and finite: from float16's smallest normal, 2^-14,
# to just under 65520, the tie from which values round to inf.
_F16_NORMAL_FROM = 0x38800000
_F16_INF_FROM = 0x477FF000
# Rounding the float32 bits to float16's 10 mantissa bits also rebases the exponent (127 -> 15): adding this
# (modulo 2^32) is adding just under half a step and subtracting 112 from the exponent field.
_F16_ROUND = (0xFFF - (112 << 23)) & 0xFFFFFFFF


def _float16_bits(x: Any, out: Any, copy: Any, magnitude: Any, scratch: Any, mask: Any) -> None:
    """float32 ``x`` rounded to float16 (nearest, ties to even) as raw bits into ``out``, as numpy's and torch's
    casts give it. numpy's own cast is scalar without AVX-512 (about 1.3 s/GB here); on the bits, as c10's
    ``fp16_ieee_from_fp32_value`` does for normal values, it is a dozen SIMD passes (about 1 s/GB: see
    benchmarks/CONVERT.md). Values whose float16 is not a finite normal (zeros, subnormals, overflow, NaN: few in
    weights) go through numpy's cast. ``copy``, ``magnitude`` and ``scratch`` are uint32 arrays of ``x``'s
    length, ``mask`` a bool one."""
    import numpy as np

    n = len(x)
    # One pass over ``x`` (a mapped file's page-cache pages cost the most to touch), the others over the copy.
    np.copyto(copy, x.view(np.uint32))
    np.bitwise_and(copy, np.uint32(0x7FFFFFFF), out=magnitude)
    # bits + 0xFFF + (bit 13 of bits) rounds the top 19 bits to nearest even; then drop the 13 low bits.
    np.right_shift(magnitude, np.uint32(13), out=scratch)
    np.bitwise_and(scratch, np.uint32(1), out=scratch)
    np.add(scratch, np.uint32(_F16_ROUND), out=scratch)
    np.add(scratch, magnitude, out=scratch)
    np.right_shift(scratch, np.uint32(13), out=scratch)
    np.right_shift(copy, np.uint32(16), out=copy)  # the sign, from bit 31 to bit 15
    np.bitwise_and(copy, np.uint32(0x8000), out=copy)
    np.bitwise_or(scratch, copy, out=scratch)
    np.copyto(out, scratch, casting="unsafe")
    # The others, in one comparison: below the normal range, ``magnitude - _F16_NORMAL_FROM`` wraps around past
    # the range's width.
    np.subtract(magnitude, np.uint32(_F16_NORMAL_FROM), out=scratch)
    odd = np.flatnonzero(np.greater_equal(scratch, np.uint32(_F16_INF_FROM - _F16_NORMAL_FROM), out=mask))
    if len(odd) > n // 4:
        np.copyto(out.view(np.float16), x, casting="unsafe")
    elif len(odd):
        out[odd] = x[odd].astype(np.float16).view(np.uint16)


def _bfloat16_bits(x: Any, out: Any, scratch: Any) -> None:
    """float32 ``x`` rounded to bfloat16 (nearest, ties to even), as raw bits into ``out``; NaN becomes 0x7FC0
    with ``x``'s sign. ``scratch`` is a uint32 array of ``x``'s length."""
    import numpy as np

    bits = x.view(np.uint32)
    # bits + 0x7FFF + (bit 16 of bits): adding just under half a step, plus one on an odd result, rounds the top
    # half to nearest even. A finite value at most one step under float32's top carries into inf's pattern.
    np.right_shift(bits, 16, out=scratch)
    np.bitwise_and(scratch, 1, out=scratch)
    np.add(scratch, 0x7FFF, out=scratch)
    np.add(scratch, bits, out=scratch)
    np.right_shift(scratch, 16, out=scratch)
    np.copyto(out, scratch, casting="unsafe")
    nan = np.isnan(x)
    if nan.any():
        out[nan] = np.where(np.signbit(x[nan]), 0xFFC0, 0x7FC0).astype(np.uint16)


class Caster:
    """Casts consecutive numpy chunks of ``source`` values (their stored form) to ``target``'s stored form,
    into reused buffers of ``capacity`` elements: the returned array is valid until the next call."""

    def __init__(self, source: str, target: str, *, clamp: bool = False, capacity: int) -> None:
        import numpy as np

        if source not in CASTS or target not in CASTS:
            raise ValueError(f"no numpy cast from {source} to {target}")
        self.source, self.target = source, target
        self._out = np.empty(capacity, storage_dtype(target))
        # Every cast but a widening goes through float32 (torch rounds float64 to float32 first).
        self._f32 = np.empty(capacity, np.float32)
        self._scratch = np.empty(capacity, np.uint32)
        self._magnitude = np.empty(capacity if target == "float16" else 0, np.uint32)
        self._copy = np.empty(capacity if target == "float16" else 0, np.uint32)
        self._mask = np.empty(capacity if target == "float16" else 0, np.bool_)
        limit = _LARGEST[target]
        self._limit = limit if clamp and limit < _LARGEST[source] else None

    def __call__(self, x: Any) -> Any:
        return self._cast(x)

    def _cast(self, x: Any) -> Any:
        import numpy as np

        n = len(x)
        out = self._out[:n]
        if self.source == self.target and self._limit is None:
            np.copyto(out, x)
            return out
        if self.source == "bfloat16":  # widened exactly, into the float32 buffer (the casts below use the others)
            wide = self._f32[:n]
            np.left_shift(x, 16, out=wide.view(np.uint32), dtype=np.uint32)
            x = wide
        if self._limit is not None:
            # In the source's precision, as torch.clamp; float32 (bfloat16 widened) into the float32 buffer.
            clamped = self._f32[:n] if x.dtype == np.float32 else np.empty(n, x.dtype)
            np.clip(x, -self._limit, self._limit, out=clamped)
            x = clamped
        with np.errstate(over="ignore", invalid="ignore"):
            if self.target == "float64" or (self.target == "float32" and x.dtype != np.float64):
                np.copyto(out, x, casting="unsafe")
            else:
                if x.dtype != np.float32:
                    f32 = self._f32[:n]
                    np.copyto(f32, x, casting="unsafe")  # float64 -> float32 first, as torch rounds
                    x = f32
                if self.target == "float32":
                    np.copyto(out, x)
                elif self.target == "float16":
                    f16 = (self._copy[:n], self._magnitude[:n], self._scratch[:n], self._mask[:n])
                    _float16_bits(x, out.view(np.uint16), *f16)
                else:
                    _bfloat16_bits(x, out, self._scratch[:n])
        return out


def cast(x: Any, source: str, target: str, *, clamp: bool = False) -> Any:
    """A new array: ``x`` (``source``'s stored form) cast to ``target``'s stored form."""
    return Caster(source, target, clamp=clamp, capacity=len(x))._cast(x).copy()
