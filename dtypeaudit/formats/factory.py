"""The one resolver of a model reference, for every command that takes a model (``scan --model``, ``convert
--model``, ``scan --explain --model``, ``trace``, a factory target of ``scan``):

- ``path/to/file.py:func``, ``pkg.module:func``, ``pkg.module:Class``: the user's code, returning a module or a
  Hugging Face config (built with ``from_config``);
- ``transformers:MODEL_TYPE`` (a model type's default config), ``transformers:PATH``, a directory holding
  ``config.json``, or a ``.json`` config file: built by transformers from the config (offline, no
  ``trust_remote_code``).

This is the one place user code runs, because the user asked for it. The model is built on the meta
device where the factory allows it, so no memory is spent on weights. The forward of each weight-only norm
class that is not PyTorch's own (transformers' LlamaRMSNorm, T5LayerNorm, GemmaRMSNorm ...) is run on the
meta device too, to measure which dtype it returns (``probe_norms``).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import traceback
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import dtypes
from ..errors import FactoryError, UsageError
from ..inventory import Finding, Inventory, TensorRecord, link_shared_storage
from ..structure import MEASURED_DTYPES, is_torch_type, type_name
from ..structure import WRAPPER_PREFIXES as WRAPPER_PREFIXES  # structure owns the list; diff reads it here
from .hfload import loaded_names

HF_PREFIX = "transformers:"
FORMS = "a factory (path/to/file.py:func or package.module:func), transformers:MODEL_TYPE, or a directory with config.json"


def looks_like_factory(target: str) -> bool:
    """``x.py:func`` or ``a.b:func`` (and not a Windows drive or an existing path)."""
    if ":" not in target or Path(target).exists():
        return False
    module, _, attr = target.rpartition(":")
    return bool(module) and attr.isidentifier()


def is_hf_reference(target: str) -> bool:
    """``transformers:...``, a directory holding ``config.json``, or a ``.json`` file: a model transformers builds."""
    if target.startswith(HF_PREFIX):
        return True
    p = Path(target)
    return (p.is_dir() and (p / "config.json").is_file()) or (p.is_file() and p.suffix == ".json")


@dataclass(frozen=True)
class ResolvedModel:
    """A model built from a reference, on the meta device where its builder allows it."""

    model: Any
    """The ``torch.nn.Module``."""
    source: str
    """``factory`` (the user's code made the module) or ``transformers`` (built from a config)."""
    weights: str | None = None
    """A Hugging Face directory that also holds weights: its dtypes are what ``from_pretrained`` loads."""


def resolve(reference: str) -> ResolvedModel:
    """Build the model ``reference`` names; ``FactoryError`` (exit 2) with one line for a reference that is not one.

    A local path is checked first: a path that does not exist says so, rather than being tried as a module name.
    """
    if is_hf_reference(reference):
        return _hf(reference)
    if looks_like_factory(reference):
        value = _call(reference)
        if _is_hf_config(value):
            return ResolvedModel(_from_config(value, reference), "transformers")
        return ResolvedModel(value, "factory")
    path = Path(reference)
    if path.is_dir():
        raise FactoryError(f"a directory without config.json is not a model: give {FORMS}", path=reference)
    if path.exists():
        raise FactoryError(f"a file is not a model: give {FORMS}", path=reference)
    if "/" in reference or "\\" in reference or path.suffix in (".py", ".json"):
        raise FactoryError(f"no such file or directory; a model is {FORMS}", path=reference)
    raise FactoryError(f"is not a model: give {FORMS}", path=reference)


def build(target: str) -> Any:
    """The ``torch.nn.Module`` ``target`` names (any form ``resolve`` takes), built on the meta device if it can be."""
    return resolve(target).model


def _call(target: str) -> Any:
    """Call a factory and return what it made: a ``torch.nn.Module`` or a Hugging Face config."""
    import torch

    module_name, _, attr = target.rpartition(":")
    try:
        mod = import_user_module(module_name)
    except FactoryError as exc:
        raise FactoryError(exc.message, path=target) from None
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
    if not isinstance(model, torch.nn.Module) and not _is_hf_config(model):
        raise FactoryError(f"'{attr}()' returned a {type(model).__name__}, not a torch.nn.Module or a transformers config", path=target)
    return model


def import_user_module(module: str) -> Any:
    """The user's module: a script path (``.py``, or any path with a slash) run as a module, or a dotted module name
    imported; only ever for a script or factory the user named."""
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


# -- Hugging Face configs ----------------------------------------------------------------------------


def _is_hf_config(value: Any) -> bool:
    return any(c.__name__.lower() == "pretrainedconfig" for c in type(value).__mro__)


def _transformers() -> Any:
    # No downloads: a model reference reads a local config or a model type's defaults.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        import transformers
    except ImportError:
        raise UsageError("a Hugging Face model reference needs the transformers package (pip install transformers)") from None
    transformers.logging.set_verbosity_error()
    return transformers


def _hf(target: str) -> ResolvedModel:
    transformers = _transformers()
    spec = target.removeprefix(HF_PREFIX)
    path = Path(spec)
    weights = None
    try:
        if path.exists():
            directory = path if path.is_dir() else path.parent
            from .jsonfile import within_json_cap

            within_json_cap(path / "config.json" if path.is_dir() else path)  # transformers would parse any size
            config = transformers.AutoConfig.from_pretrained(str(path), trust_remote_code=False, local_files_only=True)
            if path.is_dir() and _holds_weights(directory):
                weights = str(directory)
        elif "/" in spec or "\\" in spec or path.suffix == ".json":
            raise FactoryError("no such file or directory", path=target)
        else:
            config = transformers.AutoConfig.for_model(spec)
    except ValueError as exc:
        text = str(exc)
        if "trust_remote_code" in text or "custom code" in text:
            raise FactoryError(
                "its config needs trust_remote_code; dtypeaudit runs no code from a checkpoint directory "
                "(give a factory, file.py:func, that builds the model)",
                path=target,
            ) from None
        first = text.splitlines()[0].split(". Should contain")[0] if text else type(exc).__name__
        hint = "transformers:MODEL_TYPE takes a model_type such as gpt2 or llama"
        raise FactoryError(f"not a Hugging Face model: {first} ({hint})", path=target) from None
    except OSError as exc:
        raise FactoryError(f"cannot read the config: {str(exc).splitlines()[0]}", path=target) from None
    return ResolvedModel(_from_config(config, target), "transformers", weights)


def _holds_weights(directory: Path) -> bool:
    return (
        any(directory.glob("*.safetensors")) or any(directory.glob("pytorch_model*.bin")) or any(directory.glob("*.safetensors.index.json"))
    )


def _from_config(config: Any, target: str) -> Any:
    """``from_config`` on the meta device: the class ``architectures`` names, else a causal LM, else the bare model.

    The dtype is the config's own (``dtype``/``torch_dtype``), as ``from_pretrained`` would load it.
    """
    import torch

    transformers = _transformers()
    classes: list[Any] = []
    for arch in getattr(config, "architectures", None) or ():
        cls = getattr(transformers, arch, None)
        if cls is not None:
            classes.append(cls)
    classes += [transformers.AutoModelForCausalLM, transformers.AutoModel]
    last: Exception | None = None
    for cls in classes:
        try:
            with torch.device("meta"):
                if hasattr(cls, "_from_config") and cls not in (transformers.AutoModelForCausalLM, transformers.AutoModel):
                    return cls._from_config(config)
                return cls.from_config(config)
        except ValueError as exc:  # this Auto class does not cover the config's model type
            last = exc
        except Exception as exc:
            raise FactoryError(f"building {getattr(cls, '__name__', cls)} from the config failed: {exc}", path=target) from None
    raise FactoryError(f"transformers cannot build a model from this config ({last})", path=target)


def _last_frame(exc: BaseException) -> str:
    return traceback.format_exception_only(type(exc), exc)[-1].strip()


def inventory(target: str) -> Inventory:
    """The parameters and buffers of the model ``target`` names, with kind and owning module type known exactly."""
    return inventory_of_model(build(target), target)


def inventory_of_model(model: Any, path: str = "<model>") -> Inventory:
    """A built model's parameters and buffers, with kind and owning module type (by identity: ``type_name``)."""
    owners = {name: type_name(type(m)) for name, m in model.named_modules()}
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
                    dtype=dtypes.name_of(t.dtype),
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
    casts = probe_input_casts(model)
    if casts:
        metadata["input_casts"] = casts
    return Inventory(path, "factory", link_shared_storage(records), (), metadata)


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
        name = type_name(type(m))
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


class _Reached(Exception):
    """Raised by a probe's hook once the child's input is seen: the rest of the forward is not needed."""


def probe_input_casts(model: Any) -> list[str]:
    """The Linear layers whose parent module casts their input to their weight's dtype, as model paths.

    T5's feed-forward does ``hidden_states.to(self.wo.weight.dtype)`` before ``wo`` (transformers keeps ``wo`` in
    float32 through ``_keep_in_fp32_modules``), so a float32 ``wo`` in a half model runs. Each parent class that is
    not PyTorch's own is run once per Linear child on the meta device, in float16 with that child in float32; a
    hook on the child records the dtype its input arrives in. A forward that fails (it needs other arguments) claims
    nothing.
    """
    import torch

    casting: dict[tuple[str, str], bool] = {}
    out = []
    for path, parent in model.named_modules():
        if is_torch_type(type_name(type(parent))):
            continue
        for attr, child in parent.named_children():
            if not isinstance(child, torch.nn.Linear):
                continue
            key = (type_name(type(parent)), attr)
            if key not in casting:
                casting[key] = _casts_input(parent, attr)
            if casting[key]:
                out.append(f"{path}.{attr}" if path else attr)
    return out


def _casts_input(parent: Any, attr: str) -> bool:
    import copy

    import torch

    first = next((m for m in parent.children() if isinstance(m, torch.nn.Linear)), None)
    if first is None:
        return False
    seen: list[torch.dtype] = []

    def hook(module: Any, args: tuple[Any, ...]) -> None:
        if args and isinstance(args[0], torch.Tensor):
            seen.append(args[0].dtype)
        raise _Reached

    try:
        probe = copy.deepcopy(parent).to(device="meta", dtype=torch.float16)
        getattr(probe, attr).to(torch.float32).register_forward_pre_hook(hook)
        with torch.no_grad():
            probe(torch.empty(2, first.in_features, dtype=torch.float16, device="meta"))
    except _Reached:
        pass
    except Exception:  # the user's forward: whatever it raises, it measured nothing
        return False
    return seen == [torch.float32]


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
                table[f"{p}/{x}"] = dtypes.name_of(y.dtype)
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
    casts = model.metadata.get("input_casts")
    if isinstance(casts, list) and casts:
        wanted = set(casts)
        prefixes = {
            ckpt.rpartition(".")[0] for ckpt, name in mapping.matched.items() if name.rpartition(".")[0] in wanted
        }  # the checkpoint's names for the modules whose parent casts their input
        metadata["input_casts"] = sorted(prefixes)
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
    # A Hugging Face folder's tensors under the names from_pretrained gives them (transformers 5 renames keys on load)
    renamed = loaded_names(checkpoint)
    stored_as = {renamed.get(t.name, t.name): t.name for t in checkpoint.tensors if t.region == "model"}
    tensors = [t.with_(name=renamed[t.name]) if t.name in renamed else t for t in checkpoint.tensors if t.region == "model"]
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
            matched[stored_as[t.name]] = best[2]
    # For the message: by names alone, since a prefix that is right but meets other shapes is still the closest.
    ranked = tuple(
        (p, q, c, counts[(p, q)]) for (p, q), c in sorted(by_name.items(), key=lambda kv: (-kv[1], len(kv[0][0]) + len(kv[0][1])))
    )
    unmatched = next((t.name for t in tensors if stored_as[t.name] not in matched), None)
    example = (unmatched, min(known, key=lambda k: (_distance(unmatched, k), k))) if unmatched is not None else None
    return NameMatch(matched, len(tensors), ranked, example)


def _distance(a: str, b: str) -> tuple[int, int]:
    """How unalike two dotted names are: dotted tail segments not shared, then length difference."""
    sa, sb = a.split("."), b.split(".")
    shared = 0
    while shared < min(len(sa), len(sb)) and sa[-1 - shared] == sb[-1 - shared]:
        shared += 1
    return (len(sa) + len(sb) - 2 * shared, abs(len(a) - len(b)))
