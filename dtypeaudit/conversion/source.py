"""mmap access to a source checkpoint's tensor bytes and to the pickle that describes them."""

from __future__ import annotations

import mmap
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from .. import dtypes
from ..errors import CheckpointError, ConversionError
from ..formats import directory as hfdir
from ..formats import read_checkpoint
from ..formats.pickleout import keep_persistent
from ..formats.picklevm import PickleVM
from ..formats.storage import Span
from ..formats.ziparchive import ZipArchive
from ..inventory import Inventory, Layout, TensorRecord
from ..torchcast import frombuffer

Progress = Callable[[int], None]


class Source:
    """mmap access to one checkpoint file's tensor bytes, where its reader's layout says they lie."""

    def __init__(self, path: Path, inv: Inventory, stack: ExitStack) -> None:
        self.path = path
        self.inv = inv
        fh = stack.enter_context(path.open("rb"))
        self.mm = stack.enter_context(mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)) if path.stat().st_size else b""
        if isinstance(self.mm, mmap.mmap) and hasattr(mmap, "MADV_SEQUENTIAL"):
            self.mm.madvise(mmap.MADV_SEQUENTIAL)  # read ahead: every pass walks the file front to back
        if inv.metadata.get("byteorder", "little") != "little":
            raise ConversionError("big-endian archives are not supported for conversion", path=str(path))
        self.spans: dict[str, Span] = {}
        if inv.layout is not None:
            self.spans = {key: Span(offset, length) for key, (offset, length) in inv.layout.storages.items()}
        elif inv.format == "safetensors":
            from ..formats import safetensors as st_reader

            _, start = st_reader.read_header(path)
            self.spans = {t.name: Span(start + t.offset, t.nbytes) for t in inv.tensors}

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


LEGACY_EXTRAS = {"byteorder": b"little", "version": b"3\n", ".format_version": b"1", ".storage_alignment": b"64"}
"""The small records a zip archive written by torch.save holds, for legacy files converted to one."""


def main_pickle(src: Source) -> tuple[bytes | mmap.mmap, int, str, dict[str, bytes]]:
    """Where the checkpoint's object graph is pickled (buffer, offset), its archive prefix, and its other small records."""
    layout = src.layout
    if layout.container == "zip":
        with ZipArchive.open(src.path) as za:
            prefix = layout.archive_prefix

            def record(name: str) -> bytes:
                entry = za.find(prefix + name)
                if entry is None:
                    raise CheckpointError(f"record {name} vanished from the archive", path=str(src.path))
                return za.read(entry, 1 << 30)

            return record("data.pkl"), 0, prefix, {name: record(name) for name in layout.records}
    return src.mm, layout.pickle_offset, "archive/", dict(LEGACY_EXTRAS)


def faithful_root(src: Source) -> tuple[Any, str, dict[str, bytes]]:
    """The source's pickle as a faithful graph, its archive prefix, and its other small records."""
    buf, pos, prefix, extras = main_pickle(src)
    root, _ = PickleVM(buf, persistent_load=keep_persistent, source=str(src.path)).load(pos)
    return root, prefix, extras


def contiguous_span(src: Source, t: TensorRecord) -> Span | None:
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


def materialize(src: Source, t: TensorRecord) -> Any:
    import torch

    base = src.storage(t.storage or t.name)
    itemsize = dtypes.get(t.dtype).itemsize
    flat = frombuffer(src.mm, t.dtype, base.length // itemsize, base.offset)
    return torch.as_strided(flat, t.shape, t.stride or (), t.offset).contiguous()


def source_files(path: Path, inv: Inventory) -> dict[str, tuple[Path, Inventory]]:
    if inv.format != "hf-directory":
        return {"": (path, inv)}
    out: dict[str, tuple[Path, Inventory]] = {}
    shards = inv.metadata.get("shards", [])
    assert isinstance(shards, list)
    for shard in shards:
        p = hfdir.confine(path, str(shard), origin=path)
        out[str(shard)] = (p, read_checkpoint(p))
    return out
