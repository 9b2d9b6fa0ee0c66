"""Write dtypeaudit/data/transformers.json: what ``from_pretrained`` needs from transformers, per model class, as data.

A folder scan reads this table instead of importing transformers (and torch): per class its ``base_model_prefix``,
the ``_keep_in_fp32_modules(_strict)`` a built model gathers from its sub-models, its tied-weight keys, the key
conversion mapping ``get_model_conversion_mapping`` collects (renamings in order, WeightConverters, scoped to
sub-models), the names of its state dict (layer indices as ``*``) and the parameters whose dtype is pinned.

Every class transformers exports from a modeling module that is a ``PreTrainedModel`` is built as from_pretrained
builds it: ``_from_config`` of its ``config_class()`` defaults, in float16, on the meta device. A class whose default
config does not build is recorded with the error (a scan then says it is unknown).

    python scripts/generate_transformers_table.py [-o dtypeaudit/data/transformers.json] [-j 2] [CLASS ...]

Run it again after upgrading transformers; tests/test_hf_table.py holds the table equal to the installed one.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this tree's dtypeaudit, whose reader the layout is for

from dtypeaudit.formats.hftable import SHARED, TABLE, template  # noqa: E402

OUT = TABLE
BUILD_DTYPE = "float16"
"""Built in float16: a parameter that is not float16 then has a dtype of its own (``pinned``)."""


def candidates() -> list[str]:
    """The names transformers exports from its modeling modules (a config's ``architectures`` names one of them)."""
    import transformers

    mapping: dict[str, str] = transformers._class_to_module  # type: ignore[attr-defined]
    return sorted(k for k, v in mapping.items() if ".modeling_" in v and k[:1].isupper())


def transform_data(t: Any) -> dict[str, Any] | str:
    """One WeightTransform as data for ``dtypeaudit.formats.hftable``; a sentence where it cannot be."""
    from transformers import core_model_loading as cml

    kinds = {
        cml.WeightRenaming: "rename",
        cml.PrefixChange: "rename",  # a WeightRenaming whose patterns it builds itself
        cml.GroupWeightRename: "group",
        cml.Inkling2IndexOffsetWeightRename: "offset",
        cml.LayerPairCollapse: "layer-pair",
        cml.WeightConverter: "convert",
    }
    kind = kinds.get(type(t))
    if kind is None:
        return f"{type(t).__name__} renames by its own code"
    out: dict[str, Any] = {
        "kind": kind,
        "regex": t.compiled_sources.pattern,
        "sources": list(t.source_patterns),
        "targets": list(t.target_patterns),
    }
    if t.scope_prefix is not None:
        out["scope"] = t.scope_prefix
        out["base"] = t.base_model_prefix
    if kind == "offset":
        out["offset"] = t.offset
    if kind == "convert":
        out["operations"] = [type(op).__name__ for op in t.operations]
    return out


def entry(name: str) -> dict[str, Any]:
    """The record of one class (uncompressed: every name listed)."""
    import torch
    import transformers
    from transformers.conversion_mapping import get_model_conversion_mapping

    cls = getattr(transformers, name)
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)) or not hasattr(cls, "config_class"):
        return {"skip": True}
    out: dict[str, Any] = {
        "model_type": getattr(cls.config_class, "model_type", "") or "",
        "own_keep": sorted(getattr(cls, "_keep_in_fp32_modules", None) or ()),
        "own_strict": sorted(getattr(cls, "_keep_in_fp32_modules_strict", None) or ()),
    }
    try:
        config = cls.config_class()
        with torch.device("meta"):
            model = cls._from_config(config, dtype=getattr(torch, BUILD_DTYPE))
    except Exception as exc:  # needs a package not installed, or refuses its own defaults
        out["error"] = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"
        return out
    state = model.state_dict()
    tied = getattr(model, "all_tied_weights_keys", None) or getattr(cls, "_tied_weights_keys", None) or {}
    out.update(
        prefix=model.base_model_prefix or "",
        keep=sorted(model._keep_in_fp32_modules or ()),
        strict=sorted(model._keep_in_fp32_modules_strict or ()),
        tied=dict(sorted(tied.items())) if isinstance(tied, dict) else sorted(tied),
        names=sorted({template(k) for k in state}),
        pinned={
            template(k): str(v.dtype).removeprefix("torch.") for k, v in sorted(state.items()) if str(v.dtype) != f"torch.{BUILD_DTYPE}"
        },
        sub_configs={
            k: getattr(getattr(config, k, None), "model_type", None) or ""
            for k in sorted(getattr(config, "sub_configs", None) or {})
            if getattr(config, k, None) is not None
        },
    )
    try:
        mapping = [transform_data(t) for t in get_model_conversion_mapping(model)]
    except Exception as exc:
        out["mapping_unknown"] = f"get_model_conversion_mapping failed ({type(exc).__name__})"
    else:
        bad = [m for m in mapping if isinstance(m, str)]
        if bad:
            out["mapping_unknown"] = bad[0]
        else:
            out["mapping"] = mapping
    return out


def _entries(names: list[str]) -> list[tuple[str, dict[str, Any]]]:
    import logging
    import warnings

    import transformers

    transformers.logging.set_verbosity_error()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    warnings.simplefilter("ignore")
    out = []
    for n in names:
        try:
            e = entry(n)
        except Exception as exc:  # an import that fails: the class is not there for a scan either
            e = {"error": f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"}
        if not e.get("skip"):
            out.append((n, e))
    return out


def entries(names: list[str], jobs: int = 1) -> dict[str, dict[str, Any]]:
    """Every class's record, built in ``jobs`` processes, a modeling module's classes in one process."""
    import transformers

    modules: dict[str, list[str]] = defaultdict(list)
    for n in names:
        modules[transformers._class_to_module.get(n, n)].append(n)  # type: ignore[attr-defined]
    groups = list(modules.values())
    if jobs <= 1:
        results = [_entries(g) for g in groups]
    else:
        with multiprocessing.get_context("spawn").Pool(jobs, maxtasksperchild=20) as pool:
            results = pool.map(_entries, groups, chunksize=1)
    return dict(sorted(pair for r in results for pair in r))


class _Nodes:
    """The classes' name templates as a trie whose equal subtrees are stored once (``LlamaModel``'s names are
    ``LlamaForCausalLM``'s under ``model.``)."""

    def __init__(self) -> None:
        self.nodes: list[dict[str, int]] = [{}]  # 0: the end of a name
        self.ids: dict[str, int] = {"{}": 0}

    def add(self, names: list[str]) -> int:
        tree: dict[str, Any] = {}
        for n in names:
            node = tree
            for seg in n.split("."):
                node = node.setdefault(seg, {})
        return self._intern(tree)

    def _intern(self, tree: dict[str, Any]) -> int:
        node = {seg: self._intern(child) for seg, child in sorted(tree.items())}
        key = json.dumps(node, separators=(",", ":"))
        if key not in self.ids:
            self.ids[key] = len(self.nodes)
            self.nodes.append(node)
        return self.ids[key]


def compact(raw: dict[str, dict[str, Any]], version: str) -> dict[str, Any]:
    """The shipped document: name templates in a shared trie, transforms, transform lists and the other shared
    fields stored once: fewer and smaller objects to parse at a scan's start."""
    nodes = _Nodes()
    transforms: list[dict[str, Any]] = []
    transform_ids: dict[str, int] = {}
    values: list[Any] = []
    value_ids: dict[str, int] = {}
    classes: dict[str, Any] = {}
    for name, e in raw.items():
        c = without_empty(e)
        if "names" in c:
            c["names"] = nodes.add(e["names"])
        if "mapping" in c:
            ids = []
            for t in e["mapping"]:
                key = json.dumps(t, sort_keys=True)
                if key not in transform_ids:
                    transform_ids[key] = len(transforms)
                    transforms.append(t)
                ids.append(transform_ids[key])
            c["mapping"] = ids
        for k in sorted(SHARED):
            if k in c:
                key = json.dumps(c[k], sort_keys=True)
                if key not in value_ids:
                    value_ids[key] = len(values)
                    values.append(c[k])
                c[k] = value_ids[key]
        classes[name] = c
    return {
        "format": 2,
        "transformers_version": version,
        "generated_by": "scripts/generate_transformers_table.py",
        "build_dtype": BUILD_DTYPE,
        "transforms": transforms,
        "nodes": nodes.nodes,
        "values": values,
        "classes": classes,
    }


def expanded(doc: dict[str, Any], name: str) -> dict[str, Any]:
    """One class's record as ``entry`` gives it, read back from the shipped document (``compact``'s inverse)."""

    def names(node: int, prefix: str = "") -> list[str]:
        children = doc["nodes"][node]
        out = [] if children else [prefix]
        for seg, child in children.items():
            out.extend(names(child, f"{prefix}.{seg}" if prefix else seg))
        return out

    c = dict(doc["classes"][name])
    for k in SHARED:
        if k in c:
            c[k] = doc["values"][c[k]]
    if "names" in c:
        c["names"] = sorted(names(c["names"]))
    if "mapping" in c:
        c["mapping"] = [doc["transforms"][i] for i in c["mapping"]]
    return c


def without_empty(e: dict[str, Any]) -> dict[str, Any]:
    """A record as ``compact`` keeps it: empty values left out, but for the prefix and the keep lists."""
    return {k: v for k, v in e.items() if v not in ([], {}, "") or k in ("prefix", "keep", "strict")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--output", type=Path, default=OUT)
    parser.add_argument("-j", "--jobs", type=int, default=1)
    parser.add_argument("classes", nargs="*", help="only these classes (default: every one)")
    args = parser.parse_args(argv)
    import transformers

    raw = entries(args.classes or candidates(), args.jobs)
    doc = compact(raw, transformers.__version__)
    args.output.write_text(json.dumps(doc, separators=(",", ":"), sort_keys=False) + "\n")
    built = sum(1 for e in raw.values() if "names" in e)
    print(f"{args.output}: {len(raw)} classes ({built} built) from transformers {transformers.__version__}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
