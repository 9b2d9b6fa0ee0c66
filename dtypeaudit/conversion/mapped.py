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
from collections.abc import Callable
from contextlib import ExitStack
from functools import cached_property
from pathlib import Path
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
    """

    def __init__(self, path: Path, inv: Inventory, stack: ExitStack) -> None:
        self.path = path
        self.inv = inv
        fh = stack.enter_context(path.open("rb"))
        self.opened = _identity(os.fstat(fh.fileno()))
        self.mm: mmap.mmap | bytes = b""
        if path.stat().st_size:
            self.mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
            stack.callback(_unmap, self.mm)
        if isinstance(self.mm, mmap.mmap) and hasattr(mmap, "MADV_SEQUENTIAL"):
            self.mm.madvise(mmap.MADV_SEQUENTIAL)  # read ahead: every pass walks the file front to back
        if inv.metadata.get("byteorder", "little") != "little":
            raise ConversionError("big-endian archives are not supported for conversion", path=str(path))
        self.spans: dict[str, Span] = dict(inv.layout.storages) if inv.layout is not None else {}

    def check_unchanged(self) -> None:
        """Raise where the file at ``path`` is no longer the one mapped: replaced, or rewritten in place (its size,
        modification or change time). A conversion of bytes that changed under it would be neither version's."""
        try:
            now = _identity(os.stat(self.path))
        except OSError:
            now = None
        if now != self.opened:
            raise ConversionError(
                "the source changed while it was being converted (rewritten, replaced or removed); nothing was written: "
                "convert it again once it is written",
                path=str(self.path),
            )

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
        return memoryview(self.mm)[offset : offset + length]

    def tensor_at(self, dtype: str, count: int, offset: int) -> Any:
        """A read-only 1-D tensor of ``count`` elements of ``dtype`` at ``offset``, without copying."""
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
