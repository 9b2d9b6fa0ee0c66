"""Build a model from code the user names (``path/to/file.py:func``, ``pkg.module:func``, ``pkg.module:Class``).

This is the one place user code runs, because the user asked for it. The model is built on the meta
device where the factory allows it, so no memory is spent on weights. The forward of each weight-only norm
class that is not PyTorch's own (transformers' LlamaRMSNorm, T5LayerNorm, GemmaRMSNorm ...) is run on the
meta device too, to measure which dtype it returns (``probe_norms``).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import traceback
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import FactoryError
from ..inventory import Finding, Inventory, TensorRecord, link_shared_storage
from ..structure import MEASURED_DTYPES, is_torch_type
from ..structure import WRAPPER_PREFIXES as WRAPPER_PREFIXES  # structure owns the list; diff reads it here


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
    metadata: dict[str, object] = {"model_class": type(model).__name__}
    probes = probe_norms(model)
    if probes:
        metadata["module_forward"] = probes
    return Inventory(target, "factory", link_shared_storage(records), (), metadata)


def probe_norms(model: Any) -> dict[str, dict[str, str]]:
    """Type name -> ``{"{weight dtype}/{input dtype}": output dtype}`` for each weight-only norm class that is
    not PyTorch's own, from its own forward run on the meta device (no memory, no values).

    Whether a norm hands on its input's dtype or its weight's decides whether an fp32 norm in a half model
    runs: transformers' LlamaRMSNorm returns ``weight * x.to(input_dtype)`` (float32), GemmaRMSNorm casts back.
    Names cannot tell them apart; their forwards can. A class whose forward fails on the meta device for any
    combination (it needs more arguments, or real values) is left out: nothing is claimed for it.
    """
    out: dict[str, dict[str, str]] = {}
    tried: set[str] = set()
    for m in model.modules():
        name = type(m).__name__
        if name in tried or is_torch_type(name) or next(m.children(), None) is not None:
            continue
        own = {**dict(m.named_parameters(recurse=False)), **dict(m.named_buffers(recurse=False))}
        weight = own.get("weight")
        if set(own) != {"weight"} or weight is None or weight.ndim != 1 or not weight.is_floating_point():
            continue
        tried.add(name)
        table = _probe(m, int(weight.shape[0]))
        if table is not None:
            out[name] = table
    return out


def _probe(m: Any, width: int) -> dict[str, str] | None:
    import copy

    import torch

    table: dict[str, str] = {}
    try:
        for p in MEASURED_DTYPES:
            probe = copy.deepcopy(m).to(device="meta", dtype=getattr(torch, p))
            for x in MEASURED_DTYPES:
                with torch.no_grad():
                    y = probe(torch.empty(2, width, dtype=getattr(torch, x), device="meta"))
                if not isinstance(y, torch.Tensor):
                    return None
                table[f"{p}/{x}"] = _dtype_name(y.dtype)
    except Exception:  # the user's forward: whatever it raises, it measured nothing
        return None
    return table


def attach(checkpoint: Inventory, model: Inventory) -> Inventory:
    """Give each checkpoint tensor the kind and module type the model knows it by.

    Names are matched through a prefix the checkpoint adds (``model_state_dict.``, ``state_dict.``,
    ``module.``, ``_orig_mod.`` and any nesting of them, or any other prefix under which most of the
    model's names appear, such as an EMA copy), or one the model adds (a LightningModule's ``net.``
    around a bare state_dict). When fewer than half of the checkpoint's model tensors match, the
    inventory gains a ``model-mismatch`` error that shows the closest prefix: module rules and
    kinds would otherwise apply to a few tensors in silence.
    """
    mapping = match_names(checkpoint, model)
    known = {t.name: t for t in model.tensors}
    out = []
    for t in checkpoint.tensors:
        hit = mapping.matched.get(t.name)
        match = known[hit] if hit is not None else None
        out.append(t.with_(kind=match.kind, module=match.module) if match else t)
    findings = checkpoint.findings
    if mapping.total and len(mapping.matched) * 2 < mapping.total:
        findings = (*findings, Finding("model-mismatch", "error", mapping.message(model.path)))
    metadata = {**checkpoint.metadata, "model": model.path}
    if "module_forward" in model.metadata:
        metadata["module_forward"] = model.metadata["module_forward"]  # the forwards --model measured
    return Inventory(checkpoint.path, checkpoint.format, tuple(out), findings, metadata, checkpoint.layout)


@dataclass(frozen=True)
class NameMatch:
    """How a checkpoint's model-region names map onto a factory's."""

    matched: dict[str, str]
    """Checkpoint name -> the model's name for it."""
    total: int
    """Tensors in the checkpoint's model region."""
    prefixes: tuple[tuple[str, str, int, int], ...]
    """``(checkpoint prefix, model prefix, names it explains, of which same shape)``, most names first: every rewrite tried."""
    example: tuple[str, str] | None
    """A checkpoint name and a model name that no accepted rewrite relates, for the message."""

    def message(self, model_path: str) -> str:
        share = len(self.matched) / self.total
        text = (
            f"--model {model_path}: its names match {len(self.matched)} of the {self.total} model tensors in this checkpoint "
            f"({share:.0%}); kinds and module rules apply to those only"
        )
        useful = [(p, q, n, same) for p, q, n, same in self.prefixes if (p or q) and n]
        if useful:
            p, q, n, same = useful[0]
            text += f". Closest prefix: {_rewrite(p, q)} matches {n} name(s)"
            if same < n:
                text += f", {'none' if not same else f'only {same}'} with the model's shape"
        if self.example:
            text += f". Checkpoint names look like '{self.example[0]}', the model's like '{self.example[1]}'"
        return text + "; is it the model this checkpoint was saved from?"


def _rewrite(p: str, q: str) -> str:
    if p and q:
        return f"reading '{p}' as '{q}'"
    return f"stripping '{p}'" if p else f"adding '{q}'"


def _boundaries(name: str) -> Iterator[int]:
    """0 and every position just after a dot: where a dotted tail starts."""
    yield 0
    at = name.find(".")
    while at >= 0:
        yield at + 1
        at = name.find(".", at + 1)


def _is_wrapper(prefix: str) -> bool:
    """Whether ``prefix`` is only wrapper segments (``model_state_dict.module._orig_mod.``)."""
    rest = prefix
    while rest:
        for w in WRAPPER_PREFIXES:
            if rest.startswith(w):
                rest = rest[len(w) :]
                break
        else:
            return False
    return True


def match_names(checkpoint: Inventory, model: Inventory) -> NameMatch:
    """Map the checkpoint's model-region names to the model's, through the prefixes that explain most of them.

    A rewrite is ``(P, Q)``: the checkpoint's ``P + tail`` is the model's ``Q + tail``, with the same shape.
    Q is ``""`` or a prefix most of the model's names share; P is a dotted head of the checkpoint's name.
    A rewrite is accepted when P is wrapper segments only and Q is ``""``, or when it explains at least
    half of the smaller side (so an EMA copy under ``ema.`` matches too, and a stray tail such as
    ``0.weight`` of another model does not).
    """
    known = {t.name: t.shape for t in model.tensors}
    tensors = [t for t in checkpoint.tensors if t.region == "model"]
    if not known or not tensors:
        return NameMatch({}, len(tensors), (), None)
    heads: Counter[str] = Counter()
    for k in known:
        for at in _boundaries(k):
            if at:
                heads[k[:at]] += 1
    model_prefixes = [""] + [q for q, n in heads.items() if n * 2 >= len(known)]
    counts: Counter[tuple[str, str]] = Counter()
    by_name: Counter[tuple[str, str]] = Counter()
    for t in tensors:
        for at in _boundaries(t.name):
            for q in model_prefixes:
                shape = known.get(q + t.name[at:])
                if shape is not None:
                    by_name[(t.name[:at], q)] += 1
                    if shape == t.shape:
                        counts[(t.name[:at], q)] += 1
    need = max(1, min(len(known), len(tensors)) // 2)
    accepted = {pq for pq, c in counts.items() if c >= need or (pq[1] == "" and _is_wrapper(pq[0]))}
    matched: dict[str, str] = {}
    for t in tensors:
        best: tuple[int, int, str] | None = None
        for at in _boundaries(t.name):
            for q in model_prefixes:
                target = q + t.name[at:]
                if (t.name[:at], q) in accepted and known.get(target) == t.shape:
                    score = (counts[(t.name[:at], q)], -at, target)
                    best = score if best is None or score[:2] > best[:2] else best
        if best is not None:
            matched[t.name] = best[2]
    # For the message: by names alone, since a prefix that is right but meets other shapes is still the closest.
    ranked = tuple(
        (p, q, c, counts[(p, q)]) for (p, q), c in sorted(by_name.items(), key=lambda kv: (-kv[1], len(kv[0][0]) + len(kv[0][1])))
    )
    unmatched = next((t.name for t in tensors if t.name not in matched), None)
    example = (unmatched, min(known, key=lambda k: (_distance(unmatched, k), k))) if unmatched is not None else None
    return NameMatch(matched, len(tensors), ranked, example)


def _distance(a: str, b: str) -> tuple[int, int]:
    """How unalike two dotted names are: dotted tail segments not shared, then length difference."""
    sa, sb = a.split("."), b.split(".")
    shared = 0
    while shared < min(len(sa), len(sb)) and sa[-1 - shared] == sb[-1 - shared]:
        shared += 1
    return (len(sa) + len(sb) - 2 * shared, abs(len(a) - len(b)))
