"""What a target names (parsed once into a ``TargetRef``), where it lies (a local path or a remote one), and the
source that reads it."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union
from urllib.parse import unquote, urlsplit

from ..errors import LimitExceeded, UsageError
from .remote import RemotePath
from .source import LocalSource, Source

if TYPE_CHECKING:
    from .hub import Located

AnyPath = Union[Path, RemotePath]
"""What the directory logic and the readers take: a local path or a remote one."""


def is_url(target: str) -> bool:
    """``scheme://...`` (a scheme of two letters or more, so ``C:\\`` is a path) or an fsspec chain ``a::b://``."""
    scheme, sep, _ = target.partition("://")
    return bool(sep) and len(scheme) >= 2 and scheme.replace("+", "").replace("-", "").replace(".", "").isalnum()


class TargetKind(Enum):
    FILE = "file"
    """A local path that is not a folder (or does not exist: reading it says so)."""
    DIR = "dir"
    """A local folder."""
    URL = "url"
    """An fsspec URL (``s3://``, ``gs://``, ``https://``, chains ``a::b://``); ``file://`` is a local path."""
    HUB = "hub"
    """A Hugging Face hub id (``org/name[@rev]``) or an ``hf://`` URL: the local cache first, then the hub."""
    FACTORY = "factory"
    """User code that builds a model (``file.py:func``, ``package.module:func``)."""


@dataclass(frozen=True)
class TargetRef:
    """What the user named, parsed once (``parse_target``) and passed as is through scan, convert, trace and fleet.

    ``text`` is the name reports use (a URL keeps its credentials here: reports redact it). ``where`` is where its
    bytes lie once known: a target found by walking a folder (local, remote, or a hub repository) carries the path
    the walk found, so that it is never turned back into a URL and located again.
    """

    text: str
    kind: TargetKind
    where: AnyPath | None = field(default=None, compare=False, repr=False)
    """The local ``Path`` or ``RemotePath``; None for a factory, and for a hub id or URL not located yet."""
    hub_origin: tuple[str, str | None] | None = field(default=None, compare=False)
    """For a file found through the hub: where it was read from (``cache`` or ``hub``) and the commit, if known."""
    file_url: bool = field(default=False, compare=False)
    """A local path named by a ``file://`` URL: reports keep the URL, scan expands no glob characters in it."""
    documents: Mapping[str, Any] | None = field(default=None, compare=False, repr=False)
    """For a model folder a scan's expansion found: the JSON files (config.json, the index) it parsed to tell, by
    path (``directory.Documents.under``), so that the read answers from them instead of parsing them again."""

    @property
    def is_remote(self) -> bool:
        """A URL or a hub id: read through fsspec unless the hub cache holds it."""
        return self.kind in (TargetKind.URL, TargetKind.HUB)

    @property
    def is_local(self) -> bool:
        """A file or folder on this machine (named by a path or a ``file://`` URL): ``where`` is its ``Path``."""
        return self.kind in (TargetKind.FILE, TargetKind.DIR)

    @property
    def named_by_url(self) -> bool:
        """Whether ``text`` is a URL (every URL, an ``hf://`` hub target, a ``file://`` path), which reports show as
        named; a path or a bare hub id is not one."""
        return self.kind is TargetKind.URL or self.file_url or (self.kind is TargetKind.HUB and self.hub_url == self.text)

    @property
    def identity(self) -> str:
        """What two targets naming the same checkpoint share: a local path's real path, however it is spelled
        (``file://`` included); a URL or hub id as named."""
        return os.path.realpath(self.where) if self.is_local and isinstance(self.where, Path) else self.text

    @property
    def hub_url(self) -> str:
        """A hub target as an ``hf://`` URL, the form ``hub.locate`` takes."""
        return self.text if self.text.lower().startswith("hf://") else f"hf://{self.text}"

    def located(self) -> tuple[AnyPath, Located | None]:
        """Where the bytes lie, and for a hub target how the cache or the hub resolved it (None otherwise).

        Only a target not located yet is located: a hub id asks the cache (then the hub) once here.
        """
        if self.where is not None:
            return self.where, None
        if self.kind is TargetKind.FACTORY:
            raise UsageError("is a factory: it builds a model, it names no file to read", path=self.text)
        if self.kind is TargetKind.HUB:
            from . import hub  # hub ids are rare on the hot path (a pre-commit hook scanning one file)

            found = hub.locate(self.hub_url)
            return found.location, found
        if self.kind is TargetKind.URL:
            return RemotePath.from_url(self.text), None
        return Path(self.text), None

    def __reduce__(self) -> tuple[Any, ...]:
        # A remote path's filesystem (its block cache, its locks) stays in this process: a worker locates it again.
        where = self.where if isinstance(self.where, Path) else None
        return (TargetRef, (self.text, self.kind, where, self.hub_origin, self.file_url, self.documents))


def parse_target(text: str, *, models: bool = True) -> TargetRef:
    """The one place that decides what a target string names: a factory, a URL, a hub id or a local path.

    ``models``: whether a factory or a bare hub id is meant (scan's targets); convert's sources and the library's
    ``read`` take URLs and local paths only, and there ``org/name`` is a local path. An existing local path wins
    over every other reading (``looks_like_factory`` and ``is_hub_id`` both check that).
    """
    if models and ":" in text:  # no factory without one: the factory module loads only for a name that may be one
        from .factory import looks_like_factory

        if looks_like_factory(text):
            return TargetRef(text, TargetKind.FACTORY)
    if is_url(text):
        from ..redact import remember

        remember(text)  # before any backend can quote its credentials
        if text.lower().startswith("file://"):
            return replace(path_target(Path(unquote(urlsplit(text).path)), text), file_url=True)
        if text.lower().startswith("hf://"):
            return TargetRef(text, TargetKind.HUB)
        return TargetRef(text, TargetKind.URL)
    if models and "/" in text and not os.path.lexists(text):  # a hub id is ``org/name``, never a local path
        from .hub import is_hub_id  # imported only where a target can be one

        if is_hub_id(text):
            return TargetRef(text, TargetKind.HUB)
    return path_target(Path(text), text)


def path_target(p: AnyPath, text: str | None = None, *, hub_origin: tuple[str, str | None] | None = None) -> TargetRef:
    """A target for a path already located (a walk found it): named ``text``, else as ``target_string`` names it."""
    name = text if text is not None else target_string(p)
    if isinstance(p, RemotePath):
        return TargetRef(name, TargetKind.HUB if hub_origin else TargetKind.URL, p, hub_origin)
    return TargetRef(name, TargetKind.DIR if p.is_dir() else TargetKind.FILE, p)


def as_target(target: str | AnyPath | TargetRef, *, models: bool = True) -> TargetRef:
    """``target`` as a ``TargetRef``: parsed if a string, wrapped if a path, as is if one already."""
    if isinstance(target, TargetRef):
        return target
    if isinstance(target, str):
        return parse_target(target, models=models)
    return path_target(target)


def locate(target: str | AnyPath) -> AnyPath:
    """Where a path or URL string lies (``parse_target`` without factories or bare hub ids, then located)."""
    if not isinstance(target, str):
        return target
    return parse_target(target, models=False).located()[0]


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
