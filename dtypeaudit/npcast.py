"""torch's CPU casts between float64, float32, float16 and bfloat16, computed with numpy from the bits.

Conversion makes the bytes it writes here, so that a plain cast does not import torch (about a second
of CPU, a third of a small conversion). Every finite and infinite value comes out bit-equal to torch's
``Tensor.to`` (``tests/test_npcast.py`` compares all 2^16 float16 and bfloat16 values and every float32
exponent at its rounding boundaries with torch; the slow run compares all 2^32 float32 values):

- float32 -> float16: IEEE round-to-nearest-even, overflow to inf, subnormals kept;
- float32 -> bfloat16: round-to-nearest-even, ml_dtypes' cast (a maintained library; torch's rounding);
- float64 -> float16 or bfloat16: through float32, rounding twice, as torch's CPU kernels do (c10's
  Half and BFloat16 are built from a float);
- float16 and bfloat16 widen exactly.

A NaN comes out as torch writes it on this CPU: in float16 quieted with its sign and top payload bits kept
(``vcvtps2ph``, which torch's vectorised and scalar loops both use), in bfloat16 as ``BFLOAT16_NAN`` (0xFFFF
from a contiguous source, 0x7FC0 from a strided one). From a float16 source, only NaN-ness is promised: torch
quiets a signalling NaN as it widens one.
With ``clamp``, values beyond the target's largest finite
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
LARGEST = {"float16": 65504.0, "bfloat16": 3.3895313892515355e38, "float32": _F32_MAX, "float64": float("inf")}
"""Each dtype's largest finite value: what ``clamp`` saturates to."""


def storage_dtype(dtype: str) -> Any:
    """The numpy dtype of a torch dtype's stored elements (``bfloat16`` as ``uint16`` bits)."""
    import numpy as np

    return np.dtype(_STORAGE[dtype])


def _bfloat16_bits(x: Any, out: Any, scratch: Any, *, contiguous: bool, top: int | None = None) -> None:
    """float32 ``x`` rounded to bfloat16 (nearest, ties to even) by ml_dtypes, as raw bits into ``out``, its NaNs
    then given torch's bits for a ``contiguous`` source or a strided one (``BFLOAT16_NAN``). ``scratch`` is a
    uint16 array of ``x``'s length; ``top``, where a value check already found it, the largest ``|x|``'s bits."""
    import ml_dtypes
    import numpy as np

    np.copyto(out.view(ml_dtypes.bfloat16), x, casting="unsafe")
    if top is not None and top <= 0x7F800000:  # no NaN to give torch's bits
        return
    # ml_dtypes writes a NaN as 0x7FC0 with its sign; a finite float32 never rounds to a NaN pattern (it carries
    # into inf's), so the NaNs are found in the output, at half the bytes of the input.
    np.bitwise_and(out, 0x7FFF, out=scratch)
    if scratch.max(initial=0) > 0x7F80:
        out[scratch > 0x7F80] = BFLOAT16_NAN[contiguous]


BFLOAT16_NAN = {True: 0xFFFF, False: 0x7FC0}
"""The bits torch's float32 -> bfloat16 cast writes for every NaN, whatever its sign and payload: 0xFFFF from a
contiguous tensor (its vectorised loop, AVX2 and AVX-512, which also casts the last few elements), 0x7FC0 from a
strided view (its scalar loop, c10's ``round_to_nearest_even``). tests/test_npcast.py holds both to torch."""


def _float16_bits(x: Any, out: Any, scratch: Any, top: int | None = None, small: Any = None) -> None:
    """float32 ``x`` rounded to float16 (nearest, ties to even), as raw bits into ``out``; NaN is quieted
    with its sign and top payload bits kept, as ``vcvtps2ph`` (torch's vectorised cast) does. ``scratch`` is a
    uint32 array of ``x``'s length. ``top`` and ``small``: what a value check of these same values already found
    (``values.Looked``: the largest ``|x|``'s bits, the indices below float16's normal range), used instead of
    finding them again.

    From the bits, not numpy's ``astype``: numpy's cast is a scalar loop (0.43 s/GB on weights, measured here)
    that raises the underflow flag one element at a time, which makes values below float16's normal range
    (optimizer moments, small biases) 20x slower; this is five integer passes whatever the values.
    """
    import numpy as np

    bits = x.view(np.uint32)
    if top is None:
        magnitude = np.bitwise_and(bits, np.uint32(0x7FFFFFFF), out=scratch)
        top = int(magnitude.max())
        small = np.flatnonzero(magnitude < _F16_NORMAL) if int(magnitude.min()) < _F16_NORMAL else None
    # Within float16's normal range: rebias the exponent by -112 (adding 0xC8000000 wraps to that), add just under
    # half of the 13 dropped bits plus the kept lowest bit, and shift: round to nearest, ties to even. A carry
    # out of the mantissa steps the exponent, up to inf's pattern for 65520 and above. The sign rides along: the
    # magnitude's sum stays below 2^28, the sign is copied into bits 28-30 (an arithmetic shift of the bits by 13
    # leaves it there, beside the kept lowest bit), and the arithmetic shift by 13 brings bits 28-31 to bit 15 up.
    signed = np.right_shift(bits.view(np.int32), np.int32(13), out=scratch.view(np.int32))
    rounded = np.bitwise_and(signed.view(np.uint32), np.uint32(0x70000001), out=scratch)
    np.add(rounded, bits, out=rounded)
    np.add(rounded, np.uint32(0xC8000FFF), out=rounded)
    half = out.view(np.uint16)
    # the shift's low 16 bits, narrowed as numpy computes them (in blocks that stay in cache): one pass, not two
    np.right_shift(signed, np.int32(13), out=out.view(np.int16), casting="unsafe")
    if small is not None and len(small):
        # Below 2^-14 float16 steps by 2^-24 whatever the exponent: adding 0.5 (whose step is 2^-24) lets the
        # hardware round, and the sum's low bits are the float16 subnormal (or the smallest normal, rounded up).
        wide = bits[small]
        sums = (wide & np.uint32(0x7FFFFFFF)).view(np.float32) + np.float32(0.5)
        half[small] = (sums.view(np.uint32) - np.uint32(0x3F000000)) | (wide >> np.uint32(16) & np.uint32(0x8000))
    if top >= _F16_INF:  # 65536 and above, inf, NaN
        big = np.flatnonzero(np.bitwise_and(bits, np.uint32(0x7FFFFFFF), out=scratch) >= _F16_INF)
        wide = bits[big]
        magnitude = wide & np.uint32(0x7FFFFFFF)
        quiet = np.where(magnitude > 0x7F800000, 0x7E00 | ((magnitude >> 13) & 0x3FF), 0x7C00).astype(np.uint32)
        half[big] = quiet | (wide >> np.uint32(16) & np.uint32(0x8000))


_F16_NORMAL = 113 << 23  # 2^-14, float16's smallest normal, as float32 bits
_F16_INF = 143 << 23  # 2^16: every float32 from here on is beyond float16's range


class NumpyCaster:
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
        self._scratch = np.empty(capacity, np.uint16 if target == "bfloat16" else np.uint32)
        limit = LARGEST[target]
        self._limit = limit if clamp and limit < LARGEST[source] else None

    def __call__(self, x: Any, looked: Any = None) -> Any:
        """``looked``: a value check's ``values.Looked`` of these same values (from float32, unclamped)."""
        return self._cast(x, looked)

    def _cast(self, x: Any, looked: Any = None) -> Any:
        import numpy as np

        n = len(x)
        out = self._out[:n]
        contiguous = bool(x.flags.c_contiguous)  # before x is copied into a buffer of ours
        if self.source == self.target and self._limit is None:
            np.copyto(out, x)
            return out
        if self.source == "bfloat16":
            wide = self._f32[:n]
            np.left_shift(x, 16, out=wide.view(np.uint32), dtype=np.uint32)
            x = wide
        if self._limit is not None:
            # In the source's precision, as torch.clamp; float32 (bfloat16 widened) in the float32 buffer.
            clamped = self._f32[:n] if x.dtype == np.float32 else np.empty(n, x.dtype)
            np.clip(x, -self._limit, self._limit, out=clamped)
            x = clamped
        with np.errstate(over="ignore", invalid="ignore"):
            if self.target == "float64":
                np.copyto(out, x, casting="unsafe")
            elif self.target == "float32" and x.dtype != np.float64 or self.target == "float16" and x.dtype == np.float16:
                np.copyto(out, x, casting="unsafe")
            else:
                if x.dtype != np.float32:
                    f32 = self._f32[:n]
                    np.copyto(f32, x, casting="unsafe")  # float64 -> float32 first, as torch rounds
                    x = f32
                if self.target == "float32":
                    np.copyto(out, x)
                elif looked is None or self.source != "float32" or self._limit is not None:
                    if self.target == "float16":
                        _float16_bits(x, out, self._scratch[:n])
                    else:
                        _bfloat16_bits(x, out, self._scratch[:n], contiguous=contiguous)
                elif self.target == "float16":  # what the value check found of these same values
                    _float16_bits(x, out, looked.scratch, looked.top, looked.small)
                else:
                    _bfloat16_bits(x, out, self._scratch[:n], contiguous=contiguous, top=looked.top)
        return out


def cast(x: Any, source: str, target: str, *, clamp: bool = False) -> Any:
    """A new array: ``x`` (``source``'s stored form) cast to ``target``'s stored form."""
    return NumpyCaster(source, target, clamp=clamp, capacity=len(x))._cast(x).copy()
