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

The model class's keep-in-fp32 lists are class attributes: they are read from transformers' own class named by
config.json's ``architectures`` when transformers is installed (importing transformers, never user code); else
they are unknown and the report says so. Quantized checkpoints (``quantization_config``) are not modelled here.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .. import dtypes
from ..inventory import Finding, TensorRecord

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

    def keep_patterns(self) -> tuple[str, ...] | None:
        """The name patterns that load as float32 under this main dtype (_get_dtype_plan); None where unknown."""
        if self.dtype not in ("float16", "bfloat16"):
            return ()
        if self.keep_fp32_strict is None or (self.dtype == "float16" and self.keep_fp32 is None):
            return None
        return (self.keep_fp32 if self.dtype == "float16" else ()) + self.keep_fp32_strict  # type: ignore[operator]


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


def _first_floating(tensors: Sequence[TensorRecord]) -> str | None:
    """get_state_dict_dtype: the first floating dtype that is not fp8/fp4, else the first dtype, else None."""
    for t in tensors:
        if t.dtype in dtypes.DTYPES and dtypes.get(t.dtype).is_floating and not t.dtype.startswith(("float8_", "float4_")):
            return t.dtype
    return tensors[0].dtype if tensors else None


def main_dtype(
    cfg: Mapping[str, Any], index_metadata: Any, first_file: str | None, first_file_tensors: Sequence[TensorRecord]
) -> tuple[str, str] | None:
    """``(dtype, why)`` as _get_dtype decides it with ``dtype="auto"``; None where from_pretrained would fail on it."""
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
    found = _first_floating(ordered)
    if found is None:
        return DEFAULT_DTYPE, f"torch's default dtype ({first_file} holds no tensor)"
    return found, f"the first floating tensor of {first_file} (config.json names no dtype)"


def keep_in_fp32(cfg: Mapping[str, Any]) -> tuple[tuple[str, ...] | None, tuple[str, ...] | None, str | None]:
    """The ``_keep_in_fp32_modules`` and ``_keep_in_fp32_modules_strict`` of the class config.json's
    ``architectures`` names, read from transformers' own class (never user code); None where unknown."""
    archs = cfg.get("architectures")
    arch = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None
    if arch is None:
        return (), (), None  # no class named: from_pretrained's caller names it, and it is unknown
    if importlib.util.find_spec("transformers") is None:
        return None, None, arch
    import transformers

    try:
        cls = getattr(transformers, arch, None)
    except Exception:  # a lazy import that fails: as unknown as a missing class
        cls = None
    if not isinstance(cls, type):
        return None, None, arch
    keep = tuple(sorted(getattr(cls, "_keep_in_fp32_modules", None) or ()))
    strict = tuple(sorted(getattr(cls, "_keep_in_fp32_modules_strict", None) or ()))
    return keep, strict, arch


def _pattern(globs: Sequence[str]) -> re.Pattern[str] | None:
    # build_glob_alternation: each glob with * as .*, searched (not matched) in the model's parameter name
    return re.compile("|".join(f"(?:{g.replace('*', '.*')})" for g in globs)) if globs else None


def loaded_dtype(t: TensorRecord, load: LoadDtype, keep: re.Pattern[str] | None) -> str:
    """The dtype ``t`` has in the loaded model."""
    if t.dtype not in dtypes.DTYPES or not dtypes.get(t.dtype).is_floating:
        return t.dtype  # an integer or bool buffer keeps the model's own dtype, which we take to be the stored one
    if keep is not None and keep.search(t.name):
        return "float32"
    return load.dtype


def loaded_dtypes(tensors: Sequence[TensorRecord], load: LoadDtype) -> dict[str, str]:
    """name -> loaded dtype, for every tensor whose loaded dtype is not its stored one."""
    keep = _pattern(load.keep_patterns() or ())
    out = {}
    for t in tensors:
        d = loaded_dtype(t, load, keep)
        if d != t.dtype:
            out[t.name] = d
    return out


def resolve(cfg: Mapping[str, Any], index_metadata: Any, first_file: str | None, first_tensors: Sequence[TensorRecord]) -> LoadDtype | None:
    """The LoadDtype of a folder; None where from_pretrained fails on its dtype (a name torch does not have)."""
    found = main_dtype(cfg, index_metadata, first_file, first_tensors)
    if found is None:
        return None
    dtype, why = found
    keep, strict, arch = keep_in_fp32(cfg)
    return LoadDtype(dtype, why, keep, strict, arch)


def as_metadata(load: LoadDtype) -> dict[str, object]:
    """The inventory metadata that ``from_metadata`` reads back (and that travels with a planned conversion)."""

    def listed(x: tuple[str, ...] | None) -> list[str] | None:
        return None if x is None else list(x)

    return {
        "dtype": load.dtype,
        "why": load.why,
        "class": load.model_class,
        "keep_in_fp32_modules": listed(load.keep_fp32),
        "keep_in_fp32_modules_strict": listed(load.keep_fp32_strict),
    }


def from_metadata(metadata: Mapping[str, object]) -> LoadDtype | None:
    """The LoadDtype a reader stored (``from_pretrained_dtype``), with config.json's dtype replaced where a
    conversion plans a new one (``config_dtype``)."""
    raw = metadata.get("from_pretrained_dtype")
    if not isinstance(raw, dict) or not isinstance(raw.get("dtype"), str):
        return None

    def tup(x: object) -> tuple[str, ...] | None:
        return tuple(str(v) for v in x) if isinstance(x, list) else None

    dtype, why = raw["dtype"], str(raw.get("why", ""))
    planned = metadata.get("config_dtype")
    if isinstance(planned, str) and planned != dtype and _dtype_name(planned):
        dtype, why = planned, "config.json dtype"
    cls = raw.get("class")
    return LoadDtype(
        dtype, why, tup(raw.get("keep_in_fp32_modules")), tup(raw.get("keep_in_fp32_modules_strict")), cls if isinstance(cls, str) else None
    )


def loaded_findings(tensors: Sequence[TensorRecord], load: LoadDtype, *, file: str = "config.json") -> list[Finding]:
    """``load-cast`` (warning) per stored -> loaded dtype pair, naming a few tensors; ``keep-in-fp32-unknown`` (info)
    where the class's keep-in-fp32 lists could change dtypes and are not known."""
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
    if load.keep_patterns() is None:
        what = f"class {load.model_class}" if load.model_class else "the model class"
        out.append(
            Finding(
                "keep-in-fp32-unknown",
                "info",
                f"{what} is not known here (transformers not installed, or not one of its classes): its _keep_in_fp32_modules, "
                f"which stay float32 under {load.dtype}, are not applied",
                file=file,
            )
        )
    return out
