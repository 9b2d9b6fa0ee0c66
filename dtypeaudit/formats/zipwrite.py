"""A zip writer for stored (uncompressed) members laid out as torch.save lays them out: each member's
data starts on a 64-byte boundary, so that ``torch.load(mmap=True)`` can map it.

Written here rather than with ``zipfile`` so that the CRC of every byte is computed by the fastest
CRC-32 at hand (see ``crc32``): on a large checkpoint it is a fifth of the time spent writing.
Layout per PKWARE's APPNOTE: local header, data, ..., central directory, the zip64 end records when
sizes, offsets or counts outgrow 32 (16) bits, and the end of central directory record.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, BinaryIO

from ..crc import crc32

ALIGN = 64
ZIP64_LIMIT = (1 << 31) - 1
"""Sizes and offsets beyond this use zip64 records (zipfile's threshold; tests lower it)."""
_DOS_DATE = (0 << 9) | (1 << 5) | 1  # 1980-01-01, as torch.save and zipfile date undated members
_PAD_ID = 0x4246  # an extra field of padding ("FB"), the id torch.save uses for the same purpose
_ZIP64_ID = 0x0001


@dataclass
class _Member:
    name: bytes
    flags: int
    offset: int
    size: int
    crc: int


class StoredZipWriter:
    """Members are added in order; ``close`` writes the central directory. The file must be seekable."""

    def __init__(self, fh: BinaryIO) -> None:
        self._fh = fh
        self._members: list[_Member] = []
        self.crcs: dict[str, int] = {}
        """Each member's CRC-32 as written, by name, for the caller's record of what it wrote."""
        self._pending: dict[str, _Member] = {}

    def add(self, name: str, data: bytes) -> None:
        with self.member(name, len(data)) as write:
            write(data)

    @contextmanager
    def member(self, name: str, size: int) -> Iterator[Callable[[Any], None]]:
        """Yield a ``write(bytes-like)`` for exactly ``size`` bytes of the member's data."""
        data_offset = self.reserve(name, size)
        self._fh.seek(data_offset)
        state = {"crc": 0, "written": 0}

        def write(data: Any) -> None:
            state["crc"] = crc32(data, state["crc"])
            state["written"] += memoryview(data).nbytes
            self._fh.write(data)

        yield write
        if state["written"] != size:
            raise ValueError(f"zip member {name!r}: {state['written']} bytes written, {size} declared")
        self.fill(name, state["crc"])

    def reserve(self, name: str, size: int) -> int:
        """Lay out a member of ``size`` bytes and return where its data starts, for whoever writes it there
        (another process, with pwrite); ``fill`` gives its CRC once it is written. The file goes on after it."""
        encoded, flags = _encode(name)
        offset = self._fh.tell()
        zip64 = size > ZIP64_LIMIT
        sizes = struct.pack("<HHQQ", _ZIP64_ID, 16, size, size) if zip64 else b""
        start = offset + 30 + len(encoded) + len(sizes)
        pad = (-(start + 4)) % ALIGN  # an extra field of 4 header bytes and ``pad`` filler bytes
        extra = sizes + struct.pack("<HH", _PAD_ID, pad) + b"Z" * pad
        stored = 0xFFFFFFFF if zip64 else size
        self._fh.write(_local_header(encoded, flags, 0, stored, extra, zip64))
        data_offset = self._fh.tell()
        self._fh.seek(data_offset + size)
        self._pending[name] = _Member(encoded, flags, offset, size, 0)
        self._members.append(self._pending[name])
        return data_offset

    def fill(self, name: str, crc: int) -> None:
        """The CRC-32 of a reserved member's data, now written: into its local header and the directory."""
        member = self._pending.pop(name)
        member.crc = crc
        end = self._fh.tell()
        self._fh.seek(member.offset + 14)  # the CRC field of the local header
        self._fh.write(struct.pack("<I", crc))
        self._fh.seek(end)
        self.crcs[name] = crc

    def close(self) -> None:
        if self._pending:
            raise ValueError(f"zip member {next(iter(self._pending))!r} was reserved but never filled")
        directory_offset = self._fh.tell()
        for m in self._members:
            big_size, big_offset = m.size > ZIP64_LIMIT, m.offset > ZIP64_LIMIT
            fields = ([m.size, m.size] if big_size else []) + ([m.offset] if big_offset else [])
            extra = struct.pack(f"<HH{len(fields)}Q", _ZIP64_ID, 8 * len(fields), *fields) if fields else b""
            version = 45 if fields else 20
            self._fh.write(
                struct.pack(
                    "<IHHHHHHIIIHHHHHII",
                    0x02014B50,
                    (3 << 8) | version,  # made by: Unix
                    version,
                    m.flags,
                    0,  # stored
                    0,
                    _DOS_DATE,
                    m.crc,
                    0xFFFFFFFF if big_size else m.size,
                    0xFFFFFFFF if big_size else m.size,
                    len(m.name),
                    len(extra),
                    0,
                    0,
                    0,
                    0,
                    0xFFFFFFFF if big_offset else m.offset,
                )
                + m.name
                + extra
            )
        end = self._fh.tell()
        count, size = len(self._members), end - directory_offset
        if count >= 0xFFFF or size > ZIP64_LIMIT or directory_offset > ZIP64_LIMIT:
            self._fh.write(struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, count, count, size, directory_offset))
            self._fh.write(struct.pack("<IIQI", 0x07064B50, 0, end, 1))
            count, size, directory_offset = min(count, 0xFFFF), min(size, 0xFFFFFFFF), min(directory_offset, 0xFFFFFFFF)
        self._fh.write(struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, count, count, size, directory_offset, 0))


def _encode(name: str) -> tuple[bytes, int]:
    try:
        return name.encode("ascii"), 0
    except UnicodeEncodeError:
        return name.encode("utf-8"), 0x800  # the "language encoding" flag: the name is UTF-8


def _local_header(name: bytes, flags: int, crc: int, size: int, extra: bytes, zip64: bool) -> bytes:
    version = 45 if zip64 else 20
    return struct.pack("<IHHHHHIIIHH", 0x04034B50, version, flags, 0, 0, _DOS_DATE, crc, size, size, len(name), len(extra)) + name + extra
