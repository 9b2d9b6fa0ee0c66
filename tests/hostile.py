"""Builders for hostile and broken inputs, made at test time. Nothing here is ever loaded by a trusting loader."""

from __future__ import annotations

import io
import json
import struct
import zipfile
from pathlib import Path

import torch


def torch_zip_bytes(state: object) -> bytes:
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def rewrite_zip(
    src: bytes,
    dest: Path,
    *,
    drop: set[str] = frozenset(),
    replace: dict[str, bytes] | None = None,  # type: ignore[assignment]
    add: list[tuple[str, bytes]] = (),
    compress: set[str] = frozenset(),
    rename: dict[str, str] | None = None,
) -> Path:  # type: ignore[assignment]
    """Copy a zip member by member, dropping, replacing, renaming, adding or deflating some."""
    replace, rename = replace or {}, rename or {}
    with zipfile.ZipFile(io.BytesIO(src)) as zin, zipfile.ZipFile(dest, "w") as zout:
        for info in zin.infolist():
            name = info.filename
            if name in drop:
                continue
            data = replace.get(name, zin.read(name))
            zout.writestr(
                zipfile.ZipInfo(rename.get(name, name)),
                data,
                compress_type=zipfile.ZIP_DEFLATED if name in compress else zipfile.ZIP_STORED,
            )
        for name, data in add:
            zout.writestr(zipfile.ZipInfo(name), data)
    return dest


def with_data_pkl(dest: Path, data_pkl: bytes, *, storages: dict[str, bytes] | None = None, prefix: str = "archive/") -> Path:
    """A torch.save-shaped archive around a hand-made data.pkl."""
    with zipfile.ZipFile(dest, "w") as z:
        z.writestr(prefix + "data.pkl", data_pkl)
        z.writestr(prefix + "byteorder", b"little")
        for key, data in (storages or {}).items():
            z.writestr(f"{prefix}data/{key}", data)
        z.writestr(prefix + "version", b"3\n")
    return dest


def text(value: str) -> bytes:
    data = value.encode()
    return b"X" + struct.pack("<I", len(data)) + data


def global_op(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def call(func: bytes, *args: bytes) -> bytes:
    """Opcodes that call ``func`` (opcodes pushing a callable) with ``args`` (opcodes pushing values)."""
    return func + b"(" + b"".join(args) + b"tR"


def dict_pickle(**items: bytes) -> bytes:
    """A protocol-2 pickle of a dict whose values are given as opcodes."""
    body = b"".join(text(k) + v for k, v in items.items())
    return b"\x80\x02}(" + body + b"u."


def reduce_pickle(module: str, name: str, *args: str) -> bytes:
    """A pickle that would call ``module.name(*args)`` in a trusting loader: written by hand, never loaded."""
    return dict_pickle(weight=b"G" + struct.pack(">d", 1.0), payload=call(global_op(module, name), *(text(a) for a in args)))


def safetensors_bytes(header: dict[str, object] | bytes, data: bytes = b"", *, length: int | None = None) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data
