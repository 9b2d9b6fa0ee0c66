"""Where a target lies: a local path or a remote one, and the source that reads it."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Union

from ..errors import LimitExceeded
from .remote import RemotePath
from .source import LocalSource, Source

AnyPath = Union[Path, RemotePath]
"""What the directory logic and the readers take: a local path or a remote one."""


_URL_START = ("://", "::")


def is_url(target: str) -> bool:
    """``scheme://...`` (a scheme of two letters or more, so ``C:\\`` is a path) or an fsspec chain ``a::b://``."""
    scheme, sep, _ = target.partition("://")
    return bool(sep) and len(scheme) >= 2 and scheme.replace("+", "").replace("-", "").replace(".", "").isalnum()


def locate(target: str | AnyPath) -> AnyPath:
    """What a target string names: a local ``Path``, or a ``RemotePath`` for a URL (``file://`` is local)."""
    if not isinstance(target, str):
        return target
    if not is_url(target):
        return Path(target)
    if target.lower().startswith("file://"):
        from urllib.parse import unquote, urlsplit

        return Path(unquote(urlsplit(target).path))
    if target.lower().startswith("hf://"):
        from . import hub

        return hub.locate(target).location
    return RemotePath.from_url(target)


def target_string(p: AnyPath) -> str:
    """The string that names ``p`` as a scan target again (a remote path's URL keeps its credentials)."""
    return p.url if isinstance(p, RemotePath) else str(p)


def open_source(where: AnyPath | str) -> Source:
    if isinstance(where, RemotePath):
        return where.open_source()
    return LocalSource(Path(where))


@contextmanager
def opened(where: AnyPath | str | Source) -> Iterator[Source]:
    """A source for ``where``, closed after the block unless the caller passed one already open."""
    if isinstance(where, Source):
        yield where
        return
    src = open_source(where)
    try:
        yield src
    finally:
        src.close()


def listdir(path: AnyPath) -> list[str]:
    return path.listdir() if isinstance(path, RemotePath) else os.listdir(path)


def read_small(path: AnyPath, cap: int) -> bytes:
    """The whole of a small file (a JSON config or index, a DCP ``.metadata``), refused over ``cap`` bytes; counted."""
    if isinstance(path, RemotePath):
        return path.read_bytes(cap)
    with LocalSource(path) as src:
        if src.size > cap:
            raise LimitExceeded(f"is over the {cap >> 20} MiB cap", path=str(path))
        return src.read(0, src.size)
