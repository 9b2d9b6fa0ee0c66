"""Where each storage's bytes live on disk, so values and conversion can read them through mmap.

torch.save zip archives keep each storage as an uncompressed record; the legacy format keeps them
after the pickles, each behind an 8-byte element count. safetensors keeps tensors at header offsets.
"""

from __future__ import annotations

import mmap
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import CheckpointError

_LOCAL_HEADER = struct.Struct("<4s5H3L2H")


@dataclass(frozen=True)
class Span:
    """``length`` bytes at ``offset`` in a file."""

    offset: int
    length: int


def zip_record_span(path: Path, info: zipfile.ZipInfo) -> Span:
    """Where an uncompressed zip member's data starts, read from its local header."""
    if info.compress_type != zipfile.ZIP_STORED:
        raise CheckpointError(f"record {info.filename} is compressed; it cannot be read in place", path=str(path))
    with path.open("rb") as fh:
        fh.seek(info.header_offset)
        header = fh.read(_LOCAL_HEADER.size)
    if len(header) != _LOCAL_HEADER.size or header[:4] != b"PK\x03\x04":
        raise CheckpointError(f"bad local header for {info.filename}", path=str(path))
    fields = _LOCAL_HEADER.unpack(header)
    name_len, extra_len = fields[-2], fields[-1]
    return Span(info.header_offset + _LOCAL_HEADER.size + name_len + extra_len, info.file_size)


def zip_storage_spans(path: Path) -> dict[str, Span]:
    """Storage key -> span, for every ``<prefix>/data/<key>`` record of a torch.save archive."""
    from .torchzip import zip_errors

    out: dict[str, Span] = {}
    with zip_errors(path), zipfile.ZipFile(path) as zf:
        for info in zf.infolist():
            parts = info.filename.split("/")
            if len(parts) == 3 and parts[1] == "data":
                out[parts[2]] = zip_record_span(path, info)
    return out


def legacy_storage_spans(path: Path, keys: list[str], itemsizes: dict[str, int], start: int, *, little: bool = True) -> dict[str, Span]:
    """Storage key -> span for the legacy format, walking the count headers from ``start``."""
    out: dict[str, Span] = {}
    fmt = "<q" if little else ">q"
    with path.open("rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        pos = start
        for key in keys:
            (count,) = struct.unpack(fmt, mm[pos : pos + 8])
            pos += 8
            length = count * itemsizes.get(key, 1)
            out[key] = Span(pos, length)
            pos += length
    return out
