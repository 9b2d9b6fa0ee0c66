"""Bare pickles (``pickle.dump`` of tensors or anything else): read for their globals, which is where the danger is.

``pickle.load`` is the loader here: CPython's full unpickler with its default ASCII encoding, and no
persistent ids. torch.load refuses such a file (no zip signature, no legacy magic number).
"""

from __future__ import annotations

from typing import Any

from ..errors import CheckpointError, LimitExceeded
from ..inventory import Finding, Inventory
from . import locate
from .locate import AnyPath
from .picklevm import Opaque
from .source import Source
from .torchpickle import global_findings, module_findings, shadow_findings, tensor_records, torch_vm, trailing_findings, walk

MAX_PICKLE_BYTES = 1 << 30


def read_pickle(where: AnyPath | Source) -> Inventory:
    with locate.opened(where) as src:
        path = src.name
        if src.size > MAX_PICKLE_BYTES:
            raise LimitExceeded("bare pickle is over the 1 GiB cap", path=path)
        data = src.read(0, src.size)
    vm = torch_vm(data, source=str(path), persistent=False, encoding="ASCII", torch_load=False)
    vm.persistent_load = _no_persistent(path)
    root, end = vm.load()
    objects: list[Opaque] = []
    found = list(walk(root, on_object=objects.append))
    findings = global_findings(vm.trace) + module_findings(objects) + shadow_findings(found) + trailing_findings(data, end, str(path))
    findings.append(
        Finding(
            "loader-divergence",
            "warning",
            "a bare pickle: torch.load refuses it (no zip signature, no legacy magic number), pickle.load runs it in full",
        )
    )
    return Inventory(path, "pickle", tensor_records(found), tuple(findings), {})


def _no_persistent(path: str) -> Any:
    def load(pid: Any) -> Any:
        raise CheckpointError("a bare pickle refers to external storage; not a torch.save file", path=str(path))

    return load
