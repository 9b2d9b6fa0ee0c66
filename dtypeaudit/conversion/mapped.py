"""A source checkpoint file mapped for conversion: its tensor bytes and its pickle, where its reader found them.

Conversion plans, writes and verifies from what the reader already produced (the inventory and its
``Layout``): a model directory's weight files come from ``Inventory.parts``, storages and records from
``Layout``, so no header is read and no archive opened a second time. A torch.save pickle is rewritten by editing
its bytes where the reader noted its storage types (``Layout.storage_sites``); it runs a second time only as
``MappedCheckpoint.faithful``, the graph kept as written, for ``--strip-optimizer`` where it strips something.
"""

from __future__ import annotations

import mmap
import os
import sys
import threading
from collections import defaultdict
from collections.abc import Callable
from contextlib import ExitStack
from functools import cache, cached_property
from pathlib import Path
from types import TracebackType
from typing import Any

from .. import dtypes
from ..errors import CheckpointError, ConversionError
from ..formats import directory as hfdir
from ..formats import read_checkpoint
from ..formats.pickleout import keep_persistent
from ..formats.picklevm import PickleVM
from ..formats.ziparchive import ZipArchive
from ..inventory import Format, Inventory, Layout, Span, TensorRecord
from ..torchcast import frombuffer
from ..values import View
from .plan import Plan, unit_of

Progress = Callable[[int], None]

LEGACY_EXTRAS = {"byteorder": b"little", "version": b"3\n", ".format_version": b"1", ".storage_alignment": b"64"}
"""The small records a zip archive written by torch.save holds, for legacy files converted to one."""


def _identity(st: os.stat_result) -> tuple[int, ...]:
    """What tells one version of a file from another without reading it: a rewrite in place changes the times
    (the change time even under ``touch -r``), a replacement the inode."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class MappedCheckpoint:
    """One checkpoint file mapped read-only, with the inventory its reader made of it.

    Tensor bytes are reached through ``bytes_at`` and ``tensor_at`` only (``mm`` is the mapping itself, for the
    value checks that hand it to numpy).

    A file truncated under a mapping kills the reader with SIGBUS at its next access past the new end, which no
    Python code can catch (a handler that returns re-runs the faulting load). So the mapping holds a read lease
    where Linux gives one (``_Leases``): a writer's open for writing or truncate waits until the lease is
    released, and the lease is released only once the mapping reads zeros (``lose``). The conversion then fails
    with one line at its next read or last check, or as its sources close.
    """

    def __init__(self, path: Path, inv: Inventory, stack: ExitStack) -> None:
        self.path = path
        self.inv = inv
        fh = stack.enter_context(path.open("rb"))
        self.lost = False  # a writer broke the lease: the mapping reads zeros since
        self.settled = False  # the last check passed: every read was done, what a writer does later is not ours
        self.zero_pages: Callable[[], bool] | None = None  # set once mapped under a lease; run by the signal handler
        leased = LEASES.take(self, fh.fileno())  # before the mapping: from here on a writer waits for us
        if leased:
            stack.push(self._closing)
        st = os.fstat(fh.fileno())
        self.opened = _identity(st)
        self.mm: mmap.mmap | bytes = b""
        if st.st_size:
            self.mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
            stack.callback(_unmap, self.mm)
            if leased:
                self.zero_pages = _zeroer(self.mm)
        self.spans: dict[str, Span] = dict(inv.layout.storages) if inv.layout is not None else {}
        # a writer came before the mapping could be zeroed (nothing was read: it waits no longer), or the file
        # shrank after its reader read it
        if self.lost or any(span.offset + span.length > st.st_size for span in self.spans.values()):
            raise self._changed()
        if isinstance(self.mm, mmap.mmap) and hasattr(mmap, "MADV_SEQUENTIAL"):
            self.mm.madvise(mmap.MADV_SEQUENTIAL)  # read ahead: every pass walks the file front to back
        if inv.metadata.get("byteorder", "little") != "little":
            raise ConversionError("big-endian archives are not supported for conversion", path=str(path))

    def check_unchanged(self) -> None:
        """Raise where the file at ``path`` is no longer the one mapped: replaced, or rewritten in place (its size,
        modification or change time), or opened for writing while it was read (the lease broken). A conversion of
        bytes that changed under it would be neither version's."""
        try:
            now = _identity(os.stat(self.path))
        except OSError:
            now = None
        if self.lost or now != self.opened:
            raise self._changed()
        self.settled = True

    def _changed(self) -> ConversionError:
        return ConversionError(
            "the source changed while it was being converted (rewritten, replaced or removed); nothing was written: "
            "convert it again once it is written",
            path=str(self.path),
        )

    def lose(self) -> bool:
        """A writer is waiting to change the file: make the mapping read zeros, so that no access to it can fault
        once the file is truncated, and say whether nothing can (then the lease may be released). Before the
        mapping is zeroable nothing was read from it, and ``__init__`` raises before anything is."""
        self.lost = True
        return self.zero_pages is None or self.zero_pages()

    def _closing(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        """As the sources close: release the lease, and where it was broken before the last check, say so in place
        of any other outcome (what was read, or failed to parse, after it was broken was zeros)."""
        LEASES.release(self)
        if self.lost and not self.settled and (exc is None or isinstance(exc, Exception)):
            raise self._changed() from exc

    @property
    def layout(self) -> Layout:
        if self.inv.layout is None:
            raise ConversionError(f"{self.inv.format} files cannot be rewritten", path=str(self.path))
        return self.inv.layout

    def storage(self, key: str) -> Span:
        try:
            return self.spans[key]
        except KeyError:
            raise CheckpointError(f"storage '{key}' not found", path=str(self.path)) from None

    def bytes_at(self, offset: int, length: int) -> memoryview:
        """``length`` bytes at ``offset``, without copying."""
        if self.lost:
            raise self._changed()
        return memoryview(self.mm)[offset : offset + length]

    def tensor_at(self, dtype: str, count: int, offset: int) -> Any:
        """A read-only 1-D tensor of ``count`` elements of ``dtype`` at ``offset``, without copying."""
        if self.lost:
            raise self._changed()
        return frombuffer(self.mm, dtype, count, offset)

    def main_pickle(self) -> tuple[bytes | mmap.mmap, int, str, dict[str, bytes]]:
        """Where the object graph is pickled (buffer, offset), the archive prefix, and the other small records:
        from the mapping where the reader found them stored, else (a deflated record) from the archive."""
        layout = self.layout
        if layout.container != "zip":
            return self.mm, layout.pickle_offset, "archive/", dict(LEGACY_EXTRAS)
        names = ("data.pkl", *layout.records)
        if all(name in layout.record_spans for name in names):
            data = {name: self.mm[span.offset : span.offset + span.length] for name, span in ((n, layout.record_spans[n]) for n in names)}
        else:
            with ZipArchive.open(self.path) as za:
                data = {name: self._record(za, layout.archive_prefix + name) for name in names}
        pickle = data.pop("data.pkl")
        return pickle, 0, layout.archive_prefix, data

    def _record(self, za: ZipArchive, name: str) -> bytes:
        entry = za.find(name)
        if entry is None:
            raise CheckpointError(f"record {name} vanished from the archive", path=str(self.path))
        return za.read(entry, 1 << 30)

    @cached_property
    def faithful(self) -> tuple[Any, str, dict[str, bytes]]:
        """The pickle as a faithful graph (persistent ids kept as written), its archive prefix, its other records:
        a second run of the pickle, for ``--strip-optimizer`` only (what to strip, and the pickle re-emitted without it).

        Interpreted once per file; the rewrite changes it in place (``write_torch_zip``), after every reader of it."""
        buf, pos, prefix, extras = self.main_pickle()
        root, _ = PickleVM(buf, persistent_load=keep_persistent, source=str(self.path)).load(pos)
        return root, prefix, extras

    def forget_rewrite(self) -> None:
        """Drop the faithful graph a rewrite has changed (an output written while the values were checked, then
        abandoned), so that the next rewrite interprets the pickle afresh."""
        self.__dict__.pop("faithful", None)


class _Leases:
    """The read leases held on mapped sources (Linux's ``F_SETLEASE``), and the SIGIO handler that answers a
    writer's open for writing or truncate of one of them.

    A lease is taken only from the main thread (only it may set a signal handler), on a file this user owns (or
    with CAP_LEASE) that nobody holds open for writing, on a file system that gives leases; elsewhere the mapping
    is unprotected, and a truncation while it is read still ends the process with SIGBUS. The writer waits
    at most ``/proc/sys/fs/lease-break-time`` (45 s by default) for the handler, which runs between two bytecodes
    of the main thread: a lease the kernel takes back after that leaves the mapping unprotected again.
    """

    def __init__(self) -> None:
        self.held: dict[int, tuple[int, MappedCheckpoint]] = {}  # id(source) -> (fd, source)
        self.previous: Any = None

    def take(self, src: MappedCheckpoint, fd: int) -> bool:
        if sys.platform != "linux" or threading.current_thread() is not threading.main_thread():
            return False
        import fcntl
        import signal

        _remap()  # its imports here, not in the handler: that may run in the middle of an import
        if not self.held:  # the handler first: a writer may come the moment the lease is held
            self.previous = signal.signal(signal.SIGIO, self._on_signal)
        try:
            fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)
        except OSError:  # not ours to lease, open for writing elsewhere, or no leases on this file system
            self._restore()
            return False
        self.held[id(src)] = (fd, src)
        return True

    def release(self, src: MappedCheckpoint) -> None:
        import fcntl

        held = self.held.pop(id(src), None)
        if held is not None:
            try:
                fcntl.fcntl(held[0], fcntl.F_SETLEASE, fcntl.F_UNLCK)
            except OSError:  # the kernel took it back (the break timed out)
                pass
        self._restore()

    def _restore(self) -> None:
        import signal

        if not self.held and self.previous is not None:
            signal.signal(signal.SIGIO, self.previous)
            self.previous = None

    def _on_signal(self, signum: int, frame: Any) -> None:
        import fcntl

        for fd, src in list(self.held.values()):
            try:
                breaking = fcntl.fcntl(fd, fcntl.F_GETLEASE) != fcntl.F_RDLCK  # a break in progress reads as its target
            except OSError:
                continue
            if breaking and src.lose():
                self.release(src)  # the writer goes on; a mapping that could not be zeroed keeps it waiting
        if callable(self.previous):
            self.previous(signum, frame)


LEASES = _Leases()

MAP_FIXED = 0x10  # Linux's, on every architecture it runs on (the mmap module does not export it)


@cache
def _remap() -> Any:
    """libc's ``mmap``, to map fresh pages over a mapping's."""
    import ctypes

    remap = ctypes.CDLL(None, use_errno=True).mmap
    remap.restype = ctypes.c_void_p
    remap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
    return remap


def _zeroer(mm: mmap.mmap) -> Callable[[], bool]:
    """What puts fresh zero pages in place of ``mm``'s, at the same addresses (numpy views of it stay valid), so
    that nothing reading it can fault when the file shrinks, and says whether it did."""
    import ctypes

    view = (ctypes.c_void_p * 16)()  # a Py_buffer (its first field the address), with room to spare
    get, release = ctypes.pythonapi.PyObject_GetBuffer, ctypes.pythonapi.PyBuffer_Release
    get.argtypes, release.argtypes = (ctypes.py_object, ctypes.c_void_p, ctypes.c_int), (ctypes.c_void_p,)
    get(mm, view, 0)  # PyBUF_SIMPLE: the read-only mapping's address, without numpy (a failure raises)
    address = view[0]
    release(view)
    remap, length = _remap(), len(mm)
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_FIXED
    return lambda: bool(remap(address, length, mmap.PROT_READ, flags, -1, 0) == address)


def _unmap(mm: mmap.mmap) -> None:
    """Close ``mm``, unless a numpy view of it is still alive (an error's traceback holds the frame of a cast
    or check that was reading it): then the view's owner unmaps it when the traceback is gone."""
    try:
        mm.close()
    except BufferError:
        pass


def contiguous_span(src: MappedCheckpoint, t: TensorRecord) -> Span | None:
    """The bytes of ``t`` as one span if it is a contiguous run of its storage, else None."""
    itemsize = dtypes.get(t.dtype).itemsize
    if t.storage is None:
        return src.storage(t.name)
    expected, run = [], 1
    for size in reversed(t.shape):
        expected.append(run)
        run *= size
    if (
        t.stride is not None
        and t.numel > 1
        and tuple(s for s, d in zip(t.stride, t.shape, strict=True) if d > 1)
        != tuple(s for s, d in zip(reversed(expected), t.shape, strict=True) if d > 1)
    ):
        return None
    base = src.storage(t.storage)
    return Span(base.offset + t.offset * itemsize, t.numel * itemsize)


def materialize(src: MappedCheckpoint, t: TensorRecord) -> Any:
    import torch

    base = src.storage(t.storage or t.name)
    itemsize = dtypes.get(t.dtype).itemsize
    flat = src.tensor_at(t.dtype, base.length // itemsize, base.offset)
    return torch.as_strided(flat, t.shape, t.stride or (), t.offset).contiguous()


def views_by_unit(plan: Plan) -> defaultdict[str, dict[str, View]]:
    """Each unit's views of its storage by tensor name (offset, shape, strides, in elements), from every tensor of
    the plan that views it: what the value checks judge (``values.viewed_runs``); a tensor of its own sees all of it."""
    out: defaultdict[str, dict[str, View]] = defaultdict(dict)
    for p in plan.tensors:
        t = p.tensor
        if t.storage is not None and t.layout == "strided":
            out[unit_of(t)][t.name] = (t.offset, t.shape, t.stride)
    return out


def open_sources(path: Path, inv: Inventory, stack: ExitStack) -> dict[str, MappedCheckpoint]:
    """Every weight file of ``inv`` mapped, by its label (``""`` for a single file), with the inventory its reader
    made of it: a directory's from ``Inventory.parts``, read again only where the directory came without them."""
    if inv.format != Format.HF_DIRECTORY:
        return {"": MappedCheckpoint(path, inv, stack)}
    shards = inv.metadata.get("shards", [])
    assert isinstance(shards, list)
    out: dict[str, MappedCheckpoint] = {}
    for shard in shards:
        p = hfdir.confine(path, str(shard), origin=path)
        part = inv.parts.get(str(shard))
        out[str(shard)] = MappedCheckpoint(p, part if part is not None else read_checkpoint(p), stack)
    return out
