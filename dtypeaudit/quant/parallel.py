"""Ordered results from tasks run on a few threads, the memory their results hold in flight bounded."""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


def workers(most: int = 4) -> int:
    """Threads for CPU work: the cores this process may run on, at most ``most``."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(most, cores))


def ordered(tasks: Iterator[tuple[Callable[[], T], int]], threads: int, *, budget: int, ahead: int = 2) -> Iterator[T]:
    """Each task's result, in the tasks' order. Tasks come with the bytes their result holds; a task is submitted
    while those in flight and not yet consumed hold less than ``budget`` and number fewer than ``threads * ahead``
    (one always may: memory stays under ``budget`` plus one result). One thread runs them inline (no pool)."""
    if threads <= 1:
        for task, _ in tasks:
            yield task()
        return
    window: deque[tuple[Future[T], int]] = deque()
    held = 0
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="dtypeaudit-dequant") as pool:
        try:
            for task, cost in tasks:
                while window and (held >= budget or len(window) >= threads * ahead):
                    future, done_cost = window.popleft()
                    held -= done_cost
                    yield future.result()
                window.append((pool.submit(task), cost))
                held += cost
            while window:
                yield window.popleft()[0].result()
        finally:
            for future, _ in window:
                future.cancel()
