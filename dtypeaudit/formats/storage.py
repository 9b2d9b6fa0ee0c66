"""Where bytes live in a file: the span readers report and conversion reads through mmap."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Span:
    """``length`` bytes at ``offset`` in a file."""

    offset: int
    length: int
