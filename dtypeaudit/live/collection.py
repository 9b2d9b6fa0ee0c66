"""Collecting a live object's tensors: an ``Inventory`` of ``TensorRecord``s from each tensor's metadata only."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from .. import dtypes
from ..inventory import Inventory, TensorRecord, link_shared_storage

LIVE_FORMAT = "live"
# Lightning wraps optimizers in LightningOptimizer (``_optimizer``), Accelerate in AcceleratedOptimizer (``optimizer``).
_OPTIMIZER_WRAPPERS = ("_optimizer", "optimizer")


@dataclass(frozen=True)
class FirstLayer:
    """The first module of an audited model that holds floating parameters: what the batch meets first."""

    name: str
    """Its name in the model (``conv1``, ``model.embed_tokens``)."""
    type_name: str
    dtype: str
    """The dtype of its weight (or first floating parameter)."""


@dataclass(frozen=True)
class LiveInventory:
    """What ``collect`` found: the inventory of every tensor and which of them form the batch."""

    inventory: Inventory
    """Every tensor: modules, optimizer state, scaler, batch."""
    batch: frozenset[str] = frozenset()
    """Names of the batch's tensors."""
    first_layer: FirstLayer | None = None
    """The first layer of the (first) module audited, if any."""

    def part(self, batch: bool) -> Inventory:
        """The batch's tensors (``batch=True``), or everything else."""
        inv = self.inventory
        return replace(inv, tensors=tuple(t for t in inv.tensors if (t.name in self.batch) == batch))


@dataclass
class _Collector:
    records: list[TensorRecord] = field(default_factory=list)
    batch: list[str] = field(default_factory=list)
    param_names: dict[int, str] = field(default_factory=dict)
    devices: Counter[str] = field(default_factory=Counter)
    frozen: int = 0
    first_layer: FirstLayer | None = None

    def add(self, name: str, t: Any, *, kind: str = "unknown", region: str = "model", module: str | None = None) -> None:
        """One tensor, from its metadata: no element is read or copied, whatever its device."""
        device = t.device.type
        layout = dtypes.name_of(t.layout)
        try:
            stride: tuple[int, ...] | None = tuple(t.stride())
        except (RuntimeError, NotImplementedError):  # sparse layouts have no strides
            stride = None
        if getattr(t, "is_quantized", False):
            layout = "quantized"
        storage = f"id:{id(t)}"
        if device != "meta" and layout == "strided":
            try:
                ptr = t.untyped_storage().data_ptr()
            except (RuntimeError, NotImplementedError, TypeError):  # tensor subclasses without one storage
                ptr = 0
            if ptr:
                storage = f"{device}:{ptr}"
        self.records.append(
            TensorRecord(
                name=name,
                dtype=dtypes.name_of(t.dtype),
                shape=tuple(t.shape),
                nbytes=t.numel() * t.element_size(),
                kind=kind,  # type: ignore[arg-type]
                storage=storage,
                offset=_offset(t),
                stride=stride,
                layout=layout,
                region=region,  # type: ignore[arg-type]
                module=module,
            )
        )
        self.devices[device] += 1
        if getattr(t, "requires_grad", False) is False and kind == "parameter":
            self.frozen += 1


def _offset(t: Any) -> int:
    try:
        return int(t.storage_offset())
    except (RuntimeError, NotImplementedError):
        return 0


def _join(prefix: str, name: object) -> str:
    return f"{prefix}.{name}" if prefix else str(name)


def _module(c: _Collector, prefix: str, m: Any) -> None:
    owners = {name: type(sub).__name__ for name, sub in m.named_modules(remove_duplicate=False)}
    for name, p in m.named_parameters(remove_duplicate=False):
        full = _join(prefix, name)
        c.param_names.setdefault(id(p), full)
        c.add(full, p, kind="parameter", module=owners.get(name.rpartition(".")[0]))
    for name, b in m.named_buffers(remove_duplicate=False):
        c.add(_join(prefix, name), b, kind="buffer", module=owners.get(name.rpartition(".")[0]))
    if c.first_layer is None:
        c.first_layer = first_layer(m, prefix)


def first_layer(m: Any, prefix: str = "") -> FirstLayer | None:
    """The first submodule, in registration order, that holds a floating parameter of its own."""
    for name, sub in m.named_modules():
        own = [(n, p) for n, p in sub.named_parameters(recurse=False) if p.dtype.is_floating_point]
        if own:
            weight = next((p for n, p in own if n == "weight"), own[0][1])
            return FirstLayer(_join(prefix, name) or type(sub).__name__, type(sub).__name__, dtypes.name_of(weight.dtype))
    return None


def _optimizer(c: _Collector, prefix: str, opt: Any) -> None:
    index = 0
    for g, group in enumerate(opt.param_groups):
        for p in group["params"]:
            pname = c.param_names.get(id(p), str(index))
            index += 1
            for key, value in opt.state.get(p, {}).items():
                if _is_tensor(value):
                    c.add(_join(prefix, f"state.{pname}.{key}"), value, region="optimizer")
        for key, value in group.items():
            if key != "params" and _is_tensor(value):
                c.add(_join(prefix, f"param_groups.{g}.{key}"), value, region="optimizer")


def _scaler(c: _Collector, prefix: str, scaler: Any) -> None:
    for attr, name in (("_scale", "scale"), ("_growth_tracker", "growth_tracker")):
        value = getattr(scaler, attr, None)
        if _is_tensor(value):
            c.add(_join(prefix, name), value, region="optimizer")


def _is_tensor(value: object) -> bool:
    import torch

    return isinstance(value, torch.Tensor)


def _batch(c: _Collector, prefix: str, obj: Any, depth: int = 0) -> None:
    if depth > 64:
        return
    if _is_tensor(obj):
        name = prefix or "batch"
        c.add(name, obj)
        c.batch.append(name)
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            _batch(c, _join(prefix, k), v, depth + 1)
    elif isinstance(obj, (list, tuple)):
        fields = getattr(obj, "_fields", None)  # a namedtuple: its field names
        for i, v in enumerate(obj):
            _batch(c, _join(prefix, fields[i] if fields else i), v, depth + 1)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            _batch(c, _join(prefix, f.name), getattr(obj, f.name, None), depth + 1)


def _kind_of(obj: Any) -> str:
    """``module``, ``optimizer``, ``scaler`` or ``batch``."""
    import torch

    if isinstance(obj, torch.nn.Module):
        return "module"
    if isinstance(obj, torch.optim.Optimizer) or any(isinstance(getattr(obj, a, None), torch.optim.Optimizer) for a in _OPTIMIZER_WRAPPERS):
        return "optimizer"
    if isinstance(obj, torch.amp.GradScaler):
        return "scaler"
    return "batch"


def _unwrap_optimizer(obj: Any) -> Any:
    import torch

    if isinstance(obj, torch.optim.Optimizer):
        return obj
    return next(getattr(obj, a) for a in _OPTIMIZER_WRAPPERS if isinstance(getattr(obj, a, None), torch.optim.Optimizer))


def _parts(obj: Any) -> list[tuple[str, Any]]:
    """``(name prefix, object)`` pairs: a dict's values under their keys, anything else under no prefix."""
    if isinstance(obj, Mapping) and any(_kind_of(v) != "batch" for v in obj.values()):
        return [(str(k), v) for k, v in obj.items()]
    return [("", obj)]


def collect(obj: Any, *, label: str | None = None, parts: Iterable[tuple[str, Any]] | None = None) -> LiveInventory:
    """Every tensor of ``obj`` (see the module's docstring), read from metadata only.

    ``parts`` gives ``(prefix, object)`` pairs directly (the callbacks name a model's tensors without a prefix,
    its optimizer's under ``optimizer.``); otherwise a dict that holds a module, optimizer or scaler is split
    into its values, and anything else is one object.
    """
    import torch

    items = list(parts) if parts is not None else _parts(obj)
    kinds = [(_kind_of(o), p, o) for p, o in items]
    c = _Collector()
    # Modules first, so that optimizer state can be named after their parameters.
    order = {"module": 0, "optimizer": 1, "scaler": 2, "batch": 3}
    for kind, prefix, o in sorted(kinds, key=lambda k: order[k[0]]):
        if kind == "module":
            _module(c, prefix, o)
        elif kind == "optimizer":
            _optimizer(c, prefix, _unwrap_optimizer(o))
        elif kind == "scaler":
            _scaler(c, prefix, o)
        else:
            _batch(c, prefix, o)
    metadata: dict[str, object] = {
        "default_dtype": dtypes.name_of(torch.get_default_dtype()),
        "devices": dict(c.devices),
        "objects": {p or "": k for k, p, _ in kinds},
    }
    if c.frozen:
        metadata["frozen_parameters"] = c.frozen
    if c.first_layer is not None:
        metadata["first_layer"] = dataclasses.asdict(c.first_layer)
    if label is None:
        label = describe(obj) if parts is None else "<" + ", ".join(f"{p or 'model'}: {type(o).__name__}" for p, o in items) + ">"
    inv = Inventory(label, LIVE_FORMAT, link_shared_storage(c.records), (), metadata)
    return LiveInventory(inv, frozenset(c.batch), c.first_layer)


def describe(obj: Any) -> str:
    if isinstance(obj, Mapping):
        return "<" + ", ".join(f"{k}: {type(v).__name__}" for k, v in obj.items()) + ">"
    return f"<{type(obj).__name__}>"


def inventory(obj: Any, *, label: str | None = None) -> Inventory:
    """The inventory of every tensor in ``obj``: the same records ``read`` gives for a checkpoint, format ``live``."""
    return collect(obj, label=label).inventory
