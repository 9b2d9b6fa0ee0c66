"""mmap access to a source checkpoint's tensor bytes and to the pickle that describes them."""

from __future__ import annotations

import mmap
import zipfile
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from .. import dtypes
from ..errors import CheckpointError, ConversionError
from ..formats import directory as hfdir
from ..formats import read_checkpoint
from ..formats import safetensors as st_reader
from ..formats.pickleout import keep_persistent
from ..formats.picklevm import PickleVM
from ..formats.storage import Span, legacy_storage_spans, zip_storage_spans
from ..formats.torchzip import legacy_header, legacy_storage_keys
from ..inventory import Inventory, TensorRecord
from ..torchcast import frombuffer

Progress = Callable[[int], None]


class Source:
    """mmap access to one checkpoint file's tensor bytes."""

    def __init__(self, path: Path, inv: Inventory, stack: ExitStack) -> None:
        self.path = path
        self.inv = inv
        fh = stack.enter_context(path.open("rb"))
        self.mm = stack.enter_context(mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)) if path.stat().st_size else b""
        if isinstance(self.mm, mmap.mmap) and hasattr(mmap, "MADV_SEQUENTIAL"):
            self.mm.madvise(mmap.MADV_SEQUENTIAL)  # read ahead: every pass walks the file front to back
        self.spans: dict[str, Span] = {}
        if inv.format == "torch-zip":
            if inv.metadata.get("byteorder", "little") != "little":
                raise ConversionError("big-endian archives are not supported for conversion", path=str(path))
            self.spans = zip_storage_spans(path)
        elif inv.format == "torch-legacy":
            self.spans = _legacy_spans(path)
        elif inv.format == "safetensors":
            _, start = st_reader.read_header(path)
            self.spans = {t.name: Span(start + t.offset, t.nbytes) for t in inv.tensors}

    def storage(self, key: str) -> Span:
        try:
            return self.spans[key]
        except KeyError:
            raise CheckpointError(f"storage '{key}' not found", path=str(self.path)) from None


def _legacy_spans(path: Path) -> dict[str, Span]:
    from ..formats.torchpickle import REDUCERS, storage_loader

    with path.open("rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        header = legacy_header(mm, path)
        if not header.little_endian:
            raise ConversionError("big-endian legacy files are not supported for conversion", path=str(path))
        storages: list[Any] = []
        _, pos = PickleVM(mm, reducers=REDUCERS, persistent_load=storage_loader(storages.append, legacy=True)).load(header.main)
        keys, data_start, _ = legacy_storage_keys(mm, pos, path)
    sizes = {s.key: dtypes.get(s.dtype).itemsize for s in storages}
    return legacy_storage_spans(path, keys, sizes, data_start)


def main_pickle(src: Source) -> tuple[bytes | mmap.mmap, int, str, dict[str, bytes]]:
    """Where the checkpoint's object graph is pickled (buffer, offset), its archive prefix, and its other small records."""
    if src.inv.format == "torch-zip":
        with zipfile.ZipFile(src.path) as zf:
            names = zf.namelist()
            prefix = next(n for n in names if n.endswith("/data.pkl") and n.count("/") == 1)[: -len("data.pkl")]
            data = zf.read(prefix + "data.pkl")
            extras = {n[len(prefix) :]: zf.read(n) for n in names if not n.startswith((prefix + "data/", prefix + "data.pkl"))}
        return data, 0, prefix, extras
    legacy_extras = {"byteorder": b"little", "version": b"3\n", ".format_version": b"1", ".storage_alignment": b"64"}
    return src.mm, legacy_header(src.mm, src.path).main, "archive/", legacy_extras


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
