"""Inputs for the traced forward: ``--input`` specs, or a factory of inputs, made as fake tensors.

A spec is ``[NAME=]SHAPE[:DTYPE]``: ``8x3x224x224:float16`` (positional), ``input_ids=1x128:int64`` (a keyword),
``scalar:float32`` for a 0-dim tensor. Without a dtype, ids, labels and masks are int64 and anything else takes the
default dtype (``--default-dtype``, else float32).
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from typing import Any

from .. import dtypes
from ..errors import FactoryError, UsageError
from .result import InputRecord

_INTEGER_NAMES = re.compile(r"(^|_)(ids|labels|mask|indices|index|positions)$")
_SPEC = re.compile(r"^(?:(?P<name>[A-Za-z_]\w*)=)?(?P<shape>scalar|\d+(?:x\d+)*)(?::(?P<dtype>[\w.]+))?$")
DEFAULT_SEQUENCE = 128


@dataclass(frozen=True)
class InputSpec:
    name: str | None
    shape: tuple[int, ...]
    dtype: str | None


def parse(spec: str) -> InputSpec:
    m = _SPEC.match(spec.strip())
    if not m:
        raise UsageError(
            f"--input '{spec}': expected [NAME=]SHAPE[:DTYPE], e.g. 8x3x224x224:float16 or input_ids=1x128:int64 (scalar for 0-dim)"
        )
    shape = () if m["shape"] == "scalar" else tuple(int(d) for d in m["shape"].split("x"))
    dtype = None
    if m["dtype"]:
        dtype = dtypes.canonical(m["dtype"])
        if dtype is None:
            raise UsageError(f"--input '{spec}': unknown dtype '{m['dtype']}' (float32, float16, bfloat16, int64, bool, fp16, bf16 ...)")
    return InputSpec(m["name"], shape, dtype)


def dtype_for(spec: InputSpec, default: str) -> str:
    if spec.dtype:
        return spec.dtype
    return "int64" if spec.name and _INTEGER_NAMES.search(spec.name) else default


def make(specs: list[InputSpec], default: str) -> tuple[tuple[Any, ...], dict[str, Any], tuple[InputRecord, ...]]:
    """Tensors for the specs, made under the caller's FakeTensorMode: positional ones in order, named ones as keywords."""
    import torch

    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    records = []
    for spec in specs:
        name = dtype_for(spec, default)
        dtype = getattr(torch, name)
        t = torch.zeros(spec.shape, dtype=dtype) if not dtype.is_floating_point else torch.empty(spec.shape, dtype=dtype)
        if spec.name:
            if spec.name in kwargs:
                raise UsageError(f"--input {spec.name}= is given twice")
            kwargs[spec.name] = t
        else:
            args.append(t)
        records.append(InputRecord(spec.name, spec.shape, name))
    return tuple(args), kwargs, tuple(records)


def from_factory(target: str) -> tuple[tuple[Any, ...], dict[str, Any], tuple[InputRecord, ...]]:
    """Call ``file.py:func`` (under the caller's FakeTensorMode): a tensor, a tuple/list of them (positional),
    a dict (keywords), or ``(args, kwargs)``."""
    import torch

    from ..formats import factory

    module_name, _, attr = target.rpartition(":")
    if not module_name or not attr.isidentifier():
        raise UsageError(f"--input-factory '{target}': expected path/to/file.py:func or package.module:func")
    try:
        fn = getattr(factory.import_user_module(module_name), attr, None)
    except FactoryError:
        raise
    except Exception as exc:
        raise FactoryError(f"importing '{module_name}' failed: {type(exc).__name__}: {exc}", path=target) from None
    if fn is None or not callable(fn):
        raise FactoryError(f"'{module_name}' has no callable '{attr}'", path=target)
    try:
        value = fn()
    except Exception as exc:
        raise FactoryError(f"calling '{attr}()' failed: {type(exc).__name__}: {exc}", path=target) from None
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = {}
    if isinstance(value, torch.Tensor):
        args = (value,)
    elif isinstance(value, dict):
        args, kwargs = (), dict(value)
    elif isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], (tuple, list)) and isinstance(value[1], dict):
        args, kwargs = tuple(value[0]), dict(value[1])
    elif isinstance(value, (tuple, list)):
        args = tuple(value)
    else:
        raise FactoryError(f"'{attr}()' returned a {type(value).__name__}; return a tensor, a tuple, a dict or (args, kwargs)", path=target)
    records = tuple(
        InputRecord(name, tuple(t.shape), dtypes.name_of(t.dtype))
        for name, t in [*((None, a) for a in args), *kwargs.items()]
        if isinstance(t, torch.Tensor)
    )
    return args, kwargs, records


def default_specs(model: Any, source: str) -> list[InputSpec]:
    """What to feed a model when no ``--input`` is given: token ids for a Hugging Face model; nothing otherwise."""
    if source != "transformers":
        raise UsageError("give the model's input: --input SHAPE[:DTYPE] (e.g. --input 8x3x224x224:float16), or --input-factory")
    config = getattr(model, "config", None)
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None) or DEFAULT_SEQUENCE
    main = getattr(model, "main_input_name", "input_ids")
    if main != "input_ids":
        raise UsageError(f"this model takes {main}; give it with --input {main}=SHAPE[:DTYPE]")
    return [InputSpec("input_ids", (1, min(DEFAULT_SEQUENCE, int(limit))), "int64")]


def add_labels(model: Any, kwargs: dict[str, Any]) -> bool:
    """For ``--backward`` on a Hugging Face model: ``labels=input_ids`` so the model computes its own loss, as in training."""
    if "labels" in kwargs or "input_ids" not in kwargs:
        return False
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    if "labels" not in params:
        return False
    kwargs["labels"] = kwargs["input_ids"]
    return True
