"""Writes that cannot hurt: a temporary file beside the destination, fsync, rename; never over the input by accident."""

from __future__ import annotations

import errno
import os
import shutil
import stat
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from .. import dtypes
from ..errors import ConversionError
from ..inventory import Format
from ..temporaries import remove_stale, temporary_path


def default_output(source: Path, target: str, out_format: str | None = None) -> Path:
    short = dtypes.short_name(target)
    if source.is_dir():
        return source.with_name(f"{source.name}-{short}")
    suffix = ".safetensors" if out_format == Format.SAFETENSORS else source.suffix
    return source.with_name(f"{source.stem}.{short}{suffix}")


def check_destination(source: Path, dest: Path, *, force: bool, in_place: bool) -> None:
    if not dest.parent.is_dir():
        raise ConversionError("output directory does not exist", path=str(dest.parent))
    if not os.access(dest.parent, os.W_OK):
        raise ConversionError("output directory is not writable", path=str(dest.parent))
    real_source, real_dest = source.resolve(), dest.resolve()
    if source.is_dir() and real_dest.is_relative_to(real_source) and real_dest != real_source:
        raise ConversionError(
            f"output is inside the source folder {str(source)!r}: the next scan or convert of the source would read it as "
            "part of the model; choose an output outside it (-o)",
            path=str(dest),
        )
    if real_source.is_relative_to(real_dest) and real_dest != real_source:
        raise ConversionError(
            "output would replace a folder that holds the source; choose another output (-o)",
            path=str(dest),
        )
    if dest.exists() or dest.is_symlink():
        same = dest.exists() and os.path.samefile(source, dest)
        if same and not in_place:
            raise ConversionError(
                "output is the input itself (the same file by another name, link or hard link); pass --in-place to replace it",
                path=str(dest),
            )
        if not same and not force:
            raise ConversionError("output already exists; pass --force to replace it", path=str(dest))


@contextmanager
def atomic_output(
    dest: Path, *, mode_from: Path | None, is_dir: bool = False, sources_unchanged: Callable[[], None] | None = None
) -> Iterator[Path]:
    """Yield a temporary path beside ``dest``; on success fsync it and rename it into place, else remove it.
    ``sources_unchanged`` raises where a source changed while it was read: it runs last before the rename, and
    first where the body failed (a verification that fails on a changed source should say that it changed).

    The name carries this host and process (see ``temporaries``): what a killed run left here is removed first.
    The output takes ``mode_from``'s permission bits; None (a remote source, which has none): the umask's.
    """
    remove_stale(dest.parent)
    tmp = temporary_path(dest)
    if is_dir:
        tmp.mkdir()
    try:
        yield tmp
        for f in tmp.rglob("*") if is_dir else [tmp]:
            if f.is_file():
                with f.open("rb+") as fh:
                    os.fsync(fh.fileno())
        if mode_from is not None:
            os.chmod(tmp, stat.S_IMODE(mode_from.stat().st_mode))  # a directory's files got theirs as they were written
        if sources_unchanged is not None:
            sources_unchanged()
        swap_into_place(tmp, dest)
    except BaseException as exc:
        if is_dir:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        if sources_unchanged is not None and isinstance(exc, ConversionError):
            sources_unchanged()
        if isinstance(exc, OSError):  # a full disk, a file-size limit, a vanished directory: not a bug of ours
            where = f" ({exc.filename})" if exc.filename and Path(exc.filename) != tmp else ""
            raise ConversionError(f"could not write the output: {exc.strerror or exc}{where}; nothing was written", path=str(dest)) from exc
        raise


def swap_into_place(tmp: Path, dest: Path) -> None:
    """Rename the finished ``tmp`` (a file or a directory) to ``dest``, replacing what is there, so that ``dest``
    is either the old output or the new one, never a mix, and at no moment is the only copy of either under a
    name that a cleanup removes. The one swap every conversion ends with.

    A rename cannot replace a non-empty directory. Where the kernel can (Linux ``renameat2(RENAME_EXCHANGE)``),
    the two directories trade names in one step and the old one, now at ``tmp``, is removed. Elsewhere the old
    one is renamed aside to a ``.old`` temporary first; a run killed before the second rename leaves ``dest``
    missing and the ``.old`` holding it, and ``temporaries.remove_stale`` then renames it back, never removes it.
    """
    if tmp.is_dir() and dest.exists():
        if _exchange(tmp, dest):
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            backup = temporary_path(dest, "old")
            os.replace(dest, backup)
            os.replace(tmp, dest)
            shutil.rmtree(backup, ignore_errors=True)
    else:
        os.replace(tmp, dest)
    _fsync_dir(dest.parent)


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _exchange(a: Path, b: Path) -> bool:
    """Swap the names of ``a`` and ``b`` atomically; False where this system or filesystem cannot (then nothing
    moved). Linux 3.15+ with glibc 2.28+; ext4, xfs, btrfs and tmpfs support it, some network filesystems do not."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    renameat2.restype = ctypes.c_int
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM):
        return False  # not supported here: the two-rename fallback, which a later run can recover from
    raise OSError(err, os.strerror(err), str(b))


@contextmanager
def flushing(path: Path) -> Iterator[None]:
    """fsync ``path`` in a background thread while the body runs; an fsync error is raised at exit.

    Verification re-reads the file from the page cache while the disk takes the same bytes, so the
    two overlap instead of adding up. ``atomic_output`` still fsyncs before the rename.
    """
    failure: list[OSError] = []

    def flush() -> None:
        try:
            with path.open("rb+") as fh:
                os.fsync(fh.fileno())
        except OSError as exc:
            failure.append(exc)

    worker = threading.Thread(target=flush, name="dtypeaudit-fsync", daemon=True)
    worker.start()
    try:
        yield
    finally:
        worker.join()
    if failure:
        raise failure[0]


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
