"""What torch writes into its pickles: storages, tensor rebuild calls, and the globals around them.

Shared by the zip, TorchScript, legacy and DCP readers. Turns a pickle into named tensor records and
findings about every global that torch's own ``weights_only`` loader would not accept.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from .. import dtypes
from ..errors import CheckpointError, LimitExceeded
from ..inventory import Finding, Region
from .picklevm import Global, Opaque, Reducer, Trace


@dataclass(frozen=True)
class StorageRef:
    """A storage as a persistent id names it; its bytes stay on disk."""

    key: str
    dtype: str
    numel: int
    """Elements of ``dtype`` (bytes for an untyped storage)."""
    location: str

    @property
    def nbytes(self) -> int:
        return self.numel * dtypes.get(self.dtype).itemsize


class TensorRef:
    """A tensor the pickle rebuilds. Identity matters: the same object under two names is one tensor."""

    __slots__ = ("storage", "dtype", "offset", "shape", "stride", "kind", "layout", "nbytes")

    def __init__(
        self,
        storage: StorageRef | None,
        dtype: str,
        offset: int,
        shape: tuple[int, ...],
        stride: tuple[int, ...] | None,
        *,
        kind: str = "unknown",
        layout: str = "strided",
        nbytes: int | None = None,
    ) -> None:
        self.storage = storage
        self.dtype = dtype
        self.offset = offset
        self.shape = shape
        self.stride = stride
        self.kind = kind
        self.layout = layout
        self.nbytes = math.prod(shape) * dtypes.get(dtype).itemsize if nbytes is None else nbytes


# -- argument checking ----------------------------------------------------------------------------


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if isinstance(value, (tuple, list)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        if any(v < 0 for v in value) and what == "size":
            raise CheckpointError(f"tensor {what} has a negative entry")
        return tuple(value)
    raise CheckpointError(f"tensor {what} is not a tuple of integers")


def _int(value: Any, what: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    raise CheckpointError(f"tensor {what} is not a non-negative integer")


def _dtype_of_global(value: Any) -> str:
    if isinstance(value, Global) and value.module == "torch" and value.name in dtypes.DTYPES:
        return value.name
    raise CheckpointError(f"expected a torch dtype, found {value!r}")


def _tensor(value: Any, what: str) -> TensorRef:
    if isinstance(value, TensorRef):
        return value
    raise CheckpointError(f"{what} is not a tensor")


def _storage(value: Any) -> StorageRef:
    if isinstance(value, StorageRef):
        return value
    raise CheckpointError("a tensor is rebuilt from something that is not a storage record")


def _check_bounds(storage: StorageRef, dtype: str, offset: int, shape: tuple[int, ...], stride: tuple[int, ...]) -> None:
    if len(shape) != len(stride):
        raise CheckpointError(f"tensor size {shape} and stride {stride} differ in length")
    if math.prod(shape) == 0:
        return
    itemsize = dtypes.get(dtype).itemsize
    last = offset + sum((s - 1) * st for s, st in zip(shape, stride, strict=True))
    if (last + 1) * itemsize > storage.nbytes:
        raise CheckpointError(
            f"tensor of size {list(shape)} at offset {offset} reaches past its storage '{storage.key}' ({storage.nbytes} bytes)"
        )


# -- reducers: the only calls a torch pickle may make ---------------------------------------------


def _rebuild_v2(args: tuple[Any, ...]) -> TensorRef:
    if len(args) < 4:
        raise CheckpointError("tensor rebuild call has too few arguments")
    storage = _storage(args[0])
    offset, shape, stride = _int(args[1], "offset"), _ints(args[2], "size"), _ints(args[3], "stride")
    _check_bounds(storage, storage.dtype, offset, shape, stride)
    return TensorRef(storage, storage.dtype, offset, shape, stride)


def _rebuild_v3(args: tuple[Any, ...]) -> TensorRef:
    if len(args) < 7:
        raise CheckpointError("tensor rebuild call has too few arguments")
    storage = _storage(args[0])
    dtype = _dtype_of_global(args[6])
    itemsize = dtypes.get(dtype).itemsize
    byte_offset_elems = _int(args[1], "offset")
    shape, stride = _ints(args[2], "size"), _ints(args[3], "stride")
    typed = StorageRef(storage.key, dtype, storage.nbytes // itemsize, storage.location)
    _check_bounds(typed, dtype, byte_offset_elems, shape, stride)
    return TensorRef(typed, dtype, byte_offset_elems, shape, stride)


def _rebuild_parameter(args: tuple[Any, ...]) -> TensorRef:
    if not args:
        raise CheckpointError("parameter rebuild call has no tensor")
    t = _tensor(args[0], "a parameter's data")
    return TensorRef(t.storage, t.dtype, t.offset, t.shape, t.stride, kind="parameter", layout=t.layout, nbytes=t.nbytes)


def _rebuild_from_type(args: tuple[Any, ...]) -> Any:
    # torch._tensor._rebuild_from_type_v2(func, new_type, args, state): tensor subclasses.
    if len(args) < 3 or not isinstance(args[0], Global) or not isinstance(args[2], tuple):
        raise CheckpointError("malformed tensor-subclass rebuild call")
    inner = REDUCERS.get(args[0].qualname)
    if inner is None:
        return Opaque(args[0], args[2])
    value = inner(args[2])
    if isinstance(value, TensorRef) and isinstance(args[1], Global) and args[1].qualname == "torch.nn.parameter.Parameter":
        value.kind = "parameter"
    return value


def _rebuild_qtensor(args: tuple[Any, ...]) -> TensorRef:
    t = _rebuild_v2(args)
    t.layout = "quantized"
    return t


def _rebuild_sparse(args: tuple[Any, ...]) -> TensorRef:
    if len(args) != 2 or not isinstance(args[1], tuple):
        raise CheckpointError("malformed sparse tensor rebuild call")
    parts = [p for p in args[1] if isinstance(p, TensorRef)]
    sizes = [p for p in args[1] if isinstance(p, tuple)]
    if not parts or not sizes:
        raise CheckpointError("sparse tensor without values or size")
    values = parts[-1]
    layout = args[0].removeprefix("torch.") if isinstance(args[0], str) else "sparse"
    shape = _ints(sizes[-1], "size")
    return TensorRef(None, values.dtype, 0, shape, None, layout=layout, nbytes=sum(p.nbytes for p in parts))


def _rebuild_meta(args: tuple[Any, ...]) -> TensorRef:
    if len(args) < 3:
        raise CheckpointError("malformed meta tensor rebuild call")
    return TensorRef(None, _dtype_of_global(args[0]), 0, _ints(args[1], "size"), _ints(args[2], "stride"), layout="meta", nbytes=0)


def _ordered_dict(args: tuple[Any, ...]) -> dict[Any, Any]:
    if not args:
        return {}
    pairs = args[0]
    if isinstance(pairs, dict):
        return dict(pairs)
    if isinstance(pairs, (list, tuple)) and all(isinstance(p, (list, tuple)) and len(p) == 2 for p in pairs):
        try:
            return {k: v for k, v in pairs}
        except TypeError:
            raise CheckpointError("OrderedDict with an unhashable key") from None
    raise CheckpointError("malformed OrderedDict")


def _first(args: tuple[Any, ...]) -> Any:
    if not args:
        raise CheckpointError("call without arguments")
    return args[0]


def _size(args: tuple[Any, ...]) -> tuple[int, ...]:
    return _ints(_first(args), "size") if args else ()


def _codecs_encode(args: tuple[Any, ...]) -> bytes:
    # Protocol 2 spells bytes as _codecs.encode(text, "latin1").
    if len(args) == 2 and isinstance(args[0], str) and args[1] in ("latin1", "latin-1"):
        return args[0].encode("latin-1")
    raise CheckpointError("unexpected _codecs.encode call")


def _plain(kind: type) -> Reducer:
    def build(args: tuple[Any, ...]) -> Any:
        try:
            return kind(*args)
        except (TypeError, ValueError):
            raise CheckpointError(f"malformed {kind.__name__} call") from None

    return build


def _bytes(args: tuple[Any, ...]) -> bytes:
    # Only the spellings pickle itself writes: bytes() and bytes(bytes). bytes(n) would allocate n bytes.
    if not args:
        return b""
    if len(args) == 1 and isinstance(args[0], (bytes, bytearray)):
        return bytes(args[0])
    raise CheckpointError("unexpected bytes() call")


def _bytearray(args: tuple[Any, ...]) -> bytearray:
    return bytearray(_bytes(args))


def _device(args: tuple[Any, ...]) -> str:
    return ":".join(str(a) for a in args)


REDUCERS: dict[str, Reducer] = {
    "torch._utils._rebuild_tensor": _rebuild_v2,
    "torch._utils._rebuild_tensor_v2": _rebuild_v2,
    "torch._utils._rebuild_tensor_v3": _rebuild_v3,
    "torch._utils._rebuild_parameter": _rebuild_parameter,
    "torch._utils._rebuild_parameter_with_state": _rebuild_parameter,
    "torch._tensor._rebuild_from_type_v2": _rebuild_from_type,
    "torch._utils._rebuild_qtensor": _rebuild_qtensor,
    "torch._utils._rebuild_sparse_tensor": _rebuild_sparse,
    "torch._utils._rebuild_meta_tensor_no_storage": _rebuild_meta,
    "collections.OrderedDict": _ordered_dict,
    "torch.Size": _size,
    "torch.device": _device,
    "torch.serialization._get_layout": _first,
    "_codecs.encode": _codecs_encode,
    "builtins.set": _plain(set),
    "builtins.frozenset": _plain(frozenset),
    "builtins.complex": _plain(complex),
    "builtins.slice": lambda args: tuple(args),
    "builtins.bytearray": _bytearray,
    "builtins.bytes": _bytes,
    "torch.jit._pickle.build_intlist": _first,
    "torch.jit._pickle.build_doublelist": _first,
    "torch.jit._pickle.build_boollist": _first,
    "torch.jit._pickle.build_tensorlist": _first,
    "torch.jit._pickle.build_complexlist": _first,
    "torch.jit._pickle.restore_type_tag": _first,
}


def storage_loader(on_storage: Callable[[StorageRef], None] | None = None, *, legacy: bool = False) -> Callable[[Any], StorageRef]:
    """A persistent_load for torch's ``('storage', type, key, location, numel[, view])`` records."""
    cache: dict[tuple[str, str], StorageRef] = {}

    def load(pid: Any) -> StorageRef:
        if not isinstance(pid, tuple) or len(pid) < 5 or pid[0] != "storage":
            raise CheckpointError(f"persistent id {_short(pid)} is not a storage record")
        _, kind, key, location, numel = pid[:5]
        if legacy and len(pid) > 5 and pid[5] is not None:
            raise CheckpointError("legacy storage views are not supported")
        if not isinstance(kind, Global):
            raise CheckpointError("storage record names no storage type")
        if kind.name == "UntypedStorage":
            dtype = "uint8"
        elif kind.module == "torch" and kind.name in dtypes.STORAGE_CLASSES:
            dtype = dtypes.STORAGE_CLASSES[kind.name]
        else:
            raise CheckpointError(f"unknown storage type {kind.qualname}")
        if not isinstance(key, (str, int)) or not isinstance(numel, int) or numel < 0:
            raise CheckpointError("storage record has a bad key or size")
        ref = cache.get((str(key), dtype))
        if ref is None:
            ref = StorageRef(str(key), dtype, numel, str(location))
            cache[(str(key), dtype)] = ref
            if on_storage is not None:
                on_storage(ref)
        return ref

    return load


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# -- naming: walk the object graph ---------------------------------------------------------------


@dataclass(frozen=True)
class Found:
    """A tensor reached at ``name``; ``owner`` is the opaque object whose state holds it directly."""

    name: str
    tensor: TensorRef
    region: Region
    owner: Opaque | None


def _is_optimizer_state(d: Mapping[Any, Any]) -> bool:
    return "state" in d and "param_groups" in d


def walk(root: Any, *, max_visits: int = 1_000_000, max_depth: int = 200) -> Iterator[Found]:
    """Every tensor under ``root`` with its dotted key path, in pickle order.

    Shared sub-objects are walked once per path, as torch.load would show them; the visit and
    depth caps stop reference bombs (the billion-laughs shape) from costing more than a real file.
    """
    visits = 0

    def join(prefix: str, key: Any) -> str:
        part = key if isinstance(key, str) else str(key)
        return f"{prefix}.{part}" if prefix else part

    def go(value: Any, name: str, region: Region, owner: Opaque | None, depth: int) -> Iterator[Found]:
        nonlocal visits
        visits += 1
        if visits > max_visits:
            raise LimitExceeded("the pickle's references fan out into too many paths (a reference bomb?)")
        if depth > max_depth:
            raise LimitExceeded(f"the pickle nests deeper than {max_depth} levels")
        if isinstance(value, TensorRef):
            yield Found(name, value, region, owner)
        elif isinstance(value, dict):
            inner: Region = "optimizer" if _is_optimizer_state(value) else region
            for k, v in value.items():
                yield from go(v, join(name, k), inner, None, depth + 1)
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                yield from go(v, join(name, i), region, None, depth + 1)
        elif isinstance(value, (set, frozenset)):
            for i, v in enumerate(value):
                yield from go(v, join(name, i), region, None, depth + 1)
        elif isinstance(value, Opaque):
            inner = "optimizer" if _is_optimizer_state(value.items) else region
            for k, v in value.items.items():
                yield from go(v, join(name, k), inner, value, depth + 1)
            for i, v in enumerate(value.list_items):
                yield from go(v, join(name, i), region, value, depth + 1)
            if isinstance(value.state, dict):
                for k, v in value.state.items():
                    yield from go(v, join(name, k), region, value, depth + 1)
            elif value.state is not None:
                yield from go(value.state, join(name, "__state__"), region, value, depth + 1)
            for i, v in enumerate(value.args):
                yield from go(v, join(name, f"__arg{i}__"), region, value, depth + 1)

    yield from go(root, "", "model", None, 0)


# -- globals: what torch's weights_only loader would refuse ---------------------------------------

_SAFE_PREFIXES = ("torch._utils._rebuild_", "torch.jit._pickle.")
_SAFE_EXACT = frozenset(
    {
        *REDUCERS,
        "torch.storage.UntypedStorage",
        "torch.UntypedStorage",
        "torch.nn.parameter.Parameter",
        "copyreg._reconstructor",
        "builtins.object",
        "torch.strided",
        "torch.sparse_coo",
        "torch.sparse_csr",
        "torch.sparse_csc",
        "torch.sparse_bsr",
        "torch.sparse_bsc",
        "torch.per_tensor_affine",
        "torch.per_channel_affine",
        "torch.per_tensor_symmetric",
        "torch.per_channel_symmetric",
        "torch.per_channel_affine_float_qparams",
        "torch.contiguous_format",
        "torch.channels_last",
        "torch.channels_last_3d",
        "torch.preserve_format",
        *(f"torch.{name}" for name in dtypes.STORAGE_CLASSES),
        *(f"torch.{name}" for name in dtypes.DTYPES),
    }
)

# Globals that can run code or touch the system when a trusting loader resolves them.
_DANGEROUS_MODULES = (
    "os", "posix", "nt", "subprocess", "sys", "runpy", "importlib", "pickle", "_pickle", "shutil",
    "socket", "webbrowser", "pty", "code", "codeop", "ctypes", "marshal", "multiprocessing", "asyncio",
    "http", "urllib", "requests", "types", "io", "pathlib._local", "tempfile", "signal", "threading",
    "torch.hub", "torch.jit", "dill", "cloudpickle", "numpy.testing", "pip", "setuptools",
)  # fmt: skip
_DANGEROUS_EXACT = frozenset(
    {
        *(
            f"builtins.{n}"
            for n in (
                "eval",
                "exec",
                "compile",
                "getattr",
                "setattr",
                "delattr",
                "__import__",
                "open",
                "globals",
                "locals",
                "vars",
                "breakpoint",
                "input",
                "apply",
                "execfile",
            )
        ),  # fmt: skip
        "functools.partial",
        "functools.reduce",
        "operator.attrgetter",
        "operator.methodcaller",
        "operator.itemgetter",
        "torch.load",
        "torch.save",
        "torch.serialization.load",
        "torch._C._load_for_lite_interpreter",
        "numpy.load",
        "numpy.lib.npyio.load",
    }
)
# Plain data classes common in training checkpoints: harmless in practice, yet torch's
# weights_only loader refuses them, so loading the file still means trusting it.
_DATA_CLASSES = frozenset(
    {
        "argparse.Namespace",
        "pytorch_lightning.utilities.parsing.AttributeDict",
        "lightning.fabric.utilities.data.AttributeDict",
        "lightning_fabric.utilities.data.AttributeDict",
        "numpy.core.multiarray.scalar",
        "numpy._core.multiarray.scalar",
        "numpy.core.multiarray._reconstruct",
        "numpy._core.multiarray._reconstruct",
        "numpy.ndarray",
        "numpy.dtype",
        "pathlib.PosixPath",
        "pathlib.WindowsPath",
        "pathlib.PurePosixPath",
        "datetime.datetime",
        "datetime.date",
        "datetime.timedelta",
        "builtins.dict",
        "builtins.list",
        "builtins.tuple",
        "builtins.int",
        "builtins.float",
        "builtins.str",
        "builtins.bool",
        "enum.Enum",
    }
)


def classify_global(qualname: str) -> str:
    """``safe``, ``data`` (a plain data class) or ``dangerous``/``unknown`` (both unsafe)."""
    if qualname in _SAFE_EXACT or qualname.startswith(_SAFE_PREFIXES):
        return "safe"
    if (
        qualname in _DANGEROUS_EXACT
        or qualname.split(".")[0] in _DANGEROUS_MODULES
        or any(qualname.startswith(m + ".") for m in _DANGEROUS_MODULES)
    ):
        return "dangerous"
    if qualname in _DATA_CLASSES or qualname.startswith(("numpy.dtypes.", "omegaconf.")):
        return "data"
    return "unknown"


def global_findings(trace: Trace, *, also_safe: Callable[[str], bool] = lambda q: False, file: str | None = None) -> list[Finding]:
    """One finding per global that a safe loader would refuse."""
    out: list[Finding] = []
    for qualname in trace.globals:
        verdict = "safe" if also_safe(qualname) else classify_global(qualname)
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
    return out
