"""The dtypes a Hugging Face folder's tensors have once ``from_pretrained(folder)`` has loaded them.

Mirrors transformers 5.24 with from_pretrained's default arguments (``dtype`` not given, so ``"auto"``):

* ``PreTrainedConfig.__post_init__``: the config's ``dtype`` wins; ``torch_dtype`` counts only where ``dtype`` is
  absent or null. config.json is parsed by ``json.loads``, so a key given twice keeps its last value.
* ``_get_dtype``: with a config dtype, that one (a dict gives its ``""`` entry, else float32: every module gets the
  main dtype); without one, a sharded checkpoint's index ``metadata.dtype``; else the first floating tensor (not
  fp8/fp4) of the first checkpoint file in load order (a safetensors file's names sorted, a pickle's dict order),
  else its first tensor's dtype, else float32.
* ``_get_dtype_plan`` and ``convert_and_load_state_dict_in_model``: every loaded tensor is cast to the main dtype,
  except names matching the class's ``_keep_in_fp32_modules`` (main dtype float16) or
  ``_keep_in_fp32_modules_strict`` (float16 or bfloat16), which load as float32, and tensors whose model parameter
  has its own dtype (integer buffers: we take a stored integer or bool tensor to stay as stored).

* ``get_model_conversion_mapping`` and ``rename_source_key`` (core_model_loading.py): transformers 5 renames the
  keys on disk to the model's own names (a ViT saved as ``vit.encoder.layer.0.attention.attention.key.bias`` loads
  as ``vit.layers.0.attention.k_proj.bias``), adds or strips the ``base_model_prefix``, and drops keys the model does
  not have. The dtype plan above is matched against the loaded name. A ``WeightConverter`` (MoE experts fused
  into one tensor, a split qkv) builds tensors of other names and shapes from several stored ones: not modelled,
  and said so (``load-conversion-unmodelled``).
* ``_load_pretrained_model``'s loading info: the stored keys the model does not take (unexpected, dropped) and the
  model's keys no stored tensor fills (missing, initialised at random; tied ones tied instead), compared as names
  with the layer index as ``*`` (``load-names-unmatched``).

The class is the one config.json's ``architectures`` names, looked up in the table ``hftable`` reads
(``data/transformers.json``, generated from transformers by scripts/generate_transformers_table.py, with the
version it came from): each class built as from_pretrained builds it (``_from_config`` on the meta device), its
``_keep_in_fp32_modules(_strict)`` read from the built model, where ``post_init`` has gathered the lists of every
sub-model (a composite model's vision or text tower that is itself a PreTrainedModel), its conversion mapping as
the instance collects it, as data. A scan imports neither transformers nor torch, and its verdict is the same
whether or not they are installed. For a class the table does not have, or a mapping it cannot express, the
lists and the renaming are unknown and the report says so. Quantized checkpoints (``quantization_config``) are
not modelled here.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from .. import dtypes
from ..errors import CheckpointError
from ..inventory import Finding, Format, Inventory, TensorRecord
from . import hftable

DEFAULT_DTYPE = "float32"
"""torch.get_default_dtype() in a fresh process."""


@dataclass(frozen=True)
class LoadDtype:
    """What from_pretrained casts the folder's tensors to."""

    dtype: str
    """The main dtype (torch's name without prefix)."""
    why: str
    """Where it came from, for messages: ``config.json dtype``, ``the first floating tensor of model.safetensors``."""
    keep_fp32: tuple[str, ...] | None
    """The class's ``_keep_in_fp32_modules`` (float32 under a float16 main dtype); None where unknown."""
    keep_fp32_strict: tuple[str, ...] | None = ()
    """The class's ``_keep_in_fp32_modules_strict`` (float32 under float16 or bfloat16); None where unknown."""
    model_class: str | None = None
    renamed: Mapping[str, str] = field(default_factory=dict)
    """Stored name -> the name the loaded model gives it, where the two differ (the conversion mapping)."""
    converted: Mapping[str, WeightConversion] = field(default_factory=dict)
    """Stored name -> the WeightConverter that merges or splits it into another tensor: not modelled."""
    pinned: Mapping[str, str] = field(default_factory=dict)
    """Loaded name -> the dtype the built model gives that parameter or buffer where it is not the main dtype
    (from_pretrained then loads the tensor in the parameter's own dtype)."""
    names_unknown: str | None = None
    """Why the loaded names are not known (no transformers, not one of its classes, a config it cannot build);
    None where they are, or where config.json names no class."""
    unexpected: Mapping[str, str] = field(default_factory=dict)
    """Stored name the model has no tensor for (from_pretrained drops it) -> the prefix whose removal would make it
    the model's (``module.``), ``""`` where none does."""
    missing: tuple[str, ...] = ()
    """The model's names (``*`` for a layer index) no stored tensor fills: initialised at random on load."""
    expected: int = 0
    """How many names (``*`` for a layer index) the model has; 0 where they are not known."""
    variants: tuple[str, ...] = ()
    """Of ``unexpected`` and ``missing``, those another config of the class may explain (``hftable.config_variants``)."""
    config_json: bool = True
    """Whether the folder has a config.json: one with an index alone has none, and no message may name it."""

    def loaded_name(self, stored: str) -> str:
        """The name ``stored`` has in the loaded model (the converter's target for a converted tensor)."""
        conv = self.converted.get(stored)
        return conv.into if conv is not None else self.renamed.get(stored, stored)

    def keep_patterns(self) -> tuple[str, ...] | None:
        """The name patterns that load as float32 under this main dtype (_get_dtype_plan); None where unknown."""
        if self.dtype not in ("float16", "bfloat16"):
            return ()
        if self.keep_fp32_strict is None or (self.dtype == "float16" and self.keep_fp32 is None):
            return None
        return (self.keep_fp32 if self.dtype == "float16" else ()) + self.keep_fp32_strict  # type: ignore[operator]


@dataclass(frozen=True)
class WeightConversion:
    """A stored tensor that a ``WeightConverter`` merges or splits on load (MoE experts fused into one tensor)."""

    into: str
    """The loaded tensor it goes into (the converter's first target)."""
    operations: tuple[str, ...]
    """The converter's operations, by class name (``MergeModulelist``, ``Concatenate``)."""


# The dtype attributes of torch that are not a dtype's own name: what getattr(torch, value) also accepts.
_TORCH_ALIASES = {
    "half": "float16",
    "float": "float32",
    "double": "float64",
    "short": "int16",
    "int": "int32",
    "long": "int64",
    "cfloat": "complex64",
    "cdouble": "complex128",
    "chalf": "complex32",
}


def _dtype_name(value: Any) -> str | None:
    """``getattr(torch, value)`` as PreTrainedConfig resolves a config's dtype string: exact attribute names only
    (``half`` is float16; ``fp16``, ``Float16`` and ``torch.float16`` raise AttributeError); None where it fails."""
    if not isinstance(value, str):
        return None
    name = _TORCH_ALIASES.get(value, value)
    return name if name in dtypes.DTYPES else None


def config_dtype_value(cfg: Mapping[str, Any]) -> Any:
    """The config's dtype as PreTrainedConfig keeps it: ``dtype``, else ``torch_dtype``."""
    value = cfg.get("dtype")
    return value if value is not None else cfg.get("torch_dtype")


# load_state_dict's str_to_torch_dtype (transformers 5.24 modeling_utils.py): the dtypes it reads a safetensors file's
# tensors in to find the model's dtype; any other dtype in the first file fails from_pretrained
_META_DTYPES = frozenset(
    {"bool", "uint8", "int8", "int16", "uint16", "float16", "bfloat16", "int32", "uint32", "float32", "float64", "int64", "uint64"}
    | {"float8_e4m3fn", "float8_e5m2"}
)


def _first_floating(tensors: Sequence[TensorRecord]) -> str | None:
    """get_state_dict_dtype: the first floating dtype that is not fp8/fp4, else the first dtype, else None."""
    for t in tensors:
        if dtypes.is_floating(t.dtype) and not t.dtype.startswith(("float8_", "float4_")):
            return t.dtype
    return tensors[0].dtype if tensors else None


def main_dtype(
    cfg: Mapping[str, Any],
    index_metadata: Any,
    first_file: str | None,
    first_file_tensors: Sequence[TensorRecord],
    *,
    config_json: bool = True,
) -> tuple[str, str] | None:
    """``(dtype, why)`` as _get_dtype decides it with ``dtype="auto"``; None where from_pretrained would fail on it.
    ``config_json``: whether the folder has a config.json (``cfg`` is then what it holds, else empty)."""
    value = config_dtype_value(cfg)
    key = "dtype" if cfg.get("dtype") is not None else "torch_dtype"
    if value is not None:
        if isinstance(value, dict):
            entry = value.get("", DEFAULT_DTYPE)
            name = _dtype_name(entry)
            return (name, f'config.json {key}\'s "" entry') if name else None
        name = _dtype_name(value)
        return (name, f"config.json {key}") if name else None
    if isinstance(index_metadata, dict) and "dtype" in index_metadata:
        name = _dtype_name(index_metadata["dtype"])
        return (name, "the index's metadata.dtype") if name else None
    if first_file is None:
        return DEFAULT_DTYPE, "torch's default dtype"
    # the first file's tensors in load_state_dict's order: safetensors names sorted, a pickle's own order
    ordered = sorted(first_file_tensors, key=lambda t: t.name) if first_file.endswith(".safetensors") else list(first_file_tensors)
    unreadable = next((t for t in ordered if t.dtype not in _META_DTYPES), None) if first_file.endswith(".safetensors") else None
    if unreadable is not None:
        code = dtypes.SAFETENSORS_CODE_OF.get(unreadable.dtype, unreadable.dtype)
        raise CheckpointError(
            f"from_pretrained cannot load it: config.json names no dtype, so it reads {first_file}'s tensors to choose "
            f"one and fails on {unreadable.name} ({code}: 'Cannot load safetensors of unknown dtype {code}'); "
            "name the model's dtype in config.json"
        )
    found = _first_floating(ordered)
    if found is None:
        return DEFAULT_DTYPE, f"torch's default dtype ({first_file} holds no tensor)"
    missing = "config.json names no dtype" if config_json else "there is no config.json"
    return found, f"the first floating tensor of {first_file} ({missing})"


def _arch(cfg: Mapping[str, Any]) -> str | None:
    archs = cfg.get("architectures")
    return archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None


def keep_in_fp32(cfg: Mapping[str, Any]) -> tuple[tuple[str, ...] | None, tuple[str, ...] | None, str | None]:
    """The ``_keep_in_fp32_modules`` and ``_keep_in_fp32_modules_strict`` the class config.json's ``architectures``
    names defines itself (the table's ``own_keep``), and the class; None where the table does not know it.

    The top class's lists only: ``model_view`` gives the lists a built model gathers from its sub-models too, and
    is what ``resolve`` uses; this is its fallback where the table has no built model of that class."""
    arch = _arch(cfg)
    if arch is None:
        return (), (), None  # no class named: from_pretrained's caller names it, and it is unknown
    tab = hftable.table()
    found = tab.classes.get(arch)
    if found is None:
        return None, None, arch
    raw = tab.record(found)
    return tuple(raw.get("own_keep", ())), tuple(raw.get("own_strict", ())), arch


@dataclass(frozen=True)
class ModelView:
    """What the class config.json names tells about loading the folder, from the table of transformers' models."""

    keep_fp32: tuple[str, ...]
    keep_fp32_strict: tuple[str, ...]
    renamed: dict[str, str]
    converted: dict[str, WeightConversion]
    pinned: dict[str, str]
    names_unknown: str | None = None
    """Why the loaded names are not known though the keep lists are (a composite model with another sub-model)."""
    unexpected: dict[str, str] = field(default_factory=dict)
    missing: tuple[str, ...] = ()
    expected: int = 0
    variants: tuple[str, ...] = ()


def model_view(cfg: Mapping[str, Any], dtype: str, names: Iterable[str]) -> ModelView | str:
    """The keep-in-fp32 lists, the loaded name of each stored name and the pinned dtypes of the model
    config.json's ``architectures`` names; a sentence saying why they are unknown where they are.

    Mirrors transformers' from_pretrained through the table ``hftable`` reads (generated from transformers by
    scripts/generate_transformers_table.py): ``post_init`` gathers ``_keep_in_fp32_modules(_strict)`` from every
    sub-model into the top model; ``get_model_conversion_mapping`` collects the mapping of the model and of each
    sub-model, scoped to it; ``convert_and_load_state_dict_in_model`` renames each key (every renaming in turn,
    then at most one WeightConverter, then the ``base_model_prefix`` added or stripped), retries the key unrenamed
    where only that is a model key, and drops keys the model does not have. Nothing is imported or built."""
    arch = _arch(cfg)
    if arch is None:
        return "config.json names no model class (architectures)"
    tab = hftable.table()
    info = tab.get(arch)
    if isinstance(info, str):
        return info
    keep, strict = set(info.keep), set(info.strict)
    changed = []
    for key, default_type in info.sub_configs.items():
        sub = cfg.get(key)
        given = sub.get("model_type") if isinstance(sub, dict) else None
        if isinstance(given, str) and given and given != default_type:
            # post_init gathers the sub-model's lists: the table's built model had the default one's
            old, new = tab.keep_of_type(default_type), tab.keep_of_type(given)
            if old is None or new is None:
                return f"{arch} with a {key} of model_type {given} is not in the table (its default is {default_type})"
            keep = (keep - set(old[0])) | set(new[0]) | set(info.own_keep)
            strict = (strict - set(old[1])) | set(new[1]) | set(info.own_strict)
            changed.append(f"{key} of model_type {given}, the table's {default_type}")
    if changed:
        why = f"{arch} with a {'; a '.join(changed)}: its names are not in the table"
        return ModelView(tuple(sorted(keep)), tuple(sorted(strict)), {}, {}, {}, why)
    if info.mapping is None:
        why = f"the conversion mapping of {arch} cannot be read as data ({info.mapping_unknown})"
        return ModelView(tuple(sorted(keep)), tuple(sorted(strict)), {}, {}, {}, why)
    stored = list(names)
    done = hftable.rename(info, stored)
    converted = {k: WeightConversion(into, ops) for k, (into, ops) in done.converted.items()}
    dropped = set(done.unexpected)
    loaded = [done.renamed.get(n, converted[n].into if n in converted else n) for n in stored if n not in dropped]
    unexpected = hftable.stray_prefixes(info, done.unexpected)
    missing = hftable.missing(info, loaded) if stored else ()
    strays = [n for n, prefix in unexpected.items() if not prefix]
    return ModelView(
        tuple(sorted(keep)),
        tuple(sorted(strict)),
        done.renamed,
        converted,
        hftable.pinned(info, dtype, loaded),
        unexpected=unexpected,
        missing=missing,
        expected=len(info.names),
        variants=tuple(sorted(hftable.config_variants(info, loaded, strays, missing))),
    )


def _pattern(globs: Sequence[str]) -> re.Pattern[str] | None:
    # build_glob_alternation: each glob with * as .*, searched (not matched) in the model's parameter name
    return re.compile("|".join(f"(?:{g.replace('*', '.*')})" for g in globs)) if globs else None


def loaded_dtype(t: TensorRecord, load: LoadDtype, keep: re.Pattern[str] | None) -> str:
    """The dtype ``t`` has in the loaded model: the dtype plan and the model's own parameter dtypes are
    matched against its loaded name, as ``convert_and_load_state_dict_in_model`` matches them."""
    if not dtypes.is_floating(t.dtype):
        return t.dtype  # an integer or bool buffer keeps the model's own dtype, which we take to be the stored one
    name = load.loaded_name(t.name)
    if keep is not None and keep.search(name):
        return "float32"
    return load.pinned.get(name, load.dtype)


def fp32_keeper(load: LoadDtype) -> Callable[[str], str | None]:
    """stored name -> which of the class's lists (``_keep_in_fp32_modules_strict``, ``_keep_in_fp32_modules``)
    makes from_pretrained load it in float32 under ``load.dtype`` (_get_dtype_plan); None where none does."""
    lists = [("_keep_in_fp32_modules_strict", load.keep_fp32_strict or ())] if load.dtype in ("float16", "bfloat16") else []
    if load.dtype == "float16":
        lists.append(("_keep_in_fp32_modules", load.keep_fp32 or ()))
    patterns = [(label, p) for label, globs in lists if (p := _pattern(globs)) is not None]
    return lambda stored: next((label for label, p in patterns if p.search(load.loaded_name(stored))), None)


def loaded_dtypes(tensors: Sequence[TensorRecord], load: LoadDtype) -> dict[str, str]:
    """stored name -> loaded dtype, for every tensor whose loaded dtype is not its stored one."""
    keep = _pattern(load.keep_patterns() or ())
    out = {}
    for t in tensors:
        d = loaded_dtype(t, load, keep)
        if d != t.dtype:
            out[t.name] = d
    return out


def resolve(
    cfg: Mapping[str, Any],
    index_metadata: Any,
    first_file: str | None,
    first_tensors: Sequence[TensorRecord],
    names: Iterable[str] = (),
    *,
    config_json: bool = True,
) -> LoadDtype | None:
    """The LoadDtype of a folder whose stored tensors are ``names``; None where from_pretrained fails on its dtype
    (a name torch does not have). ``config_json``: whether it has a config.json (``cfg`` is then its content)."""
    found = main_dtype(cfg, index_metadata, first_file, first_tensors, config_json=config_json)
    if found is None:
        return None
    dtype, why = found
    view = model_view(cfg, dtype, names)
    if isinstance(view, ModelView):
        return LoadDtype(
            dtype,
            why,
            view.keep_fp32,
            view.keep_fp32_strict,
            _arch(cfg),
            view.renamed,
            view.converted,
            view.pinned,
            view.names_unknown,
            view.unexpected,
            view.missing,
            view.expected,
            view.variants,
            config_json,
        )
    keep, strict, arch = keep_in_fp32(cfg)  # the top class's own lists, where the table has no built model of it
    return LoadDtype(dtype, why, keep, strict, arch, names_unknown=view if arch is not None else None, config_json=config_json)


def as_metadata(load: LoadDtype) -> dict[str, object]:
    """The inventory metadata that ``from_metadata`` reads back (and that travels with a planned conversion).
    ``renamed`` (stored -> loaded name) is how a report shows the stored names beside the loaded ones."""

    def listed(x: tuple[str, ...] | None) -> list[str] | None:
        return None if x is None else list(x)

    return {
        "dtype": load.dtype,
        "why": load.why,
        "class": load.model_class,
        "keep_in_fp32_modules": listed(load.keep_fp32),
        "keep_in_fp32_modules_strict": listed(load.keep_fp32_strict),
        "renamed": dict(load.renamed),
        "converted": {k: {"into": c.into, "operations": list(c.operations)} for k, c in load.converted.items()},
        "pinned": dict(load.pinned),
        "names_unknown": load.names_unknown,
        "unexpected": dict(load.unexpected),
        "missing": list(load.missing),
        "expected": load.expected,
        "variants": list(load.variants),
        "config_json": load.config_json,
    }


def of_folder(inv: Inventory) -> LoadDtype | None:
    """The LoadDtype the folder reader stored in a Hugging Face folder's inventory; None for any other inventory."""
    return from_metadata(inv.metadata) if inv.format == Format.HF_DIRECTORY else None


def from_metadata(metadata: Mapping[str, object]) -> LoadDtype | None:
    """The LoadDtype a reader stored (``from_pretrained_dtype``), with config.json's dtype replaced where a
    conversion plans a new one (``config_dtype``)."""
    raw = metadata.get("from_pretrained_dtype")
    if not isinstance(raw, dict) or not isinstance(raw.get("dtype"), str):
        return None

    def tup(x: object) -> tuple[str, ...] | None:
        return tuple(str(v) for v in x) if isinstance(x, list) else None

    def names(x: object) -> dict[str, str]:
        return {str(k): str(v) for k, v in x.items()} if isinstance(x, dict) else {}

    dtype, why = raw["dtype"], str(raw.get("why", ""))
    planned = metadata.get("config_dtype")
    pinned = names(raw.get("pinned"))
    config_json = raw.get("config_json") is not False
    if isinstance(planned, str) and planned != dtype and _dtype_name(planned):
        dtype, why = planned, "config.json dtype" if config_json else "the converted weights' dtype (there is no config.json)"
        pinned = {}  # the model built in another dtype: which parameters it pins is not known for this one
    cls = raw.get("class")
    converted = raw.get("converted")
    unknown = raw.get("names_unknown")
    expected = raw.get("expected")
    return LoadDtype(
        dtype,
        why,
        tup(raw.get("keep_in_fp32_modules")),
        tup(raw.get("keep_in_fp32_modules_strict")),
        cls if isinstance(cls, str) else None,
        names(raw.get("renamed")),
        {
            str(k): WeightConversion(str(v["into"]), tuple(str(o) for o in v.get("operations", ())))
            for k, v in (converted.items() if isinstance(converted, dict) else ())
            if isinstance(v, dict) and "into" in v
        },
        pinned,
        unknown if isinstance(unknown, str) else None,
        names(raw.get("unexpected")),
        tup(raw.get("missing")) or (),
        expected if isinstance(expected, int) else 0,
        tup(raw.get("variants")) or (),
        config_json,
    )


def loaded_names(inv: Inventory) -> dict[str, str]:
    """stored name -> the name from_pretrained gives the tensor, where they differ (Hugging Face folders only):
    what the policy, ``--model`` and ``trace`` match names against."""
    load = from_metadata(inv.metadata) if inv.format == Format.HF_DIRECTORY else None
    return dict(load.renamed) if load is not None else {}


def loaded_findings(tensors: Sequence[TensorRecord], load: LoadDtype, *, file: str = "config.json") -> list[Finding]:
    """``load-cast`` (warning) per stored -> loaded dtype pair, naming a few tensors; ``keep-in-fp32-unknown`` (info)
    where the class's keep-in-fp32 lists could change dtypes and are not known; ``name_findings`` and
    ``unmatched_findings``."""
    casts = loaded_dtypes(tensors, load)
    groups: dict[tuple[str, str], list[str]] = {}
    stored = {t.name: t.dtype for t in tensors}
    for name, d in casts.items():
        groups.setdefault((stored[name], d), []).append(name)
    out = []
    for (before, after), names in groups.items():
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        out.append(
            Finding(
                "load-cast",
                "warning",
                f"{len(names)} tensor{'s' if len(names) != 1 else ''} stored as {before} load{'' if len(names) != 1 else 's'} as {after} "
                f"under from_pretrained ({load.why} says {load.dtype}): {shown}; the policy is checked against the loaded dtypes",
                file=file,
                expected=(before,),
                actual=after,
            )
        )
    out.extend(name_findings(load, file=file))
    # a quantized folder's logical weights stand for their storage, as from_pretrained's dequantizing load takes it:
    # their storage names are no unexpected keys, and they fill the model's names
    given = {t.name for t in tensors}
    have = {hftable.template(load.loaded_name(n)) for n in given}
    judged = replace(
        load, unexpected={k: v for k, v in load.unexpected.items() if k in given}, missing=tuple(m for m in load.missing if m not in have)
    )
    out.extend(unmatched_findings(judged, len(tensors), file=file))
    if load.keep_patterns() is None:
        what = f"class {load.model_class}" if load.model_class else "the model class"
        out.append(
            Finding(
                "keep-in-fp32-unknown",
                "info",
                f"{what} is not known here (not in the table of transformers {hftable.table().transformers_version}'s classes): "
                "its _keep_in_fp32_modules, "
                f"which stay float32 under {load.dtype}, are not applied",
                file=file,
            )
        )
    return out


def _few(pairs: Sequence[str]) -> str:
    return ", ".join(pairs[:3]) + (f" and {len(pairs) - 3} more" if len(pairs) > 3 else "")


def name_findings(load: LoadDtype, *, file: str = "config.json") -> list[Finding]:
    """``load-renamed`` (info): stored names the loaded model knows by others, a few shown stored -> loaded (all of
    them in the report's metadata); ``load-conversion-unmodelled`` (warning) per WeightConverter target: stored
    tensors from_pretrained merges or splits into a tensor of another name and shape, which is not modelled;
    ``load-names-unknown`` (info) where the table has no built model of the class named (or its names for this config)."""
    what = f"class {load.model_class}" if load.model_class else "the model class"
    out = []
    if load.renamed:
        n = len(load.renamed)
        out.append(
            Finding(
                "load-renamed",
                "info",
                f"{n} tensor{'s' if n != 1 else ''} load under another name (the conversion mapping of transformers' {what}): "
                f"{_few([f'{a} -> {b}' for a, b in load.renamed.items()])}; the policy is checked against the loaded names",
                file=file,
            )
        )
    # one finding per converter target across layers (a 48-layer MoE is one cause, not 96 rows)
    merged: dict[tuple[str, tuple[str, ...]], tuple[list[str], list[str]]] = {}
    for stored, conv in load.converted.items():
        targets, stored_names = merged.setdefault((hftable.template(conv.into), conv.operations), ([], []))
        if conv.into not in targets:
            targets.append(conv.into)
        stored_names.append(stored)
    for (shape, ops), (targets, stored_names) in merged.items():
        into = targets[0] if len(targets) == 1 else f"{shape} ({len(targets)} of them)"
        out.append(
            Finding(
                "load-conversion-unmodelled",
                "warning",
                f"from_pretrained builds {into} from {len(stored_names)} stored tensor{'s' if len(stored_names) != 1 else ''} "
                f"({_few(stored_names)}) with {', '.join(ops)} ({what}'s WeightConverter); dtypeaudit does not model that "
                "conversion: the policy judges those stored tensors under their stored names",
                tensor=targets[0],
                file=file,
            )
        )
    if load.names_unknown:
        out.append(
            Finding(
                "load-names-unknown",
                "info",
                f"the names and keep-in-fp32 modules of the model from_pretrained builds are not known ({load.names_unknown}): "
                "transformers 5 may rename keys on load (conversion mapping) and sub-models may keep more modules in float32; "
                "the policy is checked against the stored names",
                file=file,
            )
        )
    return out


UNMATCHED_ERROR_SHARE = 0.5
"""``load-names-unmatched`` is an error where more than this share of the model's names get no stored tensor
(most weights initialised at random); fewer are a warning."""


def unmatched_findings(load: LoadDtype, stored: int, *, file: str = "config.json") -> list[Finding]:
    """``load-names-unmatched``: stored names the class does not take (from_pretrained's unexpected keys) and the
    class's names no stored tensor fills (its missing keys, tied weights aside), as the table of the class gives
    them. An error where most of the model would be initialised at random, naming the cause (a prefix such as
    DistributedDataParallel's ``module.``, or another model's names); else one warning per cause."""
    if not load.expected or not (load.unexpected or load.missing):
        return []
    cls = load.model_class or "the model class"
    prefixes: dict[str, list[str]] = {}
    for name, prefix in sorted(load.unexpected.items()):
        prefixes.setdefault(prefix, []).append(name)
    stray = prefixes.pop("", [])
    n_missing = len(load.missing)
    if n_missing > UNMATCHED_ERROR_SHARE * load.expected:
        loaded = stored - len(load.unexpected)
        if prefixes:
            prefix = max(prefixes, key=lambda p: len(prefixes[p]))
            cause = (
                f"{len(prefixes[prefix])} stored keys carry a `{prefix}` prefix {cls} does not expect ({_few(prefixes[prefix])}); "
                f"strip it: save the unwrapped model (ddp_model.module.save_pretrained(...)), or rename each key with "
                f"k.removeprefix({prefix!r}) and save again"
            )
        else:
            cause = (
                f"the stored names are not {cls}'s (stored: {_few(stray)}; {cls} takes: {_few(load.missing)}): the folder "
                "holds another model's weights, or config.json's architectures names the wrong class; name the class "
                "the weights were saved from"
            )
        return [
            Finding(
                "load-names-unmatched",
                "error",
                f"from_pretrained loads {loaded} of the {stored} stored tensors into {cls}: {n_missing} of its {load.expected} "
                f"weight names (a layer index as *) get no tensor and are initialised at random; {cause}",
                file=file,
            )
        ]
    # names another config of the class may explain (the table holds the default config's model) warn of nothing
    variants = set(load.variants)
    stray = [n for n in stray if n not in variants]
    missing = [n for n in load.missing if n not in variants]
    out = []
    for prefix, names in prefixes.items():
        out.append(
            Finding(
                "load-names-unmatched",
                "warning",
                f"{len(names)} stored tensor{'s carry' if len(names) != 1 else ' carries'} a `{prefix}` prefix {cls} does not expect, "
                f"so from_pretrained drops {'them' if len(names) != 1 else 'it'} (unexpected keys): {_few(names)}; "
                f"strip it (k.removeprefix({prefix!r})) and save again",
                file=file,
            )
        )
    if stray:
        out.append(
            Finding(
                "load-names-unmatched",
                "warning",
                f"{len(stray)} stored tensor{'s' if len(stray) != 1 else ''} match no name of {cls}, so from_pretrained drops "
                f"{'them' if len(stray) != 1 else 'it'} (unexpected keys): {_few(stray)}; delete "
                f"{'them' if len(stray) != 1 else 'it'}, or name the class the weights belong to in config.json's architectures",
                file=file,
            )
        )
    if missing:
        out.append(
            Finding(
                "load-names-unmatched",
                "warning",
                f"{len(missing)} of {cls}'s {load.expected} weight names (a layer index as *) get no stored tensor, so "
                f"from_pretrained initialises {'them' if len(missing) != 1 else 'it'} at random (missing keys): {_few(missing)}",
                file=file,
            )
        )
    return out
