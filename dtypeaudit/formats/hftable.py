"""What ``from_pretrained`` needs from transformers, per model class, read from ``data/transformers.json``.

``scripts/generate_transformers_table.py`` writes the table from an installed transformers (the version is in the
file): each class built on the meta device from its default config gives its ``base_model_prefix``, the
``_keep_in_fp32_modules(_strict)`` post_init gathers from its sub-models, its tied-weight keys, the names of its
state dict (index segments as ``*``), the parameters whose dtype is its own, and the key conversion mapping as
data. This module applies that mapping as transformers 5's ``rename_source_key`` does, in pure Python: a folder
scan imports neither transformers nor torch, and gives the same verdict whichever of them is installed.

A name is the model's where its template is: the default config's layer count does not limit the layers, and
layers of different structure (a MoE whose first layers are dense) are not told apart, so a stored name that only
some layers have counts as the model's in every layer.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TABLE = Path(__file__).resolve().parent.parent / "data" / "transformers.json"

SHARED = frozenset({"keep", "strict", "own_keep", "own_strict", "tied", "pinned", "sub_configs", "mapping"})
"""The fields a class names by index into the table's ``values`` (scripts/generate_transformers_table.py)."""

_INDEX = re.compile(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)")


def template(name: str) -> str:
    """A state-dict name with its index segments as ``*``, as the table stores names (one for every layer)."""
    return _INDEX.sub("*", name)


@dataclass
class Transform:
    """One WeightTransform of a class's conversion mapping (``kind``: rename, group, offset, layer-pair, convert)."""

    kind: str
    regex: re.Pattern[str]
    sources: tuple[str, ...]
    targets: tuple[str, ...]
    scope: str | None = None
    base: str | None = None
    offset: int = 0
    operations: tuple[str, ...] = ()
    active: bool = False
    """A GroupWeightRename's guard was seen (the loader renames keys in sorted order, so state carries)."""

    def _scoped(self, key: str) -> tuple[str | None, str, re.Match[str]] | None:
        prefix = None
        if self.scope is not None:
            scope = f"{self.scope}." if self.scope else ""
            base = f"{self.base}." if self.base else ""
            if key.startswith(base + scope):
                prefix = base + scope
            elif key.startswith(scope):
                prefix = scope
            else:
                return None
            key = key.removeprefix(prefix)
        found = self.regex.search(key)
        return None if found is None else (prefix, key, found)

    def rename(self, key: str) -> tuple[str, str | None]:
        """``(new key, the source pattern that matched)``; ``(key, None)`` where it does not apply."""
        if self.kind == "layer-pair":
            return self._layer_pair(key)
        scoped = self._scoped(key)
        if scoped is None:
            return key, None
        prefix, rest, found = scoped
        group = next(g for g, v in found.groupdict().items() if v is not None)
        index = int(group[1:])
        start = self.regex.groupindex[group]
        if self.kind == "group":
            if index == 0:
                self.active = True
            elif not self.active:
                return key, None
            replacement = re.sub(r"\\(\d+)", lambda m: found.group(start + int(m.group(1))), self.targets[index])
        elif self.kind == "offset":
            replacement = self.targets[0].replace(r"\1", str(int(found.group(start + 1)) + self.offset))
        else:
            replacement = self.targets[0]
            if r"\1" in replacement:
                replacement = replacement.replace(r"\1", found.group(start + 1))
        new = rest.replace(found.group(0), replacement, 1)
        return (prefix or "") + new, self.sources[index]

    def _layer_pair(self, key: str) -> tuple[str, str | None]:
        # LayerPairCollapse: layers.{2i}.mixer -> layers.{i}.self_attn, layers.{2i+1}.mixer -> layers.{i}.mlp
        found = re.search(r"layers\.(\d+)\.(mixer|attn_alpha|mlp_alpha)(?=\.|$)", key)
        if found is None:
            return key, None
        index, name = int(found[1]), found[2]
        name = {"attn_alpha": "lambda_1", "mlp_alpha": "lambda_2"}.get(name, ("self_attn", "mlp")[index % 2])
        return key[: found.start()] + f"layers.{index // 2}.{name}" + key[found.end() :], self.sources[0]


@dataclass(frozen=True)
class ClassInfo:
    """One class's record in the table."""

    name: str
    model_type: str
    prefix: str
    keep: tuple[str, ...]
    strict: tuple[str, ...]
    own_keep: tuple[str, ...]
    own_strict: tuple[str, ...]
    tied: Mapping[str, str]
    names: frozenset[str]
    """The state dict's names as templates (``model.layers.*.mlp.up_proj.weight``)."""
    pinned: Mapping[str, str]
    """Template -> the dtype of a parameter or buffer that is not built in the main dtype."""
    sub_configs: Mapping[str, str]
    """Sub-config key -> the model_type of the default config's sub-model (a composite model's towers)."""
    mapping: tuple[dict[str, Any], ...] | None
    """The conversion mapping as data; None where it cannot be expressed so (``mapping_unknown`` says why)."""
    mapping_unknown: str | None

    def has(self, name: str) -> bool:
        """Whether the built model has a tensor of that name."""
        return template(name) in self.names

    def transforms(self) -> list[Transform]:
        """Fresh transforms (a group's state starts unset for each load)."""
        return [
            Transform(
                str(t["kind"]),
                re.compile(t["regex"]),
                tuple(t["sources"]),
                tuple(t["targets"]),
                t.get("scope"),
                t.get("base"),
                int(t.get("offset", 0)),
                tuple(t.get("operations", ())),
            )
            for t in self.mapping or ()
        ]


@dataclass(frozen=True, eq=False)
class ModelTable:
    transformers_version: str
    classes: Mapping[str, Any]
    nodes: Sequence[Mapping[str, int]]
    transforms: Sequence[dict[str, Any]]
    values: Sequence[Any]

    def names_of(self, node: int, prefix: str = "") -> Iterable[str]:
        children = self.nodes[node]
        if not children:
            yield prefix
        for seg, child in children.items():
            yield from self.names_of(child, f"{prefix}.{seg}" if prefix else seg)

    @functools.cache  # noqa: B019 - the table lives as long as the process
    def get(self, arch: str) -> ClassInfo | str:
        """The record of class ``arch``; a sentence saying why there is none."""
        found = self.classes.get(arch)
        version = f"transformers {self.transformers_version}"
        if found is None:
            return f"the table of {version}'s classes has no {arch}"
        raw = self.record(found)
        if "error" in raw:
            return f"{version} cannot build {arch} from its default config ({str(raw['error']).rstrip(': ')})"
        mapping = tuple(self.transforms[i] for i in raw["mapping"]) if "mapping" in raw else None
        return ClassInfo(
            arch,
            raw.get("model_type", ""),
            raw.get("prefix", ""),
            tuple(raw.get("keep", ())),
            tuple(raw.get("strict", ())),
            tuple(raw.get("own_keep", ())),
            tuple(raw.get("own_strict", ())),
            dict(raw.get("tied", {})) if isinstance(raw.get("tied"), dict) else {},
            frozenset(self.names_of(raw["names"])) if "names" in raw else frozenset(),
            dict(raw.get("pinned", {})),
            dict(raw.get("sub_configs", {})),
            mapping,
            raw.get("mapping_unknown") if mapping is None else None,
        )

    def record(self, found: Mapping[str, Any]) -> dict[str, Any]:
        """A class's fields with the shared ones (``SHARED``, stored once in ``values``) looked up."""
        return {k: self.values[v] if k in SHARED else v for k, v in found.items()}

    def keep_of_type(self, model_type: str) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
        """The keep-in-fp32 lists every class of ``model_type`` agrees on; None where they differ or none is built."""
        found = {
            (tuple(c.get("keep", ())), tuple(c.get("strict", ())))
            for c in map(self.record, self.classes.values())
            if c.get("model_type") == model_type and "error" not in c
        }
        return found.pop() if len(found) == 1 else None


@functools.cache
def table(path: Path = TABLE) -> ModelTable:
    doc = json.loads(path.read_text(encoding="utf-8"))
    return ModelTable(str(doc["transformers_version"]), doc["classes"], doc["nodes"], doc["transforms"], doc["values"])


def rename_source_key(key: str, renamings: Sequence[Transform], converters: Sequence[Transform], info: ClassInfo) -> tuple[str, str | None]:
    """transformers' ``rename_source_key`` on loading: every renaming in turn, then at most one converter, then the
    ``base_model_prefix`` stripped or added where that gives a name the model has."""
    for r in renamings:
        key, _ = r.rename(key)
    pattern = None
    for c in converters:
        key, pattern = c.rename(key)
        if pattern is not None:
            break
    prefix = info.prefix  # "" too, as transformers does (its regex then strips a first character)
    stripped = re.sub(f"^{prefix}.", "", key, count=1)
    if key.startswith(prefix) and info.has(stripped):
        key = stripped
    elif info.has(f"{prefix}.{key}"):
        key = f"{prefix}.{key}"
    return key, pattern


@dataclass(frozen=True)
class Renamed:
    renamed: dict[str, str]
    """Stored name -> loaded name, where they differ."""
    converted: dict[str, tuple[str, tuple[str, ...]]]
    """Stored name -> (the converter's target, its operations)."""
    unexpected: tuple[str, ...] = ()
    """Stored names the model has no tensor for, renamed or not: from_pretrained drops them (its unexpected keys)."""


def rename(info: ClassInfo, names: Iterable[str]) -> Renamed:
    """The loaded name of each stored name, as ``convert_and_load_state_dict_in_model`` gives it (keys in sorted
    order): renamed, retried unrenamed where only the prefix should change, dropped where the model lacks it."""
    transforms = info.transforms()
    renamings = [t for t in transforms if t.kind != "convert"]
    converters = [t for t in transforms if t.kind == "convert"]
    renamed: dict[str, str] = {}
    converted: dict[str, tuple[str, tuple[str, ...]]] = {}
    unexpected = []
    for name in sorted(names):
        new, pattern = rename_source_key(name, renamings, converters, info)
        if not info.has(new) and info.has(name):  # the loader's retry: only the prefix may change
            new, pattern = rename_source_key(name, [], [], info)
        if not info.has(new):
            if not _IGNORED_UNEXPECTED.search(name):
                unexpected.append(name)  # from_pretrained drops it; it keeps its stored name here
            continue
        if pattern is not None:
            conv = next(c for c in converters if pattern in c.sources)
            converted[name] = (new, conv.operations)
        elif new != name:
            renamed[name] = new
    return Renamed(renamed, converted, tuple(unexpected))


def stray_prefixes(info: ClassInfo, unexpected: Iterable[str]) -> dict[str, str]:
    """Unexpected stored name -> the leading segments whose removal makes it a name the model loads (``module.``
    of a DistributedDataParallel wrapper, ``_orig_mod.`` of torch.compile); ``""`` where none does."""
    out = {n: "" for n in unexpected}
    for k in (1, 2):
        rests = {n.split(".", k)[k]: n for n, p in out.items() if not p and n.count(".") > k}
        done = rename(info, rests)
        for rest, n in rests.items():
            conv = done.converted.get(rest)
            if info.has(conv[0] if conv else done.renamed.get(rest, rest)):
                out[n] = n[: len(n) - len(rest)]
    return out


def _modules(name: str) -> list[str]:
    """The modules a name lies in, innermost first (``a.b.c`` -> ``a.b``, ``a``)."""
    parts = name.split(".")
    return [".".join(parts[:k]) for k in range(len(parts) - 1, 0, -1)]


def config_variants(info: ClassInfo, loaded: Iterable[str], unexpected: Iterable[str], missing: Iterable[str]) -> frozenset[str]:
    """The unexpected stored names and missing names that another config of the class may explain, since the table
    holds the names of the default config's model: a stored name inside a module the checkpoint loads tensors into
    (a bias ``attention_bias`` adds, GPT-2's ``add_cross_attention`` blocks, T5 v1.1's gated ``wi_0``/``wi_1``), and a
    missing name beside a loaded one in its module (a bias the config turns off) or beside such a stored name (T5's
    ``wi``). Not the base model's module alone, which holds every tensor."""
    held = {m for n in loaded for m in _modules(template(n))} - {info.prefix, ""}
    out = set()
    for name in unexpected:
        t = template(name)
        if any(m in held for m in (*_modules(t), *_modules(f"{info.prefix}.{t}"))):
            out.add(name)
    parents = {m[1] for m in (_modules(template(n)) for n in out) if len(m) > 1}
    for name in missing:
        mods = _modules(name)
        if mods and (mods[0] in held or (len(mods) > 1 and mods[1] in parents)):
            out.add(name)
    return frozenset(out)


# _adjust_missing_and_unexpected_keys: buffers older transformers saved, never reported as unexpected. (It also
# applies each class's _keys_to_ignore_on_load_unexpected/_missing, which the table does not hold yet.)
_IGNORED_UNEXPECTED = re.compile(r"rotary_emb\.inv_freq|(^|\.)position_ids$")


def missing(info: ClassInfo, loaded: Iterable[str]) -> tuple[str, ...]:
    """The model's names (templates, ``*`` for a layer index) that no loaded tensor fills: from_pretrained
    initialises them at random (its missing keys). A tied weight counts as filled where its partner is loaded, as
    ``tie_weights`` ties whichever of the two the checkpoint has."""
    have = {template(n) for n in loaded}
    tied: dict[str, set[str]] = {}  # name -> every name tied with it (T5's shared, embed_tokens and lm_head are one)
    for a, b in info.tied.items():
        group = tied.get(template(a), {template(a)}) | tied.get(template(b), {template(b)})
        for n in group:
            tied[n] = group
    return tuple(n for n in sorted(info.names) if n not in have and not tied.get(n, set()) & have)


def pinned(info: ClassInfo, dtype: str, loaded: Iterable[str]) -> dict[str, str]:
    """Loaded name -> its parameter's own dtype, where the built model does not give it ``dtype``."""
    out = {}
    for name in loaded:
        own = info.pinned.get(template(name))
        if own is not None and own != dtype:
            out[name] = own
    return out
