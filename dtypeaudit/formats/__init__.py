"""Readers, one module per container. Each turns a path into an Inventory without running checkpoint code.

:func:`read_checkpoint` picks the reader from the content, never the extension, as torch.load and
safetensors decide (see :mod:`.sniff`); a file that is two formats at once is refused.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import CheckpointError, DtypeAuditError
from ..inventory import Inventory
from . import dcp, directory, safetensors, torchzip
from .sniff import sniff


def read_file(path: Path) -> Inventory:
    kind = sniff(path)
    if kind == "zip":
        return torchzip.read_zip(path)
    if kind == "legacy":
        return torchzip.read_legacy(path)
    if kind == "safetensors":
        return safetensors.read(path)
    return torchzip.read_pickle(path)


def read_checkpoint(path: str | Path) -> Inventory:
    """The inventory of a checkpoint file or directory; CheckpointError (one line) if it cannot be read."""
    p = Path(path)
    try:
        if not p.exists():
            raise CheckpointError("no such file or directory", path=str(p))
        if p.is_dir():
            if (p / ".metadata").is_file():
                return dcp.read(p)
            if directory.is_model_directory(p):
                return directory.read(p, read_file)
            raise CheckpointError(
                "directory holds no checkpoint (no .metadata, no index, no *.safetensors or pytorch_model*.bin)", path=str(p)
            )
        return read_file(p)
    except DtypeAuditError as exc:
        if exc.path is None:
            exc.path = str(p)
        raise
    except PermissionError:
        raise CheckpointError("permission denied", path=str(p)) from None
    except RecursionError:
        raise CheckpointError("structure nests too deeply to read", path=str(p)) from None
    except MemoryError:
        raise CheckpointError("ran out of memory reading it", path=str(p)) from None
    except OSError as exc:
        raise CheckpointError(f"cannot read ({exc.strerror or exc})", path=str(p)) from None
