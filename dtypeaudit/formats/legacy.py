"""Legacy torch.save files (``_use_new_zipfile_serialization=False``, the format before torch 1.6).

Three small pickles (magic number, protocol version, system info), the main pickle, the list of
storage keys, then each storage as an 8-byte element count and its bytes. Mirrors ``_legacy_load``
in torch/serialization.py: any pickle protocol; the counts and data are always little-endian
(torch reads them in native order and ignores ``sys_info``), and each count must equal the storage
size its first record gave. Storage sizes are checked by seeking; tensor bytes are never read.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

from ..errors import CheckpointError
from ..inventory import Finding, Inventory, Layout
from .picklevm import Opaque, PickleVM, Trace
from .torchpickle import StorageRef, global_findings, module_findings, tensor_records, torch_vm, walk

LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
LEGACY_PROTOCOL = 1001


@dataclass(frozen=True)
class LegacyHeader:
    """The three small pickles a legacy file opens with: magic number, protocol, system info."""

    main: int
    """Offset of the main pickle (the checkpoint's object graph)."""
    trace: Trace
    sys_info: object


def is_legacy_magic(value: object) -> bool:
    return type(value) is int and value == LEGACY_MAGIC


def legacy_header(buf: bytes | mmap.mmap, path: Path) -> LegacyHeader:
    vm = PickleVM(buf, source=str(path))
    magic, pos = vm.load(0)
    if not is_legacy_magic(magic):
        raise CheckpointError("starts like a legacy torch.save file but its magic number is wrong", path=str(path))
    protocol, pos = vm.load(pos)
    if type(protocol) is not int or protocol != LEGACY_PROTOCOL:
        raise CheckpointError(f"legacy torch.save protocol {protocol!r} is not {LEGACY_PROTOCOL}", path=str(path))
    sys_info, pos = vm.load(pos)
    return LegacyHeader(pos, vm.trace, sys_info)


def legacy_storage_keys(buf: bytes | mmap.mmap, pos: int, path: Path) -> tuple[list[str], int, Trace]:
    """The list of storage keys that follows the main pickle, and where the storage data starts."""
    vm = PickleVM(buf, source=str(path))
    keys, end = vm.load(pos)
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise CheckpointError("legacy torch.save storage list is malformed", path=str(path))
    return keys, end, vm.trace


def read_legacy(path: Path) -> Inventory:
    try:
        with path.open("rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            return _read_legacy(path, mm)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot map the file ({exc})", path=str(path)) from None


def _read_legacy(path: Path, mm: mmap.mmap) -> Inventory:
    storages: list[StorageRef] = []
    header = legacy_header(mm, path)
    vm = torch_vm(mm, source=str(path), on_storage=storages.append, legacy=True)
    root, pos = vm.load(header.main)
    objects: list[Opaque] = []
    found = list(walk(root, on_object=objects.append))
    keys, pos, keys_trace = legacy_storage_keys(mm, pos, path)
    spans = storage_spans(mm, pos, keys, storages, path)
    findings: list[Finding] = []
    for trace in (header.trace, vm.trace, keys_trace):
        findings += global_findings(trace, weights_only_loader=True)
    findings += module_findings(objects)
    metadata: dict[str, object] = {"byteorder": "little"}
    if isinstance(header.sys_info, dict) and header.sys_info.get("little_endian") is False:
        findings.append(
            Finding("loader-divergence", "info", "sys_info says big-endian, but torch reads legacy files in the machine's byte order")
        )
    layout = Layout("legacy", spans, pickle_offset=header.main)
    return Inventory(str(path), "torch-legacy", tensor_records(found), tuple(findings), metadata, layout)


def storage_spans(mm: mmap.mmap, pos: int, keys: list[str], storages: list[StorageRef], path: Path) -> dict[str, tuple[int, int]]:
    """Storage key -> (offset, length) of its bytes, walking the count headers from ``pos``."""
    by_key: dict[str, StorageRef] = {}
    for s in storages:
        if s.key not in by_key or not by_key[s.key].nbytes:
            by_key[s.key] = s  # torch keeps the first storage with data for a key
    missing = [k for k in by_key if k not in keys]
    if missing:
        raise CheckpointError(f"storage '{missing[0]}' is missing from the file", path=str(path))
    spans: dict[str, tuple[int, int]] = {}
    for key in keys:
        ref = by_key.get(key)
        if ref is None:
            raise CheckpointError(f"the storage list names '{key}', which the pickle never uses; torch refuses the file", path=str(path))
        if pos + 8 > len(mm):
            raise CheckpointError(f"file ends before storage '{key}' (truncated)", path=str(path))
        (count,) = struct.unpack("<q", mm[pos : pos + 8])
        pos += 8
        if count != ref.numel:
            raise CheckpointError(f"storage '{key}' holds {count} elements but the pickle needs {ref.numel}", path=str(path))
        length = ref.nbytes
        if pos + length > len(mm):
            raise CheckpointError(f"file ends inside storage '{key}' (truncated)", path=str(path))
        spans[key] = (pos, length)
        pos += length
    return spans
