"""torch.distributed.checkpoint directories: the ``.metadata`` pickle describes every tensor.

Non-tensor values (``BytesStorageMetadata`` entries) are stored by ``DefaultSavePlanner`` as a whole
``torch.save`` of the object, at an offset in a ``.distcp`` file; ``FileSystemReader.read_data`` and
``dcp_to_torch_save`` load them with ``torch.load(weights_only=False)``. Each such item is read here as the
torch.save file it is: its tensors are listed under the item's name, its globals reported. Every other file
in the folder is read for safety (``directory.companions``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from .. import dtypes
from ..errors import CheckpointError, DtypeAuditError, LimitExceeded
from ..inventory import Finding, Inventory, TensorRecord
from . import directory
from .locate import AnyPath, open_source, read_small
from .picklevm import Global, Opaque
from .source import Source
from .torchpickle import global_findings, torch_vm

MAX_METADATA_BYTES = 1 << 30
_DCP_MODULES = ("torch.distributed.checkpoint.",)
# DCP records where it was saved as a pathlib path; torch's own DCP loader allows these too.
_DCP_EXTRA = frozenset({"torch.serialization._get_layout", "pathlib.PosixPath", "pathlib.WindowsPath", "pathlib.PurePosixPath"})


def _is_dcp_global(qualname: str) -> bool:
    return qualname.startswith(_DCP_MODULES) or qualname in _DCP_EXTRA


def _cls(value: Any) -> str:
    return value.callable.name if isinstance(value, Opaque) and isinstance(value.callable, Global) else ""


class BytesSource(Source):
    """An item's bytes held in memory, read as a file of its own."""

    def __init__(self, name: str, data: bytes) -> None:
        self.name, self.data, self.size = name, data, len(data)

    def read(self, offset: int, n: int) -> bytes:
        return self.data[offset : offset + max(n, 0)] if offset < self.size else b""

    def view(self) -> bytes:
        return self.data


def read(path: AnyPath, read_file: Callable[[Any], Inventory] | None = None, *, exclude: tuple[str, ...] = ()) -> Inventory:
    """The checkpoint's tensors, and the tensors and globals of its bytes items; with ``read_file``, every
    other file in the folder is read for safety too."""
    meta_path = path / ".metadata"
    size = meta_path.stat().st_size
    if size > MAX_METADATA_BYTES:
        raise LimitExceeded(".metadata is over the 1 GiB cap", path=str(meta_path))
    vm = torch_vm(read_small(meta_path, MAX_METADATA_BYTES), source=str(meta_path), persistent=False)
    root, _ = vm.load()
    if _cls(root) != "Metadata" or not isinstance(root.state, dict):
        raise CheckpointError("not a torch.distributed.checkpoint Metadata object", path=str(meta_path))
    entries = root.state.get("state_dict_metadata")
    if not isinstance(entries, dict):
        raise CheckpointError("Metadata has no state_dict_metadata", path=str(meta_path))
    infos = _storage_infos(root.state.get("storage_data"))
    files = {fqn: rel for fqn, (rel, _, _, _) in infos.items()}
    tensors = []
    findings = global_findings(vm.trace, also_safe=_is_dcp_global, file=".metadata")
    for name, entry in entries.items():
        if _cls(entry) == "BytesStorageMetadata" and read_file is not None:
            item_tensors, item_findings = _bytes_item(path, str(name), infos.get(str(name)), read_file)
            tensors.extend(item_tensors)
            findings.extend(item_findings)
            continue
        if _cls(entry) != "TensorStorageMetadata":
            continue
        state = entry.state if isinstance(entry.state, dict) else {}
        dtype = _dtype(state.get("properties"), meta_path, name)
        size_ = state.get("size")
        if not isinstance(size_, tuple) or not all(isinstance(d, int) and d >= 0 for d in size_):
            raise CheckpointError(f"tensor '{name}' has a bad size", path=str(meta_path))
        nbytes = math.prod(size_) * dtypes.get(dtype).itemsize
        tensors.append(TensorRecord(name=str(name), dtype=dtype, shape=size_, nbytes=nbytes, file=files.get(str(name), "")))
    if read_file is not None:
        used = {meta_path.resolve()}
        for rel in sorted({rel for rel, _, _, _ in infos.values()}):
            used.add(directory.confine(path, rel, origin=meta_path).resolve())
        findings.extend(directory.companions(path, used, read_file, exclude=exclude))
    return Inventory(str(path), "dcp", tuple(tensors), tuple(findings), {})


def _bytes_item(
    path: AnyPath, fqn: str, info: tuple[str, int, int, Any] | None, read_file: Callable[[Any], Inventory]
) -> tuple[list[TensorRecord], list[Finding]]:
    """A bytes item read as the torch.save file FileSystemReader hands to ``torch.load(weights_only=False)``."""
    meta_path = path / ".metadata"
    if info is None:
        raise CheckpointError(f"bytes item '{fqn}' has no storage record", path=str(meta_path))
    rel, offset, length, transforms = info
    if transforms:
        what = f"bytes item '{fqn}' is stored through transforms {transforms!r}, which are not undone here; refused"
        raise CheckpointError(what, path=str(meta_path))
    if length > MAX_METADATA_BYTES:
        raise LimitExceeded(f"bytes item '{fqn}' is over the 1 GiB cap", path=str(meta_path))
    data_path = directory.confine(path, rel, origin=meta_path)
    with open_source(data_path) as src:
        data = src.read(offset, length)
    if len(data) != length:
        raise CheckpointError(f"bytes item '{fqn}' runs past the end of {rel}", path=str(meta_path))
    try:
        inv = read_file(BytesSource(f"{data_path}[{fqn}]", data))
    except DtypeAuditError as exc:
        raise CheckpointError(f"bytes item '{fqn}' in {rel}: {exc.message}", path=str(path)) from None
    tensors = [t.with_(name=f"{fqn}.{t.name}" if t.name else fqn, file=rel, shares_with=()) for t in inv.tensors]
    findings = [replace(f, message=f"bytes item '{fqn}': {f.message}", file=rel) for f in inv.findings]
    return tensors, findings


def _dtype(props: Any, meta_path: AnyPath, name: str) -> str:
    if _cls(props) == "TensorProperties":
        state = props.state
        value = state[0] if isinstance(state, tuple) and state else state.get("dtype") if isinstance(state, dict) else None
        if isinstance(value, Global) and value.module == "torch" and value.name in dtypes.DTYPES:
            return value.name
    raise CheckpointError(f"tensor '{name}' has no readable dtype", path=str(meta_path))


def _storage_infos(storage_data: Any) -> dict[str, tuple[str, int, int, Any]]:
    """fqn -> (relative_path, offset, length, transform_descriptors) of its first storage record."""
    out: dict[str, tuple[str, int, int, Any]] = {}
    if not isinstance(storage_data, dict):
        return out
    for index, info in storage_data.items():
        fqn = index.state.get("fqn") if isinstance(index, Opaque) and isinstance(index.state, dict) else None
        st = info.state if isinstance(info, Opaque) and isinstance(info.state, dict) else None
        if not isinstance(fqn, str) or st is None or not isinstance(st.get("relative_path"), str):
            continue
        offset, length = st.get("offset"), st.get("length")
        if not (type(offset) is int and type(length) is int and offset >= 0 and length >= 0):
            raise CheckpointError(f"storage record of '{fqn}' has a bad offset or length")
        out.setdefault(fqn, (st["relative_path"], offset, length, st.get("transform_descriptors")))
    return out
