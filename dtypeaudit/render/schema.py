"""A JSON Schema for ``dtypeaudit.report/1``, derived from the code that writes the report.

The keys come from ``render/json.py``'s dict builders, run on a small probe report; each key's type and
description come from the dataclass field of the same name in ``inventory.py`` (its annotation and the
docstring under it). Only the few keys no dataclass field holds are described here, and a key that is
neither raises, so a field added to the report cannot go undocumented. The docs site renders this schema
(``docs/hooks.py``) and ``tests/test_report_schema.py`` validates real reports against it.
"""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
import types
import typing
from collections.abc import Mapping
from functools import cache
from typing import Any

from ..inventory import CheckpointReport, DtypeTotals, Finding, Inventory, Report, TensorRecord
from .json import SCHEMA, checkpoint_dict, finding_dict, report_dict, tensor_dict

SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"

# Keys the builders compute rather than copy from a field: their meaning is stated once, here.
_COMPUTED: dict[str, dict[str, Any]] = {
    "report.schema": {"const": SCHEMA, "description": "The contract's name and version. Renaming or removing a field means a new version."},
    "report.tool": {
        "type": "object",
        "description": "The program that wrote the report.",
        "properties": {
            "name": {"const": "dtypeaudit", "description": "Always `dtypeaudit`."},
            "version": {"type": "string", "description": "dtypeaudit's version."},
        },
        "required": ["name", "version"],
    },
    "tensor.numel": {"description": "Elements: the product of `shape`."},
    "tensor.file": {
        "description": "The file that holds it, relative to the checkpoint path (a shard of a directory); null for a single file."
    },
    "by_dtype.dtype": {"description": "A dtype, as torch names it."},
    "by_dtype.tensors": {"description": "Tensors of that dtype, a tensor under several names counted once."},
    "by_dtype.numel": {"description": "Their elements."},
    "by_dtype.nbytes": {"description": "Their bytes."},
    "by_dtype.share": {"description": "Fraction of the checkpoint's bytes, rounded to six places."},
    "checkpoint.findings": {"description": "What the reader noticed and the checks found, in the order they were raised."},
    "summary.tensors": {"type": "integer", "description": "Tensors listed, every name counted."},
    "summary.numel": {"type": "integer", "description": "Elements, a tensor under several names (a tie, a view) counted once."},
    "summary.nbytes": {"type": "integer", "description": "Bytes of the elements, a tensor under several names counted once."},
    "summary.by_dtype": {"description": "Totals by dtype, largest share of the bytes first."},
    "checkpoint.summary": {"type": "object", "description": "Totals over the checkpoint's tensors."},
    "checkpoint.metadata": {
        "description": "Format-specific facts (see `Inventory.metadata`); `{}` where the checkpoint could not be read."
    },
    "checkpoint.trace": {
        "type": "object",
        "description": "`dtypeaudit trace` only: the dtypes of the traced run (its modules, operations, activations and gradients).",
    },
}
# Keys a report may hold without the builders above writing them (another command adds them).
_OPTIONAL = {"checkpoint": ["trace"]}


def attribute_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field (and property) of a class, by name."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, after in zip(body, body[1:] + [None], strict=True):
        if isinstance(node, ast.FunctionDef):
            text = ast.get_docstring(node)
            if text:
                docs[node.name] = text
            continue
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
            docs[node.target.id] = after.value.value
    return {name: " ".join(inspect.cleandoc(text).split()).replace("``", "`") for name, text in docs.items()}


def _is_property(cls: type, name: str) -> bool:
    return isinstance(inspect.getattr_static(cls, name, None), property)


def _annotation(cls: type, name: str) -> Any:
    hints = typing.get_type_hints(cls)
    if name in hints:
        return hints[name]
    prop = inspect.getattr_static(cls, name, None)
    if isinstance(prop, property) and prop.fget is not None:
        return typing.get_type_hints(prop.fget).get("return", Any)
    return Any


def json_type(annotation: Any) -> dict[str, Any]:
    """The JSON Schema of a value of a Python annotation, as ``json.dumps`` writes it."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        options = [json_type(a) for a in args if a is not type(None)]
        schema = options[0] if len(options) == 1 else {"anyOf": options}
        if type(None) in args:
            schema = _nullable(schema)
        return schema
    if origin is typing.Literal:
        return {"enum": list(args)}
    if origin is tuple or origin is list:
        items = args[0] if args and (len(args) == 1 or args[-1] is Ellipsis) else Any
        return {"type": "array", "items": json_type(items)}
    if origin is not None and isinstance(origin, type) and issubclass(origin, Mapping):
        return {"type": "object"}
    simple = {str: "string", bool: "boolean", int: "integer", float: "number"}
    return {"type": simple[annotation]} if annotation in simple else {}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    if "type" in schema:
        kinds = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        return {**schema, "type": [*kinds, "null"]} if "null" not in kinds else schema
    if "enum" in schema:
        return {**schema, "enum": [*schema["enum"], None]}
    return {"anyOf": [schema, {"type": "null"}]} if schema else schema


def _object(
    where: str,
    probe: dict[str, Any],
    sources: tuple[type, ...],
    nested: Mapping[str, dict[str, Any]],
) -> dict[str, Any]:
    """The schema of one dict a builder wrote: its keys, typed and described by the field of the same name."""
    properties: dict[str, dict[str, Any]] = {}
    for key in [*probe, *_OPTIONAL.get(where, [])]:
        computed = _COMPUTED.get(f"{where}.{key}")
        owner = next((c for c in sources if key in typing.get_type_hints(c) or _is_property(c, key)), None)
        if computed is None and owner is None:
            raise LookupError(f"report key {where}.{key} has no dataclass field of that name and no description in render/schema.py")
        schema: dict[str, Any] = {}
        if owner is not None:
            schema = dict(json_type(_annotation(owner, key)))
        description = next((attribute_docs(c)[key] for c in sources if key in attribute_docs(c)), None)
        if description:
            schema["description"] = re.sub(r"\bNone\b", "null", description)  # in JSON words
        if key in nested:
            schema = {**schema, **nested[key]}
        if computed is not None:
            schema = {**schema, **computed}
        if key in probe and probe[key] is None and schema.get("type") not in (None, "null"):
            schema = _nullable(schema)  # the builder writes null where the field is empty (``file or None``)
        properties[key] = schema
    return {"type": "object", "properties": properties, "required": list(probe)}


def _probe() -> tuple[dict[str, Any], CheckpointReport, TensorRecord, Finding]:
    """A one-tensor, one-finding report: every builder writes every key it has for it."""
    tensor = TensorRecord("w", "float32", (2,), 8)
    finding = Finding("rule", "error", "message")
    checkpoint = CheckpointReport("model.pt", "torch-zip", None, Inventory("model.pt", "torch-zip", (tensor,), (finding,)), (finding,))
    return report_dict(Report((checkpoint,))), checkpoint, tensor, finding


@cache
def report_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) that every ``dtypeaudit.report/1`` document meets.

    Fields may be added to the report without a new version, so objects accept properties beyond those listed.
    """
    doc, checkpoint, tensor, finding = _probe()
    checkpoint_doc = checkpoint_dict(checkpoint)
    by_dtype = _object("by_dtype", checkpoint_doc["summary"]["by_dtype"][0], (DtypeTotals,), {})
    summary = _object("summary", checkpoint_doc["summary"], (), {"by_dtype": {"type": "array", "items": by_dtype}})
    tensor_schema = _object("tensor", tensor_dict(tensor), (TensorRecord,), {})
    finding_schema = _object("finding", finding_dict(finding), (Finding,), {})
    checkpoint_schema = _object(
        "checkpoint",
        checkpoint_doc,
        (CheckpointReport, Inventory),
        {
            "summary": summary,
            "tensors": {"type": "array", "items": tensor_schema, "description": "Every tensor, in file order."},
            "findings": {"type": "array", "items": finding_schema},
        },
    )
    report = _object(
        "report",
        doc,
        (Report,),
        {"checkpoints": {"type": "array", "items": checkpoint_schema, "description": "One entry per checkpoint, in input order."}},
    )
    return {
        "$schema": SCHEMA_DIALECT,
        "title": SCHEMA,
        "description": "The JSON report of `dtypeaudit scan` and `dtypeaudit trace` (`--format json`).",
        **report,
    }


def fields_table(schema: Mapping[str, Any], prefix: str = "") -> list[tuple[str, str, bool, str]]:
    """``(path, type, required, description)`` for every property, depth first, for the docs page."""
    rows: list[tuple[str, str, bool, str]] = []
    required = set(schema.get("required", []))
    for key, prop in schema.get("properties", {}).items():
        path = f"{prefix}{key}"
        rows.append((path, _type_name(prop), key in required, prop.get("description", "")))
        if prop.get("type") == "object" or "properties" in prop:
            rows.extend(fields_table(prop, path + "."))
        items = prop.get("items", {})
        if isinstance(items, dict) and "properties" in items:
            rows.extend(fields_table(items, path + "[]."))
    return rows


def _type_name(prop: Mapping[str, Any]) -> str:
    if "const" in prop:
        return f'"{prop["const"]}"'
    if "enum" in prop:
        return " \\| ".join("null" if v is None else f'"{v}"' for v in prop["enum"])
    kinds = prop.get("type", "any")
    kinds = kinds if isinstance(kinds, list) else [kinds]
    names = []
    for kind in kinds:
        if kind == "array":
            items = prop.get("items", {})
            names.append("array of objects" if "properties" in items else f"array of {_type_name(items)}")
        else:
            names.append(kind)
    return " \\| ".join(names)
