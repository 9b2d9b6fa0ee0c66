"""What an interpreted torch pickle's contents say about it: globals a safe loader refuses, whole pickled
modules, tensors whose state shadows a method, and pickles hidden after the main one."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..errors import CheckpointError, LimitExceeded
from ..inventory import Finding
from . import allowlist
from .picklevm import Opaque, PickleVM, Trace
from .picklewalk import Found, is_module_state

# Methods of torch.Tensor that a state's plain setattr would shadow on the loaded tensor: the casts and copies
# that model code, .half()/.to() on a module, and conversion call (a shadowed one makes the tensor misbehave).
SHADOWABLE_METHODS = frozenset(
    {
        "half", "float", "double", "bfloat16", "to", "type", "type_as", "cuda", "cpu", "int", "long", "short", "bool",
        "byte", "char", "clone", "detach", "detach_", "copy_", "contiguous", "numpy", "tolist", "item", "view", "reshape",
        "size", "dim", "numel", "element_size", "storage", "untyped_storage", "data_ptr", "requires_grad_",
        "share_memory_", "pin_memory", "register_hook", "backward", "new_empty", "new_zeros", "new_ones", "new_tensor",
        "new_full", "is_floating_point", "is_complex", "apply_", "map_", "__torch_function__", "__torch_dispatch__",
        "__reduce_ex__", "__deepcopy__", "__setstate__", "__getstate__", "__repr__", "__format__", "__array__",
        "__getattr__", "__getattribute__", "__setattr__", "__len__", "__iter__", "__getitem__", "__setitem__",
    }
)  # fmt: skip


def shadow_findings(found: list[Found]) -> list[Finding]:
    """A ``shadowed-method`` error per tensor whose state sets an attribute named like one of torch.Tensor's
    methods: the loaded tensor would not behave as a plain tensor of its dtype (``p.half()`` doing something
    else), so the file is not passed, and convert, which refuses a file with errors, never writes it again."""
    out = []
    seen: set[int] = set()
    for f in found:
        if id(f.tensor) in seen:
            continue
        seen.add(id(f.tensor))
        shadowed = sorted(k for k in f.tensor.attrs if k in SHADOWABLE_METHODS)
        if shadowed:
            out.append(
                Finding(
                    "shadowed-method",
                    "error",
                    f"its state sets {', '.join(shadowed)}, shadowing torch.Tensor's own method: the loaded tensor does not behave "
                    "as a plain tensor",
                    tensor=f.name,
                )
            )
    return out


def module_findings(objects: list[Opaque]) -> list[Finding]:
    """One ``pickled-module`` error per class of whole nn.Module the pickle holds."""
    seen: dict[str, None] = {}
    for obj in objects:
        if is_module_state(obj):
            seen.setdefault(obj.qualname)
    return [
        Finding(
            "pickled-module",
            "error",
            f"pickles a whole nn.Module ({q}): loading it imports and runs that class's code; save its state_dict and load that",
        )
        for q in seen
    ]


# -- globals: what torch's weights_only loader would refuse ---------------------------------------


def global_findings(
    trace: Trace,
    *,
    also_safe: Callable[[str], bool] = lambda q: False,
    file: str | None = None,
    torchscript: bool = False,
    weights_only_loader: bool = False,
    file_name: str = "",
) -> list[Finding]:
    """One finding per global that a safe loader would refuse; with ``weights_only_loader`` (the
    stream is one torch.load reads), a ``loader-divergence`` note when weights_only refuses it. ``file_name``:
    the path the stream was read from, whose loader may accept more (``allowlist.accepted_by_its_loader``)."""
    out: list[Finding] = []
    for qualname in trace.globals:
        safe = also_safe(qualname) or allowlist.accepted_by_its_loader(file_name, qualname)
        verdict = "safe" if safe else allowlist.classify_global(qualname, torchscript=torchscript)
        if verdict == "safe":
            continue
        called = qualname in trace.calls
        if verdict == "data":
            out.append(
                Finding(
                    "foreign-global",
                    "warning",
                    f"references {qualname}, a plain data class that torch.load(weights_only=True) refuses "
                    "unless allow-listed; it was not loaded",
                    file=file,
                )
            )
        else:
            what = "can execute code when loaded" if verdict == "dangerous" else "is not a tensor-rebuilding global"
            verb = "calls" if called else "references"
            out.append(
                Finding(
                    "unsafe-global",
                    "error",
                    f"{verb} {qualname}, which {what}; it was not executed",
                    file=file,
                )
            )
    # Globals it refuses are reported above; anything else it refuses is worth a note of its own.
    # An object made from a refused global is refused again where it is built or filled: only opcodes then.
    # A global reported nowhere above (torch.load renamed it to an allowed one) is named here.
    refused_global = any(r.startswith("global ") for r in trace.weights_only_refusals)
    reasons = [
        r
        for r in trace.weights_only_refusals
        if r.startswith("opcode ")
        or (r.startswith("global ") and r[len("global ") :] not in trace.globals)
        or not (refused_global or r.startswith("global "))
    ]
    if weights_only_loader and reasons:
        out.append(
            Finding(
                "loader-divergence",
                "warning",
                f"torch.load(weights_only=True) refuses this pickle ({', '.join(reasons)}); loading it takes "
                "weights_only=False, CPython's full unpickler, which dtypeaudit models",
                file=file,
            )
        )
    return out


def trailing_findings(data: Any, end: int, source: str, limit: int = 16) -> list[Finding]:
    """Bytes after the pickle's STOP: loaders ignore them, so a second pickle there is a smuggling attempt.

    Each further pickle is interpreted (never executed) for its globals, so what it would call is
    reported. Bytes that do not interpret as pickles fail the file: what they hold cannot be checked.
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
            return out
        vm = PickleVM(data, persistent_load=lambda pid: None, source=source)
        try:
            _, end = vm.load(end)
        except CheckpointError as exc:
            raise CheckpointError(
                f"bytes after the pickle do not interpret as pickles ({exc.message}); what they hold cannot be checked", path=source
            ) from None
        out.extend(global_findings(vm.trace))
    raise LimitExceeded(f"more than {limit} pickles follow the main one", path=source)
