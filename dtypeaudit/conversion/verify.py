"""Read a written file back once and prove it holds what its writer says it wrote (a ``Written`` record):
names, shapes, dtypes, sharing, each record's bytes (CRC-32 of what was handed to the file) and, where the
writer says where they came from, samples of each record recast from the source by a second implementation,
not the writer's (``reference_cast``: numpy's own float16 conversion, bfloat16 by integer rounding), the same
on every install; ``Written.recast_with`` says what the samples were compared with, ``verified_line`` says it
to the user. The writer and ``reference_cast`` are both held to torch's own cast in the tests
(tests/test_npcast.py); here no torch is imported for it (its import would be half of a small conversion's
time and more memory than its largest tensor: benchmarks/CONVERT.md, round 10)."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import dtypes, npcast
from ..crc import crc32
from ..errors import CheckpointError, ConversionError
from ..formats import read_checkpoint
from ..inventory import Span, TensorRecord
from .mapped import MappedCheckpoint, materialize
from .plan import Plan

CRC_CHUNK_BYTES = 8 << 20
SAMPLE_BYTES = 64 << 10
"""Source bytes per recast sample: three per record (first, middle, last) catch a wrong offset, dtype or clamp."""


@dataclass(frozen=True)
class Origin:
    """Where a written record's bytes came from, so verification can recompute them independently."""

    src: MappedCheckpoint
    span: Span | None
    """The source bytes; None for a view that had to be gathered (``tensor`` says which)."""
    dtype: str
    target: str
    tensor: TensorRecord | None = None
    names: tuple[str, ...] = ()
    """The tensors these bytes hold, for the error report."""


@dataclass
class Written:
    """What a writer put in one file, as the writer knows it: every tensor with its dtype and shape, the
    CRC-32 of each record's bytes (a zip storage by its key, a safetensors tensor by its name) as handed to
    the file, and, for records cast or copied from a source, where they came from."""

    tensors: dict[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)
    """Tensor name -> (dtype, shape), every name a load of the file gives back (tied names included)."""
    crcs: dict[str, int] = field(default_factory=dict)
    origins: dict[str, Origin] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)
    """safetensors: a tied name -> the name its tensor was written under (kept in the metadata, not as a tensor)."""
    sharing: set[frozenset[str]] | None = None
    """torch.save: the groups of tensor names that share a storage (ties, views), as the source had them."""
    clamp: bool = False
    """The cast clamped to the target's range (``--clamp``)."""
    recast_with: str | None = None
    """What verification compared the records' samples with: ``"numpy"``'s ``reference_cast``, ``"torch"``'s cast
    (a view that had to be gathered), or, when no record was cast, the ``"source"``'s bytes; None: no record came
    from a source."""

    @classmethod
    def planned(cls, plan: Plan, *, sharing: bool = False) -> Written:
        """A record for ``plan``'s output file: its tensors as planned, and (``sharing``) the source's ties."""
        kept = {p.tensor.name: p for p in plan.tensors if p.action != "drop"}
        out = cls(tensors={n: (p.target, p.tensor.shape) for n, p in kept.items()}, clamp=plan.clamp)
        if sharing:
            groups = {frozenset((n, *p.tensor.shares_with)) & set(kept) for n, p in kept.items() if p.tensor.shares_with}
            out.sharing = {g for g in groups if len(g) > 1}
        return out


def verify_written(out: Path, written: Written) -> None:
    """Read ``out`` once with its reader and compare it with ``written``; ConversionError on any difference."""
    try:
        got = read_checkpoint(out)
    except CheckpointError as exc:  # a new error: the reader's own stays as it was raised
        raise ConversionError(f"verification failed: the output cannot be read back: {exc.message}", path=str(out)) from exc
    have = got.by_name()
    missing = [n for n in written.tensors if n not in have and n not in written.aliases]
    if missing:
        raise ConversionError(f"verification failed: {len(missing)} tensors missing from the output (first: {missing[0]})", path=str(out))
    for name, (dtype, shape) in written.tensors.items():
        t = have[written.aliases.get(name, name)]
        if t.shape != shape or t.dtype != dtype:
            raise ConversionError(f"verification failed: '{name}' is {t.dtype}{list(t.shape)}, planned {dtype}{list(shape)}", path=str(out))
    if written.sharing is not None and written.sharing != {frozenset((t.name, *t.shares_with)) for t in got.tensors if t.shares_with}:
        raise ConversionError("verification failed: storage sharing (ties, views) differs from the source", path=str(out))
    spans = dict(got.layout.storages) if got.layout is not None else {}
    lost = [name for name in written.crcs if name not in spans]
    if lost:
        raise ConversionError(f"verification failed: record {lost[0]} is missing from the output", path=str(out))
    with out.open("rb") as fh:
        fd = fh.fileno()
        # The CRC releases the GIL, so two threads read the records back at twice the speed, while this one
        # recasts the samples (and imports numpy to do it). Failures are reported in record order, a record's
        # bytes before its cast.
        with ThreadPoolExecutor(max_workers=2) as pool:
            crcs = {name: pool.submit(_mapped_crc, fd, spans[name]) for name in written.crcs}
            recast: dict[str, bool | Exception] = {}
            for name, origin in written.origins.items():
                if name in crcs:
                    if origin.dtype != origin.target:
                        written.recast_with = "torch" if origin.span is None or written.recast_with == "torch" else "numpy"
                    elif written.recast_with is None:
                        written.recast_with = "source"
                    try:
                        recast[name] = _matches_cast(fd, spans[name], origin, written.clamp)
                    except Exception as exc:  # raised below in its record's turn, as one check after another would
                        recast[name] = exc
            for name, expected in written.crcs.items():
                crc, matches = crcs[name].result(), recast.get(name, True)
                if crc == expected and isinstance(matches, Exception):
                    raise matches
                if crc != expected or matches is not True:
                    what = _recast_by(written.origins[name]) if name in recast else "what was written"
                    raise ConversionError(f"verification failed: {name} on disk differs from {what}", path=str(out))


def _pread(fd: int, offset: int, length: int) -> bytes:
    data = os.pread(fd, length, offset)
    while len(data) < length:
        more = os.pread(fd, length - len(data), offset + len(data))
        if not more:
            raise ConversionError("verification failed: the output is shorter than its header says")
        data += more
    return data


def _mapped_crc(fd: int, span: Span) -> int:
    """The CRC-32 of the bytes at ``span``, read through short-lived read-only maps of ``CRC_CHUNK_BYTES`` each: no
    copy out of the page cache (0.10 s for 0.74 GB against 0.16 s with ``pread`` into a buffer, measured here),
    and each map is closed
    before the next, so what is read back never stays in the process's memory. A file system that cannot map
    (some FUSE, 9p or SMB mounts) is read with ``pread``."""
    import mmap

    if os.fstat(fd).st_size < span.offset + span.length:
        raise ConversionError("verification failed: the output is shorter than its header says")
    crc = 0
    done = 0
    while done < span.length:
        start = span.offset + done
        base = start - start % mmap.ALLOCATIONGRANULARITY
        size = min(CRC_CHUNK_BYTES, span.length - done)
        try:
            mapped = _map_read(fd, start - base + size, base)
        except (ValueError, OSError):
            return _pread_crc(fd, Span(start, span.length - done), crc)
        with mapped, memoryview(mapped) as view:
            crc = crc32(view[start - base :], crc)
        done += size
    return crc


def _map_read(fd: int, length: int, offset: int) -> Any:
    """A read-only map of ``length`` bytes at ``offset``, its pages mapped in one call where the system can
    (Linux's MAP_POPULATE: a third less time than a fault per page, measured here)."""
    import mmap

    populate = getattr(mmap, "MAP_POPULATE", 0)
    if populate:
        return mmap.mmap(fd, length, flags=mmap.MAP_SHARED | populate, prot=mmap.PROT_READ, offset=offset)
    return mmap.mmap(fd, length, access=mmap.ACCESS_READ, offset=offset)


def _pread_crc(fd: int, span: Span, crc: int = 0) -> int:
    """The CRC-32 (continued from ``crc``) of the bytes at ``span``, read with ``pread`` into one buffer."""
    buf = bytearray(min(CRC_CHUNK_BYTES, max(1, span.length)))
    view = memoryview(buf)
    done = 0
    while done < span.length:
        n = os.preadv(fd, [view[: min(len(buf), span.length - done)]], span.offset + done)
        if n <= 0:
            raise ConversionError("verification failed: the output is shorter than its header says")
        crc = crc32(view[:n], crc)
        done += n
    return crc


def _matches_cast(fd: int, span: Span, origin: Origin, clamp: bool) -> bool:
    """Whether the bytes at ``span`` equal the source's cast, recomputed here by ``reference_cast``, an
    implementation other than the writer's (which is npcast's bit rounding, ml_dtypes or torch).

    The whole record is covered by the CRC check against what the writer produced; this recomputes the cast
    for its first, middle and last 64 KiB, which catches a wrong offset, dtype or clamp without paying for a
    second full cast. A view that had to be gathered (``materialize``, by torch) is recast whole, by torch.
    """
    if origin.span is None:
        return _matches_gathered(fd, span, origin, clamp)
    copied = origin.dtype == origin.target  # every other record is a cast between npcast's dtypes (dtypes.CASTABLE)
    itemsize = 1 if copied else dtypes.get(origin.dtype).itemsize  # a copied record (quantized, ints...): byte for byte
    out_itemsize = 1 if copied else dtypes.get(origin.target).itemsize
    numel = origin.span.length // itemsize
    if span.length != numel * out_itemsize:
        return False
    for first, count in _samples(numel, itemsize):
        got = _pread(fd, span.offset + first * out_itemsize, count * out_itemsize)
        raw = origin.src.bytes_at(origin.span.offset + first * itemsize, count * itemsize)
        if copied:
            if got != bytes(raw):
                return False
            continue
        import numpy as np

        expected = reference_cast(np.frombuffer(raw, npcast.storage_dtype(origin.dtype)), origin.dtype, origin.target, clamp=clamp)
        if got != expected.tobytes() and not _equal_but_nan_bits(got, expected.tobytes(), origin.target):
            return False
    return True


def reference_cast(x: Any, source: str, target: str, *, clamp: bool = False) -> Any:
    """``x`` (``source``'s stored form, as ``npcast.storage_dtype``) cast to ``target``'s stored form as torch's
    CPU cast does it, by code that shares nothing with the writer's: numpy's own float16 conversion (a C loop,
    where the writer rounds the bits in integer passes), bfloat16 by the integer round-to-nearest-even c10
    spells out (where the writer uses ml_dtypes), float64 through float32 as torch rounds it, and ``clamp``
    as torch.clamp in the source's precision (bfloat16 widened, as it cannot hold float16's largest). A NaN
    stays a NaN; its bits are not promised (``_equal_but_nan_bits``). Bit-equal to torch's for every other
    value: tests/test_npcast.py."""
    import numpy as np

    with np.errstate(all="ignore"):
        if source == "bfloat16":
            wide: Any = (x.astype(np.uint32) << np.uint32(16)).view(np.float32)
        else:
            wide = x
        if clamp:
            limit = npcast.LARGEST[target]
            if limit < npcast.LARGEST[source]:
                wide = np.clip(wide, -limit, limit)
        if target == "float64":
            return wide.astype(np.float64)
        f32 = wide.astype(np.float32)  # float64 rounds to float32 first, as torch's kernels do
        if target == "float32":
            return f32
        if target == "float16":
            return f32.astype(np.float16)
        bits = f32.view(np.uint32)
        rounded = ((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)
        return np.where(np.isnan(f32), np.uint16(0x7FC0), rounded)


def _equal_but_nan_bits(got: bytes, expected: bytes, target: str) -> bool:
    """Whether two casts to ``target`` differ only in the bits of NaNs: which NaN torch writes depends on its loop
    and this CPU (a float16 source's signalling NaN is quieted as torch widens it, numpy keeps it), and none
    is promised; every other value must be bit-equal."""
    import numpy as np

    width = {8: np.uint64, 4: np.uint32, 2: np.uint16}[dtypes.get(target).itemsize]
    a, b = np.frombuffer(got, width), np.frombuffer(expected, width)
    if target == "bfloat16":
        nan_a, nan_b = (a & 0x7FFF) > 0x7F80, (b & 0x7FFF) > 0x7F80
    else:
        nan_a, nan_b = np.isnan(a.view(npcast.storage_dtype(target))), np.isnan(b.view(npcast.storage_dtype(target)))
    return bool(np.array_equal(nan_a, nan_b) and np.array_equal(a[~nan_a], b[~nan_b]))


def _recast_by(origin: Origin) -> str:
    if origin.dtype == origin.target:
        return "the source's bytes"
    return "torch's cast of the source" if origin.span is None else "a second cast of the source"


def verified_line(written: list[Written]) -> str:
    """The line a converted output's report ends with: what was read back, and what its samples were compared
    with (never a comparison that did not happen)."""
    engines = {w.recast_with for w in written}
    line = "verified: names, shapes, dtypes and ties; bytes read back and CRC-checked"
    if "torch" in engines:
        return f"{line}; sampled records equal torch's own cast of the source"
    if "numpy" in engines:
        return f"{line}; sampled records equal a second cast of the source, by numpy, apart from the writer"
    if "source" in engines:
        return f"{line}; sampled records equal the source's bytes"
    return line


def _samples(numel: int, itemsize: int) -> list[tuple[int, int]]:
    """(first element, count) of the first, middle and last SAMPLE_BYTES of a record of ``numel`` elements."""
    step = max(1, SAMPLE_BYTES // itemsize)
    starts = sorted({0, (numel // 2) // step * step, max(0, (numel - 1) // step * step)}) if numel else []
    return [(first, min(step, numel - first)) for first in starts]


def _torch_cast(x: Any, target_name: str, clamp: bool) -> Any:
    """torch's cast, clamped as npcast clamps (a bfloat16 source widened: bfloat16 cannot hold float16's 65504)."""
    import torch

    target = getattr(torch, target_name)
    if clamp and x.dtype != target:
        limit = float(torch.finfo(target).max)
        if limit < float(torch.finfo(x.dtype).max):
            x = torch.clamp(x.float() if x.dtype == torch.bfloat16 else x, -limit, limit)
    return x.to(target)


def _matches_gathered(fd: int, span: Span, origin: Origin, clamp: bool) -> bool:
    assert origin.tensor is not None
    import torch

    expected = _torch_cast(materialize(origin.src, origin.tensor), origin.target, clamp).reshape(-1).view(torch.uint8)
    return span.length == expected.numel() and _pread(fd, span.offset, span.length) == expected.numpy().tobytes()
