"""The temporaries ``convert`` writes beside its output, named so that a later run can tell a dead one.

``atomic_output`` writes ``.NAME.dtypeaudit-HOST-PID.tmp`` beside ``NAME`` (and ``.old`` while a directory is
swapped where the kernel cannot exchange two names in one step). A run killed with SIGKILL cannot remove its
own; the next run in that directory removes those of processes that no longer exist on this host (or renames
back a ``.old`` that is the only copy), and scans pass every one of them over with a note. A temporary of
another host (a shared filesystem) or of a live process is left alone.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path

MARKER = "dtypeaudit"
_NAME = re.compile(rf"^\.(?P<dest>.+)\.{MARKER}-(?:(?P<host>[A-Za-z0-9-]*)-)?(?P<pid>\d+)\.(?:tmp|old)$")
log = logging.getLogger("dtypeaudit")


def this_host() -> str:
    """This machine's name as temporaries carry it: the first label, letters, digits and dashes only."""
    return re.sub(r"[^A-Za-z0-9-]", "", socket.gethostname().split(".")[0]) or "localhost"


def temporary_path(dest: Path, suffix: str = "tmp") -> Path:
    """Where a run of this process writes ``dest`` before renaming it into place."""
    return dest.parent / f".{dest.name}.{MARKER}-{this_host()}-{os.getpid()}.{suffix}"


@dataclass(frozen=True)
class Temporary:
    """A name that ``temporary_path`` made."""

    dest: str
    host: str | None
    """None for the names of dtypeaudit releases that did not record it (taken as this host)."""
    pid: int


def parse(name: str) -> Temporary | None:
    """The parts of a temporary's file name, or None for any other name."""
    m = _NAME.match(name)
    if m is None:
        return None
    return Temporary(m.group("dest"), m.group("host"), int(m.group("pid")))


def is_alive(pid: int) -> bool:
    """Whether a process with this id exists (one we may not signal still exists)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return True  # cannot tell: keep its files
    return True


def is_stale(t: Temporary) -> bool:
    """Left by a process of this host that has ended."""
    return (t.host is None or t.host == this_host()) and t.pid != os.getpid() and not is_alive(t.pid)


def remove_stale(directory: Path) -> list[Path]:
    """Tidy what dead runs left in ``directory``; the paths removed, each logged on stderr.

    A ``.old`` is the previous output that a directory swap moved aside (``atomic.swap_into_place``). Where its
    destination is missing, the run died between its two renames and the ``.old`` is the only copy, perhaps of
    an ``--in-place`` source: it is renamed back, never removed. Everything else a dead run left is removed.
    """
    removed = []
    try:
        entries = list(directory.iterdir())
    except OSError:
        return []
    for entry in sorted(entries, key=lambda e: not e.name.endswith(".old")):  # restore before removing
        t = parse(entry.name)
        if t is None or not is_stale(t):
            continue
        dest = directory / t.dest
        if entry.name.endswith(".old") and not (dest.exists() or dest.is_symlink()):
            try:
                os.rename(entry, dest)
            except OSError:
                continue
            log.warning(
                "dtypeaudit: restored %s from %s: a conversion ended between the two renames of its swap (process %d)",
                dest,
                entry.name,
                t.pid,
            )
            continue
        try:
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        except OSError:
            continue
        removed.append(entry)
        log.warning("dtypeaudit: removed %s, left by a conversion that did not finish (process %d has ended)", entry, t.pid)
    return removed
