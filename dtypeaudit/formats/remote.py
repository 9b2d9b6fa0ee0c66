"""Remote byte sources: fsspec URLs read with range requests, and remote folders walked like local ones.

Small reads go through a cache of 64 KiB blocks (the sniffing head, a safetensors header and a torch archive's
first member share one request), larger ones are fetched as they are, and ``read_ranges`` fetches many small
ranges at once (every zip member's local header, every legacy storage's count). So a scan of a 10 GB remote
file reads a few hundred KiB.

Directories and prefixes are ``RemotePath`` objects, which answer the few questions the directory logic
asks of a ``pathlib.Path`` (``/``, ``is_file``, ``glob``, ``stat``, ``read_text`` ...) from one listing per
folder, so a model directory on S3 is audited by the same code, by content, as one on disk.

Every remote call is retried on what may pass (HTTP 5xx and 429, timeouts, dropped connections) and
otherwise ends in one ``CheckpointError`` line naming the object, its URL shown without credentials.
"""

from __future__ import annotations

import contextvars
import errno
import fnmatch
import os
import posixpath
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import PurePosixPath
from typing import Any, NamedTuple, TypeVar

from ..errors import CheckpointError, LimitExceeded, UsageError
from ..redact import redact
from .source import SKIPPED_DIRS, Source, count_read, current_meter

T = TypeVar("T")

BLOCK = 64 << 10
"""Remote reads below DIRECT bytes are rounded out to whole blocks of this size, and the blocks cached."""
DIRECT = 1 << 20
"""Remote reads of at least this many bytes (a data.pkl, a large header) are fetched as asked, not cached."""
GAP = 16 << 10
"""``read_ranges`` fetches two ranges in one request where at most this many bytes lie between them."""
CACHE_BYTES = 64 << 20
"""Cached blocks per remote source, at most; the least recently used go first."""


def _env_number(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        raise UsageError(f"{name} must be a number, not {os.environ[name]!r}") from None


def concurrency() -> int:
    """Requests in flight at once for one batch (``DTYPEAUDIT_REMOTE_CONCURRENCY``, default 32)."""
    return max(1, int(_env_number("DTYPEAUDIT_REMOTE_CONCURRENCY", 32)))


def retries() -> int:
    """Attempts per remote call on a transient error (``DTYPEAUDIT_REMOTE_RETRIES``, default 3)."""
    return max(1, int(_env_number("DTYPEAUDIT_REMOTE_RETRIES", 3)))


def timeout() -> float:
    """Seconds to connect, and between bytes of a response (``DTYPEAUDIT_REMOTE_TIMEOUT``, default 60)."""
    return _env_number("DTYPEAUDIT_REMOTE_TIMEOUT", 60)


def concurrent_map(fn: Callable[[Any], T], items: Sequence[Any], *, workers: int | None = None) -> list[T]:
    """``[fn(x) for x in items]`` on a thread pool, in order; the first exception (in item order) is raised.

    Each call runs in a copy of the caller's context, so the reads it makes count in the caller's ``metered()``.
    """
    if len(items) <= 1:
        return [fn(x) for x in items]
    from concurrent.futures import ThreadPoolExecutor

    ctx = contextvars.copy_context()
    with ThreadPoolExecutor(max_workers=min(len(items), workers or concurrency())) as pool:
        futures = [pool.submit(ctx.copy().run, fn, x) for x in items]
        return [f.result() for f in futures]


# -- remote errors ---------------------------------------------------------------------------------


class RemoteError(CheckpointError):
    """A remote object could not be fetched (not found, refused, timed out): about the network, not the file's
    content, so readers that take a malformed file for "not this format" let it through."""


class _Problem(NamedTuple):
    what: str
    transient: bool


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen and len(seen) < 16:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _status(exc: BaseException) -> tuple[int | None, str]:
    """An HTTP status and error code found on the exception or what caused it (aiohttp, botocore, httpx, requests)."""
    for e in _chain(exc):
        status = getattr(e, "status", None)
        if isinstance(status, int) and 100 <= status < 600:
            return status, ""
        response = getattr(e, "response", None)
        if isinstance(response, dict):  # botocore's ClientError
            meta = response.get("ResponseMetadata") or {}
            code = str((response.get("Error") or {}).get("Code") or "")
            if isinstance(meta.get("HTTPStatusCode"), int):
                return meta["HTTPStatusCode"], code
            if code:
                return None, code
        code_attr = getattr(response, "status_code", None)
        if isinstance(code_attr, int):
            return code_attr, ""
    return None, ""


def _problem(exc: BaseException) -> _Problem:
    status, code = _status(exc)
    detail = f"HTTP {status}" + (f" {code}" if code and code != str(status) else "") if status else code
    if status in (401, 403) or code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken"):
        return _Problem(f"access denied ({detail}): check the credentials", False)
    if status == 404 or code in ("NoSuchKey", "NoSuchBucket", "404"):
        return _Problem(f"not found ({detail})", False)
    if status == 416:
        return _Problem(f"the server refused a byte range ({detail}): the object changed while it was read?", False)
    if status == 429 or code in ("SlowDown", "Throttling", "RequestLimitExceeded"):
        return _Problem(f"rate limited ({detail})", True)
    if status is not None and status >= 500:
        return _Problem(f"server error ({detail})", True)
    if status is not None:
        return _Problem(f"request refused ({detail})", False)
    for e in _chain(exc):
        name = type(e).__name__
        if isinstance(e, TimeoutError) or "Timeout" in name:
            return _Problem(f"timed out (no answer within {timeout():g} s)", True)
        if isinstance(e, ConnectionError) or "Connect" in name or "Disconnected" in name or "ClientPayloadError" in name:
            return _Problem(f"cannot connect ({_why_not_connected(e)})", True)
    for e in _chain(exc):
        if isinstance(e, FileNotFoundError):
            return _Problem("not found", False)
        if isinstance(e, PermissionError):
            return _Problem("access denied: check the credentials", False)
    if "range request" in str(exc).lower():  # fsspec's HTTP file, on a 200 where a 206 was asked for
        return _Problem("the server does not honour range requests; not downloading the whole file", False)
    if isinstance(exc, ImportError):
        return _Problem(f"{_short(exc)} (pip install 'dtypeaudit[remote]')", False)
    return _Problem(f"cannot read ({_short(exc)})", False)


def _why_not_connected(exc: BaseException) -> str:
    """``Connection refused``, ``Name or service not known``: the system's words, without the library's wrapping."""
    for e in _chain(exc):
        for err in (e, getattr(e, "os_error", None)):
            if isinstance(err, OSError) and isinstance(err.errno, int) and err.errno:
                if err.errno in errno.errorcode:
                    return os.strerror(err.errno)
                if isinstance(err.strerror, str) and err.strerror:
                    return err.strerror  # getaddrinfo's own codes: "Name or service not known"
    return _short(exc)


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    text = redact(text)
    return f"{type(exc).__name__}: {text[:200]}" if text else type(exc).__name__


_BACKENDS = frozenset(
    {
        *("fsspec", "s3fs", "gcsfs", "adlfs", "ocifs", "huggingface_hub"),  # fsspec and its filesystems
        *("aiohttp", "yarl", "botocore", "aiobotocore", "requests", "urllib3", "httpx", "httpx2", "httpcore"),  # their clients
        *("google", "azure"),  # google-auth, google-api-core, azure-core
    }
)
"""Top-level packages whose own exception classes say that a remote request failed."""


def _frame_packages(exc: BaseException) -> Iterator[str]:
    """The top-level package of each frame ``exc`` passed through."""
    tb = exc.__traceback__
    while tb is not None:
        yield str(tb.tb_frame.f_globals.get("__name__", "")).partition(".")[0]
        tb = tb.tb_next


def _is_remote_failure(exc: Exception) -> bool:
    """Whether ``exc``, raised by a call into an fsspec backend, is the backend saying the request failed (exit 2),
    rather than a bug of ours (a TypeError, an AttributeError: exit 3, with its traceback).

    Known: OSError and its kin (FileNotFoundError, PermissionError, ConnectionError, TimeoutError, which are also
    asyncio's and fsspec's timeouts, aiohttp's connection errors and requests' errors); every class a backend or its
    client defines (aiohttp's ClientResponseError, botocore's ClientError and BotoCoreError, huggingface_hub's and
    httpx's errors); a missing backend package (fsspec's ImportError names it); and a ValueError raised inside a
    backend's own code, which is how fsspec's HTTP file refuses a server that ignores Range."""
    if isinstance(exc, OSError):
        return True
    if isinstance(exc, ImportError):
        return not (exc.name or "").startswith("dtypeaudit")
    if type(exc).__module__.partition(".")[0] in _BACKENDS:
        return True
    return isinstance(exc, ValueError) and any(m in _BACKENDS for m in _frame_packages(exc))


def remote_call(fn: Callable[[], T], name: str) -> T:
    """``fn()``, retried with backoff while it fails in a way that may pass; else one RemoteError naming ``name``.
    Only a backend's failures (``_is_remote_failure``) are taken for the network's: anything else is a bug of ours
    and propagates unchanged (exit 3)."""
    attempts = retries()
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except (CheckpointError, UsageError):
            raise
        except Exception as exc:
            if not _is_remote_failure(exc):
                raise
            problem = _problem(exc)
            if not problem.transient or attempt == attempts:
                tries = f" after {attempt} tries" if attempt > 1 else ""
                # The line names the object without credentials. The backend's error quotes the URL with them: kept
                # as the context, out of any traceback (from None), for --debug to show redacted.
                raise RemoteError(problem.what + tries, path=name) from None
            time.sleep(0.2 * 2 ** (attempt - 1) * (0.5 + random.random()))
    raise AssertionError("unreachable")


# -- remote files ----------------------------------------------------------------------------------


class RemoteSource(Source):
    """A file behind fsspec, read with range requests through a block cache."""

    remote = True

    def __init__(self, fs: Any, path: str, name: str, size: int | None = None) -> None:
        self.fs, self.path, self.name = fs, path, name
        self._meter = current_meter()
        self.bytes_read = 0
        self._lock = threading.Lock()
        self._blocks: OrderedDict[int, bytes] = OrderedDict()
        self._spans: dict[int, bytes] = {}
        self._file: Any = None
        self._known_size = size
        self.size = size if size is not None else self._open().size
        if self.size is None:
            raise RemoteError("the server does not say how large the file is, so it cannot be read in ranges", path=name)

    def _open(self) -> Any:
        if self._file is None:
            kwargs: dict[str, Any] = {"block_size": BLOCK, "cache_type": "none"}
            if self._known_size:  # from the listing: spares the backend asking again (a HEAD)
                kwargs["size"] = self._known_size

            def open_file() -> Any:
                try:
                    return self.fs.open(self.path, "rb", **kwargs)
                except TypeError:
                    kwargs.pop("size", None)
                    return self.fs.open(self.path, "rb", **kwargs)

            self._file = remote_call(open_file, self.name)
        return self._file

    def _fetch_once(self, start: int, end: int) -> bytes:
        from fsspec.spec import AbstractBufferedFile  # type: ignore[import-untyped]

        f = self._open()
        if isinstance(f, AbstractBufferedFile):
            try:
                return bytes(f._fetch_range(start, end))
            except NotImplementedError:
                pass
        if type(f).__name__ == "HTTPStreamFile":
            raise RemoteError("the server does not take range requests; not downloading the whole file", path=self.name)
        with self._lock:
            f.seek(start)
            return bytes(f.read(end - start))

    def _fetch(self, start: int, end: int) -> bytes:
        data = remote_call(lambda: self._fetch_once(start, end), self.name)
        with self._lock:
            self.bytes_read += len(data)
        count_read(self._meter, len(data))
        if len(data) != end - start:
            raise RemoteError(
                f"asked for bytes {start} to {end - 1} and got {len(data)} bytes: the server does not honour range requests, "
                "or the object changed while it was read",
                path=self.name,
            )
        return data

    def _ensure(self, first: int, last: int) -> None:
        """Blocks ``first`` to ``last`` in the cache, each run of missing ones in one request."""
        with self._lock:
            missing = [i for i in range(first, last + 1) if i not in self._blocks]
        runs: list[tuple[int, int]] = []
        for i in missing:
            if runs and runs[-1][1] == i - 1:
                runs[-1] = (runs[-1][0], i)
            else:
                runs.append((i, i))
        for a, b in runs:
            data = self._fetch(a * BLOCK, min((b + 1) * BLOCK, self.size))
            with self._lock:
                for i in range(a, b + 1):
                    self._blocks[i] = data[(i - a) * BLOCK : (i - a + 1) * BLOCK]
        with self._lock:
            for i in range(first, last + 1):
                if i in self._blocks:
                    self._blocks.move_to_end(i)
            while len(self._blocks) * BLOCK > CACHE_BYTES:
                self._blocks.popitem(last=False)

    def block(self, index: int) -> bytes:
        with self._lock:
            got = self._blocks.get(index)
        if got is None:
            self._ensure(index, index)
            with self._lock:
                got = self._blocks.get(index)
            if got is None:  # evicted at once by a concurrent reader: fetch it for this caller alone
                got = self._fetch(index * BLOCK, min((index + 1) * BLOCK, self.size))
        return got

    def read(self, offset: int, n: int) -> bytes:
        if offset < 0:
            raise ValueError("negative offset")
        end = min(offset + max(n, 0), self.size)
        if end <= offset:
            return b""
        span = self._spans.get(offset)
        if span is not None and len(span) >= end - offset:
            return span[: end - offset]
        if end - offset >= DIRECT:
            return self._fetch(offset, end)
        first, last = offset // BLOCK, (end - 1) // BLOCK
        if first == last:
            block = self.block(first)
            return block[offset - first * BLOCK : end - first * BLOCK]
        self._ensure(first, last)
        with self._lock:
            parts = [self._blocks.get(i) for i in range(first, last + 1)]
        if any(p is None for p in parts):
            return self._fetch(offset, end)
        data = b"".join(parts)  # type: ignore[arg-type]
        return data[offset - first * BLOCK : end - first * BLOCK]

    def _cached(self, offset: int, end: int) -> bool:
        with self._lock:
            return all(i in self._blocks for i in range(offset // BLOCK, (end - 1) // BLOCK + 1))

    def read_ranges(self, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        todo = sorted(
            {
                (o, min(o + n, self.size))
                for o, n in ranges
                if 0 <= o < self.size and n > 0 and o not in self._spans and not self._cached(o, min(o + n, self.size))
            }
        )

        # Ranges close together (the local headers of small members, a legacy file's counts) share a request.
        groups: list[list[tuple[int, int]]] = []
        for r in todo:
            if groups and r[0] - groups[-1][-1][1] <= GAP and r[1] - groups[-1][0][0] <= DIRECT:
                groups[-1].append(r)
            else:
                groups.append([r])

        def one(group: list[tuple[int, int]]) -> None:
            start = group[0][0]
            data = self._fetch(start, max(end for _, end in group))
            with self._lock:
                for a, b in group:
                    self._spans[a] = data[a - start : b - start]

        concurrent_map(one, groups)
        return [self.read(o, n) for o, n in ranges]

    def prefetch(self, ranges: Iterable[tuple[int, int]]) -> None:
        wanted: set[int] = set()
        for offset, n in ranges:
            end = min(offset + n, self.size)
            if end > offset and end - offset <= CACHE_BYTES // 2:
                wanted.update(range(offset // BLOCK, (end - 1) // BLOCK + 1))
        with self._lock:
            missing = sorted(i for i in wanted if i not in self._blocks)
        runs: list[tuple[int, int]] = []
        for i in missing:
            if runs and runs[-1][1] == i - 1 and (i - runs[-1][0]) * BLOCK < DIRECT:
                runs[-1] = (runs[-1][0], i)
            else:
                runs.append((i, i))
        concurrent_map(lambda r: self._ensure(r[0], r[1]), runs)

    def view(self) -> BlockView:
        return BlockView(self)

    def close(self) -> None:
        f, self._file = self._file, None
        if f is not None:
            try:
                f.close()
            except Exception:  # a remote file opened for reading holds nothing to flush
                pass
        self._blocks.clear()
        self._spans.clear()


class BlockView:
    """A remote file as the buffer readers index and search; blocks are fetched on first touch.

    Supports what ``PickleVM`` and the zip reader use of a ``bytes`` or an ``mmap``: ``len``, ``view[i]``,
    ``view[a:b]``, ``find`` and ``rfind``.
    """

    def __init__(self, src: RemoteSource) -> None:
        self._src = src
        self._len = src.size
        self._base = 0
        self._block = b""

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, key: int | slice) -> Any:
        if isinstance(key, slice):
            start, stop, step = key.indices(self._len)
            if step != 1:
                raise ValueError("BlockView slices take no step")
            return self._src.read(start, stop - start) if stop > start else b""
        i = key + self._len if key < 0 else key
        off = i - self._base
        if 0 <= off < len(self._block):
            return self._block[off]
        if not 0 <= i < self._len:
            raise IndexError("BlockView index out of range")
        self._base = i - i % BLOCK
        self._block = self._src.block(i // BLOCK)
        return self._block[i - self._base]

    def _bounds(self, start: int | None, end: int | None) -> tuple[int, int]:
        start, end, _ = slice(start, end).indices(self._len)
        return start, end

    def find(self, sub: bytes, start: int | None = None, end: int | None = None) -> int:
        start, end = self._bounds(start, end)
        pos = start
        while pos < end:
            stop = min(end, pos + BLOCK)
            data = self._src.read(pos, min(end, stop + len(sub) - 1) - pos)
            i = data.find(sub)
            if i >= 0:
                return pos + i
            pos = stop
        return -1

    def rfind(self, sub: bytes, start: int | None = None, end: int | None = None) -> int:
        start, end = self._bounds(start, end)
        stop = end
        while stop > start:
            pos = max(start, stop - 4 * BLOCK)
            data = self._src.read(pos, min(end, stop + len(sub) - 1) - pos)
            i = data.rfind(sub)
            if i >= 0:
                return pos + i
            stop = pos
        return -1


# -- remote trees ----------------------------------------------------------------------------------


_TTL = 60.0
"""Seconds a listing or an object's details are trusted for; a scan that runs longer asks again."""
_SMALL = 1 << 20
"""Files up to this size (configs, indexes) read by a walk are kept for the reads after it."""


class RemoteFS:
    """One fsspec filesystem and what has been learnt about its objects: details, listings, small files."""

    def __init__(self, fs: Any) -> None:
        self.fs = fs
        self._lock = threading.Lock()
        self._info: dict[str, tuple[float, dict[str, Any] | None]] = {}
        self._listing: dict[str, tuple[float, dict[str, dict[str, Any]]]] = {}
        self._small: OrderedDict[str, bytes] = OrderedDict()

    def forget(self) -> None:
        """Drop what was learnt (details, listings, small files): after this process wrote objects itself."""
        with self._lock:
            self._info.clear()
            self._listing.clear()
            self._small.clear()
        invalidate = getattr(self.fs, "invalidate_cache", None)
        if invalidate is not None:
            invalidate()

    def url(self, path: str) -> str:
        """The URL of ``path``, credentials included: what a reader passes on, never what a report shows."""
        if "://" in path:
            return path
        return str(self.fs.unstrip_protocol(path))

    def display(self, path: str) -> str:
        return redact(self.url(path))

    def _fresh(self, entry: tuple[float, T] | None) -> T | None:
        return entry[1] if entry is not None and time.monotonic() - entry[0] < _TTL else None

    def _remember(self, path: str, info: dict[str, Any] | None) -> None:
        with self._lock:
            self._info[path] = (time.monotonic(), info)

    def info(self, path: str) -> dict[str, Any] | None:
        """The object's details (``type`` ``file`` or ``directory``, ``size``), None if there is no such object."""
        with self._lock:
            cached = self._info.get(path)
        if cached is not None and time.monotonic() - cached[0] < _TTL:
            return cached[1]
        parent = _parent(path)
        if parent != path:
            with self._lock:
                listed = self._fresh(self._listing.get(parent))
                parent_info = self._fresh(self._info.get(parent))
            if listed is None and parent_info is not None and parent_info.get("type") == "directory":
                listed = self.listing(parent)
            if listed is not None:
                info = listed.get(_base(path))
                self._remember(path, info)
                return info

        def ask() -> dict[str, Any] | None:
            try:
                return dict(self.fs.info(path))
            except FileNotFoundError as exc:
                status, _ = _status(exc)
                if status is not None and status != 404:
                    raise  # fsspec's HTTP info turns every failure into FileNotFoundError; the cause says which
                for e in _chain(exc):
                    if e is not exc and (isinstance(e, TimeoutError) or "Connect" in type(e).__name__):
                        raise
                return None

        info = remote_call(ask, self.display(path))
        self._remember(path, info)
        return info

    def listing(self, path: str) -> dict[str, dict[str, Any]]:
        """Name -> details of each object directly in the folder ``path``."""
        with self._lock:
            cached = self._fresh(self._listing.get(path))
        if cached is not None:
            return cached
        entries = remote_call(lambda: self.fs.ls(path, detail=True), self.display(path))
        out: dict[str, dict[str, Any]] = {}
        root = path.rstrip("/")
        for e in entries:
            name = str(e.get("name", "")).rstrip("/")
            if name == root or not name:
                continue
            out[_base(name)] = dict(e)
        now = time.monotonic()
        with self._lock:
            self._listing[path] = (now, out)
            self._info.setdefault(path, (now, {"name": path, "type": "directory", "size": 0}))
            for name, e in out.items():
                self._info[_join(path, name)] = (now, e)
        return out

    def walk(self, root: str) -> None:
        """List everything under ``root`` in one go (one paginated listing on an object store), folder by folder."""
        found = remote_call(lambda: self.fs.find(root, withdirs=True, detail=True), self.display(root))
        base = root.rstrip("/")
        folders: dict[str, dict[str, dict[str, Any]]] = {base: {}}
        for name, e in found.items():
            name = str(name).rstrip("/")
            if name == base or not name.startswith(base + "/"):
                continue
            if e.get("type") == "directory":
                folders.setdefault(name, {})
            folders.setdefault(_parent(name), {})[_base(name)] = dict(e)
            # object stores list objects, not folders: every prefix on the way is a folder
            parent = _parent(name)
            while parent != base and parent.startswith(base + "/"):
                up = _parent(parent)
                folders.setdefault(up, {}).setdefault(_base(parent), {"name": parent, "type": "directory", "size": 0})
                folders.setdefault(parent, {})
                parent = up
        now = time.monotonic()
        with self._lock:
            for folder, entries in folders.items():
                self._listing[folder] = (now, entries)
                self._info[folder] = (now, {"name": folder, "type": "directory", "size": 0})
                for n, e in entries.items():
                    self._info[_join(folder, n)] = (now, e)

    def prefetch_small(self, root: str, names: Callable[[str], bool]) -> None:
        """Fetch at once every small object under ``root`` whose name ``names`` accepts (each folder's config and
        index, which deciding what a folder is reads); failures are left for the reads that need them."""
        with self._lock:
            listed = [(folder, dict(entries)) for folder, (_, entries) in self._listing.items()]
        base = root.rstrip("/") + "/"
        wanted = [
            _join(folder, name)
            for folder, entries in listed
            if folder == root or folder.startswith(base)
            for name, e in entries.items()
            if e.get("type") == "file" and names(name) and isinstance(e.get("size"), int) and e["size"] <= _SMALL
        ]

        def one(path: str) -> None:
            try:
                self.read_small(path, _SMALL)
            except CheckpointError:
                pass

        concurrent_map(one, wanted)

    def read_small(self, path: str, cap: int) -> bytes:
        """The whole of a small object (a config, an index), refused over ``cap`` bytes; kept for a while."""
        with self._lock:
            kept = self._small.get(path)
        if kept is not None:
            return kept
        info = self.info(path)
        size = info.get("size") if info else None
        if isinstance(size, int) and size > cap:
            raise LimitExceeded(f"is over the {cap >> 20} MiB cap", path=self.display(path))
        with RemoteSource(self.fs, path, self.display(path), size if isinstance(size, int) else None) as src:
            if src.size > cap:
                raise LimitExceeded(f"is over the {cap >> 20} MiB cap", path=src.name)
            data = src.read(0, src.size)
        if len(data) <= _SMALL:
            with self._lock:
                self._small[path] = data
                while sum(len(v) for v in self._small.values()) > 16 * _SMALL:
                    self._small.popitem(last=False)
        return data


def _is_walk_json(name: str) -> bool:
    return name == "config.json" or name.endswith(".index.json")


def _parent(path: str) -> str:
    if "://" in path:
        scheme, rest = path.split("://", 1)
        return f"{scheme}://{posixpath.dirname(rest.rstrip('/')) or rest}"
    return posixpath.dirname(path.rstrip("/")) or path


def _base(path: str) -> str:
    return posixpath.basename(path.rstrip("/"))


def _join(base: str, name: str) -> str:
    name = name.replace("\\", "/")
    if "://" in base:
        scheme, rest = base.split("://", 1)
        return f"{scheme}://{posixpath.normpath(rest.rstrip('/') + '/' + name)}"
    return posixpath.normpath(base.rstrip("/") + "/" + name)


class _Stat(NamedTuple):
    st_size: int


class RemotePath:
    """A file or folder behind fsspec, answering what the directory logic asks of a ``pathlib.Path``.

    It has no ``__fspath__``: nothing can open it as a local file by mistake. Object stores have no links,
    so ``resolve()`` is the path itself.
    """

    def __init__(self, rfs: RemoteFS, path: str) -> None:
        self.rfs = rfs
        self.path = path.rstrip("/") if len(path) > 1 else path

    @classmethod
    def from_url(cls, url: str) -> RemotePath:
        fs, path = filesystem(url)
        return cls(remote_fs(fs), path)

    # -- naming
    def __str__(self) -> str:
        return self.rfs.display(self.path)

    def __repr__(self) -> str:
        return f"RemotePath({str(self)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RemotePath) and other.rfs is self.rfs and other.path == self.path

    def __hash__(self) -> int:
        return hash((id(self.rfs), self.path))

    @property
    def url(self) -> str:
        """The URL with its credentials, for reading; ``str()`` is the URL to show."""
        return self.rfs.url(self.path)

    @property
    def name(self) -> str:
        if "://" in self.path:
            from urllib.parse import urlsplit

            return posixpath.basename(urlsplit(self.path).path.rstrip("/"))
        return _base(self.path)

    @property
    def suffix(self) -> str:
        return PurePosixPath(self.name).suffix

    @property
    def parent(self) -> RemotePath:
        return RemotePath(self.rfs, _parent(self.path))

    @property
    def parents(self) -> list[RemotePath]:
        out, here = [], self
        while (up := here.parent).path != here.path:
            out.append(up)
            here = up
        return out

    def __truediv__(self, name: str) -> RemotePath:
        return RemotePath(self.rfs, _join(self.path, name))

    def resolve(self) -> RemotePath:
        return self

    def absolute(self) -> RemotePath:
        return self

    def is_relative_to(self, other: RemotePath) -> bool:
        return other.rfs is self.rfs and (self.path == other.path or self.path.startswith(other.path.rstrip("/") + "/"))

    def relative_to(self, other: RemotePath) -> PurePosixPath:
        if not self.is_relative_to(other):
            raise ValueError(f"{self} is not under {other}")
        return PurePosixPath(self.path[len(other.path) :].lstrip("/") or ".")

    def as_posix(self) -> str:
        return self.path

    # -- questions
    def _info(self) -> dict[str, Any] | None:
        return self.rfs.info(self.path)

    def exists(self) -> bool:
        return self._info() is not None

    def is_file(self) -> bool:
        info = self._info()
        return info is not None and info.get("type") == "file"

    def is_dir(self) -> bool:
        info = self._info()
        return info is not None and info.get("type") == "directory"

    def is_symlink(self) -> bool:
        return False

    def stat(self) -> _Stat:
        info = self._info()
        if info is None:
            raise FileNotFoundError(2, "No such file or directory", str(self))
        size = info.get("size")
        return _Stat(int(size) if isinstance(size, int) else 0)

    def listdir(self) -> list[str]:
        return sorted(self.rfs.listing(self.path))

    def iterdir(self) -> Iterator[RemotePath]:
        return (self / name for name in self.listdir())

    def glob(self, pattern: str) -> Iterator[RemotePath]:
        """Matches of ``pattern`` in this folder (no ``**``), as ``Path.glob`` finds them."""
        return (self / n for n in self.listdir() if fnmatch.fnmatchcase(n, pattern))

    def read_bytes(self, cap: int = 1 << 30) -> bytes:
        data = self.rfs.read_small(self.path, cap)
        count_read(current_meter(), len(data))
        return data

    def read_text(self, encoding: str = "utf-8") -> str:
        return self.read_bytes().decode(encoding)

    def open_source(self) -> RemoteSource:
        info = self.rfs.info(self.path)
        if info is None:
            raise CheckpointError("no such file or directory", path=str(self))
        if info.get("type") == "directory":
            raise IsADirectoryError(21, "Is a directory", str(self))
        size = info.get("size")
        return RemoteSource(self.rfs.fs, self.path, str(self), size if isinstance(size, int) else None)

    def walk(self, stop_at: Callable[[RemotePath], bool] | None = None) -> Iterator[RemotePath]:
        """``directory.walk_files`` for a prefix: every object under it, sorted, from one listing; a folder for
        which ``stop_at`` is true is yielded itself instead of entered."""
        self.rfs.walk(self.path)
        self.rfs.prefetch_small(self.path, _is_walk_json)
        stack = [self]
        while stack:
            here = stack.pop()
            if here != self and stop_at is not None and stop_at(here):
                yield here
                continue
            subdirs = []
            for name in here.listdir():
                child = here / name
                if child.is_dir():
                    if name not in SKIPPED_DIRS:
                        subdirs.append(child)
                elif child.is_file():
                    yield child
            stack.extend(reversed(subdirs))


# -- opening ---------------------------------------------------------------------------------------


_FS_LOCK = threading.Lock()
_REMOTE_FS: dict[object, RemoteFS] = {}


_PID = [os.getpid()]


def remote_fs(fs: Any) -> RemoteFS:
    """The RemoteFS of an fsspec filesystem (fsspec caches filesystems; so are their listings, here)."""
    with _FS_LOCK:
        if _PID[0] != os.getpid():
            # A worker process forked from a scan: fsspec makes its filesystems afresh here, but what the parent
            # learnt (listings, sizes) still holds; only the locks, maybe held at the fork, are new.
            for kept in _REMOTE_FS.values():
                kept._lock = threading.Lock()
            _PID[0] = os.getpid()
        token = getattr(fs, "_fs_token", None)  # fsspec's token: the same filesystem, whatever the instance
        key = ("token", token) if token is not None else ("id", id(fs))
        rfs = _REMOTE_FS.get(key)
        if rfs is None or (token is None and rfs.fs is not fs):
            rfs = _REMOTE_FS[key] = RemoteFS(fs)
        elif rfs.fs is not fs:
            rfs.fs = fs
        return rfs


def forget() -> None:
    """Drop every listing, object detail and small file learnt so far (they are trusted for a minute otherwise)."""
    with _FS_LOCK:
        _REMOTE_FS.clear()


def _fsspec_config(protocol: str) -> dict[str, Any]:
    """What fsspec's own config (``FSSPEC_S3_*`` variables, ``~/.config/fsspec``) sets for ``protocol``."""
    try:
        import fsspec.config  # type: ignore[import-untyped]
    except ImportError:
        return {}
    return dict(fsspec.config.conf.get(protocol, {}))


def _defaults(protocol: str, configured: dict[str, Any]) -> dict[str, Any]:
    """Timeouts for the backends that wait minutes by default, unless fsspec's own config (``configured``) sets them."""
    t = timeout()
    if protocol in ("s3", "s3a") and "config_kwargs" not in configured:
        # botocore retries a failed connection itself (legacy mode: 5 attempts, backoff up to 20 s), and s3fs retries
        # botocore (5 more, `S3FileSystem.retries`), all under remote_call's 3 tries: a server that closed every
        # connection took 150 connections and 114 s to report. One attempt each (s3fs's: `filesystem`), so
        # remote_call's retries are the only ones.
        return {"config_kwargs": {"connect_timeout": t, "read_timeout": t, "retries": {"mode": "standard", "max_attempts": 1}}}
    if protocol in ("http", "https") and "client_kwargs" not in configured:
        import aiohttp

        return {"client_kwargs": {"timeout": aiohttp.ClientTimeout(total=None, sock_connect=t, sock_read=t)}}
    return {}


def filesystem(url: str) -> tuple[Any, str]:
    """fsspec's filesystem and path for ``url``, with options from fsspec's config (``FSSPEC_S3_*`` variables and
    ``~/.config/fsspec``) and credentials from each backend's usual chain."""
    shown = redact(url)
    try:
        from fsspec.core import url_to_fs  # type: ignore[import-untyped]
    except ImportError:
        raise UsageError(f"{shown}: reading remote paths needs fsspec (pip install 'dtypeaudit[remote]')") from None
    protocol = url.split("::")[-1].split("://", 1)[0].lower()
    configured = _fsspec_config(protocol)
    try:
        fs, path = url_to_fs(url, **_defaults(protocol, configured))
    except ImportError as exc:  # fsspec says which package its backend needs ("Please install gcsfs ...")
        hint = " (pip install 'dtypeaudit[remote]')" if protocol in ("s3", "s3a", "http", "https", "hf") else ""
        raise UsageError(f"{shown}: {redact(str(exc).strip()) or 'the package for this protocol is missing'}{hint}") from None
    except ValueError as exc:
        if "Protocol not known" in str(exc) or "not known" in str(exc):
            raise UsageError(f"{shown}: no fsspec filesystem is registered for '{protocol}://'") from None
        raise CheckpointError(f"cannot open ({_short(exc)})", path=shown) from None
    if protocol in ("s3", "s3a") and "retries" not in configured:
        fs.retries = 1  # a class attribute of S3FileSystem, no argument: see _defaults
    return fs, path
