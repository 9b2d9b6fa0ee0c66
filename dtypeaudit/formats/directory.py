"""Hugging Face model directories: sharded safetensors or ``pytorch_model*.bin`` files, with or without an index.

Shard names come from a file the user downloaded, so each is confined to the directory before it is
opened. Where the index and the shards disagree, the report says so tensor by tensor.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, LimitExceeded
from ..inventory import Finding, Inventory, TensorRecord, link_shared_storage
from .jsonfile import DuplicateKey, loads_unique

INDEX_NAMES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
MAX_JSON_BYTES = 64 << 20


def _load_json(path: Path) -> Any:
    if path.stat().st_size > MAX_JSON_BYTES:
        raise LimitExceeded("JSON file is over the 64 MiB cap", path=str(path))

    try:
        return loads_unique(path.read_text(encoding="utf-8"))
    except DuplicateKey as exc:
        raise CheckpointError(f"'{exc.key}' is listed twice", path=str(path)) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"not valid JSON ({exc})", path=str(path)) from None


def confine(root: Path, name: str, *, origin: Path) -> Path:
    """The shard ``name`` inside ``root``, refusing absolute paths, ``..`` and links that lead out."""
    if not name or name.startswith(("/", "\\")) or ":" in name[:3] or any(p == ".." for p in name.replace("\\", "/").split("/")):
        raise CheckpointError(f"shard name '{name}' leaves the directory; refused", path=str(origin))
    candidate = root / name
    resolved = candidate.resolve()
    if not resolved.is_relative_to(root.resolve()):
        raise CheckpointError(f"shard '{name}' is a link that leads outside the directory; refused", path=str(origin))
    if not candidate.is_file():
        raise CheckpointError(f"shard '{name}' named by the index is missing", path=str(origin))
    return candidate


def find_index(path: Path) -> Path | None:
    for name in INDEX_NAMES:
        if (path / name).is_file():
            return path / name
    return None


def shard_files(path: Path) -> list[Path]:
    safetensors = sorted(p for p in path.glob("*.safetensors") if p.is_file())
    if safetensors:
        return safetensors
    return sorted(p for p in path.glob("pytorch_model*.bin") if p.is_file())


_SHARD_NAME = re.compile(r"-\d{5}-of-\d{5}\.(safetensors|bin)$")


def is_model_directory(path: Path) -> bool:
    """An index, or shard files with a config.json or numbered like ``model-00001-of-00004``.

    A folder that merely holds a few unrelated checkpoints is not one model.
    """
    if find_index(path) is not None:
        return True
    shards = shard_files(path)
    return bool(shards) and ((path / "config.json").is_file() or all(_SHARD_NAME.search(s.name) for s in shards))


def read(path: Path, read_file: Callable[[Path], Inventory]) -> Inventory:
    index_path = find_index(path)
    findings: list[Finding] = []
    weight_map: dict[str, str] | None = None
    if index_path is not None:
        index = _load_json(index_path)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
            raise CheckpointError("index has no weight_map of tensor names to shard files", path=str(index_path))
        shards = [confine(path, name, origin=index_path) for name in dict.fromkeys(weight_map.values())]
    else:
        shards = shard_files(path)
    if not shards:
        raise CheckpointError("directory holds no checkpoint: no index, no *.safetensors, no pytorch_model*.bin", path=str(path))

    tensors: list[TensorRecord] = []
    holder: dict[str, str] = {}
    for shard in shards:
        label = shard.name
        inv = read_file(shard)
        findings.extend(f if f.file else Finding(**{**f.__dict__, "file": label}) for f in inv.findings)
        for t in inv.tensors:
            if t.name in holder:
                findings.append(
                    Finding("index-mismatch", "error", f"tensor is stored in both {holder[t.name]} and {label}", tensor=t.name, file=label)
                )
                continue
            holder[t.name] = label
            tensors.append(t.with_(file=label, shares_with=()))

    if weight_map is not None:
        assert index_path is not None
        for name, shard_name in weight_map.items():
            where = holder.get(name)
            if where is None:
                findings.append(
                    Finding(
                        "index-mismatch",
                        "error",
                        f"index lists it in {shard_name}, but no shard holds it",
                        tensor=name,
                        file=index_path.name,
                    )
                )
            elif Path(shard_name).name != where:
                findings.append(
                    Finding(
                        "index-mismatch",
                        "error",
                        f"index says {shard_name}, but it is stored in {where}",
                        tensor=name,
                        file=index_path.name,
                    )
                )
        for name, where in holder.items():
            if name not in weight_map:
                findings.append(
                    Finding("index-mismatch", "warning", f"stored in {where} but missing from the index", tensor=name, file=where)
                )

    metadata: dict[str, object] = {"shards": [s.name for s in shards]}
    if index_path is not None:
        metadata["index"] = index_path.name
    config = path / "config.json"
    if config.is_file():
        try:
            cfg = _load_json(config)
        except CheckpointError:
            cfg = None
        if isinstance(cfg, dict):
            dtype = cfg.get("torch_dtype", cfg.get("dtype"))
            if isinstance(dtype, str):
                metadata["config_dtype"] = dtype
    return Inventory(str(path), "hf-directory", link_shared_storage(tensors), tuple(findings), metadata)
