"""Ordered results from tasks run on a few threads, a bounded number in flight."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


def ordered(tasks: Iterator[Callable[[], T]], workers: int, *, ahead: int = 2) -> Iterator[T]:
    """Each task's result, in the tasks' order; at most ``workers * ahead`` submitted and not yet consumed.
    One worker runs them inline (no thread)."""
    if workers <= 1:
        for task in tasks:
            yield task()
        return
    window: deque[Future[T]] = deque()
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="dtypeaudit-dequant") as pool:
        try:
            for task in tasks:
                window.append(pool.submit(task))
                if len(window) >= workers * ahead:
                    yield window.popleft().result()
            while window:
                yield window.popleft().result()
        finally:
            for f in window:
                f.cancel()
