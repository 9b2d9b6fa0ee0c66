"""The conversion's executor: a pool of threads in this process, making a conversion's bytes piece by piece.

A piece is up to ``PIECE_ELEMENTS`` values of one source record. Making it is one pass over its chunks, each
chunk read once while it is in cache: its value checks folded (``values.ValueCheck``), cast (``npcast``) or
copied, CRC'd and written at the piece's place in the output with ``pwrite``; a piece with no output only checks.
numpy's loops, the CRC and ``pwrite`` release the GIL, so the threads make pieces on every core. Pieces start on
chunk boundaries, so a record's checks are folded over exactly the chunks one pass would fold, whichever thread
made each piece: counts add, maxima combine (``ValueStats.merge``), and CRCs combine (``crc32_combine``) in
record order.

Memory stays bounded whatever the checkpoint's size: a piece is read from the source's map a chunk at a time
and written as it is made, so each thread holds one chunk's buffers, and ``ordered`` keeps only a few pieces in
flight. A computed record's tasks (a dequantized weight's pieces, ``conversion.write.make_records``) run on the
same ``ordered``, bounding the bytes their results hold.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable, Generator, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

from . import dtypes, npcast
from .crc import crc32, crc32_combine
from .values import CHUNK_BYTES, ValueCheck, ValueStats, float32_chunks

T = TypeVar("T")

CHUNK_ELEMENTS = CHUNK_BYTES // 4
"""Values per chunk, whatever their dtype: the value checks' step (``values.float32_chunks``), so that a piece's
chunks are the chunks one pass over the record would make."""
PIECE_ELEMENTS = 4 * CHUNK_ELEMENTS
"""Values per piece (16 MB of float32): small enough that the threads finish together, large enough that
handing a piece over costs nothing next to making it."""
COPY_CHUNK_BYTES = 8 << 20
"""A record copied unchanged and unchecked goes through in larger pieces: there is no cast to keep in cache."""


def thread_count(most: int = 4) -> int:
    """Threads for CPU work: the cores this process may run on, at most ``most``."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(most, cores))


def ordered(
    tasks: Iterator[tuple[Callable[[], T], int]],
    threads: int,
    *,
    budget: int,
    ahead: int = 2,
    started: Callable[[], object] | None = None,
) -> Generator[T, None, None]:
    """Each task's result, in the tasks' order: the one executor. Tasks come with the bytes their result holds; a
    task is submitted while those in flight and not yet consumed hold less than ``budget`` and number fewer than
    ``threads * ahead`` (one always may: memory stays under ``budget`` plus one result). ``started`` runs on the
    caller's thread once the first tasks are submitted (work that overlaps theirs). One thread runs them inline."""
    if threads <= 1:
        if started is not None:
            started()
        for task, _ in tasks:
            yield task()
        return
    window: deque[tuple[Future[T], int]] = deque()
    held = 0
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="dtypeaudit-work") as pool:
        try:
            for task, cost in tasks:
                while window and (held >= budget or len(window) >= threads * ahead):
                    if started is not None:
                        overlap, started = started, None
                        overlap()
                    future, done_cost = window.popleft()
                    held -= done_cost
                    yield future.result()
                window.append((pool.submit(task), cost))
                held += cost
            if started is not None:
                started()
            while window:
                yield window.popleft()[0].result()
        finally:
            for future, _ in window:
                future.cancel()


@dataclass(frozen=True)
class Piece:
    """One piece of work: ``length`` bytes of ``dtype`` at ``offset`` in ``source``, cast to ``target`` (copied
    when the two are equal) and written at ``out_offset`` in ``out`` (None: checked only); ``check``: fold its
    value checks."""

    source: str
    offset: int
    length: int
    dtype: str
    target: str
    out: str | None
    out_offset: int
    check: bool


@dataclass(frozen=True)
class Job:
    """One record (or, with no output, one unit to check): what a writer hands over. ``unit`` names the
    ``ValueStats`` its checks fold into (None: unchecked)."""

    source: str
    offset: int
    length: int
    dtype: str
    target: str
    out: str | None = None
    out_offset: int = 0
    unit: str | None = None


@dataclass
class Made:
    """What a piece made: the CRC-32 and length of the bytes it wrote, and its checks' statistics."""

    crc: int = 0
    length: int = 0
    stats: ValueStats | None = None


def pieces_of(jobs: list[Job]) -> Iterator[tuple[int, Piece]]:
    """Each job's pieces, in order, with the index of the job each belongs to."""
    for index, job in enumerate(jobs):
        if job.dtype == job.target and job.unit is None:  # copied unchecked: any dtype, as bytes
            itemsize = out_itemsize = 1
            step = PIECE_ELEMENTS * 4
        else:
            itemsize, out_itemsize = dtypes.get(job.dtype).itemsize, dtypes.get(job.target).itemsize
            step = PIECE_ELEMENTS
        numel = job.length // itemsize
        for first in range(0, numel, step) if numel else range(1):
            count = min(step, numel - first)
            out_offset = job.out_offset + first * out_itemsize
            yield (
                index,
                Piece(
                    job.source,
                    job.offset + first * itemsize,
                    count * itemsize,
                    job.dtype,
                    job.target,
                    job.out,
                    out_offset,
                    job.unit is not None,
                ),
            )


def write_at(fd: int, data: Any, where: int) -> None:
    """All of ``data`` at ``where`` in the file ``fd`` (``pwrite`` may write less than it is given)."""
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, where)
        where += n
        view = view[n:]


class Maker:
    """Makes pieces on one thread: its casters, value check and open outputs kept from piece to piece (their
    buffers are reused, so a maker is never shared between threads)."""

    def __init__(self, *, clamp: bool, view: Callable[[str, int, int], Any]) -> None:
        self.clamp = clamp
        self._view = view
        self._check: ValueCheck | None = None
        self._casters: dict[tuple[str, str], npcast.NumpyCaster] = {}
        self._outputs: dict[str, int] = {}

    def close(self) -> None:
        for fd in self._outputs.values():
            os.close(fd)
        self._outputs.clear()

    def make(self, piece: Piece) -> Made:
        made = Made()
        copy = piece.dtype == piece.target
        fd = self._output(piece.out) if piece.out is not None else None
        buffer = self._view(piece.source, piece.offset, piece.length)

        def write(data: Any) -> None:
            assert fd is not None
            view = memoryview(data).cast("B")
            made.crc = crc32(view, made.crc)
            write_at(fd, view, piece.out_offset + made.length)
            made.length += len(view)

        if not piece.check and fd is None:
            return made
        if not piece.check and copy:
            for start in range(0, piece.length, COPY_CHUNK_BYTES):
                write(buffer[start : start + COPY_CHUNK_BYTES])
            return made
        import numpy as np

        if not piece.check:
            stored = npcast.storage_dtype(piece.dtype)
            caster = self._caster(piece.dtype, piece.target)
            numel = piece.length // stored.itemsize
            for first in range(0, numel, CHUNK_ELEMENTS):
                x = np.frombuffer(buffer, stored, min(CHUNK_ELEMENTS, numel - first), first * stored.itemsize)
                with np.errstate(over="ignore", invalid="ignore"):
                    write(caster(x))
            return made
        if self._check is None:
            self._check = ValueCheck()
        made.stats = ValueStats("", piece.dtype, piece.target)
        numel = piece.length // dtypes.get(piece.dtype).itemsize
        cast = None if copy or fd is None else self._caster(piece.dtype, piece.target)
        for as_float32, original in float32_chunks(buffer, piece.dtype, 0, numel):
            looked = self._check.fold(made.stats, as_float32, original, clamp=self.clamp)
            if fd is None:
                continue
            if cast is None:
                write(original)
            else:
                with np.errstate(over="ignore", invalid="ignore"):
                    write(cast(original, looked))  # what the fold found of these values, not found again
        return made

    def _caster(self, dtype: str, target: str) -> npcast.NumpyCaster:
        key = (dtype, target)
        if key not in self._casters:
            self._casters[key] = npcast.NumpyCaster(dtype, target, clamp=self.clamp, capacity=CHUNK_ELEMENTS)
        return self._casters[key]

    def _output(self, path: str) -> int:
        if path not in self._outputs:
            self._outputs[path] = os.open(path, os.O_WRONLY)
        return self._outputs[path]


@dataclass
class Workers:
    """The threads making ``Job``s piece by piece, each with a ``Maker`` of its own for one ``run``.

    ``checks``: the statistics each checked unit folds into (``Job.unit``), every piece's merged in; ``claim``
    says which checked unit, if any, a job's source bytes are exactly (once: see ``conversion.value_policy.ValueChecks``).
    ``view`` gives the bytes of a source (``MappedCheckpoint.bytes_at``, the conversion's one way to them);
    ``threads``: how many make pieces (one: the calling thread alone).
    """

    clamp: bool
    view: Callable[[str, int, int], Any]
    checks: Mapping[str, ValueStats] = field(default_factory=dict)
    claim: Callable[[str, int, int], str | None] | None = None
    threads: int = field(default_factory=lambda: thread_count())
    _disk: Writeback | None = field(default=None, init=False, repr=False)

    def unit_of(self, source: str, offset: int, length: int) -> str | None:
        return self.claim(source, offset, length) if self.claim is not None else None

    def __enter__(self) -> Workers:
        self._disk = Writeback()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._disk is not None:
            self._disk.close()

    def run(
        self, jobs: list[Job], *, progress: Callable[[int], None] | None = None, meanwhile: Callable[[], object] | None = None
    ) -> list[int]:
        """Make every job (``meanwhile`` on this thread, while the pool starts on them); each job's checks are
        folded into ``checks[job.unit]``. Returns each job's CRC-32 (0 for a job with no output)."""
        disk = self._disk
        assert disk is not None, "use Workers as a context manager"
        work = list(pieces_of(jobs))
        local = threading.local()
        makers: list[Maker] = []

        def make(piece: Piece) -> Made:
            maker = getattr(local, "maker", None)
            if maker is None:
                maker = local.maker = Maker(clamp=self.clamp, view=self.view)
                makers.append(maker)  # list.append is atomic; closed below, once no thread makes pieces
            made = maker.make(piece)
            if piece.out is not None:
                disk.landed(piece.out, made.length)
            return made

        crcs = [0] * len(jobs)
        # A result holds no bytes (cost 0): what is in flight is each thread's chunk, and a few pieces queued.
        results = ordered(((partial(make, piece), 0) for _, piece in work), self.threads, budget=1, started=meanwhile)
        try:
            for (index, piece), made in zip(work, results, strict=True):
                crcs[index] = crc32_combine(crcs[index], made.crc, made.length)
                unit = jobs[index].unit
                if unit is not None and made.stats is not None:
                    self.checks[unit].merge(made.stats)
                if progress is not None:
                    progress(piece.length)
        finally:
            results.close()  # on an error: the pending pieces cancelled, the running ones finished, before the outputs close
            for maker in makers:
                maker.close()
        return crcs


class Writeback:
    """Makes a file's bytes durable as they land, so that the fsync before the rename finds little left.

    Every ``STEP`` bytes reported for a file, a thread of its own calls ``fdatasync`` on it, while the writers go
    on. Starting writeback alone (``posix_fadvise``, ``sync_file_range``) is not enough: a virtual disk with a
    write cache on its host empties that cache only on a flush, so the final fsync still waits for every byte
    (benchmarks/CONVERT.md, round 4). On a disk without such a cache the syncs are the writeback itself. Any
    thread may report bytes; the written pages stay cached for verification to read back.

    One sync is in flight per file, so while the disk is the slower side the syncs follow each other and take
    whatever landed meanwhile; ``STEP`` only sets how soon the first starts. At 64 MiB the disk sat idle for the
    first 0.2 s of a 1.5 GB conversion (benchmarks/CONVERT.md, round 5)."""

    STEP = 8 << 20

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dtypeaudit-writeback")
        self._unsynced: dict[str, int] = {}
        self._syncing: set[str] = set()
        self._lock = threading.Lock()

    def __enter__(self) -> Writeback:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def landed(self, path: str, length: int) -> None:
        """``length`` more bytes of ``path`` are written (where in the file does not matter: a sync takes them all)."""
        with self._lock:
            self._unsynced[path] = self._unsynced.get(path, 0) + length
            if self._unsynced[path] < self.STEP or path in self._syncing:
                return
            self._unsynced[path] = 0
            self._syncing.add(path)
        self._pool.submit(self._sync, path)

    def _sync(self, path: str) -> None:
        # Opened for each sync, not kept: a directory written in thousands of shards would hold as many descriptors.
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                _datasync(fd)
            finally:
                os.close(fd)
        except OSError:  # only a head start: the fsync before the rename reports what matters
            pass
        finally:
            with self._lock:
                self._syncing.discard(path)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


_datasync = getattr(os, "fdatasync", os.fsync)  # macOS and Windows have no fdatasync
