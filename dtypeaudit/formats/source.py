"""Byte sources: the one interface every reader reads through, and its local implementation.

A reader never opens a file itself. It is given a ``Source``: a file of known ``size`` read by offset
(``read(offset, n)``), with a ``view()`` that the pickle interpreter and the zip reader index, slice and
search as they would a ``bytes``. Locally the source is the file's descriptor (``os.pread``) and its
mapping. ``formats/remote.py`` implements the same interface for fsspec URLs, and ``formats/locate.py`` turns
a target into a path and a path into a source. ``bytes_read`` counts what was read; ``metered()`` adds up
every source opened inside it.
"""

from __future__ import annotations

import contextvars
import errno
import mmap
import os
import stat as stat_mod
import threading
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

HEAD_CACHE = 64 << 10
"""A local source keeps the first read at offset 0 up to this size (the sniffing head) for the readers after it."""

SKIPPED_DIRS = frozenset({".git", ".hg", ".svn"})
"""Version-control folders: never walked, locally or remotely."""


# -- counting ------------------------------------------------------------------------------------


class Meter:
    """Bytes read by every source opened while it is the current one (see ``metered``); thread-safe."""

    def __init__(self) -> None:
        self.total = 0
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        with self._lock:
            self.total += n


_METER: contextvars.ContextVar[Meter | None] = contextvars.ContextVar("dtypeaudit_meter", default=None)


@contextmanager
def metered() -> Iterator[Meter]:
    """A Meter for the reads inside the block; when it ends, its total is added to the meter around it."""
    outer = _METER.get()
    meter = Meter()
    token = _METER.set(meter)
    try:
        yield meter
    finally:
        _METER.reset(token)
        if outer is not None:
            outer.add(meter.total)


def count_read(meter: Meter | None, n: int) -> None:
    """Add ``n`` bytes read to ``meter``, where there is one."""
    if meter is not None and n:
        meter.add(n)


def current_meter() -> Meter | None:
    """The meter of the innermost ``metered()`` block, which a source opened now counts its reads in."""
    return _METER.get()


# -- the protocol ----------------------------------------------------------------------------------


class Source:
    """A file read by offset: ``size``, ``read``, ``view``, and ``bytes_read`` so far. Use as a context manager."""

    name: str
    """The file as messages name it (a URL without its credentials)."""
    size: int
    bytes_read: int = 0
    remote: bool = False

    def read(self, offset: int, n: int) -> bytes:
        """Up to ``n`` bytes at ``offset`` (fewer only at the end of the file)."""
        raise NotImplementedError

    def read_ranges(self, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        """``read(offset, n)`` for each ``(offset, n)``; a remote source fetches them concurrently and keeps them
        for the reads that follow."""
        return [self.read(offset, n) for offset, n in ranges]

    def prefetch(self, ranges: Iterable[tuple[int, int]]) -> None:
        """A hint that these ranges are about to be read through ``view()``; remote sources fetch them at once."""

    def view(self) -> Any:
        """The whole file as a buffer: ``len``, indexing, slicing, ``find``, ``rfind`` (an mmap locally)."""
        raise NotImplementedError

    def note_span(self, start: int, end: int) -> None:
        """Count bytes a reader interpreted through a local mapping (remote views count their own fetches)."""

    def close(self) -> None:
        pass

    def __enter__(self) -> Source:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LocalSource(Source):
    """A local file: ``os.pread`` for reads, its mapping for ``view()``."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.name = str(path)
        self._meter = current_meter()
        self._fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
        try:
            st = os.fstat(self._fd)
            if stat_mod.S_ISDIR(st.st_mode):
                raise IsADirectoryError(21, "Is a directory", self.name)
        except BaseException:
            os.close(self._fd)
            raise
        self.size = st.st_size
        self.bytes_read = 0
        self._head = b""
        self._mm: mmap.mmap | None = None

    def fileno(self) -> int:
        return self._fd

    def _account(self, n: int) -> None:
        self.bytes_read += n
        count_read(self._meter, n)

    def read(self, offset: int, n: int) -> bytes:
        if n <= 0 or offset >= self.size:
            return b""
        n = min(n, self.size - offset)
        if offset + n <= len(self._head):
            return self._head[offset : offset + n]
        data = os.pread(self._fd, n, offset)
        while len(data) < n and offset + len(data) < self.size:
            more = os.pread(self._fd, n - len(data), offset + len(data))
            if not more:
                break
            data += more
        self._account(len(data))
        if offset == 0 and len(self._head) < len(data) <= HEAD_CACHE:
            self._head = data
        return data

    def view(self) -> mmap.mmap | bytes:
        if self.size == 0:
            return b""
        if self._mm is None:
            self._mm = mmap.mmap(self._fd, 0, access=mmap.ACCESS_READ)
        return self._mm

    def note_span(self, start: int, end: int) -> None:
        start = max(start, len(self._head))
        if end > start:
            self._account(end - start)

    def close(self) -> None:
        if self._mm is not None:
            self._mm.close()
            self._mm = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class SourceFile:
    """A read-only, seekable file object over a source, for the standard library's readers (tarfile, zipfile)."""

    def __init__(self, src: Source) -> None:
        self._src, self._pos = src, 0

    def read(self, n: int | None = -1) -> bytes:
        want = self._src.size - self._pos if n is None or n < 0 else n
        data = self._src.read(self._pos, want)
        self._pos += len(data)
        return data

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._src.size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        pass


def missing_local_path(path: str) -> str:
    """Why a local ``path`` cannot be read, for the one-line error: it does not exist, and where the deepest
    folder of it that does exist holds a close name (a typo: ``hf/gtp2`` beside ``hf/gpt2``), that name."""
    import difflib

    p = Path(path)
    try:
        os.stat(p)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "a symbolic link loop (the link leads back to itself)"
    parts = p.parts
    for depth in range(len(parts) - 1, -1, -1):
        parent = Path(*parts[:depth]) if depth else Path(".")
        if not parent.is_dir():
            continue
        wanted = parts[depth]
        try:
            names = sorted(os.listdir(parent))
        except OSError:
            break
        if depth == len(parts) - 1:
            from ..temporaries import parse

            moved = [n for n in names if n.endswith(".old") and (t := parse(n)) is not None and t.dest == wanted]
            if moved:
                return (
                    f"no such file or directory: a conversion was stopped while it swapped this folder in, and the folder is "
                    f"at {str(parent / moved[0])!r}: `mv` it back (a convert that writes into {str(parent)!r} does so too)"
                )
        close = difflib.get_close_matches(wanted, names, n=1, cutoff=0.6)
        if close:
            return f"no such file or directory (did you mean {str(Path(*parts[:depth], close[0]))!r}?)"
        break
    return "no such file or directory"
