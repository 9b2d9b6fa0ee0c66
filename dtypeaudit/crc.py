"""The CRC-32 every writer and verifier uses: Intel ISA-L's where installed (the same CRC as zlib's, several times
faster; on a large checkpoint zlib's was a fifth of the time spent writing), else zlib's. Both release the GIL
over a large buffer, so the conversion's threads CRC their pieces side by side."""

from __future__ import annotations

try:
    from isal.isal_zlib import crc32, crc32_combine
except ImportError:  # pragma: no cover - isal is a dependency, but a missing wheel must not break writing
    from zlib import crc32

    def crc32_combine(crc1: int, crc2: int, length2: int, /) -> int:
        return crc32_of_parts(crc1, crc2, length2)


def crc32_of_parts(crc1: int, crc2: int, length2: int, /) -> int:
    """The CRC-32 of A + B from A's and B's (``length2`` bytes), with any CRC-32: CRC-32 is affine in its start
    value, so A's CRC extended over B's length of zeros, less what those zeros give from 0, plus B's CRC is
    A + B's. Costs a pass over ``length2`` zeros (ISA-L's ``crc32_combine`` does it in a few steps)."""
    zeros = bytes(min(length2, 1 << 20))
    a, b = crc1, 0
    left = length2
    while left:
        n = min(left, len(zeros))
        a, b = crc32(zeros[:n], a), crc32(zeros[:n], b)
        left -= n
    return a ^ b ^ crc2


__all__ = ["crc32", "crc32_combine", "crc32_of_parts"]
