"""Name a file's format from its content, the way the loaders that read it afterwards decide. The safetensors reader
is imported only for a file that may be one: a .pt scan's start-up does without it.

``torch.load`` (torch/serialization.py) takes a file whose first four bytes are ``PK\\x03\\x04`` as a zip
archive; otherwise it opens it with ``tarfile.open(mode="r:")`` (the pre-0.4 tar format); otherwise it
unpickles the first pickle and goes on as a legacy file if that is the magic number. safetensors
(``safe_open``, and transformers and torch.load for a ``.safetensors`` path) reads any file whose header
parses. A file valid as two of these is refused: two loaders would read two different things.
"""

from __future__ import annotations

import struct
from typing import IO, Any

from ..errors import CheckpointError, LimitExceeded
from . import gguf, locate
from .legacy import LEGACY_MAGIC, is_legacy_magic
from .locate import AnyPath
from .remote import RemoteError
from .source import Source, SourceFile

HEAD_BYTES = 64 << 10
"""Bytes read to name a format; a first pickle that runs past them is interpreted over the whole file."""
WALK_HEAD_BYTES = 512
"""Bytes read per file when a directory walk decides what to scan."""
TAR_PROBE_BYTES = 1 << 20
"""tarfile may read a long-name or pax header past its first block; past this many bytes we stop and refuse."""

# What torch.save writes first in a legacy file at its default protocol: a pickle of the magic number.
_LEGACY_FAST = b"\x80\x02\x8a\x0a" + LEGACY_MAGIC.to_bytes(10, "little") + b"."
_ZIP_LOCAL = b"PK\x03\x04"  # torch.serialization._is_zipfile checks exactly these four bytes
_ZIP_EMPTY = b"PK\x05\x06"
_JSON_WS = b" \t\n\r"
_CHECKPOINT_SUFFIXES = frozenset({".pt", ".pth", ".ckpt", ".safetensors"})
"""Named like a checkpoint: a walk reports these even when their content is not one (an LFS pointer, a login page)."""

_NAMES = {"zip": "a zip archive", "tar": "a tar archive", "legacy": "a legacy torch.save file", "safetensors": "a safetensors file"}

# Things people end up holding instead of a checkpoint, and what to tell them.
_NOT_CHECKPOINTS: tuple[tuple[bytes, str], ...] = (
    (
        b"version https://git-lfs.github.com/spec",
        "a Git LFS pointer file, not the checkpoint itself; run `git lfs pull` to fetch the real file",
    ),
    (b"\x89PNG", "a PNG image, not a checkpoint"),
    (b"\xff\xd8\xff", "a JPEG image, not a checkpoint"),
    (b"GIF8", "a GIF image, not a checkpoint"),
    (b"%PDF", "a PDF document, not a checkpoint"),
    (b"\x1f\x8b", "gzip-compressed data; decompress it first"),
    (b"\x89HDF", "an HDF5 file (Keras?), not a PyTorch checkpoint"),
    (b"\x93NUMPY", "a NumPy .npy array, not a PyTorch checkpoint"),
)


class _NoPickle:
    """The file does not start with a complete pickle."""


_NO_PICKLE = _NoPickle()
_TOO_BIG = (None, -1)
"""A first pickle over the interpreter's limits: the pickle reader says so."""


# -- the pieces ---------------------------------------------------------------------------------


def _head(src: Source, n: int) -> tuple[bytes, int]:
    return src.read(0, n), src.size


def _open(path: AnyPath) -> Source:
    try:
        return locate.open_source(path)
    except IsADirectoryError:
        raise CheckpointError("is a directory", path=str(path)) from None


def _is_zip(head: bytes) -> bool:
    return head.startswith(_ZIP_LOCAL) or head.startswith(_ZIP_EMPTY)


class _PastProbe(Exception):
    """tarfile asked for more than TAR_PROBE_BYTES of the file."""


class _Capped:
    """A read-only file that refuses to be read past ``cap`` bytes (unless the file is no longer than that)."""

    def __init__(self, fh: IO[bytes] | SourceFile, size: int, cap: int) -> None:
        self.fh, self.size, self.cap = fh, size, cap

    def read(self, n: int | None = -1) -> bytes:
        pos = self.fh.tell()
        want = self.size - pos if n is None or n < 0 else n
        if pos + want > self.cap and self.size > self.cap:
            raise _PastProbe
        return self.fh.read(want)

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.fh.seek(offset, whence)

    def tell(self) -> int:
        return self.fh.tell()


def _tar(src: Source, size: int) -> str | None:
    """``"tar"`` where torch.load's ``tarfile.open(mode="r:")`` succeeds, ``"empty-tar"`` where it opens a
    tar of no members (a first block of zeros), None where it raises TarError and torch moves on."""
    import tarfile

    try:
        with tarfile.open(fileobj=_Capped(SourceFile(src), size, TAR_PROBE_BYTES), mode="r:", format=tarfile.PAX_FORMAT) as tar:  # type: ignore[call-overload]
            return "tar" if tar.firstmember is not None else "empty-tar"
    except tarfile.TarError:
        return None
    except _PastProbe:
        return "tar"  # a header claiming a megabyte of long name: a tar to tarfile, and refused as one
    except RemoteError:
        raise  # a remote read failed: say so, rather than guess
    except (ValueError, EOFError, OverflowError, struct.error) as exc:
        # tarfile's own parse failures past its first check: torch.load raises the same out of tarfile, so the
        # file is unreadable to it. Anything else, or one raised in our file object, is a bug of ours and
        # propagates (exit 3), never a verdict.
        if not _raised_in(exc, "tarfile"):
            raise
        return "tar"


def _raised_in(exc: BaseException, module: str) -> bool:
    """Whether the innermost frame ``exc`` passed through is in ``module`` (a builtin such as ``int()`` has none)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_globals.get("__name__") == module


def _may_be_tar(head: bytes, size: int) -> bool:
    """False only where ``tarfile.open(mode="r:")`` refuses the first block, on what it checks first
    (``TarInfo.frombuf``: a file shorter than a block, then ``nti`` of bytes 148-156 and ``calc_chksums``, mirrored
    here), so that a zip or a pickle does not import tarfile; anything else goes to tarfile."""
    if size < 512:
        return False  # tarfile: EmptyHeaderError or TruncatedHeaderError at offset 0, a ReadError
    block = head[:512]
    if len(block) < 512 or not block.strip(b"\0") or block[148] in (0o200, 0o377):
        return True
    field = block[148:156].split(b"\0", 1)[0]
    try:
        chksum = int(field.decode("ascii").strip() or "0", 8)
    except ValueError:  # tarfile: InvalidHeaderError at offset 0, a ReadError
        return False
    rest = block[:148] + block[156:]
    return chksum in (256 + sum(rest), 256 + sum(b - 256 if b > 127 else b for b in rest))


def _tar_block(head: bytes) -> bool:
    """The first 512 bytes are a tar header with a valid checksum (the check tarfile makes first)."""
    import tarfile

    if len(head) < 512 or not head[:512].strip(b"\0"):
        return False
    try:
        tarfile.TarInfo.frombuf(head[:512], "utf-8", "surrogateescape")
    except tarfile.HeaderError:
        return False
    return True


def _first_pickle(src: Source, head: bytes, size: int) -> tuple[Any, int] | _NoPickle:
    """The value of the pickle at byte 0 and where it ends, interpreted (never run) by dtypeaudit's VM."""
    if head.startswith(_LEGACY_FAST):
        return LEGACY_MAGIC, len(_LEGACY_FAST)
    from .picklevm import PickleVM

    try:
        return PickleVM(head, source=src.name).load(0)
    except LimitExceeded:
        return _TOO_BIG
    except CheckpointError:
        if len(head) >= size:
            return _NO_PICKLE
    # It ran past the bytes read: the file decides. Any protocol, so no prefix is trusted.
    try:
        whole = src.view()
    except (OSError, ValueError):  # mmap's refusals: a file that shrank to nothing, or is no regular file, since it was opened
        return _NO_PICKLE
    vm = None
    try:
        vm = PickleVM(whole, source=src.name)
        return vm.load(0)
    except LimitExceeded:
        return _TOO_BIG
    except RemoteError:
        raise  # the network failed, not the pickle
    except (CheckpointError, OSError):
        # PickleVM says what is wrong with a pickle only as CheckpointError: anything else (a ValueError, a
        # TypeError) is a bug of ours and propagates (exit 3), never a verdict on the file.
        return _NO_PICKLE
    finally:
        if vm is not None:
            src.note_span(0, vm.pos)


def _safetensors_plausible(head: bytes, size: int) -> bool:
    """Where the safetensors reader should say what is wrong: a ``{`` at byte 8 (today's rule), or a
    header length that fits the file and a header that opens, after JSON whitespace, with ``{``."""
    if len(head) < 9:
        return False
    if head[8:9] == b"{":
        return True
    (n,) = struct.unpack("<Q", head[:8])
    if 8 + n > size:
        return False  # a zip's or a pickle's first eight bytes read as a length past the end of any file of ordinary size
    from .safetensors import MAX_HEADER_BYTES

    if n > MAX_HEADER_BYTES:
        return False
    text = head[8 : 8 + n].lstrip(_JSON_WS)
    return text.startswith(b"{") or (not text and len(head) < 8 + n)


def _both(name: str, formats: list[str]) -> CheckpointError:
    what = " and ".join(_NAMES[f] for f in formats)
    if "safetensors" in formats:
        why = "torch.load and safetensors would read different tensors"
    else:
        why = "loaders would read different things from it"
    return CheckpointError(f"is both {what}; {why}", path=name)


# -- the decisions ------------------------------------------------------------------------------


def sniff_kind(path: AnyPath | Source) -> str:
    """``zip``, ``legacy``, ``safetensors``, ``gguf`` or ``pickle``; anything else raises a one-line CheckpointError."""
    if not isinstance(path, Source):
        with _open(path) as src:
            return sniff_kind(src)
    src = path
    name = src.name
    head, size = _head(src, HEAD_BYTES)
    if not head:
        raise CheckpointError("empty file (0 bytes); an interrupted download?", path=name)
    formats: list[str] = []
    if _is_zip(head):
        formats.append("zip")
    tar = _tar(src, size) if _may_be_tar(head, size) else None
    if tar is not None:
        formats.append("tar")
    first = _first_pickle(src, head, size)
    # torch compares with !=: only an int equals the magic (a float cannot; it needs 75 bits of mantissa).
    if not isinstance(first, _NoPickle) and is_legacy_magic(first[0]):
        formats.append("legacy")
    plausible = _safetensors_plausible(head, size)
    if plausible and formats:
        from . import safetensors

        if safetensors.accepts(src):
            formats.append("safetensors")
    if len(formats) > 1:
        raise _both(name, formats)
    if formats == ["tar"]:
        if tar == "empty-tar":
            raise CheckpointError(
                "is not a checkpoint: it starts with a block of zero bytes, which torch.load takes for an empty tar archive",
                path=name,
            )
        raise CheckpointError("is a tar archive (torch.save's pre-0.4 format, not supported); re-save it with a current torch", path=name)
    if formats:
        return formats[0]
    if gguf.is_gguf(head):
        return "gguf"  # llama.cpp's gguf_init_from_file checks these four bytes
    if plausible:
        return "safetensors"
    if not isinstance(first, _NoPickle):
        value, end = first
        if type(value) is int and 0 <= end < size:
            return "legacy"  # a number and more pickles: a legacy file whose magic is wrong, and its reader says so
        return "pickle"  # any protocol: its globals are reported
    if head[0] == 0x80 and len(head) > 1 and head[1] <= 5:
        return "pickle"  # a damaged pickle: its reader says where
    for magic, what in _NOT_CHECKPOINTS:
        if head.startswith(magic):
            raise CheckpointError(f"is {what}", path=name)
    text = head[:512].lstrip().lower()
    if text.startswith((b"<!doctype html", b"<html", b"<?xml", b"<head")):
        raise CheckpointError("is an HTML page, not a checkpoint (a login or error page saved in its place?)", path=name)
    if text.startswith((b"{", b"[")):
        raise CheckpointError("is a JSON file, not a checkpoint", path=name)
    raise CheckpointError(f"is not a checkpoint: unrecognised content starting {head[:8]!r}", path=name)


def _zip_left_out(src: Source) -> str | None:
    """Why a zip archive is left out of a walk: only where torch's own reader (mirrored by ``ziparchive``, not
    Python's zipfile, whose view of the central directory can differ) opens it and finds no record a loader
    unpickles. An archive torch's reader cannot open is scanned, so its reader says why it is refused."""
    from .ziparchive import ZipArchive

    try:
        with ZipArchive.open(src) as za:
            return None if za.pickle_entries() else "a zip archive with no pickle in it (torch.load cannot load it)"
    except RemoteError:
        raise
    except (CheckpointError, OSError):
        # What ZipArchive raises for an archive it refuses (it reports every malformed one as CheckpointError). Any
        # other exception is a bug of ours: it propagates (exit 3) rather than decide that the file is scanned.
        return None


def is_candidate(path: AnyPath) -> bool:
    """Whether a file found by walking a directory is scanned (see ``leave_out_reason``)."""
    return leave_out_reason(path) is None


def leave_out_reason(path: AnyPath) -> str | None:
    """None where a file found by walking a directory is scanned; else why it is left out, in words the
    report shows. A file is left out only where no loader dtypeaudit models would load it: torch.load takes
    any ``PK\\x03\\x04`` file for a zip, any file starting with a PROTO opcode for a pickle (its weights_only
    unpickler accepts every protocol number), and safetensors any file whose header parses. Reads a few
    hundred bytes; only pickles without a protocol header (protocols 0 and 1) are interpreted further.
    A file named like a checkpoint (``.pt``, ``.safetensors`` ...) is always scanned, except a temporary that
    ``convert`` writes (or a killed one left): half a file, passed over with a note on stderr."""
    from .. import temporaries

    temp = temporaries.parse(path.name)
    if temp is not None:
        state = "left by a run that has ended" if temporaries.is_stale(temp) else "being written by a conversion"
        if path.name.endswith(".old") and not (path.parent / temp.dest).exists():
            state = f"that is the only copy of {temp.dest} (a conversion stopped during its swap; `mv` it back)"
        temporaries.log.warning("dtypeaudit: skipping %s: a temporary %s (process %d)", path, state, temp.pid)
        return f"a temporary {state} (process {temp.pid})"
    if path.suffix.lower() in _CHECKPOINT_SUFFIXES:
        return None
    try:
        with _open(path) as src:
            return _left_out(src)
    except (OSError, CheckpointError):
        return None  # cannot look: say so by scanning it, rather than pass it over


def _left_out(src: Source) -> str | None:
    head, size = _head(src, WALK_HEAD_BYTES)
    if not head:
        return "an empty file"
    if head.startswith(_ZIP_LOCAL):
        return _zip_left_out(src)
    if head[0] == 0x80:
        return None  # PROTO, whatever the number: torch.load's weights_only unpickler reads protocol 6 and up too
    if _safetensors_plausible(head, size) or _tar_block(head) or gguf.is_gguf(head):
        return None
    if head[:1] in _PICKLE_OPCODES:
        more, size = _head(src, HEAD_BYTES)
        if not isinstance(_first_pickle(src, more, size), _NoPickle):
            return None
    for magic, what in _NOT_CHECKPOINTS:
        if head.startswith(magic):
            return what.split(";")[0]
    if head[:1] in _PICKLE_OPCODES:
        return "not a pickle, zip, tar, safetensors or GGUF file (its first bytes do not unpickle)"
    return "not a pickle, zip, tar, safetensors or GGUF file"


# Bytes a pickle can start with (pickletools' opcode codes, protocols 0 to 5).
_PICKLE_OPCODES = frozenset(bytes([b]) for b in b"().012BCFGIJKLMNPQRSTUVX]abcdeghijlopqrstu}" + bytes(range(0x80, 0x99)))
