"""What torch writes into its pickles: storages, tensor rebuild calls, and the globals around them.

The one torch-pickle toolkit, shared by the zip, TorchScript, legacy, bare-pickle and DCP readers and by
conversion, in three modules by job, whose names this one gathers:

- ``torchrebuild``: torch's rebuild functions (``REDUCERS``), storage records (:func:`storage_loader`) and
  :func:`torch_vm`, which sets up the interpreter as torch.load runs it;
- ``picklewalk``: the object graph: :func:`children` is the one traversal, :func:`walk` names every tensor,
  :func:`tensor_records` makes the inventory's records;
- ``pickle_findings``: :func:`global_findings` turns the globals into findings, with whole pickled modules,
  shadowed tensor methods and trailing pickles.
"""

from __future__ import annotations

from .pickle_findings import SHADOWABLE_METHODS, global_findings, module_findings, shadow_findings, trailing_findings
from .picklewalk import Found, children, is_module_state, is_optimizer_state, tensor_records, walk
from .torchrebuild import (
    NEW_REDUCERS,
    REDUCERS,
    TORCH_LOAD_MODULE_RENAMES,
    Device,
    StorageRef,
    TensorRef,
    TorchLayout,
    storage_loader,
    torch_vm,
)

__all__ = [
    "NEW_REDUCERS",
    "REDUCERS",
    "SHADOWABLE_METHODS",
    "TORCH_LOAD_MODULE_RENAMES",
    "Device",
    "Found",
    "StorageRef",
    "TensorRef",
    "TorchLayout",
    "children",
    "global_findings",
    "is_module_state",
    "is_optimizer_state",
    "module_findings",
    "shadow_findings",
    "storage_loader",
    "tensor_records",
    "torch_vm",
    "trailing_findings",
    "walk",
]
