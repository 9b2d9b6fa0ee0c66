"""Where the per-checkpoint work runs: in this process, in local worker processes (``--jobs N``), or as
tasks on a Dask distributed cluster (``--cluster ADDRESS``).

One shape for all three. The unit of work is a function of one input and a ``Work`` description
(``audit_one`` for scan: read, attach the model, annotate, check; ``convert_one`` for convert: one
source's whole conversion). Inputs go out in batches, since a checkpoint's metadata takes about a
millisecond to read and a task round trip costs as much; results come back as each batch completes
(progress follows them) and are put back in input order, so the report is the one a serial run writes.
A failure stays with its input: an unreadable checkpoint is a report with ``error`` set (exit 2 for it,
the others reported), and so is one that kills its Dask worker even when it runs alone. Anything else
raised in a task is raised here, as in a serial run.

The Dask side is dask.distributed used as intended: the work description is one task every batch
depends on (fetched once per worker), ``Client.map`` sends the batches, ``as_completed`` streams them
back. Dask is imported only for ``--cluster`` (the ``dask`` extra).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from .checks import Check, run_checks
from .errors import DtypeAuditError, UsageError
from .extras import require
from .inventory import CheckpointReport, Inventory

T = TypeVar("T")
Progress = Callable[[int, int, str], None]
"""Called with (inputs done, inputs in all, the last input done) as results come back."""

SERIAL_BELOW = 16
"""Fewer inputs than this are read in this process whatever ``jobs`` says: a worker pool costs more to start."""
MAX_BATCH = 64
"""Inputs per task at most: large enough that a task's round trip is small beside its work, small enough
that progress moves and a slow worker does not hold the end of the run."""
BATCHES_PER_WORKER = 4


@dataclass(frozen=True)
class Work:
    """What every checkpoint of one scan goes through; sent once to each worker, not with every task."""

    read: Callable[[str], Inventory]
    """The reader (``scan.read_target``): a path, URL or factory to its inventory."""
    checks: tuple[Check, ...] = ()
    """Per-checkpoint checks; picklable (module-level functions and partials), since they travel to workers."""
    model: Inventory | None = None
    """``--model``'s inventory, built once by the caller, attached to every checkpoint."""
    strict: bool = False
    """Raise every finding a loader might read differently to an error (``checks.strict_findings``)."""
    raise_errors: bool = False
    """Raise a reader's error instead of reporting it (``--debug``)."""


def audit_one(target: str, work: Work) -> CheckpointReport:
    """Read one checkpoint and run every check on it: the unit of a scan, wherever it runs."""
    try:
        inv = work.read(target)
    except DtypeAuditError as exc:
        if work.raise_errors:
            raise
        return CheckpointReport(path=target, format=None, error=exc.one_line(), inventory=None)
    if work.model is not None and inv.format != "factory":
        from .formats import factory

        inv = factory.attach(inv, work.model)
    inv, findings = run_checks(inv, work.checks, strict=work.strict)
    return CheckpointReport(path=target, format=inv.format, error=None, inventory=inv, findings=tuple(findings))


def run(
    fn: Callable[[str, Any], T],
    inputs: Sequence[str],
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
            progress(done, len(inputs), inputs[start + len(batch_results) - 1])
    return results


def _batches_done(
    fn: Callable[[str, Any], T],
    inputs: Sequence[str],
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


def call_batch(fn: Callable[[str, Any], T], inputs: Sequence[str], work: Any) -> list[T]:
    """One task: ``fn`` over a batch of inputs, in order."""
    return [fn(x, work) for x in inputs]


# -- local processes ------------------------------------------------------------------------------

_worker_work: Any = None


def _install(work: Any) -> None:
    """A worker process's initializer: keep the work description, sent once rather than with every batch."""
    global _worker_work
    _worker_work = work


def _call_installed(fn: Callable[[str, Any], T], inputs: Sequence[str]) -> list[T]:
    return call_batch(fn, inputs, _worker_work)


def _in_processes(fn: Callable[[str, Any], T], inputs: Sequence[str], work: Any, workers: int) -> Iterator[tuple[int, list[T]]]:
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
    fn: Callable[[str, Any], T],
    inputs: Sequence[str],
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
            sent: Sequence[str] = inputs
        else:
            if "://" not in address:
                raise UsageError(f"--cluster takes a scheduler address (tcp://host:8786) or 'local', not '{address}'")
            try:
                # how long to keep trying: dask's own setting (distributed.comm.timeouts.connect, 30 s by default)
                client = stack.enter_context(Client(address))
            except OSError as exc:
                raise UsageError(f"cannot reach the Dask scheduler at {address} ({exc})") from None
            # The workers' working directory is not ours: a relative path that names a file here is sent whole.
            sent = [os.path.abspath(x) if not os.path.isabs(x) and os.path.exists(x) else x for x in inputs]
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
                    result = [lost(inputs[i], f"the Dask worker reading it was lost ({type(exc).__name__})")]
                else:
                    result = _renamed(result, inputs[i : i + 1], sent[i : i + 1])
                future.release()
                yield i, result
        finally:
            pending.clear()  # an error or Ctrl-C: the client's close cancels what is still queued


def _same(work: Any) -> Any:
    return work


def _renamed(results: list[T], named: Sequence[str], sent: Sequence[str]) -> list[T]:
    """Reports under the paths the user named, where a relative path was sent whole (its error line too)."""
    out: list[Any] = []
    for r, n, s in zip(results, named, sent, strict=True):
        if n != s and isinstance(r, CheckpointReport):
            error = n + r.error[len(s) :] if r.error and r.error.startswith(s) else r.error
            inventory = replace(r.inventory, path=n) if r.inventory is not None else None
            r = replace(r, path=n, error=error, inventory=inventory)
        out.append(r)
    return out


# -- conversion -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ConvertWork:
    """What every source of one ``convert SOURCE...`` goes through."""

    to: str
    """The target dtype, as ``--to`` gives it."""
    options: Mapping[str, Any]
    """Keyword arguments of ``conversion.convert`` shared by every source (policy, keep, clamp, dry_run ...)."""
    outputs: Mapping[str, str] = field(default_factory=dict)
    """Source -> where its output goes, where ``-o`` names a directory; a source not here is written beside itself."""
    raise_errors: bool = False
    """Raise a source's error instead of reporting it (``--debug``)."""


@dataclass(frozen=True)
class Converted:
    """One source's conversion as its task returns it."""

    source: str
    result: Any = None
    """The ``conversion.Result``; None when ``error`` says why there is none."""
    error: str | None = None
    """None, or the one line why the source could not be converted (exit 2 for it)."""


def convert_one(source: str, work: ConvertWork) -> Converted:
    """Convert one source (plan, check, write, verify): the unit of ``convert SOURCE...``, wherever it runs."""
    from .conversion import convert

    try:
        return Converted(source, convert(source, work.to, output=work.outputs.get(source), **work.options))
    except DtypeAuditError as exc:
        if work.raise_errors:
            raise
        return Converted(source, error=exc.one_line())


def convert_lost(source: str, reason: str) -> Converted:
    return Converted(source, error=f"{source}: {reason}")
