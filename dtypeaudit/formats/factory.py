"""Build a model from code the user names (``path/to/file.py:func``, ``pkg.module:func``, ``pkg.module:Class``).

This is the one place user code runs, because the user asked for it. The model is built on the meta
device where the factory allows it, so no memory is spent on weights.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import traceback
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..errors import FactoryError
from ..inventory import Inventory, TensorRecord, link_shared_storage

# Prefixes that training code wraps a state_dict in: Lightning's ``state_dict``, a plain ``model``,
# DDP's ``module``, torch.compile's ``_orig_mod``.
WRAPPER_PREFIXES = ("state_dict.", "model.", "module.", "_orig_mod.", "net.", "network.")


def looks_like_factory(target: str) -> bool:
    """``x.py:func`` or ``a.b:func`` (and not a Windows drive or an existing path)."""
    if ":" not in target or Path(target).exists():
        return False
    module, _, attr = target.rpartition(":")
    return bool(module) and attr.isidentifier()


def _import(module: str) -> Any:
    if module.endswith(".py") or "/" in module or "\\" in module:
        file = Path(module)
        if not file.is_file():
            raise FactoryError(f"no such script '{module}'")
        name = f"_dtypeaudit_user_{abs(hash(str(file.resolve())))}"
        spec = importlib.util.spec_from_file_location(name, file)
        if spec is None or spec.loader is None:
            raise FactoryError(f"cannot load '{module}' as a Python script")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        sys.path.insert(0, str(file.resolve().parent))
        try:
            spec.loader.exec_module(mod)
        finally:
            sys.path.remove(str(file.resolve().parent))
        return mod
    if "" not in sys.path and "." not in sys.path:
        sys.path.insert(0, "")
    return importlib.import_module(module)


def build(target: str) -> Any:
    """Call the factory and return the ``torch.nn.Module`` it makes, built on the meta device if it can be."""
    import torch

    module_name, _, attr = target.rpartition(":")
    try:
        mod = _import(module_name)
    except FactoryError:
        raise
    except ModuleNotFoundError as exc:
        raise FactoryError(f"cannot import '{module_name}' ({exc}); is it on PYTHONPATH?", path=target) from None
    except Exception as exc:  # the user's module failed while importing
        raise FactoryError(f"importing '{module_name}' failed: {_last_frame(exc)}", path=target) from None
    fn = getattr(mod, attr, None)
    if fn is None or not callable(fn):
        raise FactoryError(f"'{module_name}' has no callable '{attr}'", path=target)
    try:
        with torch.device("meta"):
            model = fn()
    except Exception:
        try:
            model = fn()
        except Exception as exc:
            raise FactoryError(f"calling '{attr}()' failed: {_last_frame(exc)}", path=target) from None
    if not isinstance(model, torch.nn.Module):
        raise FactoryError(f"'{attr}()' returned a {type(model).__name__}, not a torch.nn.Module", path=target)
    return model


def _last_frame(exc: BaseException) -> str:
    return traceback.format_exception_only(type(exc), exc)[-1].strip()


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def inventory(target: str) -> Inventory:
    """The model's parameters and buffers, with kind and owning module type known exactly."""
    model = build(target)
    owners = {name: type(m).__name__ for name, m in model.named_modules()}
    records: list[TensorRecord] = []
    storage_ids: dict[int, str] = {}

    def add(items: Iterable[tuple[str, Any]], kind: str) -> None:
        for name, t in items:
            owner = owners.get(name.rpartition(".")[0])
            key = storage_ids.setdefault(id(t), str(len(storage_ids)))
            meta = t.device.type == "meta"
            records.append(
                TensorRecord(
                    name=name,
                    dtype=_dtype_name(t.dtype),
                    shape=tuple(t.shape),
                    nbytes=t.numel() * t.element_size(),
                    kind=kind,  # type: ignore[arg-type]
                    storage=key,
                    layout="strided",
                    module=owner,
                    stride=None if meta else tuple(t.stride()),
                )
            )

    add(model.named_parameters(remove_duplicate=False), "parameter")
    add(model.named_buffers(remove_duplicate=False), "buffer")
    return Inventory(target, "factory", link_shared_storage(records), (), {"model_class": type(model).__name__})


def attach(checkpoint: Inventory, model: Inventory) -> Inventory:
    """Give each checkpoint tensor the kind and module type the model knows it by.

    A common wrapper prefix (``model.``, ``state_dict.``, ``module.``) is recognised, so a Lightning
    ``.ckpt`` matches the bare module.
    """
    known = {t.name: t for t in model.tensors}
    out = []
    for t in checkpoint.tensors:
        match = _match(t.name, known) if t.region == "model" else None
        out.append(t.with_(kind=match.kind, module=match.module) if match else t)
    return Inventory(checkpoint.path, checkpoint.format, tuple(out), checkpoint.findings, {**checkpoint.metadata, "model": model.path})


def _match(name: str, known: dict[str, TensorRecord]) -> TensorRecord | None:
    if name in known:
        return known[name]
    rest = name
    for _ in range(3):
        for prefix in WRAPPER_PREFIXES:
            if rest.startswith(prefix):
                rest = rest[len(prefix) :]
                if rest in known:
                    return known[rest]
                break
        else:
            return None
    return None
