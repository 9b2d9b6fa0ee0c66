"""Readers, one module per container. Each turns a byte source into an Inventory without running checkpoint code.

:func:`read_checkpoint` picks the reader from the content, never the extension, as torch.load and
safetensors decide (see :mod:`.sniff`); a file that is two formats at once is refused. Every reader
reads through a :class:`.source.Source`, local or remote (see :mod:`.source`), so a URL is audited by
the same code as a file on disk.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ..errors import CheckpointError, DtypeAuditError
from ..inventory import Format, Inventory, format_of
from ..redact import redact
from . import gguf, locate, source, torchzip
from .locate import AnyPath, TargetRef
from .sniff import sniff_kind
from .source import Source

__all__ = ["Format", "format_of", "read_checkpoint", "read_file"]


def read_file(path: AnyPath | Source) -> Inventory:
    """One file's inventory, its format decided by content; the source is opened once for sniffing and reading."""
    with locate.opened(path) as src:
        kind = sniff_kind(src)
        if kind == "zip":
            return torchzip.read_zip(src)
        if kind == "legacy":
            return torchzip.read_legacy(src)
        if kind == "safetensors":
            from . import safetensors

            return safetensors.read(src)
        if kind == "gguf":
            return gguf.read(src)
        return torchzip.read_pickle(src)


def read_checkpoint(path: str | AnyPath | TargetRef, *, label: str | None = None, exclude: tuple[str, ...] = ()) -> Inventory:
    """The inventory of a checkpoint file or directory, local or remote (a URL: ``s3://``, ``https://``, ``hf://``,
    any fsspec protocol); CheckpointError (one line) if it cannot be read. ``bytes_read`` says how much was read.

    A string is parsed as a URL or a local path (``locate.parse_target`` without factories or bare hub ids); a
    ``TargetRef`` is read where it lies, located only if it was not yet. ``label`` names it in the inventory instead
    of the path (a hub id read from a cache snapshot). ``exclude``: glob patterns for files of a directory that are
    left out of its safety scan (each is listed in a note).
    """
    target = locate.as_target(path, models=False)
    shown = label or (redact(target.text) if target.named_by_url else None)  # a URL is shown as named
    hub_meta: dict[str, object] = {}
    with source.metered() as meter:
        p: AnyPath = Path(target.text) if not target.is_remote else Path()
        try:
            p, found = target.located()
            origin = (found.source, found.revision) if found is not None else target.hub_origin
            if origin is not None:
                hub_meta = {"hub": {"read_from": origin[0], "revision": origin[1]}}
            shown = shown or str(p)
            inv = _read(p, shown, exclude, target)
        except DtypeAuditError as exc:
            if exc.path is None:
                raise exc.naming(shown or str(p)) from exc
            raise
        except PermissionError:
            raise CheckpointError("permission denied", path=shown or str(p)) from None
        except RecursionError:
            raise CheckpointError("structure nests too deeply to read", path=shown or str(p)) from None
        except MemoryError:
            raise CheckpointError("ran out of memory reading it", path=shown or str(p)) from None
        except OSError as exc:
            raise CheckpointError(f"cannot read ({exc.strerror or exc})", path=shown or str(p)) from None
    out = replace(inv, bytes_read=meter.total)
    if label is not None or (shown is not None and shown != inv.path):
        out = replace(out, path=shown)
    if hub_meta:
        out = replace(out, metadata={**out.metadata, **hub_meta})
    return out


def _read(p: AnyPath, shown: str, exclude: tuple[str, ...], target: TargetRef) -> Inventory:
    if not p.exists():
        raise CheckpointError(source.missing_local_path(str(p)) if isinstance(p, Path) else "no such file or directory", path=shown)
    if p.is_dir():
        return _read_directory(p, shown, exclude, target)
    return read_file(p)


def _read_directory(p: AnyPath, shown: str, exclude: tuple[str, ...], target: TargetRef) -> Inventory:
    """A directory as DCP or a Hugging Face model, its JSON files each parsed once (``directory.Documents``), those
    the expansion parsed to tell that it is a model (``target.documents``) not again."""
    from . import dcp, directory  # a directory's readers: a file's scan does not import them

    known = target.documents if target.where is not None else None
    docs = directory.Documents(known, folder=target.where)

    is_dcp = (p / ".metadata").is_file() and not directory.excluded_by(".metadata", exclude)
    if is_dcp and directory.is_model_directory(p, docs):
        # torch.distributed.checkpoint would load .metadata's tensors, from_pretrained its weight files: two models.
        raise CheckpointError(
            "holds both a torch.distributed.checkpoint (.metadata) and a Hugging Face model (config, index or weight "
            "files), which load as two different models; refused (scan the files by name, or --exclude .metadata)",
            path=shown,
        )
    if is_dcp:
        return dcp.read(p, read_file, exclude=exclude)
    if directory.is_model_directory(p, docs):
        return directory.read(p, read_file, docs, exclude=exclude)
    raise CheckpointError(
        "directory is not one checkpoint: no DCP .metadata, no weights index, and no config.json or numbered shards "
        "beside its weight files (what from_pretrained needs); name its files one by one (or scan the folder, which "
        "reads each file apart)",
        path=shown,
    )
