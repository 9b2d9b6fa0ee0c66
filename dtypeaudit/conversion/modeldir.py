"""The files of a converted model directory other than its weights: config.json with the new dtype, the index
with the new sizes, and everything else copied. One home for local, remote and dequantizing conversion."""

from __future__ import annotations

import json
import os
import shutil
import stat
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from ..errors import ConversionError
from ..formats import directory as hfdir
from ..inventory import Inventory


def config_with_dtype(config: dict[str, Any], dtype: str | None, *, dequantized: bool = False) -> dict[str, Any]:
    """config.json naming ``dtype`` (unchanged when None); ``dequantized`` also drops ``quantization_config``,
    so that a plain ``from_pretrained`` loads the result as the model it was."""
    out = {k: v for k, v in config.items() if not (dequantized and k == "quantization_config")}
    if dtype is not None:
        # transformers 5 reads dtype (and torch_dtype where dtype is absent); 4 reads torch_dtype.
        keys = [k for k in ("torch_dtype", "dtype") if k in out] or ["torch_dtype"]
        out.update(dict.fromkeys(keys, dtype))
    return out


def index_with_sizes(index: dict[str, Any], total_size: int, weight_map: dict[str, str] | None = None) -> dict[str, Any]:
    """A weights index whose ``metadata.total_size`` (and, where the weights were re-packed, ``weight_map``) is the output's."""
    out = dict(index)
    out["metadata"] = {**(out.get("metadata") or {}), "total_size": total_size}
    if weight_map is not None:
        out["weight_map"] = weight_map
    return out


def read_json(path: Path) -> dict[str, Any]:
    from ..formats.jsonfile import within_json_cap

    within_json_cap(path)  # the readers' cap: a 200 MB config.json took 2.4 GB here
    doc = json.loads(path.read_text(encoding="utf-8"))
    return doc if isinstance(doc, dict) else {}


def write_json(path: Path, doc: dict[str, Any], *, mode_from: Path | None = None) -> None:
    """``doc`` as transformers writes its JSON files (two-space indent, a final newline), with ``mode_from``'s mode."""
    path.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    if mode_from is not None:
        os.chmod(path, file_mode(mode_from))


def file_mode(path: Path) -> int:
    """A file's permission bits (of the file a link names: a cache snapshot's blob)."""
    return stat.S_IMODE(path.stat().st_mode)


def refuse_escaping_link(root: Path, item: Path) -> None:
    """Refuse to copy a link that leads out of the model directory (other than into its cache blobs)."""
    if item.is_symlink() and not hfdir.link_allowed(root, item.resolve()):
        raise ConversionError(f"'{item.relative_to(root)}' is a link that leads outside the directory; refused", path=str(root))


def output_index(source: Inventory, *, repacked: bool = False) -> str | None:
    """The one index a converted model directory gets written with the output's sizes (and, ``repacked``, its new
    weight map), local, remote and dequantized alike; None: none.

    The output keeps the names of the source's weight files, so ``from_pretrained`` resolves the output as it
    resolved the source (``formats.directory.resolve``): it reads the index it read there (``Resolution.index``,
    which the directory's reader leaves in ``source.metadata["index"]``), and that one must describe the
    converted shards. Weights re-packed into ``model-NNNNN-of-NNNNN.safetensors`` shards are found through
    ``model.safetensors.index.json`` (or the source's own index, where it was a safetensors one). Any other index
    (a ``pytorch_model.bin.index.json`` beside a safetensors model) names files the conversion copies untouched,
    so it is copied untouched too.
    """
    named = source.metadata.get("index")
    source_index = named if isinstance(named, str) else None
    if repacked and not (source_index and source_index.endswith(".safetensors.index.json")):
        return hfdir.SAFE_WEIGHTS_INDEX_NAME
    return source_index


def not_carried(source: Inventory) -> frozenset[str]:
    """The files of a model directory its reader did not read because ``--exclude`` named them (paths in the
    folder): never read for safety, so never copied into a conversion's output."""
    excluded = source.metadata.get("excluded")
    return frozenset(str(label) for label in excluded) if isinstance(excluded, dict) else frozenset()


def copy_beside_weights(
    src_dir: Path,
    out_dir: Path,
    *,
    source: Inventory,
    skip: Collection[str],
    edit_config: Callable[[dict[str, Any]], dict[str, Any]],
) -> None:
    """Every file and folder of a model directory other than ``skip`` (its weights and the index the output gets
    written, ``output_index``), what ``source``'s reader was told to leave out (``not_carried``) and hidden files,
    copied into ``out_dir``: confined to ``src_dir`` (links are copied as the files they name), config.json
    rewritten through ``edit_config``, modes kept."""
    left_out = not_carried(source)

    def unread(folder: str, names: list[str]) -> set[str]:
        here = Path(folder).relative_to(src_dir)
        return {n for n in names if (here / n).as_posix() in left_out}

    for item in sorted(src_dir.iterdir()):
        if item.name in skip or item.name in left_out or item.name.startswith("."):
            continue
        dest = out_dir / item.name
        refuse_escaping_link(src_dir, item)
        if item.name == "config.json" and item.is_file():
            write_json(dest, edit_config(read_json(item)), mode_from=item)
        elif item.is_dir():
            for inner in item.rglob("*"):
                refuse_escaping_link(src_dir, inner)
            shutil.copytree(item, dest, symlinks=False, ignore=unread)  # links confined above are copied as the files they name
        else:
            shutil.copy2(item, dest)


def write_index(src_dir: Path, out_dir: Path, name: str | None, total_size: int, weight_map: dict[str, str] | None = None) -> None:
    """The output's index ``name`` (``output_index``'s choice; None: none): the source's of that name, when it has
    one, with the output's sizes, or a new one where the weights were re-packed into shards (``weight_map``)."""
    if name is None:
        return
    source_index = src_dir / name if (src_dir / name).is_file() else None
    if source_index is None and weight_map is None:
        return
    doc = read_json(source_index) if source_index is not None else {}
    write_json(out_dir / name, index_with_sizes(doc, total_size, weight_map), mode_from=source_index)
