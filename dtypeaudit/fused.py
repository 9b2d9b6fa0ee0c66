"""The float32 -> float16 / bfloat16 conversion pass in one compiled loop, where it was built.

A conversion's value checks (``values.ValueCheck``) and its cast (``npcast``) are about sixteen numpy passes over
each chunk, 1.5 to 2 s of CPU per GB. ``fused_kernel.c`` makes the same bytes and the same figures in one pass, several
times faster, for the cast almost every conversion makes: float32 to float16 or bfloat16, unclamped. Every other
cast, and an install without a C compiler, take the numpy path; ``DTYPEAUDIT_NO_FUSED=1`` forces it (the
benchmarks compare the two). tests/test_fused.py holds the two paths to the same bits and figures.

It needs no numpy: a conversion's first bytes go to the disk before numpy (a tenth of a second) is imported.
"""

from __future__ import annotations

import functools
import importlib
import os
import struct
import sys
from typing import Any

from .values import ValueStats

kernel: Any
"""The compiled module (``fused_kernel.c``), or None where the install had no C compiler."""
try:
    kernel = importlib.import_module(f"{__package__}.fused_kernel")
except ImportError:  # built without a C compiler: numpy makes the same bytes
    kernel = None

TARGETS = ("float16", "bfloat16")


def available() -> bool:
    """Whether the compiled pass was built, passes its probe, and is not turned off (``DTYPEAUDIT_NO_FUSED`` set to
    anything but ``0``)."""
    if os.environ.get("DTYPEAUDIT_NO_FUSED", "0") not in ("", "0"):
        return False
    # The loop reads the stored little-endian float32 as native words: on a big-endian machine numpy's path runs.
    return kernel is not None and sys.byteorder == "little" and _sound()


# Sixteen float32 values with every kind of outcome (exact, rounded, the largest half, 65520's tie to inf, the
# smallest normal, a subnormal, one that becomes zero, float32 subnormals, signed zeros, float32's top, inf, NaN),
# and what torch's own cast (bytes) and the numpy path (figures: ValueStats.to_fields) give for them. A build that
# rounds otherwise (fast-math from the environment's CFLAGS, a miscompile) fails this and is not used.
_PROBE = bytes.fromhex(
    "0000803fcdccccbd00e07f47ffef7f4700f07f47000080380000403300008032c21601000100008000000000000000809ec97f7f0000807f0000c07ff7cc92b8"
)
_EXPECTED = {
    "float16": (
        "003c66aeff7bff7b007c0004010000000000008000000080007c007c007e9684",
        [16, 14, 2, 2, 3, 1, 3.3999999521443642e38, 15.99609375, 1.0, True],
    ),
    "bfloat16": (
        "803fcdbd8047804780478038403380320100008000000080807f807fffff93b8",
        [16, 0, 2, 1, 0, 0, 3.3999999521443642e38, 32.0, 0.0013580054510384798, True],
    ),
}


@functools.cache
def _sound() -> bool:
    """Whether the built loop gives the probe's bytes and figures, for both targets (once per process)."""
    for target, (bits, figures) in _EXPECTED.items():
        stats = ValueStats("", "float32", target)
        out = FusedCast(target, capacity=len(_PROBE) // 4)(_PROBE, stats)
        if bytes(out).hex() != bits or stats.to_fields() != figures:
            return False
    return True


def applies(source: str, target: str, *, clamp: bool) -> bool:
    """Whether the compiled pass makes this cast: float32 to float16 or bfloat16, unclamped."""
    return source == "float32" and target in TARGETS and not clamp and available()


class FusedCast:
    """Casts float32 chunks to ``target``'s stored bits, folding their checks into a ``ValueStats`` on the way
    (the figures ``values.ValueCheck.fold`` gives). The returned array is valid until the next call."""

    def __init__(self, target: str, *, capacity: int) -> None:
        if target not in TARGETS or kernel is None:
            raise ValueError(f"no compiled cast to {target}")
        self.target = target
        self._out = memoryview(bytearray(2 * capacity))

    def __call__(self, chunk: Any, stats: ValueStats | None = None) -> memoryview:
        """``chunk``: float32 values (any buffer); ``stats``: where their checks fold (None: cast only)."""
        view = memoryview(chunk).cast("B")
        n = len(view) // 4
        out = self._out[: 2 * n]
        nonzero, nonfinite, overflow, underflow, subnormal, top, error, relative = kernel.fold_cast(view, out, self.target == "bfloat16")
        if stats is not None and n:  # an empty chunk leaves the figures as they were, as ValueCheck.fold does
            # this chunk's figures, combined as any two parts of the same values are (ValueStats.merge)
            part = ValueStats(
                "", "float32", self.target, numel=n, nonzero=nonzero, nonfinite=nonfinite, overflow=overflow,
                underflow=underflow, subnormal=subnormal, max_abs=_float32(top), max_abs_error=error,
                max_rel_error=relative, errors_measured=True,
            )  # fmt: skip
            stats.merge(part)
        return out


def _float32(bits: int) -> float:
    """The float32 whose bit pattern is ``bits``."""
    return float(struct.unpack("<f", struct.pack("<I", bits))[0])
