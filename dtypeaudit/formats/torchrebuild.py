"""torch's rebuild functions as the pickle interpreter calls them: storages, tensors, and the globals around them.

Each rebuild mirrors the function of the same name in ``torch/_utils.py`` (torch 2.13): the dtype,
shape and storage a real load ends up with, including what the function's later arguments change
(``_rebuild_device_tensor_from_cpu_tensor`` casts; a rebuild ``state`` runs ``setattr`` on the tensor).
Anything whose outcome is not modelled exactly is refused rather than guessed. :func:`torch_vm` sets up
the interpreter as torch.load runs it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .. import dtypes
from ..errors import CheckpointError
from . import allowlist
from .picklevm import DictObject, Global, Opaque, PickleVM, Reducer


@dataclass(frozen=True, eq=False)
class StorageRef:
    """A storage as a persistent id names it; its bytes stay on disk.

    Compared by identity, as torch's storage objects are: two records with equal fields (keys ``0`` and
    ``"0"``, which torch caches apart) are two storages, also as dict keys or set members."""

    key: str
    """The record name: ``data/<key>`` in a zip archive."""
    dtype: str
    numel: int
    """Elements of ``dtype`` (bytes for an untyped storage)."""
    location: str

    @property
    def nbytes(self) -> int:
        return self.numel * dtypes.get(self.dtype).itemsize


class TensorRef:
    """A tensor the pickle rebuilds. Identity matters: the same object under two names is one tensor."""

    __slots__ = ("storage", "dtype", "offset", "shape", "stride", "kind", "layout", "nbytes", "attrs")

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
        self.attrs: dict[str, Any] = {}
        """Python attributes a rebuild's state set on the tensor (they may hold tensors too)."""

    def copy(self, **changes: Any) -> TensorRef:
        out = TensorRef(self.storage, self.dtype, self.offset, self.shape, self.stride, kind=self.kind, layout=self.layout)
        out.nbytes = self.nbytes
        out.attrs = dict(self.attrs)
        for key, value in changes.items():
            setattr(out, key, value)
        return out


class _TorchValue(str):
    """A torch value a pickle rebuilds from its name: equal to a value of its own type, never to a plain string key."""

    __slots__ = ()
    torch_type = ""

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and str.__eq__(self, other)

    def __hash__(self) -> int:
        return hash((self.torch_type, str(self)))


class Device(_TorchValue):
    """A ``torch.device`` value."""

    __slots__ = ()
    torch_type = "torch.device"


class TorchLayout(_TorchValue):
    """A ``torch.layout`` value (``torch.sparse_coo``), as ``torch.serialization._get_layout`` returns it."""

    __slots__ = ()
    torch_type = "torch.layout"


# -- argument checking ----------------------------------------------------------------------------


def _ints(value: Any, what: str, *, nonneg: bool = True) -> tuple[int, ...]:
    if isinstance(value, (tuple, list)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        if nonneg and any(v < 0 for v in value):
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


def _arity(args: tuple[Any, ...], what: str, low: int, high: int | None = None) -> None:
    if not low <= len(args) <= (low if high is None else high):
        raise CheckpointError(f"{what} called with {len(args)} arguments; torch's takes {low}" + (f" to {high}" if high else ""))


def _requires_grad(value: Any, dtype: str) -> None:
    # Setting requires_grad on an integer tensor raises in torch, so such a file does not load.
    if not isinstance(value, bool):
        raise CheckpointError("requires_grad is not a boolean")
    if value and dtypes.get(dtype).family not in ("float", "complex"):
        raise CheckpointError(f"a {dtype} tensor is marked requires_grad; torch refuses to load it")


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


def _metadata(value: Any) -> None:
    # torch._utils.set_tensor_metadata: only the conj/neg view bits are meaningful.
    if value is None or value == {}:
        return
    known = isinstance(value, dict) and set(value) <= allowlist.TENSOR_METADATA_KEYS
    if not known or not all(isinstance(v, bool) for v in value.values()):
        raise CheckpointError(f"tensor metadata {_short(value)} is not what torch.save writes; not modelled")


def _apply_state(t: TensorRef, state: Any) -> None:
    """torch._utils._set_obj_state: setattr for each entry of the dict (and slots) state."""
    if isinstance(state, tuple):
        if len(state) != 2:
            raise CheckpointError("a tensor's state is a tuple but not (dict, slots)")
        parts = state
    else:
        parts = (state, None)
    for part in parts:
        if not part:
            continue
        if not isinstance(part, dict):
            raise CheckpointError("a tensor's state is not a dict")
        for key, value in part.items():
            if not isinstance(key, str):
                raise CheckpointError("a tensor's state sets an attribute whose name is not a string")
            if key in allowlist.TENSOR_DESCRIPTORS:
                raise CheckpointError(f"a tensor's state sets '{key}', which changes the tensor torch loads; refused")
            t.attrs[key] = value


# -- reducers: the only calls a torch pickle may make ---------------------------------------------


def _rebuild_v1(args: tuple[Any, ...]) -> TensorRef:
    _arity(args, "_rebuild_tensor", 4)
    return _strided(args)


def _strided(args: tuple[Any, ...]) -> TensorRef:
    storage = _storage(args[0])
    offset, shape, stride = _int(args[1], "offset"), _ints(args[2], "size"), _ints(args[3], "stride")
    _check_bounds(storage, storage.dtype, offset, shape, stride)
    return TensorRef(storage, storage.dtype, offset, shape, stride)


def _hooks(t: TensorRef, hooks: Any) -> TensorRef:
    """``tensor._backward_hooks = backward_hooks``, as _rebuild_tensor_v2 and _rebuild_parameter do: what a
    non-empty hooks dict holds (tensors, objects) is part of what the loader builds, so it is walked."""
    if hooks is not None and not (isinstance(hooks, dict) and not hooks and not getattr(hooks, "attrs", None)):
        t.attrs["_backward_hooks"] = hooks
    return t


def _rebuild_v2(args: tuple[Any, ...]) -> TensorRef:
    _arity(args, "_rebuild_tensor_v2", 6, 7)
    t = _strided(args)
    _requires_grad(args[4], t.dtype)
    _metadata(args[6] if len(args) > 6 else None)
    return _hooks(t, args[5])


def _rebuild_v3(args: tuple[Any, ...]) -> TensorRef:
    # torch.empty((0,), dtype=dtype).set_(storage._untyped_storage, ...): the storage is reinterpreted.
    _arity(args, "_rebuild_tensor_v3", 7, 8)
    storage = _storage(args[0])
    dtype = _dtype_of_global(args[6])
    itemsize = dtypes.get(dtype).itemsize
    offset = _int(args[1], "offset")
    shape, stride = _ints(args[2], "size"), _ints(args[3], "stride")
    typed = StorageRef(storage.key, dtype, storage.nbytes // itemsize, storage.location)
    _check_bounds(typed, dtype, offset, shape, stride)
    _requires_grad(args[4], dtype)
    _metadata(args[7] if len(args) > 7 else None)
    return TensorRef(typed, dtype, offset, shape, stride)


def _rebuild_parameter(args: tuple[Any, ...]) -> TensorRef:
    _arity(args, "_rebuild_parameter", 3)
    return _hooks(_parameter(args[0], args[1]), args[2])


def _rebuild_parameter_with_state(args: tuple[Any, ...]) -> TensorRef:
    _arity(args, "_rebuild_parameter_with_state", 4)
    t = _hooks(_parameter(args[0], args[1]), args[2])
    _apply_state(t, args[3])
    return t


def _parameter(data: Any, requires_grad: Any) -> TensorRef:
    t = _tensor(data, "a parameter's data")
    _requires_grad(requires_grad, t.dtype)
    # nn.Parameter(data) is a new object: the data's Python attributes do not come with it.
    return t.copy(kind="parameter", attrs={})


def _parameter_class(args: tuple[Any, ...]) -> TensorRef:
    # torch.nn.Parameter(data=None, requires_grad=True); with no data it wraps torch.empty(0) in the default dtype.
    if len(args) > 2:
        raise CheckpointError("Parameter called with more than two arguments")
    data = args[0] if args else None
    requires_grad = args[1] if len(args) > 1 else True
    if data is None:
        return TensorRef(None, "float32", 0, (0,), (1,), kind="parameter")
    return _parameter(data, requires_grad)


def _rebuild_from_type(args: tuple[Any, ...]) -> Any:
    # torch._tensor._rebuild_from_type_v2(func, new_type, args, state): tensor subclasses.
    _arity(args, "_rebuild_from_type_v2", 4)
    func, new_type, inner_args, state = args
    if not isinstance(func, Global) or not isinstance(inner_args, tuple):
        raise CheckpointError("malformed tensor-subclass rebuild call")
    inner = REDUCERS.get(func.qualname)
    if inner is None:
        return Opaque(func, inner_args)
    value = inner(inner_args)
    if not isinstance(value, TensorRef):
        raise CheckpointError(f"tensor-subclass rebuild through {func.qualname}, which does not make a tensor")
    # ret.as_subclass(new_type) when its type differs: a Parameter made a plain Tensor, or the reverse.
    value = value.copy()
    if isinstance(new_type, Global) and new_type.qualname == "torch.nn.parameter.Parameter":
        value.kind = "parameter"
    elif isinstance(new_type, Global) and new_type.qualname == "torch.Tensor":
        value.kind = "unknown"
    else:
        raise CheckpointError(f"a tensor rebuilt as {_short(new_type)}, a subclass whose state handling is not modelled")
    _apply_state(value, state)
    return value


def _rebuild_qtensor(args: tuple[Any, ...]) -> TensorRef:
    _arity(args, "_rebuild_qtensor", 7)
    t = _strided(args)
    _requires_grad(args[5], t.dtype)
    t.layout = "quantized"
    return t


def _rebuild_sparse(args: tuple[Any, ...]) -> TensorRef:
    _arity(args, "_rebuild_sparse_tensor", 2)
    layout, data = args
    if isinstance(layout, Global) and layout.module == "torch":
        layout = TorchLayout(layout.qualname)
    if not isinstance(layout, TorchLayout) or not isinstance(data, tuple):
        raise CheckpointError("malformed sparse tensor rebuild call")
    name = layout.removeprefix("torch.")
    if name == "sparse_coo" and len(data) in (3, 4):
        values, size = data[1], data[2]
    elif name in ("sparse_csr", "sparse_csc", "sparse_bsr", "sparse_bsc") and len(data) == 4:
        values, size = data[2], data[3]
    else:
        raise CheckpointError(f"sparse tensor of layout {name} with {len(data)} parts is not what torch rebuilds")
    values = _tensor(values, "a sparse tensor's values")
    parts = [p for p in data if isinstance(p, TensorRef)]
    return TensorRef(None, values.dtype, 0, _ints(size, "size"), None, layout=name, nbytes=sum(p.nbytes for p in parts))


def _rebuild_meta(args: tuple[Any, ...]) -> TensorRef:
    _arity(args, "_rebuild_meta_tensor_no_storage", 4)
    dtype = _dtype_of_global(args[0])
    _requires_grad(args[3], dtype)
    return TensorRef(None, dtype, 0, _ints(args[1], "size"), _ints(args[2], "stride", nonneg=False), layout="meta", nbytes=0)


def _rebuild_nested(args: tuple[Any, ...]) -> TensorRef:
    _arity(args, "_rebuild_nested_tensor", 4)
    buffer = _tensor(args[0], "a nested tensor's buffer")
    return buffer.copy(layout="nested", kind="unknown", attrs={})  # a new tensor viewing the buffer


def _rebuild_wrapper_subclass(args: tuple[Any, ...]) -> TensorRef:
    _arity(args, "_rebuild_wrapper_subclass", 8)
    cls = args[0]
    if not (isinstance(cls, Global) and cls.qualname in allowlist.WEIGHTS_ONLY_GLOBALS):
        raise CheckpointError(f"a wrapper tensor of class {_short(cls)}, whose behaviour is not modelled")
    dtype = _dtype_of_global(args[1])
    _requires_grad(args[7], dtype)
    return TensorRef(None, dtype, 0, _ints(args[2], "size"), _ints(args[3], "stride", nonneg=False), layout="wrapper", nbytes=0)


def _rebuild_from_cpu_tensor(args: tuple[Any, ...]) -> TensorRef:
    # data.to(dtype=dtype, device=device): the dtype the file asks for, not the storage's.
    _arity(args, "_rebuild_device_tensor_from_cpu_tensor", 4)
    data = _tensor(args[0], "the data of a device tensor")
    dtype = _dtype_of_global(args[1])
    _requires_grad(args[3], dtype)
    if dtype == data.dtype:
        return data.copy()  # .to() of the same dtype on the CPU returns the tensor itself
    return TensorRef(None, dtype, 0, data.shape, None, layout=data.layout)  # a new plain tensor


def _refuse(what: str) -> Reducer:
    def call(args: tuple[Any, ...]) -> Any:
        raise CheckpointError(f"{what}; what torch would build is not modelled, so the file is refused")

    return call


def _dict_class(cls: str) -> Reducer:
    def build(args: tuple[Any, ...]) -> DictObject:
        # OrderedDict(pairs or mapping), Counter(mapping): the constructor's own semantics for what
        # pickles hold; Counter over an iterable counts, which no checkpoint needs.
        if not args:
            return DictObject(cls)
        if len(args) > 1:
            raise CheckpointError(f"{cls} called with {len(args)} arguments")
        pairs = args[0]
        if isinstance(pairs, dict):
            return DictObject(cls, pairs)
        is_pairs = isinstance(pairs, (list, tuple)) and all(isinstance(p, (list, tuple)) and len(p) == 2 for p in pairs)
        if cls == "collections.OrderedDict" and is_pairs:
            try:
                return DictObject(cls, [(k, v) for k, v in pairs])
            except TypeError:
                raise CheckpointError("OrderedDict with an unhashable key") from None
        raise CheckpointError(f"malformed {cls} call")

    return build


def _size(args: tuple[Any, ...]) -> tuple[int, ...]:
    if len(args) > 1:
        raise CheckpointError("torch.Size called with more than one argument")
    return _ints(args[0], "size", nonneg=False) if args else ()


def _get_layout(args: tuple[Any, ...]) -> TorchLayout:
    if len(args) != 1 or not isinstance(args[0], str) or not args[0].startswith("torch."):
        raise CheckpointError("malformed torch.serialization._get_layout call")
    return TorchLayout(args[0])


def _codecs_encode(args: tuple[Any, ...]) -> bytes:
    # Protocol 2 spells bytes as _codecs.encode(text, "latin1").
    if len(args) == 2 and isinstance(args[0], str) and args[1] in ("latin1", "latin-1", "utf-8", "utf8", "ascii"):
        try:
            return args[0].encode(args[1])
        except UnicodeEncodeError:
            raise CheckpointError("_codecs.encode of text its codec cannot encode") from None
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


def _device(args: tuple[Any, ...]) -> Device:
    if not 1 <= len(args) <= 2 or not isinstance(args[0], str) or (len(args) == 2 and not isinstance(args[1], int)):
        raise CheckpointError("malformed torch.device call")
    return Device(":".join(str(a) for a in args))


def _first(args: tuple[Any, ...]) -> Any:
    if not args:
        raise CheckpointError("call without arguments")
    return args[0]


REDUCERS: dict[str, Reducer] = {
    "torch._utils._rebuild_tensor": _rebuild_v1,
    "torch._utils._rebuild_tensor_v2": _rebuild_v2,
    "torch._utils._rebuild_tensor_v3": _rebuild_v3,
    "torch._utils._rebuild_parameter": _rebuild_parameter,
    "torch._utils._rebuild_parameter_with_state": _rebuild_parameter_with_state,
    "torch._tensor._rebuild_from_type_v2": _rebuild_from_type,
    "torch._utils._rebuild_qtensor": _rebuild_qtensor,
    "torch._utils._rebuild_sparse_tensor": _rebuild_sparse,
    "torch._utils._rebuild_meta_tensor_no_storage": _rebuild_meta,
    "torch._utils._rebuild_nested_tensor": _rebuild_nested,
    "torch._utils._rebuild_wrapper_subclass": _rebuild_wrapper_subclass,
    "torch._utils._rebuild_device_tensor_from_cpu_tensor": _rebuild_from_cpu_tensor,
    "torch._utils._rebuild_device_tensor_from_numpy": _refuse("a tensor rebuilt from a numpy array"),
    "torch.nn.parameter.Parameter": _parameter_class,
    "collections.OrderedDict": _dict_class("collections.OrderedDict"),
    "collections.Counter": _dict_class("collections.Counter"),
    "torch.Size": _size,
    "torch.device": _device,
    "torch.serialization._get_layout": _get_layout,
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
    # Tensors and storages made by calling their classes (the legacy constructors): allowed by
    # weights_only, never written by torch.save, and each can make any dtype or size.
    **{name: _refuse(f"calls {name}") for name in allowlist.WEIGHTS_ONLY_GLOBALS if name.endswith(("Tensor", "Storage"))},
}

# NEWOBJ runs ``cls.__new__(cls, *args)``: dict and set classes come out empty (their __init__ fills them).
NEW_REDUCERS: dict[str, Reducer] = {
    **REDUCERS,
    "collections.OrderedDict": lambda args: DictObject("collections.OrderedDict"),
    "collections.Counter": lambda args: DictObject("collections.Counter"),
    "builtins.set": lambda args: set(),
    "builtins.bytearray": lambda args: bytearray(),
}


def _build_tensor(target: Any, state: Any) -> bool:
    if isinstance(target, TensorRef):
        # Tensor.__setstate__ (and weights_only's BUILD) call set_() or replace .data: a different tensor.
        raise CheckpointError("BUILD on a tensor would replace its data or storage (Tensor.__setstate__); refused")
    return False


def storage_loader(on_storage: Callable[[StorageRef], None] | None = None, *, legacy: bool = False) -> Callable[[Any], StorageRef]:
    """A persistent_load for torch's ``('storage', type, key, location, numel[, view])`` records.

    As torch.serialization does, a key seen before returns the storage made the first time, whatever
    type or size the later record claims; an empty storage is not remembered (the zip loader caches
    only storages with data, and the legacy one re-types an empty one), so each record types its own.
    """
    cache: dict[Any, StorageRef] = {}

    def load(pid: Any) -> StorageRef:
        if not isinstance(pid, tuple) or len(pid) < 5:
            raise CheckpointError(f"persistent id {_short(pid)} is not a storage record")
        typename = pid[0].decode("ascii", "replace") if isinstance(pid[0], bytes) else pid[0]
        if typename != "storage":
            raise CheckpointError(f"persistent id {_short(pid)} is not a storage record")
        if len(pid) != (6 if legacy else 5):
            raise CheckpointError(f"storage record has {len(pid)} fields, not {6 if legacy else 5}")
        _, kind, key, location, numel = pid[:5]
        if legacy and pid[5] is not None:
            raise CheckpointError("legacy storage views are not supported")
        if not isinstance(kind, Global):
            raise CheckpointError("storage record names no storage type")
        # torch's unpickler maps any global whose name holds "Storage" to that storage type by name.
        if kind.name == "UntypedStorage" and kind.module in ("torch", "torch.storage"):
            dtype = "uint8"
        elif kind.name in dtypes.STORAGE_CLASSES:
            dtype = dtypes.STORAGE_CLASSES[kind.name]
        else:
            raise CheckpointError(f"unknown storage type {kind.qualname}")
        if not isinstance(key, (str, int)) or isinstance(key, bool) or not isinstance(numel, int) or isinstance(numel, bool) or numel < 0:
            raise CheckpointError("storage record has a bad key or size")
        if not isinstance(location, (str, bytes)):
            raise CheckpointError("storage record has a bad location")
        ref = cache.get(key)
        if ref is None:
            ref = StorageRef(str(key), dtype, numel, location.decode("ascii", "replace") if isinstance(location, bytes) else location)
            if ref.nbytes:
                cache[key] = ref
            if on_storage is not None:
                on_storage(ref)
        return ref

    return load


def torch_vm(
    data: Any,
    *,
    source: str | None,
    on_storage: Callable[[StorageRef], None] | None = None,
    legacy: bool = False,
    persistent: bool = True,
    encoding: str = "utf-8",
    torch_load: bool = True,
) -> PickleVM:
    """The interpreter as torch.load runs it: torch's rebuilds, its storage records, its encoding, and
    (``torch_load``) the module renames its unpickler applies; ``pickle.load`` applies none."""
    return PickleVM(
        data,
        reducers=REDUCERS,
        new_reducers=NEW_REDUCERS,
        builder=_build_tensor,
        persistent_load=storage_loader(on_storage, legacy=legacy) if persistent else None,
        source=source,
        encoding=encoding,
        module_renames=TORCH_LOAD_MODULE_RENAMES if torch_load else None,
        track_global=_is_storage_type if persistent else None,
    )


def _is_storage_type(g: Global) -> bool:
    # what storage_loader accepts as a storage type (torch's unpickler maps any global named *Storage to one)
    return "Storage" in g.name


def storage_sites(vm: PickleVM) -> dict[str, Any]:
    """What a run of ``vm`` (from :func:`torch_vm`) learnt of where its storage types are named, as ``Layout``'s
    ``storage_sites``, ``storage_type_pushes`` and ``pickle_frames``: what conversion edits to retype a storage
    without running the pickle again (formats/picklesplice.py)."""
    sites = tuple(
        (at, str(pid[2]), pid[1].name, none_at)
        for pid, at, none_at in zip(vm.persistent_ids, vm.type_pushed_at, vm.none_pushed_at, strict=True)
    )
    used = {s[0] for s in sites}
    pushes = tuple(tuple(p) for p in vm.pushes.values() if used.intersection(p))
    return {"storage_sites": sites, "storage_type_pushes": pushes, "pickle_frames": tuple(vm.frames)}


def non_tensor_entries(root: Any, limit: int = 4) -> tuple[str, ...]:
    """The first ``limit`` entries of ``root`` that are not tensors, dicts walked (an OrderedDict's attributes are
    not entries), as dotted key paths; ``<root>`` when the root itself is neither."""
    found: list[str] = []

    def walk(value: Any, name: str) -> None:
        if isinstance(value, TensorRef) or len(found) >= limit:
            return
        if isinstance(value, dict):
            for key, item in value.items():
                walk(item, f"{name}.{key}" if name else str(key))
        else:
            found.append(name or "<root>")

    walk(root, "")
    return tuple(found)


# torch/serialization.py's load_module_mapping, applied by UnpicklerWrapper.find_class (weights_only=False).
TORCH_LOAD_MODULE_RENAMES = {"torch.tensor": "torch._tensor"}


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
