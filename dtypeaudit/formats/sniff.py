"""Name a file's format from its first bytes, and name what it is when it is not a checkpoint."""

from __future__ import annotations

from pathlib import Path

from ..errors import CheckpointError

# Legacy torch.save starts with a pickled 10-byte integer (its magic number); the reader checks the value.
_LEGACY_PREFIX = b"\x80\x02\x8a\x0a"

# Things people end up holding instead of a checkpoint, and what to tell them.
_NOT_CHECKPOINTS: tuple[tuple[bytes, str], ...] = (
    (
        b"version https://git-lfs.github.com/spec",
        "a Git LFS pointer file, not the checkpoint itself; run `git lfs pull` to fetch the real file",
    ),
    (b"\x89PNG", "a PNG image, not a checkpoint"),
    (b"\xff\xd8\xff", "a JPEG image, not a checkpoint"),
    (b"GIF8", "a GIF image, not a checkpoint"),
    (b"%PDF", "a PDF document, not a checkpoint"),
    (b"\x1f\x8b", "gzip-compressed data; decompress it first"),
    (b"GGUF", "a GGUF file (llama.cpp), not a PyTorch checkpoint"),
    (b"\x89HDF", "an HDF5 file (Keras?), not a PyTorch checkpoint"),
    (b"\x93NUMPY", "a NumPy .npy array, not a PyTorch checkpoint"),
)


def sniff(path: Path) -> str:
    """``zip``, ``legacy``, ``safetensors`` or ``pickle``; anything else raises a one-line CheckpointError."""
    try:
        with path.open("rb") as fh:
            head = fh.read(512)
    except IsADirectoryError:
        raise CheckpointError("is a directory", path=str(path)) from None
    if not head:
        raise CheckpointError("empty file (0 bytes); an interrupted download?", path=str(path))
    if head.startswith(b"PK\x03\x04") or head.startswith(b"PK\x05\x06"):
        return "zip"
    if head.startswith(_LEGACY_PREFIX):
        return "legacy"
    if head[8:9] == b"{":  # an 8-byte header length, then the JSON header; the reader checks the length
        return "safetensors"
    if head[:1] == b"\x80" and len(head) > 1 and head[1] <= 5:
        return "pickle"
    for magic, what in _NOT_CHECKPOINTS:
        if head.startswith(magic):
            raise CheckpointError(f"is {what}", path=str(path))
    text = head.lstrip().lower()
    if text.startswith((b"<!doctype html", b"<html", b"<?xml", b"<head")):
        raise CheckpointError("is an HTML page, not a checkpoint (a login or error page saved in its place?)", path=str(path))
    if text.startswith((b"{", b"[")):
        raise CheckpointError("is a JSON file, not a checkpoint", path=str(path))
    if len(head) >= 262 and head[257:262] == b"ustar":
        raise CheckpointError(
            "is a tar archive (torch.save's pre-0.4 format, not supported); re-save it with a current torch", path=str(path)
        )
    raise CheckpointError(f"is not a checkpoint: unrecognised content starting {head[:8]!r}", path=str(path))
