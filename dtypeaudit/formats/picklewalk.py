"""The object graph of an interpreted torch pickle: :func:`children` is the one traversal, :func:`walk` names
every tensor, :func:`tensor_records` turns what it found into the inventory's records."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import LimitExceeded
from ..inventory import Region, TensorRecord, link_shared_storage
from .picklevm import DictObject, Global, Opaque
from .torchrebuild import StorageRef, TensorRef


def _key_part(key: Any, index: int) -> str | None:
    """How a dict key reads in a tensor name; None for keys that are objects (tensors, tuples, ...)."""
    if isinstance(key, str):
        return key
    if isinstance(key, (int, float, complex, bytes)) or key is None:
        return str(key)
    if isinstance(key, Global):
        return key.qualname
    if isinstance(key, tuple) and all(_key_part(k, 0) is not None and not isinstance(k, Global) for k in key):
        return str(key)  # a tuple of plain values reads as Python prints it: ('t', 1)
    return None


def children(value: Any) -> Iterator[tuple[str, Any, bool]]:
    """The values directly inside ``value`` as ``(name part, child, is_state)``: the one traversal.

    Dict keys that are objects (a tensor used as a key) come out as ``__key<i>__`` with their value
    at ``__value<i>__``; a dict class's attributes under ``__dict__``; an opaque object's arguments
    as ``__arg<i>__``. ``is_state`` marks what lives in an opaque object's or a tensor's state.
    """
    if isinstance(value, TensorRef):
        for k, v in value.attrs.items():
            yield k, v, True
    elif isinstance(value, dict):
        for i, (k, v) in enumerate(value.items()):
            part = _key_part(k, i)
            if part is None:
                yield f"__key{i}__", k, False
                part = f"__value{i}__"
            yield part, v, False
        if isinstance(value, DictObject) and value.attrs:
            yield "__dict__", value.attrs, True
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield str(i), v, False
    elif isinstance(value, (set, frozenset)):
        for i, v in enumerate(value):
            yield str(i), v, False
    elif isinstance(value, Opaque):
        yield from children(value.items)
        for i, v in enumerate(value.list_items):
            yield str(i), v, True
        if isinstance(value.state, dict):
            for k, v in value.state.items():
                yield (k if isinstance(k, str) else str(k)), v, True
        elif value.state is not None:
            yield "__state__", value.state, True
        for i, v in enumerate(value.args):
            yield f"__arg{i}__", v, True


@dataclass(frozen=True)
class Found:
    """A tensor reached at ``name``; ``owner`` is the opaque object whose state holds it directly."""

    name: str
    tensor: TensorRef
    region: Region
    owner: Opaque | None


def is_optimizer_state(value: Any) -> bool:
    """A torch optimizer's state_dict: ``state`` and ``param_groups`` side by side."""
    keys: Any = value.items if isinstance(value, Opaque) else value
    return isinstance(keys, Mapping) and "state" in keys and "param_groups" in keys


def is_module_state(value: Any) -> bool:
    """An ``nn.Module`` pickled whole: its instance dict has ``_parameters`` and ``_modules``."""
    return isinstance(value, Opaque) and isinstance(value.state, dict) and "_parameters" in value.state and "_modules" in value.state


def walk(
    root: Any, *, max_visits: int = 1_000_000, max_depth: int = 200, on_object: Callable[[Opaque], None] | None = None
) -> Iterator[Found]:
    """Every tensor under ``root`` with its dotted key path, in pickle order.

    Shared sub-objects are walked once per path, as torch.load would show them; the visit and
    depth caps stop reference bombs (the billion-laughs shape) from costing more than a real file.
    """
    visits = 0
    bare: dict[int, TensorRef] = {}  # the storages are held by ``root`` while this runs, so their ids stay theirs

    def go(value: Any, name: str, region: Region, owner: Opaque | None, depth: int) -> Iterator[Found]:
        nonlocal visits
        visits += 1
        if visits > max_visits:
            raise LimitExceeded("the pickle's references fan out into too many paths (a reference bomb?)")
        if depth > max_depth:
            raise LimitExceeded(f"the pickle nests deeper than {max_depth} levels")
        if isinstance(value, TensorRef):
            yield Found(name, value, region, owner)
        elif isinstance(value, StorageRef):
            # torch.load returns a bare storage as a TypedStorage of its record's type: listed as one, so a policy sees it
            if id(value) not in bare:  # one object under every name, as the storage is
                bare[id(value)] = TensorRef(value, value.dtype, 0, (value.numel,), (1,), layout="storage")
            yield Found(name, bare[id(value)], region, owner)
        elif isinstance(value, Opaque) and on_object is not None:
            on_object(value)
        inner: Region = "optimizer" if is_optimizer_state(value) else region
        this = value if isinstance(value, Opaque) else None
        for part, child, is_state in children(value):
            if isinstance(child, (str, int, float, bytes, bool)) or child is None:
                continue
            yield from go(child, f"{name}.{part}" if name else part, inner, this if is_state else None, depth + 1)

    yield from go(root, "", "model", None, 0)


def tensor_records(found: list[Found], *, module_of: Callable[[Found], tuple[str | None, str]] | None = None) -> tuple[TensorRecord, ...]:
    """The inventory's records for the tensors :func:`walk` found, with shared storages linked."""
    out = []
    for f in found:
        t = f.tensor
        module, kind = module_of(f) if module_of else (None, t.kind)
        out.append(
            TensorRecord(
                name=f.name,
                dtype=t.dtype,
                shape=t.shape,
                nbytes=t.nbytes,
                kind=kind,  # type: ignore[arg-type]
                storage=t.storage.key if t.storage else None,
                offset=t.offset,
                stride=t.stride,
                layout=t.layout,
                region=f.region,
                module=module,
            )
        )
    # A tensor with no storage record of its own (a cast, a wrapper) is still one object under each of its names.
    fresh: dict[int, list[int]] = {}
    for i, f in enumerate(found):
        if f.tensor.storage is None:
            fresh.setdefault(id(f.tensor), []).append(i)
    linked = list(link_shared_storage(out))
    for indices in fresh.values():
        for i in indices:
            linked[i] = linked[i].with_(shares_with=tuple(out[j].name for j in indices if j != i))
    return tuple(linked)
