"""A zip reader that sees exactly what ``torch.load`` sees, or refuses the file.

torch reads archives with ``PyTorchStreamReader`` (caffe2/serialize/inline_container.cc) on miniz 3.0.2;
Python's ``zipfile`` reads some files differently (it shifts offsets by prepended bytes, counts entries by
bytes, decodes names as cp437, looks names up case-sensitively). Where miniz's reading is clear this module
mirrors it; where a file could honestly be read two ways it raises ``CheckpointError`` with one line.

Opening touches only the end records, the central directory and each member's 30-byte local header and
name, never member data, so a 10 GB archive opens as fast as a small one. It reads through a byte source
(``source.py``): locally the file's mapping and ``pread``; remotely a block cache, with every member's
local header fetched at once, so a remote archive costs a handful of round trips.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from ..errors import CheckpointError, LimitExceeded
from .source import LocalSource, Source

MAX_ENTRIES = 1_000_000
"""More entries than any checkpoint holds; the central directory of a hostile file costs at most this."""

_EOCD = struct.Struct("<4sHHHHIIH")  # end of central directory record
_LOC64 = struct.Struct("<4sIQI")  # zip64 end of central directory locator
_EOCD64 = struct.Struct("<4sQHHIIQQQQ")  # zip64 end of central directory record
_CDH = struct.Struct("<4sHHHHHHIIIHHHHHII")  # central directory file header
_LFH = struct.Struct("<4sHHHHHIIIHH")  # local file header
_SIG_EOCD, _SIG_LOC64, _SIG_EOCD64 = b"PK\x05\x06", b"PK\x06\x07", b"PK\x06\x06"
_SIG_CDH, _SIG_LFH = b"PK\x01\x02", b"PK\x03\x04"
_ZIP64_EXTRA = 0x0001
_FLAG_ENCRYPTED, _FLAG_PATCH, _FLAG_STRONG, _FLAG_UTF8, _FLAG_MASKED = 0x0001, 0x0020, 0x0040, 0x0800, 0x2000
_DOS_DIRECTORY = 0x10
_U16, _U32 = 0xFFFF, 0xFFFFFFFF
_DISAGREE = "loaders disagree"


@dataclass(frozen=True)
class ZipEntry:
    """One member, as the central directory and its local header describe it."""

    name: str
    """The central directory's name bytes decoded as UTF-8 (torch passes them on as raw bytes, and its
    Python layer decodes them as UTF-8); names that are not valid UTF-8, or hold a NUL, are refused."""
    header_offset: int
    """Where the member's local header starts."""
    data_offset: int
    """Where the member's bytes start: the local header's own name and extra lengths decide it, as miniz's
    extraction and ``getRecordOffset`` (torch.load's ``mmap=True``) do."""
    compressed_size: int
    """Bytes the member occupies at ``data_offset``."""
    size: int
    """Bytes it holds once inflated (equal to ``compressed_size`` when stored)."""
    method: int
    """Compression method: 0 stored, 8 deflated; any other is refused when read."""
    crc: int
    """The CRC-32 the central directory records (0 when torch.save ran with ``compute_crc32=False``)."""


def _refuse(path: Path | str, message: str) -> CheckpointError:
    return CheckpointError(message, path=str(path))


def _ascii_lower(raw: bytes) -> bytes:
    # miniz's MZ_TOLOWER folds A-Z only; bytes.lower() does the same
    return raw.lower()


class ZipArchive:
    """A read-only zip archive over a byte source; use ``ZipArchive.open`` (also a context manager)."""

    def __init__(self, src: Source, buf: Any, entries: tuple[ZipEntry, ...], *, owned: bool = False) -> None:
        self.source = src
        self.path: Path | str = src.path if isinstance(src, LocalSource) else src.name
        """The file (a local Path), or the remote source's name."""
        self._mm = buf
        self._owned = owned
        self.entries = entries
        """Central-directory order: torch takes the archive's folder name from the first entry."""
        self._by_name = {_ascii_lower(e.name.encode("utf-8")): e for e in entries}

    @classmethod
    def open(cls, path: Path | str | Source) -> ZipArchive:
        """The archive at ``path`` (a local file), or in an open source, which stays the caller's to close."""
        if isinstance(path, Source):
            src, owned = path, False
        else:
            try:
                src, owned = LocalSource(Path(path)), True
            except OSError as exc:
                raise _refuse(path, f"cannot read the file ({exc.strerror or exc})") from None
        try:
            if src.size < _EOCD.size:
                raise _refuse(src.name, f"truncated zip archive: too short to be one ({src.size} bytes); an incomplete download?")
            try:
                buf = src.view()
            except (OSError, ValueError) as exc:
                raise _refuse(src.name, f"cannot read the file ({getattr(exc, 'strerror', None) or exc})") from None
            return cls(src, buf, _read_entries(src.name, buf, src), owned=owned)
        except BaseException:
            if owned:
                src.close()
            raise

    def close(self) -> None:
        if self._owned:
            self.source.close()

    def __enter__(self) -> ZipArchive:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def find(self, name: str) -> ZipEntry | None:
        """The entry miniz's ``mz_zip_reader_locate_file(..., flags=0)`` finds: names compare with A-Z folded
        (case-insensitively), and the name ends at a NUL as a C string does (torch passes ``c_str()``)."""
        return self._by_name.get(_ascii_lower(name.split("\0", 1)[0].encode("utf-8", "surrogatepass")))

    def read(self, entry: ZipEntry, cap: int) -> bytes:
        """The member's bytes, inflated if deflated; refused past ``cap`` bytes or on a CRC-32 mismatch."""
        if entry.method not in (0, 8):
            raise _refuse(
                self.path, f"zip entry '{entry.name}' uses compression method {entry.method}; torch reads only stored and deflated members"
            )
        if entry.size > cap:
            raise LimitExceeded(f"zip entry '{entry.name}' holds {entry.size} bytes, over the {cap}-byte cap", path=str(self.path))
        raw = self._mm[entry.data_offset : entry.data_offset + entry.compressed_size]
        self.source.note_span(entry.data_offset, entry.data_offset + entry.compressed_size)
        if entry.method == 8:
            # miniz's extraction inflates into a buffer of exactly ``size`` bytes and fails unless the deflate
            # stream ends there (tinfl DONE and out == size); bytes after the stream's end are ignored by both.
            inflater = zlib.decompressobj(-zlib.MAX_WBITS)
            try:
                data = inflater.decompress(raw, entry.size + 1)
            except zlib.error as exc:
                raise _refuse(self.path, f"zip entry '{entry.name}' does not inflate ({exc})") from None
            if len(data) != entry.size or not inflater.eof:
                raise _refuse(self.path, f"zip entry '{entry.name}' does not inflate to the {entry.size} bytes its header records")
        else:
            data = raw
        # torch's miniz is built without its CRC check (a corrupted member loads), and torch.save with
        # compute_crc32=False writes 0; zipfile refuses any mismatch. A nonzero wrong CRC is corruption.
        if entry.crc != 0 and (actual := zlib.crc32(data)) != entry.crc:
            raise _refuse(
                self.path,
                f"zip entry '{entry.name}' fails its CRC-32 check (recorded {entry.crc:#010x}, computed {actual:#010x}): "
                f"the file is corrupt, and {_DISAGREE} (torch does not check, zipfile does)",
            )
        return data

    def span(self, entry: ZipEntry) -> tuple[int, int]:
        """``(offset, length)`` of a stored member's bytes in the file, for reads without copying."""
        if entry.method != 0:
            raise _refuse(
                self.path,
                f"zip entry '{entry.name}' is compressed; torch.load(mmap=True) would map its compressed bytes raw, so it is not read",
            )
        return entry.data_offset, entry.size

    def pickle_entries(self) -> list[ZipEntry]:
        """Every entry a loader might unpickle: names ending in ``.pkl`` (A-Z folded, as torch's lookups are),
        and any other entry whose bytes open with a PROTO opcode of protocol 2 to 5, except storage records
        (``<folder>/data/<key>``), which torch reads as raw tensor bytes and which start so by chance."""
        out = []
        for e in self.entries:
            if e.name.encode("utf-8").lower().endswith(b".pkl"):
                out.append(e)
            elif e.name.split("/")[1:2] != ["data"] and self._head(e, 2) in _PROTO_HEADS:
                out.append(e)
        return out

    def _head(self, entry: ZipEntry, n: int) -> bytes:
        if entry.method == 0:
            return self._mm[entry.data_offset : entry.data_offset + min(n, entry.size)]
        if entry.method == 8:
            try:  # a few KiB of deflate input yield the first bytes; a broken stream is refused when read
                return zlib.decompressobj(-zlib.MAX_WBITS).decompress(
                    self._mm[entry.data_offset : entry.data_offset + min(entry.compressed_size, 1 << 16)], n
                )
            except zlib.error:
                return b""
        return b""


_PROTO_HEADS = frozenset(bytes((0x80, p)) for p in range(2, 6))


def _find_eocd(path: str, mm: Any, src: Source) -> int:
    """miniz's ``mz_zip_reader_locate_header_sig``: the last signature, scanning back from the end, after
    which a whole record fits, no further back than 64 KiB plus the record."""
    size = len(mm)
    start = max(0, size - (_U16 + _EOCD.size) - 4096)  # miniz reads in 4 KiB blocks, so may look a little further
    pos = mm.rfind(_SIG_EOCD, start, size - _EOCD.size + 4)
    src.note_span(start, size)
    if pos < 0:
        raise _refuse(path, "no end-of-central-directory record: a truncated zip archive (an incomplete download?) or none at all")
    return pos


def _read_entries(path: str, mm: Any, src: Source) -> tuple[ZipEntry, ...]:
    size = len(mm)
    eocd = _find_eocd(path, mm, src)
    _, disk, cd_disk, count_disk, count, cd_size, cd_offset, comment_len = _EOCD.unpack(mm[eocd : eocd + _EOCD.size])
    # miniz ignores the comment length: bytes past the comment hide where the archive ends, so the record
    # and its comment must end the file.
    if eocd + _EOCD.size + comment_len != size:
        raise _refuse(
            path,
            f"zip archive's end record (comment of {comment_len} bytes) does not end at the end of the file "
            f"({size - eocd - _EOCD.size} bytes follow it); {_DISAGREE} on where the archive ends",
        )
    # miniz skips a signature with no room for a record after it; zipfile's rfind takes it, unless the file
    # ends in a comment-less record, which zipfile tries first.
    if comment_len and mm.find(_SIG_EOCD, eocd + 1) >= 0:
        raise _refuse(
            path, f"zip archive holds a second end-of-central-directory signature after its end record; {_DISAGREE} on which is used"
        )
    directory_end = eocd
    loc = eocd - _LOC64.size
    if loc >= 0 and mm[loc : loc + 4] == _SIG_LOC64:
        # Both readers then take every count, size and offset from the zip64 record. miniz finds it through
        # the locator's offset, zipfile just before the locator: they must be the same place.
        _, loc_disk, rec, disks = _LOC64.unpack(mm[loc : loc + _LOC64.size])
        if loc_disk != 0 or disks != 1:
            raise _refuse(
                path, f"zip archive spans several disks (zip64 locator: disk {loc_disk} of {disks}); torch reads single-disk archives"
            )
        if rec != loc - _EOCD64.size or mm[rec : rec + 4] != _SIG_EOCD64:
            raise _refuse(path, f"zip64 end record is not where its locator points (offset {rec}); {_DISAGREE} on which record is used")
        _, rec_size, _, _, disk64, cd_disk64, count_disk64, count64, cd_size64, cd_offset64 = _EOCD64.unpack(mm[rec : rec + _EOCD64.size])
        if rec_size != _EOCD64.size - 12:
            raise _refuse(
                path, f"zip64 end record carries {rec_size - (_EOCD64.size - 12)} bytes of extensible data; {_DISAGREE} on its layout"
            )
        for label, small, big, sentinel in (
            ("entry count", count, count64, _U16),
            ("entry count on this disk", count_disk, count_disk64, _U16),
            ("central directory size", cd_size, cd_size64, _U32),
            ("central directory offset", cd_offset, cd_offset64, _U32),
        ):
            if small not in (big, sentinel):
                raise _refuse(
                    path,
                    f"zip archive's end record and its zip64 record disagree on the {label} ({small} vs {big}); {_DISAGREE} on which holds",
                )
        disk, cd_disk, count_disk, count, cd_size, cd_offset = disk64, cd_disk64, count_disk64, count64, cd_size64, cd_offset64
        directory_end = rec
    if disk != 0 or cd_disk != 0 or count_disk != count:
        raise _refuse(path, f"zip archive spans several disks (disk {disk}, directory on disk {cd_disk}); torch reads single-disk archives")
    if count == 0:
        raise _refuse(path, "zip archive holds no entries")
    if count > MAX_ENTRIES:
        raise LimitExceeded(f"zip archive lists {count} entries, over the {MAX_ENTRIES} cap", path=str(path))
    # zipfile shifts every offset by the bytes between where the directory is said to end and the end record
    # ("concat", for prepended data); miniz reads at the recorded offsets. Only a directory that ends right
    # at the end records means the same to both.
    if cd_offset + cd_size != directory_end:
        raise _refuse(
            path,
            f"zip archive's central directory is not where its end record says (offset {cd_offset} + size {cd_size} != {directory_end}): "
            f"bytes were inserted or prepended, and {_DISAGREE} (zipfile shifts offsets, torch does not)",
        )
    if src.remote:
        src.prefetch([(cd_offset, cd_size)])
        src.read_ranges(_header_ranges(mm, cd_offset, cd_size, count))
    entries = _read_directory(path, mm, src, cd_offset, cd_size, count)
    src.note_span(cd_offset, cd_offset + cd_size)
    _check_layout(path, entries, cd_offset)
    return entries


def _header_ranges(mm: Any, cd_offset: int, cd_size: int, count: int) -> list[tuple[int, int]]:
    """``(offset, length)`` of each member's local header and name, from the central directory read without
    checks, to fetch them all at once before ``_read_directory`` reads them one by one, with every check."""
    out: list[tuple[int, int]] = []
    pos, end = cd_offset, cd_offset + cd_size
    try:
        for _ in range(count):
            if pos + _CDH.size > end:
                break
            fields = _CDH.unpack(mm[pos : pos + _CDH.size])
            if fields[0] != _SIG_CDH:
                break
            csize, usize, name_len, extra_len, comment_len, offset = *fields[8:13], fields[16]
            if _U32 in (usize, csize, offset):
                extra = mm[pos + _CDH.size + name_len : pos + _CDH.size + name_len + extra_len]
                offset = _zip64_fields("", "", extra, usize, csize, offset)[2]
            out.append((offset, _LFH.size + name_len))
            pos += _CDH.size + name_len + extra_len + comment_len
    except CheckpointError:
        pass  # the checked read says what is wrong
    return out


def _read_directory(path: str, mm: Any, src: Source, cd_offset: int, cd_size: int, count: int) -> tuple[ZipEntry, ...]:
    entries = []
    seen: dict[bytes, str] = {}
    pos, end = cd_offset, cd_offset + cd_size
    for i in range(count):
        if pos + _CDH.size > end or mm[pos : pos + 4] != _SIG_CDH:
            raise _refuse(path, f"zip central directory entry {i} is corrupt (no header signature at offset {pos})")
        fields = _CDH.unpack(mm[pos : pos + _CDH.size])
        flags, method, crc, csize, usize, name_len, extra_len, comment_len = fields[3], fields[4], *fields[7:13]
        disk_start, external_attr, header_offset = fields[13], fields[15], fields[16]
        name_at = pos + _CDH.size
        record_end = name_at + name_len + extra_len + comment_len
        if record_end > end:
            raise _refuse(path, f"zip central directory entry {i} runs past the end of the central directory")
        raw = bytes(mm[name_at : name_at + name_len])
        name = _decode_name(path, raw, flags)
        if flags & (_FLAG_ENCRYPTED | _FLAG_STRONG | _FLAG_MASKED):
            raise _refuse(path, f"zip entry '{name}' is encrypted; torch cannot read it")
        if flags & _FLAG_PATCH:
            raise _refuse(path, f"zip entry '{name}' is a patch (flag bit 5); torch cannot read it")
        if disk_start != 0:
            raise _refuse(path, f"zip entry '{name}' starts on disk {disk_start}; torch reads single-disk archives")
        key = _ascii_lower(raw)
        if key in seen:
            other = seen[key]
            what = f"the entry '{name}' twice" if other == name else f"entries whose names differ only in case ({other}, {name})"
            raise _refuse(path, f"zip archive holds {what}; {_DISAGREE} on which is read")
        seen[key] = name
        usize, csize, header_offset = _zip64_fields(
            path, name, mm[name_at + name_len : name_at + name_len + extra_len], usize, csize, header_offset
        )
        if usize and not csize:
            raise _refuse(path, f"zip entry '{name}' claims {usize} bytes from 0 stored bytes; torch reads nothing for it")
        if method == 0 and usize != csize:
            raise _refuse(
                path, f"zip entry '{name}' is stored but records two sizes ({csize} and {usize}); {_DISAGREE} on how much to read"
            )
        if (external_attr & _DOS_DIRECTORY or name.endswith("/")) and usize:
            # mz_zip_reader_extract_to_mem returns at once for a directory: torch would hand back unread memory
            raise _refuse(path, f"zip entry '{name}' is marked as a directory but holds {usize} bytes; torch reads no data for directories")
        data_offset = _local_header(path, src, name, raw, flags, header_offset)
        if data_offset + csize > len(mm):
            raise _refuse(path, f"zip entry '{name}' runs past the end of the file ({data_offset} + {csize} > {len(mm)} bytes)")
        entries.append(ZipEntry(name, header_offset, data_offset, csize, usize, method, crc))
        pos = record_end
    if pos != end:
        # miniz reads exactly ``count`` entries, zipfile reads entries until the directory's bytes run out
        raise _refuse(
            path, f"zip central directory holds {end - pos} bytes after its {count} entries; {_DISAGREE} on how many entries it has"
        )
    return tuple(entries)


def _decode_name(path: str, raw: bytes, flags: int) -> str:
    try:
        name = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise _refuse(path, f"zip entry name {raw[:80]!r} is not valid UTF-8; torch cannot name it") from None
    if "\0" in name:
        # a C string ends at the NUL (miniz's lookups, torch's record list); zipfile cuts the name there too
        raise _refuse(path, f"zip entry name {name[:80]!r} holds a NUL byte; {_DISAGREE} on where the name ends")
    if not name.isascii() and not flags & _FLAG_UTF8:
        raise _refuse(
            path, f"zip entry name {name[:80]!r} is not ASCII and not flagged UTF-8; {_DISAGREE} on its encoding (zipfile reads cp437)"
        )
    return name


def _zip64_fields(path: str, name: str, extra: bytes, usize: int, csize: int, offset: int) -> tuple[int, int, int]:
    """miniz's ``mz_zip_file_stat_internal``: a field of 0xFFFFFFFF is read from the zip64 extra field, in the
    order size, compressed size, offset; the first such field counts (zipfile reads the same order)."""
    wanted = [v == _U32 for v in (usize, csize, offset)]
    found = False
    values = [usize, csize, offset]
    pos = 0
    while pos < len(extra):
        if pos + 4 > len(extra):
            raise _refuse(path, f"zip entry '{name}' has a corrupt extra field")
        tag, length = struct.unpack_from("<HH", extra, pos)
        body = extra[pos + 4 : pos + 4 + length]
        if len(body) != length:
            raise _refuse(path, f"zip entry '{name}' has a corrupt extra field")
        if tag == _ZIP64_EXTRA:
            if found:
                raise _refuse(path, f"zip entry '{name}' has two zip64 extra fields; {_DISAGREE} on which is used")
            found = True
            at = 0
            for i, want in enumerate(wanted):
                if want:
                    if at + 8 > length:
                        raise _refuse(path, f"zip entry '{name}' has a zip64 extra field too short for its sizes")
                    values[i] = struct.unpack_from("<Q", body, at)[0]
                    at += 8
        pos += 4 + length
    if any(wanted) and not found:
        raise _refuse(path, f"zip entry '{name}' has 32-bit size or offset fields at their maximum but no zip64 extra field")
    return values[0], values[1], values[2]


def _local_header(path: str, src: Source, name: str, raw: bytes, flags: int, offset: int) -> int:
    # Read with pread, not through the mapping: one small read per member keeps memory flat however
    # large the archive (a mapped page drags its cached neighbours into the process's resident set).
    # A remote source has them already, fetched together (``_header_ranges``).
    head = src.read(offset, _LFH.size + len(raw))
    if len(head) < _LFH.size:
        raise _refuse(path, f"zip entry '{name}': its local header offset {offset} lies past the end of the file")
    sig, _, local_flags, *_, name_len, extra_len = _LFH.unpack_from(head, 0)
    if sig != _SIG_LFH:
        raise _refuse(path, f"zip entry '{name}' has no local header at offset {offset} (bad signature)")
    local_name = head[_LFH.size : _LFH.size + name_len] if name_len <= len(raw) else src.read(offset + _LFH.size, name_len)
    if local_name != raw:
        # miniz never reads the local name; zipfile refuses a mismatch, other tools list the local one
        shown = bytes(local_name[:80]).decode("utf-8", "replace")
        raise _refuse(path, f"zip entry '{name}': its local header names it '{shown}'; {_DISAGREE} on its name")
    if not name.isascii() and (local_flags ^ flags) & _FLAG_UTF8:
        raise _refuse(
            path, f"zip entry '{name}': its local header and central directory disagree on the UTF-8 flag; {_DISAGREE} on its name"
        )
    if (local_flags ^ flags) & (_FLAG_ENCRYPTED | _FLAG_PATCH):
        raise _refuse(
            path, f"zip entry '{name}': its local header and central directory disagree on its flags ({local_flags:#06x} vs {flags:#06x})"
        )
    return offset + _LFH.size + name_len + extra_len


def _check_layout(path: str, entries: tuple[ZipEntry, ...], cd_offset: int) -> None:
    """Members may not share bytes with each other or the central directory, and the first starts the file:
    torch.load sends a file that does not open with a local header to its legacy reader."""
    spans = sorted(((e.header_offset, e.data_offset + e.compressed_size, e) for e in entries), key=lambda s: (s[0], s[1]))
    if spans[0][0] != 0:
        raise _refuse(
            path,
            f"zip archive does not start with its first member's local header ({spans[0][0]} bytes come first); "
            f"{_DISAGREE} (torch.load reads such a file as a legacy pickle)",
        )
    for (_, end, a), (start, _, b) in zip(spans, spans[1:], strict=False):
        if start < end:
            raise _refuse(path, f"zip entries '{a.name}' and '{b.name}' overlap (bytes {start} to {end}); {_DISAGREE} on what each holds")
    last = spans[-1]
    if last[1] > cd_offset:
        raise _refuse(path, f"zip entry '{last[2].name}' overlaps the central directory (ends at {last[1]}, directory at {cd_offset})")
