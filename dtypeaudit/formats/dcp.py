"""torch.distributed.checkpoint directories: the ``.metadata`` pickle describes every tensor."""

from __future__ import annotations

import math
from typing import Any

from .. import dtypes
from ..errors import CheckpointError, LimitExceeded
from ..inventory import Inventory, TensorRecord
from .locate import AnyPath, read_small
from .picklevm import Global, Opaque
from .torchpickle import global_findings, torch_vm

MAX_METADATA_BYTES = 1 << 30
_DCP_MODULES = ("torch.distributed.checkpoint.",)
# DCP records where it was saved as a pathlib path; torch's own DCP loader allows these too.
_DCP_EXTRA = frozenset({"torch.serialization._get_layout", "pathlib.PosixPath", "pathlib.WindowsPath", "pathlib.PurePosixPath"})


def _is_dcp_global(qualname: str) -> bool:
    return qualname.startswith(_DCP_MODULES) or qualname in _DCP_EXTRA


def _cls(value: Any) -> str:
    return value.callable.name if isinstance(value, Opaque) and isinstance(value.callable, Global) else ""


def read(path: AnyPath) -> Inventory:
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
    files = _files_by_name(root.state.get("storage_data"))
    tensors = []
    for name, entry in entries.items():
        if _cls(entry) != "TensorStorageMetadata":
            continue
        state = entry.state if isinstance(entry.state, dict) else {}
        dtype = _dtype(state.get("properties"), meta_path, name)
        size_ = state.get("size")
        if not isinstance(size_, tuple) or not all(isinstance(d, int) and d >= 0 for d in size_):
            raise CheckpointError(f"tensor '{name}' has a bad size", path=str(meta_path))
        nbytes = math.prod(size_) * dtypes.get(dtype).itemsize
        tensors.append(TensorRecord(name=str(name), dtype=dtype, shape=size_, nbytes=nbytes, file=files.get(str(name), "")))
    findings = global_findings(vm.trace, also_safe=_is_dcp_global, file=".metadata")
    return Inventory(str(path), "dcp", tuple(tensors), tuple(findings), {})


def _dtype(props: Any, meta_path: AnyPath, name: str) -> str:
    if _cls(props) == "TensorProperties":
        state = props.state
        value = state[0] if isinstance(state, tuple) and state else state.get("dtype") if isinstance(state, dict) else None
        if isinstance(value, Global) and value.module == "torch" and value.name in dtypes.DTYPES:
            return value.name
    raise CheckpointError(f"tensor '{name}' has no readable dtype", path=str(meta_path))


def _files_by_name(storage_data: Any) -> dict[str, str]:
    out: dict[str, str] = {}
    if not isinstance(storage_data, dict):
        return out
    for index, info in storage_data.items():
        fqn = index.state.get("fqn") if isinstance(index, Opaque) and isinstance(index.state, dict) else None
        rel = info.state.get("relative_path") if isinstance(info, Opaque) and isinstance(info.state, dict) else None
        if isinstance(fqn, str) and isinstance(rel, str):
            out.setdefault(fqn, rel)
    return out
