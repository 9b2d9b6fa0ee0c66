"""A conversion's bytes made on both cores: every record cut into pieces that this process and one child make.

A piece is up to ``PIECE_ELEMENTS`` values of one source record. Making it is one pass over its chunks, each
chunk read once while it is in cache: cast and its value checks folded, by one compiled loop for float32 to
float16/bfloat16 (``fused.FusedCast``) or else by numpy (``values.ValueCheck``, the same fold as the checks
alone make, then npcast's cast, or a copy), then CRC'd and written at the piece's place in the output with
``pwrite``; a piece with no output only checks. Pieces start on chunk boundaries, so a record's checks
are folded over exactly the chunks one pass would fold, whichever process made each piece: counts add, maxima
combine (``ValueStats.merge``), and CRCs combine (``crc32_combine``) in record order.

The child (``serve``) imports this module's few neighbours only (numpy only for a piece the compiled loop does
not make), so it starts in under a tenth of a second; records go to it one piece at a time, two pieces ahead,
from the same queue this process takes its own from, so neither waits for the other at the end by more than a
piece. Work under ``CHILD_MIN_BYTES`` is
made here alone. A child that fails (it cannot start, a file it cannot open) only means this process makes
the pieces it had: the result is the same.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from . import dtypes, fused, npcast
from .crc import crc32, crc32_combine
from .values import CHUNK_BYTES, ValueCheck, ValueStats, float32_chunks

CHUNK_ELEMENTS = CHUNK_BYTES // 4
"""Values per chunk, whatever their dtype: the value checks' step (``values.float32_chunks``), so that a piece's
chunks are the chunks one pass over the record would make."""
PIECE_ELEMENTS = 16 * CHUNK_ELEMENTS
"""Values per piece (16 MB of float32): small enough that the two processes finish together, large enough that
handing a piece over costs nothing next to making it."""
COPY_CHUNK_BYTES = 8 << 20
"""A record copied unchanged and unchecked goes through in larger pieces: there is no cast to keep in cache."""
CHILD_MIN_BYTES = 64 << 20
"""Work on fewer source bytes than this is made in this process alone: a child costs a tenth of a second to start."""


@dataclass(frozen=True)
class Piece:
    """One piece of work, as it crosses to the child: ``length`` bytes of ``dtype`` at ``offset`` in ``source``,
    cast to ``target`` (copied when the two are equal) and written at ``out_offset`` in ``out`` (None: checked
    only); ``check``: fold its value checks."""

    id: int
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
    n = 0
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
            yield (
                index,
                Piece(
                    n,
                    job.source,
                    job.offset + first * itemsize,
                    count * itemsize,
                    job.dtype,
                    job.target,
                    job.out,
                    job.out_offset + first * out_itemsize,
                    job.unit is not None,
                ),
            )
            n += 1


def write_at(fd: int, data: Any, where: int) -> None:
    """All of ``data`` at ``where`` in the file ``fd`` (``pwrite`` may write less than it is given)."""
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, where)
        where += n
        view = view[n:]


class Maker:
    """Makes pieces in one process: its casters, value check and open outputs kept from piece to piece."""

    def __init__(self, *, clamp: bool, view: Callable[[str, int, int], Any]) -> None:
        self.clamp = clamp
        self._view = view
        self._check: ValueCheck | None = None
        self._casters: dict[tuple[str, str], npcast.NumpyCaster] = {}
        self._fused: dict[str, fused.FusedCast] = {}
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
        if fused.applies(piece.dtype, piece.target, clamp=self.clamp):  # checks and cast in one compiled loop
            if piece.check:
                made.stats = ValueStats("", piece.dtype, piece.target)
            cast_fused = self._fused_cast(piece.target)
            for start in range(0, piece.length, CHUNK_BYTES):
                out = cast_fused(buffer[start : start + CHUNK_BYTES], made.stats)
                if fd is not None:
                    write(out)
            return made
        if not piece.check and copy:
            for start in range(0, piece.length, COPY_CHUNK_BYTES):
                write(buffer[start : start + COPY_CHUNK_BYTES])
            return made
        import numpy as np  # only here: the paths above need none, and start writing before it is imported

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

    def _fused_cast(self, target: str) -> fused.FusedCast:
        if target not in self._fused:
            self._fused[target] = fused.FusedCast(target, capacity=CHUNK_ELEMENTS)
        return self._fused[target]

    def _caster(self, dtype: str, target: str) -> npcast.NumpyCaster:
        key = (dtype, target)
        if key not in self._casters:
            self._casters[key] = npcast.NumpyCaster(dtype, target, clamp=self.clamp, capacity=CHUNK_ELEMENTS)
        return self._casters[key]

    def _output(self, path: str) -> int:
        if path not in self._outputs:
            self._outputs[path] = os.open(path, os.O_WRONLY)
        return self._outputs[path]


def mapped_view() -> tuple[Callable[[str, int, int], Any], Callable[[], None]]:
    """A ``view(path, offset, length)`` over files mapped read-only on first use, and its closer (the child's)."""
    import mmap

    maps: dict[str, mmap.mmap] = {}

    def view(path: str, offset: int, length: int) -> Any:
        if path not in maps:
            with open(path, "rb") as fh:
                maps[path] = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        return memoryview(maps[path])[offset : offset + length]

    def close() -> None:
        for mm in maps.values():
            try:
                mm.close()
            except BufferError:  # a view still alive in a traceback: its owner unmaps it
                pass

    return view, close


# -- the two processes -------------------------------------------------------------------------------


@dataclass
class Workers:
    """This process and, for large work, one child, making ``Job``s piece by piece.

    ``checks``: the statistics each checked unit folds into (``Job.unit``), every piece's merged in; ``claim``
    says which checked unit, if any, a job's source bytes are exactly (once: see ``conversion.checks.ValueChecks``).
    ``view`` gives this process's bytes of a source (``MappedCheckpoint.bytes_at``, the conversion's one way to
    them); ``child``: whether one may help (it is started by the first run of at least ``CHILD_MIN_BYTES``).
    """

    clamp: bool
    view: Callable[[str, int, int], Any]
    checks: Mapping[str, ValueStats] = field(default_factory=dict)
    claim: Callable[[str, int, int], str | None] | None = None
    child: bool = False
    _proc: Any = field(default=None, init=False, repr=False)
    _maker: Maker | None = field(default=None, init=False, repr=False)
    _disk: Writeback | None = field(default=None, init=False, repr=False)

    def unit_of(self, source: str, offset: int, length: int) -> str | None:
        return self.claim(source, offset, length) if self.claim is not None else None

    def __enter__(self) -> Workers:
        self._maker = Maker(clamp=self.clamp, view=self.view)
        self._disk = Writeback()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._maker is not None:
            self._maker.close()
        if self._disk is not None:
            self._disk.close()
        if exc[0] is None:
            self.retire_child()
            return
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.kill()
            proc.wait()

    def retire_child(self) -> None:
        """Let the child go now, when no more pieces are in sight (a file is written, verification comes next): it
        exits while this process goes on, and is waited for on a thread that the interpreter joins at its exit, so
        its CPU time is this process's and none is left running. A later run starts another if it needs one."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            proc.stdin.close()
        except OSError:
            pass
        reaper = threading.Thread(target=_reap, args=(proc,), name="dtypeaudit-reap")
        reaper.start()
        _REAPERS[:] = [t for t in _REAPERS if t.is_alive()] + [reaper]

    def run(
        self, jobs: list[Job], *, progress: Callable[[int], None] | None = None, meanwhile: Callable[[], object] | None = None
    ) -> list[int]:
        """Make every job (``meanwhile`` first, in this process, while the child starts on them); each job's
        checks are folded into ``checks[job.unit]``. Returns each job's CRC-32 (0 for a job with no output)."""
        assert self._maker is not None, "use Workers as a context manager"
        owner: dict[int, int] = {}
        queue: deque[Piece] = deque()
        for index, piece in pieces_of(jobs):
            owner[piece.id] = index
            queue.append(piece)
        made: dict[int, Made] = {}
        lock = threading.Lock()
        feeder = None
        if self._proc is None and self.child and queue and sum(job.length for job in jobs) >= CHILD_MIN_BYTES:
            self._proc = _start_child(self.clamp)
            self.child = self._proc is not None  # one that cannot start is not tried again
        if self._proc is not None:
            feeder = _Feeder(self._proc, queue, lock, made, self._disk)
            feeder.start()
        try:
            if meanwhile is not None:
                meanwhile()
            self._make_queued(queue, lock, made, progress, feeder)
            if feeder is not None:
                feeder.join()
                for n in feeder.take_progress():
                    if progress is not None:
                        progress(n)
                if feeder.failed:  # what it had went back on the queue: made here, and no child from now on
                    self._proc.wait()
                    self._proc, self.child = None, False
                    self._make_queued(queue, lock, made, progress, None)
                feeder = None
        finally:
            if feeder is not None:
                feeder.stop()
        return self._combine(jobs, owner, made)

    def _make_queued(
        self,
        queue: deque[Piece],
        lock: threading.Lock,
        made: dict[int, Made],
        progress: Callable[[int], None] | None,
        feeder: _Feeder | None,
    ) -> None:
        """Make pieces from the front of the queue until it is empty (the child takes from it too)."""
        assert self._maker is not None
        while True:
            with lock:
                piece = queue.popleft() if queue else None
            if piece is None:
                return
            result = self._maker.make(piece)
            with lock:
                made[piece.id] = result
            if self._disk is not None and piece.out is not None:
                self._disk.landed(piece.out, result.length)
            if progress is not None:
                progress(piece.length)
                for n in feeder.take_progress() if feeder is not None else ():
                    progress(n)

    def _combine(self, jobs: list[Job], owner: dict[int, int], made: dict[int, Made]) -> list[int]:
        if set(made) != set(owner):
            raise RuntimeError(f"{len(owner) - len(made)} of {len(owner)} pieces were not made")  # our bug, never a result
        crcs = [0] * len(jobs)
        for piece_id in sorted(made):
            job = jobs[owner[piece_id]]
            result = made[piece_id]
            crcs[owner[piece_id]] = crc32_combine(crcs[owner[piece_id]], result.crc, result.length)
            if job.unit is not None and result.stats is not None:
                self.checks[job.unit].merge(result.stats)
        return crcs


class _Feeder(threading.Thread):
    """Hands the child pieces from the shared queue, two ahead, and collects what it made."""

    AHEAD = 2

    def __init__(
        self,
        proc: Any,
        queue: deque[Piece],
        lock: threading.Lock,
        made: dict[int, Made],
        disk: Writeback | None,
    ) -> None:
        super().__init__(name="dtypeaudit-pieces", daemon=True)
        self._proc, self._queue, self._lock, self._made, self._disk = proc, queue, lock, made, disk
        self._out: dict[int, Piece] = {}
        self._progress: list[int] = []
        self.failed = False

    def take_progress(self) -> list[int]:
        with self._lock:
            done, self._progress = self._progress, []
        return done

    def stop(self) -> None:
        self.failed = True
        self._proc.kill()
        self.join()

    def _send(self) -> bool:
        with self._lock:
            piece = self._queue.popleft() if self._queue else None
            if piece is None:
                return False
            self._out[piece.id] = piece
        self._proc.stdin.write((json.dumps(asdict(piece)) + "\n").encode())
        self._proc.stdin.flush()
        return True

    def run(self) -> None:
        try:
            for _ in range(self.AHEAD):
                self._send()
            while self._out:
                line = self._proc.stdout.readline()
                if not line:
                    raise OSError("the child stopped")
                piece_id, crc, length, stats = json.loads(line)
                piece = self._out[piece_id]
                result = Made(crc, length, None if stats is None else ValueStats.from_fields(piece.dtype, piece.target, stats))
                with self._lock:
                    del self._out[piece_id]  # only now: a reply that cannot be read leaves its piece to be made here
                    self._made[piece_id] = result
                    self._progress.append(piece.length)
                if self._disk is not None and piece.out is not None:
                    self._disk.landed(piece.out, length)
                self._send()
        except (OSError, ValueError, KeyError, TypeError):
            self.failed = True
            with self._lock:  # what it had goes back to the front of the queue, for this process to make
                self._queue.extendleft(sorted(self._out.values(), key=lambda p: p.id, reverse=True))
                self._out.clear()
            self._proc.kill()


class Writeback:
    """Makes a file's bytes durable as they land, so that the fsync before the rename finds little left.

    Every ``STEP`` bytes reported for a file, a thread of its own calls ``fdatasync`` on it, while the writers go
    on. Starting writeback alone (``posix_fadvise``, ``sync_file_range``) is not enough: a virtual disk with a
    write cache on its host empties that cache only on a flush, so the final fsync still waits for every byte
    (benchmarks/CONVERT.md, round 4). On a disk without such a cache the syncs are the writeback itself. Any
    thread may report bytes; the written pages stay cached for verification to read back.

    One sync is in flight per file, so while the disk is the slower side (it is, once the compiled pass makes the
    bytes) the syncs follow each other and take whatever landed meanwhile; ``STEP`` only sets how soon the first
    starts. At 64 MiB the disk sat idle for the first 0.2 s of a 1.5 GB conversion (benchmarks/CONVERT.md, round 5)."""

    STEP = 8 << 20

    def __init__(self) -> None:
        from concurrent.futures import ThreadPoolExecutor

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


_REAPERS: list[threading.Thread] = []
"""The threads waiting for children let go (``Workers.retire_child``), while they wait."""


def wait_for_children() -> None:
    """Wait until every child let go is reaped: for a process about to leave with ``os._exit``, which waits for no
    thread (the CLI after torch was loaded, ``cli_commands.leave_fast_after_torch``)."""
    for reaper in list(_REAPERS):
        reaper.join()


def _reap(proc: Any) -> None:
    """Wait for a child that has answered every piece; one that has not exited in 30 s is killed."""
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


def _start_child(clamp: bool) -> Any:
    """The child, started with this interpreter in isolated mode; None if it cannot start."""
    if not sys.executable:  # an embedded interpreter cannot start itself
        return None
    root = str(Path(__file__).resolve().parent.parent)
    code = f"import sys; sys.path.insert(0, {root!r}); from dtypeaudit.pieces import serve; serve()"
    try:
        # stderr is dropped: a failed child only means this process makes its pieces, where any real error surfaces
        proc = subprocess.Popen(
            [sys.executable, "-I", "-c", code],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env={**os.environ, "OPENBLAS_NUM_THREADS": "1"},  # no linear algebra here: no spinning BLAS threads
        )
    except OSError:
        return None
    try:
        assert proc.stdin is not None
        proc.stdin.write((json.dumps({"clamp": clamp}) + "\n").encode())
        proc.stdin.flush()
    except OSError:  # it died at once: this process makes every piece
        proc.kill()
        proc.wait()
        return None
    return proc


def serve() -> None:
    """The child's side: a settings line, then one piece per line on stdin; ``[id, crc, length, stats]`` per
    piece made, on stdout, until stdin closes."""
    settings = json.loads(sys.stdin.readline())
    view, unmap = mapped_view()
    maker = Maker(clamp=settings["clamp"], view=view)
    try:
        for line in sys.stdin:
            piece = Piece(**json.loads(line))
            made = maker.make(piece)
            stats = None if made.stats is None else made.stats.to_fields()
            sys.stdout.write(json.dumps([piece.id, made.crc, made.length, stats]) + "\n")
            sys.stdout.flush()
    finally:
        maker.close()
        unmap()
    # Every piece is answered and every write made: leave without the interpreter's teardown (a twentieth of a
    # second, which the parent would wait for at its end). An error above still exits as Python does.
    os._exit(0)
