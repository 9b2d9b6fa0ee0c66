"""torch.save archives (zip, and the pre-1.6 legacy stream) and TorchScript archives.

Reads the central directory and ``data.pkl`` only; storage records are checked by size, never read.
"""

from __future__ import annotations

import mmap
import re
import struct
import zipfile
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, LimitExceeded
from ..inventory import Finding, Inventory, TensorRecord, link_shared_storage
from .picklevm import Global, Opaque, PickleVM, Trace
from .torchpickle import REDUCERS, Found, StorageRef, global_findings, storage_loader, walk

MAX_PICKLE_BYTES = 1 << 30
LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
LEGACY_PROTOCOL = 1001


def _records(found: list[Found], *, module_of: Callable[[Found], tuple[str | None, str]] | None = None) -> tuple[TensorRecord, ...]:
    out = []
    for f in found:
        t = f.tensor
        module, kind = module_of(f) if module_of else (None, t.kind)
        out.append(
            TensorRecord(
                name=f.name,
                dtype=t.dtype,
                shape=t.shape,
                nbytes=t.nbytes,
                kind=kind,  # type: ignore[arg-type]
                storage=t.storage.key if t.storage else None,
                offset=t.offset,
                stride=t.stride,
                layout=t.layout,
                region=f.region,
                module=module,
            )
        )
    return link_shared_storage(out)


# -- zip archives -------------------------------------------------------------------------------

# What Python's zipfile raises on a damaged archive (found by fuzz/fuzz_readers.py): each becomes one line.
ZIP_ERRORS = (zipfile.BadZipFile, NotImplementedError, UnicodeDecodeError, struct.error, ValueError, OverflowError, EOFError, zlib.error)


@contextmanager
def zip_errors(path: Path) -> Iterator[None]:
    """Turn zipfile's many failure modes on a damaged archive into one CheckpointError line."""
    try:
        yield
    except ZIP_ERRORS as exc:
        raise CheckpointError(f"corrupt zip archive ({type(exc).__name__}: {exc})", path=str(path)) from None


def _open_zip(path: Path) -> zipfile.ZipFile:
    try:
        return zipfile.ZipFile(path)
    except zipfile.BadZipFile as exc:
        raise CheckpointError(f"truncated or corrupt zip archive ({exc}); an incomplete download?", path=str(path)) from None
    except ZIP_ERRORS as exc:
        raise CheckpointError(f"corrupt zip archive ({type(exc).__name__}: {exc})", path=str(path)) from None


def _prefix(zf: zipfile.ZipFile, path: Path) -> str:
    names = zf.namelist()
    if not names:
        raise CheckpointError("zip archive is empty", path=str(path))
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise CheckpointError(f"zip archive has the entry '{dup}' twice; torch refuses such files", path=str(path))
    pkls = [n for n in names if n.endswith("/data.pkl") and n.count("/") == 1]
    if not pkls:
        if "data.pkl" in names:
            raise CheckpointError("zip archive's data.pkl has no top-level folder; torch needs one", path=str(path))
        raise CheckpointError("zip archive has no data.pkl: not a torch.save or TorchScript file", path=str(path))
    if len(pkls) > 1:
        raise CheckpointError(f"zip archive has {len(pkls)} data.pkl entries under different folders", path=str(path))
    prefix = pkls[0][: -len("data.pkl")]
    strays = [n for n in names if not n.startswith(prefix)]
    if strays:
        raise CheckpointError(f"zip archive mixes folders: '{strays[0]}' is outside '{prefix}'", path=str(path))
    return prefix


def _read_member(zf: zipfile.ZipFile, name: str, path: Path, cap: int = MAX_PICKLE_BYTES) -> bytes:
    info = zf.getinfo(name)
    if info.file_size > cap:
        raise LimitExceeded(f"{name} is {info.file_size} bytes, over the {cap}-byte cap", path=str(path))
    try:
        with zf.open(info) as fh:
            data = fh.read(cap + 1)
    except (*ZIP_ERRORS, OSError, RuntimeError) as exc:
        raise CheckpointError(f"cannot read {name} ({exc})", path=str(path)) from None
    if len(data) > cap:
        raise LimitExceeded(f"{name} inflates past the {cap}-byte cap (a zip bomb?)", path=str(path))
    return data


def _check_storages(zf: zipfile.ZipFile, prefix: str, storages: list[StorageRef], path: Path) -> None:
    for ref in storages:
        name = f"{prefix}data/{ref.key}"
        try:
            info = zf.getinfo(name)
        except KeyError:
            raise CheckpointError(f"storage '{ref.key}' is missing from the archive (no {name})", path=str(path)) from None
        if info.compress_type != zipfile.ZIP_STORED:
            raise CheckpointError(
                f"storage record {name} is compressed; torch writes them uncompressed, so it was not read", path=str(path)
            )
        if info.file_size < ref.nbytes:
            raise CheckpointError(
                f"storage record {name} holds {info.file_size} bytes but the pickle needs {ref.nbytes}",
                path=str(path),
            )


_TS_CLASS = re.compile(r"^class ([\w.]+)\(Module\):\n  __parameters__ = \[([^\]]*)\]\n  __buffers__ = \[([^\]]*)\]", re.M)


def _torchscript_kinds(zf: zipfile.ZipFile, prefix: str, path: Path) -> dict[str, dict[str, str]]:
    """Class qualname -> {attribute: 'parameter'|'buffer'}, from the archive's generated code (text, not run)."""
    kinds: dict[str, dict[str, str]] = {}
    for name in zf.namelist():
        if not (name.startswith(prefix + "code/") and name.endswith(".py")):
            continue
        module = name[len(prefix + "code/") : -len(".py")].replace("/", ".")
        text = _read_member(zf, name, path, cap=64 << 20).decode("utf-8", "replace")
        for m in _TS_CLASS.finditer(text):
            attrs = {a: "parameter" for a in re.findall(r'"([^"]+)"', m.group(2))}
            attrs.update({a: "buffer" for a in re.findall(r'"([^"]+)"', m.group(3))})
            kinds[f"{module}.{m.group(1)}"] = attrs
    return kinds


def _module_type(qualname: str) -> str:
    return qualname.rsplit(".", 1)[-1]


def read_zip(path: Path) -> Inventory:
    with zip_errors(path), _open_zip(path) as zf:
        prefix = _prefix(zf, path)
        names = set(zf.namelist())
        torchscript = any(n.startswith(prefix + "code/") for n in names) or f"{prefix}constants.pkl" in names
        metadata: dict[str, object] = {"archive_prefix": prefix.rstrip("/")}
        if f"{prefix}byteorder" in names:
            order = _read_member(zf, f"{prefix}byteorder", path, cap=64).decode("ascii", "replace").strip()
            if order not in ("little", "big"):
                raise CheckpointError(f"unknown byteorder '{order[:20]}' in the archive", path=str(path))
            metadata["byteorder"] = order
        data = _read_member(zf, f"{prefix}data.pkl", path)
        storages: list[StorageRef] = []
        vm = PickleVM(data, reducers=REDUCERS, persistent_load=storage_loader(storages.append), source=str(path))
        root, end = vm.load()
        found = list(walk(root))
        trailing = _trailing_findings(data, end, path)
        _check_storages(zf, prefix, storages, path)
        if torchscript:
            kinds = _torchscript_kinds(zf, prefix, path)

            def module_of(f: Found) -> tuple[str | None, str]:
                if f.owner is None or not isinstance(f.owner.callable, Global):
                    return None, f.tensor.kind
                owner = f.owner.callable.qualname
                attr = f.name.rsplit(".", 1)[-1]
                return _module_type(owner), kinds.get(owner, {}).get(attr, f.tensor.kind)

            tensors = _records(found, module_of=module_of)
            findings = global_findings(vm.trace, also_safe=lambda q: q.startswith("__torch__."))
            return Inventory(str(path), "torchscript", tensors, tuple(findings + trailing), metadata)
        return Inventory(str(path), "torch-zip", _records(found), tuple(global_findings(vm.trace) + trailing), metadata)


def _trailing_findings(data: bytes, end: int, path: Path, limit: int = 16) -> list[Finding]:
    """Bytes after the pickle's STOP: loaders ignore them, so a second pickle there is a smuggling attempt.

    Each further pickle is interpreted (never executed) for its globals, so what it would call is reported.
    """
    if end >= len(data):
        return []
    out = [
        Finding(
            "trailing-data", "warning", f"{len(data) - end} bytes follow the pickle; torch.load ignores them, so something is hidden there"
        )
    ]
    for _ in range(limit):
        if end >= len(data):
            break
        vm = PickleVM(data, persistent_load=lambda pid: None, source=str(path))
        try:
            _, end = vm.load(end)
        except CheckpointError:
            break
        out.extend(global_findings(vm.trace))
    return out


# -- legacy (pre-1.6) stream --------------------------------------------------------------------


def read_legacy(path: Path) -> Inventory:
    try:
        with path.open("rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            return _read_legacy(path, mm)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot map the file ({exc})", path=str(path)) from None


@dataclass(frozen=True)
class LegacyHeader:
    """The three small pickles a legacy file opens with: magic number, protocol, system info."""

    main: int
    """Offset of the main pickle (the checkpoint's object graph)."""
    little_endian: bool
    trace: Trace


def legacy_header(buf: bytes | mmap.mmap, path: Path) -> LegacyHeader:
    vm = PickleVM(buf, source=str(path))
    magic, pos = vm.load(0)
    if magic != LEGACY_MAGIC or isinstance(magic, bool):
        raise CheckpointError("starts like a legacy torch.save file but its magic number is wrong", path=str(path))
    protocol, pos = vm.load(pos)
    if protocol != LEGACY_PROTOCOL:
        raise CheckpointError(f"legacy torch.save protocol {protocol!r} is not {LEGACY_PROTOCOL}", path=str(path))
    sys_info, pos = vm.load(pos)
    if not isinstance(sys_info, dict):
        raise CheckpointError("legacy torch.save header is malformed", path=str(path))
    return LegacyHeader(pos, bool(sys_info.get("little_endian", True)), vm.trace)


def legacy_storage_keys(buf: bytes | mmap.mmap, pos: int, path: Path) -> tuple[list[str], int, Trace]:
    """The list of storage keys that follows the main pickle, and where the storage data starts."""
    vm = PickleVM(buf, source=str(path))
    keys, end = vm.load(pos)
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise CheckpointError("legacy torch.save storage list is malformed", path=str(path))
    return keys, end, vm.trace


def _read_legacy(path: Path, mm: mmap.mmap) -> Inventory:
    storages: list[StorageRef] = []
    header = legacy_header(mm, path)
    little = header.little_endian
    vm = PickleVM(mm, reducers=REDUCERS, persistent_load=storage_loader(storages.append, legacy=True), source=str(path))
    root, pos = vm.load(header.main)
    found = list(walk(root))
    keys, pos, keys_trace = legacy_storage_keys(mm, pos, path)
    _check_legacy_storages(mm, pos, keys, storages, path, little=little)
    findings = global_findings(vm.trace) + global_findings(header.trace) + global_findings(keys_trace)
    metadata: dict[str, object] = {"byteorder": "little" if little else "big"}
    return Inventory(str(path), "torch-legacy", _records(found), tuple(findings), metadata)


def _check_legacy_storages(mm: mmap.mmap, pos: int, keys: list[str], storages: list[StorageRef], path: Path, *, little: bool) -> None:
    by_key = {s.key: s for s in storages}
    missing = [s.key for s in storages if s.key not in keys]
    if missing:
        raise CheckpointError(f"storage '{missing[0]}' is missing from the file", path=str(path))
    fmt = "<q" if little else ">q"
    for key in keys:
        if pos + 8 > len(mm):
            raise CheckpointError(f"file ends before storage '{key}' (truncated)", path=str(path))
        (count,) = struct.unpack(fmt, mm[pos : pos + 8])
        pos += 8
        ref = by_key.get(key)
        itemsize = ref.nbytes // ref.numel if ref and ref.numel else 1
        if ref is not None and count != ref.numel:
            raise CheckpointError(f"storage '{key}' holds {count} elements but the pickle needs {ref.numel}", path=str(path))
        pos += count * itemsize
        if pos > len(mm):
            raise CheckpointError(f"file ends inside storage '{key}' (truncated)", path=str(path))


def read_pickle(path: Path) -> Inventory:
    """A bare pickle (``pickle.dump`` of tensors): read for its globals, which is where the danger is."""
    with path.open("rb") as fh:
        data = fh.read(MAX_PICKLE_BYTES + 1)
    if len(data) > MAX_PICKLE_BYTES:
        raise LimitExceeded("bare pickle is over the 1 GiB cap", path=str(path))
    vm = PickleVM(data, reducers=REDUCERS, persistent_load=_no_persistent(path), source=str(path))
    root, end = vm.load()
    findings = global_findings(vm.trace) + _trailing_findings(data, end, path)
    return Inventory(str(path), "pickle", _records(list(walk(root))), tuple(findings), {})


def _no_persistent(path: Path) -> Callable[[Any], Any]:
    def load(pid: Any) -> Any:
        raise CheckpointError("a bare pickle refers to external storage; not a torch.save file", path=str(path))

    return load


__all__ = ["read_zip", "read_legacy", "read_pickle", "Opaque"]
