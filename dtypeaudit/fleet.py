"""Where the per-checkpoint work runs: in this process, in local worker processes (``--jobs N``), or as
tasks on a Dask distributed cluster (``--cluster ADDRESS``).

One shape for all three. The unit of work is a function of one input and a work description
(``pipeline.audit_one`` for scan: the one pipeline on one checkpoint; ``conversion.convert_one`` for
convert: one source's whole conversion); this module knows neither, only where they run. Inputs go out
in batches, since a checkpoint's metadata takes about a millisecond to read and a task round trip costs
as much; results come back as each batch completes (progress follows them) and are put back in input
order, so the report is the one a serial run writes. A failure stays with its input: an unreadable
checkpoint is a report with ``error`` set (exit 2 for it, the others reported), and so is one that
kills its Dask worker even when it runs alone. Anything else raised in a task is raised here, as in a
serial run.

The Dask side is dask.distributed used as intended: the work description is one task every batch
depends on (fetched once per worker), ``Client.map`` sends the batches, ``as_completed`` streams them
back. Dask is imported only for ``--cluster`` (the ``dask`` extra).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar, Union

from .errors import UsageError
from .extras import require
from .formats.locate import TargetRef
from .inventory import CheckpointReport

T = TypeVar("T")
Input = Union[TargetRef, str]
"""One input: a scan's target or a convert's source, parsed once (``TargetRef``); a plain string (a library caller's)
is sent as it is."""
Progress = Callable[[int, int, str], None]
"""Called with (inputs done, inputs in all, the last input done) as results come back."""

SERIAL_BELOW = 16
"""Fewer inputs than this are read in this process whatever ``jobs`` says: a worker pool costs more to start."""
MAX_BATCH = 64
"""Inputs per task at most: large enough that a task's round trip is small beside its work, small enough
that progress moves and a slow worker does not hold the end of the run."""
BATCHES_PER_WORKER = 4


def run(
    fn: Callable[[Any, Any], T],
    inputs: Sequence[Input],
    work: Any,
    *,
    jobs: int | None = None,
    cluster: str | None = None,
    progress: Progress | None = None,
    lost: Callable[[str, str], T] | None = None,
) -> list[T]:
    """``[fn(x, work) for x in inputs]``, here, in ``jobs`` local processes or on the Dask cluster at ``cluster``.

    ``jobs``: None means one process per core (serial below SERIAL_BELOW inputs), 1 means this process.
    ``cluster``: ``tcp://host:port`` (a running scheduler) or ``local`` (a LocalCluster of ``jobs`` worker
    processes, one per core by default). ``lost(input, reason)`` stands in for the result of an input that
    kills its Dask worker even when it runs alone (see ``_on_dask``); without it that raises.
    """
    if jobs is not None and jobs < 1:
        raise UsageError(f"--jobs must be at least 1, not {jobs}")
    results: list[Any] = [None] * len(inputs)
    done = 0
    for start, batch_results in _batches_done(fn, inputs, work, jobs=jobs, cluster=cluster, lost=lost):
        results[start : start + len(batch_results)] = batch_results
        done += len(batch_results)
        if progress:
            progress(done, len(inputs), name_of(inputs[start + len(batch_results) - 1]))
    return results


def _batches_done(
    fn: Callable[[Any, Any], T],
    inputs: Sequence[Input],
    work: Any,
    *,
    jobs: int | None,
    cluster: str | None,
    lost: Callable[[str, str], T] | None,
) -> Iterator[tuple[int, list[T]]]:
    """(index of a batch's first input, its results), as batches complete."""
    if cluster is not None:
        yield from _on_dask(fn, inputs, work, cluster, jobs, lost)
        return
    workers = min(jobs or os.cpu_count() or 1, len(inputs))
    if workers <= 1 or (jobs is None and len(inputs) < SERIAL_BELOW):
        for i, x in enumerate(inputs):
            yield i, [fn(x, work)]
        return
    yield from _in_processes(fn, inputs, work, workers)


def batches(n: int, workers: int) -> list[tuple[int, int]]:
    """(start, stop) ranges covering ``n`` inputs: BATCHES_PER_WORKER per worker, at most MAX_BATCH inputs each."""
    size = max(1, min(MAX_BATCH, -(-n // (workers * BATCHES_PER_WORKER))))
    return [(start, min(n, start + size)) for start in range(0, n, size)]


def call_batch(fn: Callable[[Any, Any], T], inputs: Sequence[Input], work: Any) -> list[T]:
    """One task: ``fn`` over a batch of inputs, in order."""
    return [fn(x, work) for x in inputs]


# -- local processes ------------------------------------------------------------------------------

_worker_work: Any = None


def _install(work: Any) -> None:
    """A worker process's initializer: keep the work description, sent once rather than with every batch."""
    global _worker_work
    _worker_work = work


def _call_installed(fn: Callable[[Any, Any], T], inputs: Sequence[Input]) -> list[T]:
    return call_batch(fn, inputs, _worker_work)


def _in_processes(fn: Callable[[Any, Any], T], inputs: Sequence[Input], work: Any, workers: int) -> Iterator[tuple[int, list[T]]]:
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

    with ProcessPoolExecutor(max_workers=workers, initializer=_install, initargs=(work,)) as pool:
        pending = {pool.submit(_call_installed, fn, inputs[start:stop]): start for start, stop in batches(len(inputs), workers)}
        try:
            while pending:
                finished, _ = wait(pending, return_when=FIRST_COMPLETED)
                for future in finished:
                    yield pending.pop(future), future.result()
        finally:  # an error or Ctrl-C: start nothing more
            for future in pending:
                future.cancel()


# -- Dask -----------------------------------------------------------------------------------------


def _on_dask(
    fn: Callable[[Any, Any], T],
    inputs: Sequence[Input],
    work: Any,
    address: str,
    jobs: int | None,
    lost: Callable[[str, str], T] | None,
) -> Iterator[tuple[int, list[T]]]:
    require("dask", "--cluster")
    from distributed import Client, LocalCluster, as_completed
    from distributed.client import FutureCancelledError
    from distributed.scheduler import KilledWorker

    with ExitStack() as stack:
        if address == "local":
            cluster = stack.enter_context(
                LocalCluster(n_workers=jobs or os.cpu_count() or 1, threads_per_worker=1, processes=True, dashboard_address=":0")
            )
            client = stack.enter_context(Client(cluster))
            sent: Sequence[Input] = inputs
        else:
            if "://" not in address:
                raise UsageError(f"--cluster takes a scheduler address (tcp://host:8786) or 'local', not '{address}'")
            try:
                # how long to keep trying: dask's own setting (distributed.comm.timeouts.connect, 30 s by default)
                client = stack.enter_context(Client(address))
            except OSError as exc:
                raise UsageError(f"cannot reach the Dask scheduler at {address} ({exc})") from None
            # The workers' working directory is not ours: a relative path that names a file here is sent whole.
            sent = [_absolute(x) for x in inputs]
        workers = max(1, sum(client.nthreads().values()))
        # A task that returns the work description, rather than scattered data: each worker fetches it once,
        # and the scheduler can make it again should every worker holding it die.
        shipped = client.submit(_same, work, pure=False)

        def submit(ranges: list[tuple[int, int]]) -> list[Any]:
            futures = client.map(call_batch, [fn] * len(ranges), [sent[a:b] for a, b in ranges], work=shipped, pure=False)
            span.update((f.key, r) for f, r in zip(futures, ranges, strict=True))
            return futures

        span: dict[Any, tuple[int, int]] = {}
        pending = as_completed(submit(batches(len(sent), workers)))
        suspects: list[int] = []
        try:
            for future in pending:
                a, b = span.pop(future.key)
                try:
                    result = future.result()
                except (KilledWorker, FutureCancelledError):
                    # Dask blames every task on a worker that died, not only the one that killed it: try each input alone
                    if b - a > 1:
                        pending.update(submit([(i, i + 1) for i in range(a, b)]))
                    else:
                        suspects.append(a)
                    continue
                future.release()
                yield a, _renamed(result, inputs[a:b], sent[a:b])
            # Then each suspect alone on the cluster, one at a time: a worker that dies now died of that input.
            for i in sorted(suspects):
                (future,) = submit([(i, i + 1)])
                span.clear()
                try:
                    result = future.result()
                except (KilledWorker, FutureCancelledError) as exc:
                    if lost is None:
                        raise
                    result = [lost(name_of(inputs[i]), f"the Dask worker reading it was lost ({type(exc).__name__})")]
                else:
                    result = _renamed(result, inputs[i : i + 1], sent[i : i + 1])
                future.release()
                yield i, result
        finally:
            pending.clear()  # an error or Ctrl-C: the client's close cancels what is still queued


def _same(work: Any) -> Any:
    return work


def name_of(x: Input) -> str:
    """The name an input goes by in reports and progress lines."""
    return x.text if isinstance(x, TargetRef) else x


def _absolute(x: Input) -> Input:
    """A local target named by a relative path, made absolute: the workers' working directory is not ours. A plain
    string (a caller of ``run`` that parsed nothing) is taken as a path when it names a file here."""
    if not isinstance(x, TargetRef):
        return os.path.abspath(x) if not os.path.isabs(x) and os.path.exists(x) else x
    if not x.is_local or not isinstance(x.where, Path) or x.where.is_absolute():
        return x
    whole = os.path.abspath(x.where)
    return replace(x, text=whole, where=Path(whole))


def _renamed(results: list[T], named: Sequence[Input], sent: Sequence[Input]) -> list[T]:
    """Reports under the paths the user named, where a relative path was sent whole (its error line too)."""
    out: list[Any] = []
    for r, named_as, sent_as in zip(results, named, sent, strict=True):
        n, s = name_of(named_as), name_of(sent_as)
        if n != s and isinstance(r, CheckpointReport):
            error = n + r.error[len(s) :] if r.error and r.error.startswith(s) else r.error
            inventory = replace(r.inventory, path=n) if r.inventory is not None else None
            r = replace(r, path=n, error=error, inventory=inventory)
        out.append(r)
    return out
