"""Hugging Face hub ids, offline first: ``org/name``, ``org/name@rev``, ``hf://org/name[@rev][/path]``.

The local cache is read first, as huggingface_hub lays it out (``HF_HUB_CACHE``, else ``HF_HOME/hub``,
else ``~/.cache/huggingface/hub``): ``models--org--name/refs/<ref>`` holds a commit hash, and
``snapshots/<commit>/`` holds the files, as links into ``blobs/``. A revision given as a commit hash is
looked up directly, a branch or tag through its ref, no revision through ``refs/main``. Only where the
cache does not hold it does the hub get asked (through huggingface_hub's ``HfFileSystem``, with
``HF_TOKEN`` or the saved login), and never with ``HF_HUB_OFFLINE=1``: then the checkpoint is one
error line (exit 2).

A bare ``org/name`` is a hub id only where no local path of that name exists and it does not end like a
file (``.pt``, ``.safetensors`` ...): a local path always wins.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, unquote

from ..errors import CheckpointError
from .remote import RemotePath, remote_fs

_TRUE = {"1", "ON", "YES", "TRUE"}
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_NAME = r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,95}"
_BARE_ID = re.compile(rf"^(?P<repo>{_NAME}/{_NAME})(?:@(?P<rev>[A-Za-z0-9_.\-%]+))?$")
_HF_URL = re.compile(rf"^hf://(?:(?P<type>models|datasets|spaces)/)?(?P<repo>{_NAME}/{_NAME})(?:@(?P<rev>[^/]+))?(?:/(?P<sub>.*))?$")
_FILE_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".safetensors", ".json", ".pkl", ".tar", ".model", ".gguf", ".py", ".yaml", ".yml")


@dataclass(frozen=True)
class HubRef:
    """A repository on the hub, a revision and a path in it."""

    repo: str
    """``org/name``."""
    repo_type: str = "model"
    """``model``, ``dataset`` or ``space``."""
    revision: str | None = None
    """As given (a branch, a tag or a commit hash); None means ``main``."""
    subpath: str = ""
    """A file or folder in the repository; empty for the whole repository."""

    @property
    def folder(self) -> str:
        """The repository's folder in the cache (``models--org--name``)."""
        return f"{self.repo_type}s--{self.repo.replace('/', '--')}"


@dataclass(frozen=True)
class Located:
    """Where a hub reference was found."""

    location: Path | RemotePath
    """A snapshot in the local cache, or the repository on the hub."""
    source: str
    """``cache`` or ``hub``."""
    revision: str | None
    """The commit hash the cache resolved it to (None when read from the hub)."""


def offline() -> bool:
    """huggingface_hub's rule: ``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) set to 1, ON, YES or TRUE."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE")
    return value is not None and value.upper() in _TRUE


def cache_dir() -> Path:
    """huggingface_hub's cache folder, resolved from the environment as huggingface_hub resolves it."""
    xdg = os.getenv("XDG_CACHE_HOME", os.path.join(os.path.expanduser("~"), ".cache"))
    home = os.path.expandvars(os.path.expanduser(os.getenv("HF_HOME", os.path.join(xdg, "huggingface"))))
    legacy = os.getenv("HUGGINGFACE_HUB_CACHE", os.path.join(home, "hub"))
    return Path(os.path.expandvars(os.path.expanduser(os.getenv("HF_HUB_CACHE", legacy))))


def is_hub_id(target: str) -> bool:
    """``org/name`` or ``org/name@rev`` that is not a local path and does not end like a file name."""
    m = _BARE_ID.match(target)
    if m is None or "--" in m.group("repo") or ".." in m.group("repo"):
        return False
    if m.group("repo").lower().endswith(_FILE_SUFFIXES) or os.path.lexists(target):
        return False
    # A local folder named like the organisation: a typo in a local path (hf/gtp2 beside hf/gpt2), said as one.
    return not os.path.isdir(m.group("repo").split("/")[0])


def parse(target: str) -> HubRef:
    """A ``HubRef`` for ``org/name[@rev]`` or ``hf://[datasets/|spaces/]org/name[@rev][/path]``."""
    m = _HF_URL.match(target) if target.lower().startswith("hf://") else _BARE_ID.match(target)
    if m is None:
        raise CheckpointError("is not a Hugging Face hub id (org/name[@revision])", path=target)
    groups = m.groupdict()
    repo_type = (groups.get("type") or "models")[:-1]
    rev = unquote(groups["rev"]) if groups.get("rev") else None
    return HubRef(m.group("repo"), repo_type, rev, (groups.get("sub") or "").strip("/"))


def cached_snapshot(ref: HubRef) -> tuple[Path, str] | None:
    """The snapshot folder and commit the cache holds for ``ref``, or None."""
    repo = cache_dir() / ref.folder
    revision = ref.revision or "main"
    if _COMMIT.match(revision):
        commit = revision
    else:
        ref_file = repo / "refs" / revision
        try:
            commit = ref_file.read_text(encoding="utf-8").strip()
        except OSError:
            return None
        if not _COMMIT.match(commit):
            return None
    snapshot = repo / "snapshots" / commit
    return (snapshot, commit) if snapshot.is_dir() else None


def locate(target: str) -> Located:
    """The cached snapshot (or the file in it) ``target`` names, else the hub when allowed; CheckpointError otherwise."""
    ref = parse(target)
    cached = cached_snapshot(ref)
    if cached is not None:
        snapshot, commit = cached
        where = snapshot / ref.subpath if ref.subpath else snapshot
        if os.path.lexists(where):
            return Located(where, "cache", commit)
    what = f"{ref.repo}@{ref.revision}" if ref.revision else ref.repo
    if offline():
        held = "a snapshot without that file" if cached is not None else "no snapshot of it"
        raise CheckpointError(
            f"the Hugging Face cache ({cache_dir()}) holds {held}, and HF_HUB_OFFLINE=1 forbids asking the hub",
            path=target,
            hint=f"download it first: hf download {what}",
        )
    try:
        from huggingface_hub import HfFileSystem
    except ImportError:
        raise CheckpointError(
            f"is not in the Hugging Face cache ({cache_dir()}), and reading from the hub needs huggingface_hub",
            path=target,
            hint="pip install 'dtypeaudit[remote]'",
        ) from None

    prefix = "" if ref.repo_type == "model" else f"{ref.repo_type}s/"
    rev = f"@{quote(ref.revision, safe='')}" if ref.revision else ""
    path = f"{prefix}{ref.repo}{rev}" + (f"/{ref.subpath}" if ref.subpath else "")
    return Located(RemotePath(remote_fs(HfFileSystem()), path), "hub", None)
