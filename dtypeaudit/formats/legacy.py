"""Legacy torch.save files (``_use_new_zipfile_serialization=False``, the format before torch 1.6).

Three small pickles (magic number, protocol version, system info), the main pickle, the list of
storage keys, then each storage as an 8-byte element count and its bytes. Mirrors ``_legacy_load``
in torch/serialization.py: any pickle protocol; the counts and data are always little-endian
(torch reads them in native order and ignores ``sys_info``), and each count must equal the storage
size its first record gave. Storage sizes are checked by seeking; tensor bytes are never read.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import CheckpointError
from ..inventory import Finding, Inventory, Layout, Span
from . import locate
from .locate import AnyPath
from .picklevm import Opaque, PickleVM, Trace
from .source import Source
from .torchpickle import (
    StorageRef,
    global_findings,
    module_findings,
    shadow_findings,
    tensor_records,
    torch_vm,
    walk,
)
from .torchrebuild import non_tensor_entries, storage_sites

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


def legacy_header(buf: Any, path: Path | str) -> LegacyHeader:
    vm = PickleVM(buf, source=str(path))
    magic, pos = vm.load(0)
    if not is_legacy_magic(magic):
        raise CheckpointError("starts like a legacy torch.save file but its magic number is wrong", path=str(path))
    protocol, pos = vm.load(pos)
    if type(protocol) is not int or protocol != LEGACY_PROTOCOL:
        raise CheckpointError(f"legacy torch.save protocol {protocol!r} is not {LEGACY_PROTOCOL}", path=str(path))
    sys_info, pos = vm.load(pos)
    return LegacyHeader(pos, vm.trace, sys_info)


def legacy_storage_keys(buf: Any, pos: int, path: Path | str) -> tuple[list[str], int, Trace]:
    """The list of storage keys that follows the main pickle, and where the storage data starts."""
    vm = PickleVM(buf, source=str(path))
    keys, end = vm.load(pos)
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise CheckpointError("legacy torch.save storage list is malformed", path=str(path))
    return keys, end, vm.trace


def read_legacy(where: AnyPath | Source) -> Inventory:
    with locate.opened(where) as src:
        try:
            mm = src.view()
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"cannot map the file ({exc})", path=src.name) from None
        return _read_legacy(src, mm)


def _read_legacy(src: Source, mm: Any) -> Inventory:
    path = src.name
    storages: list[StorageRef] = []
    header = legacy_header(mm, path)
    vm = torch_vm(mm, source=str(path), on_storage=storages.append, legacy=True)
    root, end = vm.load(header.main)
    objects: list[Opaque] = []
    found = list(walk(root, on_object=objects.append))
    keys, pos, keys_trace = legacy_storage_keys(mm, end, path)
    src.note_span(0, pos)
    if src.remote:
        src.read_ranges(_count_ranges(pos, keys, storages))
    spans = storage_spans(mm, pos, keys, storages, path)
    for offset, _ in spans.values():
        src.note_span(offset - 8, offset)
    findings: list[Finding] = []
    for trace in (header.trace, vm.trace, keys_trace):
        findings += global_findings(trace, weights_only_loader=True, file_name=str(path))
    findings += module_findings(objects) + shadow_findings(found)
    metadata: dict[str, object] = {"byteorder": "little"}
    if isinstance(header.sys_info, dict) and header.sys_info.get("little_endian") is False:
        findings.append(
            Finding("loader-divergence", "info", "sys_info says big-endian, but torch reads legacy files in the machine's byte order")
        )
    layout = Layout("legacy", spans, pickle_offset=header.main, pickle_end=end, non_tensor=non_tensor_entries(root), **storage_sites(vm))
    return Inventory(path, "torch-legacy", tensor_records(found), tuple(findings), metadata, layout)


def _count_ranges(pos: int, keys: list[str], storages: list[StorageRef]) -> list[tuple[int, int]]:
    """Where each storage's 8-byte element count should lie, if every storage is the size the pickle says:
    fetched at once, before ``storage_spans`` checks them one by one."""
    nbytes: dict[str, int] = {}
    for s in storages:
        if s.key not in nbytes or not nbytes[s.key]:
            nbytes[s.key] = s.nbytes
    out = []
    for key in keys:
        if key not in nbytes:
            break
        out.append((pos, 8))
        pos += 8 + nbytes[key]
    return out


def storage_spans(mm: Any, pos: int, keys: list[str], storages: list[StorageRef], path: Path | str) -> dict[str, Span]:
    """Storage key -> the span of its bytes, walking the count headers from ``pos``."""
    by_key: dict[str, StorageRef] = {}
    for s in storages:
        if s.key not in by_key or not by_key[s.key].nbytes:
            by_key[s.key] = s  # torch keeps the first storage with data for a key
    missing = [k for k in by_key if k not in keys]
    if missing:
        raise CheckpointError(f"storage '{missing[0]}' is missing from the file", path=str(path))
    spans: dict[str, Span] = {}
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
        spans[key] = Span(pos, length)
        pos += length
    return spans
