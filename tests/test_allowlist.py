"""The safety tables are torch's own: checked against the installed torch, so an upgrade that changes
what weights_only accepts fails here first."""

from __future__ import annotations

import inspect
import pickle
import pickletools

import torch
import torch._utils
import torch._weights_only_unpickler as wo

from dtypeaudit.formats import allowlist
from dtypeaudit.formats.picklevm import _DISPATCH, _OPCODE_NAMES, PickleVM


def test_the_globals_weights_only_accepts_are_torchs() -> None:
    assert allowlist.WEIGHTS_ONLY_GLOBALS == frozenset(wo._get_allowed_globals())
    assert allowlist.WEIGHTS_ONLY_BLOCKED_MODULES == frozenset(wo._blocklisted_modules)


def test_the_opcodes_weights_only_handles_are_torchs() -> None:
    # Every pickle opcode constant torch's unpickler imports is one it handles.
    source = inspect.getsource(wo.Unpickler.load)
    handled = {
        op.name for op in pickletools.opcodes if getattr(wo, op.name, None) == getattr(pickle, op.name, object()) and op.name in source
    }
    assert allowlist.WEIGHTS_ONLY_OPCODES == handled


def test_the_python2_renames_are_torchs() -> None:
    assert allowlist.WEIGHTS_ONLY_MODULE_RENAMES == torch._utils.IMPORT_MAPPING
    assert allowlist.WEIGHTS_ONLY_NAME_RENAMES == torch._utils.NAME_MAPPING


def test_every_tensor_data_descriptor_is_listed() -> None:
    found = {
        name
        for cls in torch.nn.Parameter.__mro__
        for name, value in vars(cls).items()
        if inspect.isdatadescriptor(value) or isinstance(value, property)
    }
    assert found <= allowlist.TENSOR_DESCRIPTORS


def test_every_pickletools_opcode_has_a_handler() -> None:
    names = {op.name for op in pickletools.opcodes}
    assert set(_OPCODE_NAMES.values()) == names
    assert {_OPCODE_NAMES[code] for code in _DISPATCH} == names - {"STOP"}
    assert all(
        callable(getattr(PickleVM, f"op_{n}", None)) for n in names - {"STOP", "EXT1", "EXT2", "EXT4", "NEXT_BUFFER", "READONLY_BUFFER"}
    )


def test_classification() -> None:
    assert allowlist.classify_global("torch._utils._rebuild_tensor_v2") == "safe"
    assert allowlist.classify_global("posix.system") == "dangerous"
    assert allowlist.classify_global("builtins.eval") == "dangerous"
    assert allowlist.classify_global("argparse.Namespace") == "data"
    assert allowlist.classify_global("torch.strided") == "data"  # weights_only refuses layout globals
    assert allowlist.classify_global("mymodels.Net") == "unknown"
    assert allowlist.classify_global("__torch__.Net") == "unknown"
    assert allowlist.classify_global("__torch__.Net", torchscript=True) == "safe"
