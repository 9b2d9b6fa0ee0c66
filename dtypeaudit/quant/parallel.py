"""The dequantizer's executor: the conversion's own (``pieces.ordered`` on ``pieces.thread_count`` threads), under
the names the dequantizer calls it by."""

from __future__ import annotations

from ..pieces import ordered
from ..pieces import thread_count as workers

__all__ = ["ordered", "workers"]
