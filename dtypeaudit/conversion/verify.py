"""Re-read what was written and prove it: names, shapes, dtypes, sharing, and bytes equal to torch's cast."""

from __future__ import annotations

import json
import mmap
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import dtypes
from ..errors import ConversionError
from ..formats import read_checkpoint
from ..formats import safetensors as st_reader
from ..formats.storage import Span
from ..formats.zipwrite import crc32
from ..inventory import TensorRecord
from ..torchcast import frombuffer
from .plan import Plan
from .source import Source, materialize

CRC_CHUNK_BYTES = 8 << 20
SAMPLE_BYTES = 64 << 10
"""Source bytes per recast sample: three per record (first, middle, last) catch a wrong offset, dtype or clamp."""


@dataclass(frozen=True)
class Origin:
    """Where a written record's bytes came from, so verification can recompute them independently."""

    src: Source
    span: Span | None
    """The source bytes; None for a view that had to be gathered (``tensor`` says which)."""
    dtype: str
    target: str
    tensor: TensorRecord | None = None
    names: tuple[str, ...] = ()
    """The tensors these bytes hold, for the error report."""


@dataclass
class Written:
    """What the writer produced: for each record (zip member or safetensors tensor), its origin and the
    CRC-32 of the bytes handed to the file (zip members carry theirs in the archive)."""

    origins: dict[str, Origin] = field(default_factory=dict)
    crcs: dict[str, int] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)
    """safetensors: a tied name -> the name its tensor was written under (kept in the metadata, not as a tensor)."""


def verify(plan: Plan, out: Path, written: Written) -> None:
    """Re-read what was written: names, shapes, dtypes as planned, ties kept, bytes equal to torch's cast."""
    got = read_checkpoint(out)
    want = {p.tensor.name: p for p in plan.tensors if p.action != "drop"}
    have = got.by_name()
    st_meta = got.metadata.get("safetensors_metadata")
    aliases = json.loads(st_meta.get("dtypeaudit.aliases", "{}")) if isinstance(st_meta, dict) else {}
    missing = [n for n in want if n not in have and n not in aliases]
    if missing:
        raise ConversionError(f"verification failed: {len(missing)} tensors missing from the output (first: {missing[0]})", path=str(out))
    for name, p in want.items():
        t = have.get(aliases.get(name, name))
        assert t is not None
        if t.shape != p.tensor.shape or t.dtype != p.target:
            raise ConversionError(
                f"verification failed: '{name}' is {t.dtype}{list(t.shape)}, planned {p.target}{list(p.tensor.shape)}", path=str(out)
            )
    if got.format == "torch-zip":
        kept = set(want)
        src_groups = {frozenset((n, *want[n].tensor.shares_with)) & kept for n in want if want[n].tensor.shares_with}
        out_groups = {frozenset((t.name, *t.shares_with)) for t in got.tensors if t.shares_with}
        if {g for g in src_groups if len(g) > 1} != out_groups:
            raise ConversionError("verification failed: storage sharing (ties, views) differs from the source", path=str(out))
        from ..formats.ziparchive import ZipArchive

        with ZipArchive.open(out) as za:
            entries = {name: za.find(name) for name in written.origins}
            if any(e is None for e in entries.values()):
                raise ConversionError("verification failed: a storage record is missing from the output", path=str(out))
            spans = {name: Span(*za.span(e)) for name, e in entries.items() if e is not None}
            expected_crcs = {name: e.crc for name, e in entries.items() if e is not None}
    else:
        _, start = st_reader.read_header(out)
        spans = {t.name: Span(start + t.offset, t.nbytes) for t in got.tensors if t.name in written.origins}
        expected_crcs = written.crcs
    with out.open("rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        # zlib releases the GIL, so two threads read the records back at twice the speed.
        with ThreadPoolExecutor(max_workers=2) as pool:
            crcs = dict(zip(spans, pool.map(lambda span: _crc(mm, span), spans.values()), strict=True))
        for name, span in spans.items():
            origin = written.origins[name]
            if crcs[name] != expected_crcs[name] or not _matches_cast(mm, span, origin, plan.clamp):
                raise ConversionError(f"verification failed: {name} on disk differs from torch's cast of the source", path=str(out))


def _crc(buffer: Any, span: Span) -> int:
    crc = 0
    view = memoryview(buffer)
    try:
        for start in range(0, span.length, CRC_CHUNK_BYTES):
            crc = crc32(view[span.offset + start : span.offset + min(span.length, start + CRC_CHUNK_BYTES)], crc)
    finally:
        view.release()
    return crc


def _matches_cast(mm: Any, span: Span, origin: Origin, clamp: bool) -> bool:
    """Whether the bytes at ``span`` equal torch's own ``tensor.to(target)`` of the source, recomputed here.

    The whole record is covered by the CRC check against what the writer produced; this recomputes
    the cast independently for its first, middle and last 64 KiB, which catches a wrong offset,
    dtype or clamp without paying for a second full cast.
    """
    import torch

    if origin.dtype == origin.target and origin.span is not None:
        # A copied record (quantized, complex, ints...): its bytes must be the source's, byte for byte.
        origin = Origin(origin.src, origin.span, "uint8", "uint8", origin.tensor, origin.names)
    target = getattr(torch, origin.target)

    def cast(x: Any) -> Any:
        if clamp and x.dtype != target:
            limit = float(torch.finfo(target).max)
            x = torch.clamp(x, -limit, limit)
        return x.to(target)

    if origin.span is None:
        assert origin.tensor is not None
        expected = cast(materialize(origin.src, origin.tensor)).reshape(-1).view(torch.uint8)
        return span.length == expected.numel() and _same_bytes(frombuffer(mm, "uint8", span.length, span.offset), expected)
    itemsize = dtypes.get(origin.dtype).itemsize
    out_itemsize = dtypes.get(origin.target).itemsize
    numel = origin.span.length // itemsize
    if span.length != numel * out_itemsize:
        return False
    step = max(1, SAMPLE_BYTES // itemsize)
    starts = sorted({0, (numel // 2) // step * step, max(0, (numel - 1) // step * step)}) if numel else []
    for first in starts:
        count = min(step, numel - first)
        x = frombuffer(origin.src.mm, origin.dtype, count, origin.span.offset + first * itemsize)
        got = frombuffer(mm, origin.target, count, span.offset + first * out_itemsize)
        if not _same_bytes(got.view(torch.uint8), cast(x).view(torch.uint8)):
            return False
    return True


def _same_bytes(a: Any, b: Any) -> bool:
    """Byte tensors compared with numpy (several times faster than torch.equal on uint8)."""
    import numpy as np

    return bool(np.array_equal(a.numpy(), b.numpy()))
