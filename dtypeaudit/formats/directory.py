"""Hugging Face model directories, audited as transformers' ``from_pretrained`` would load them.

Which files are read mirrors ``PreTrainedModel.from_pretrained`` in transformers 5.24 with its default
arguments (no subfolder, no variant, ``use_safetensors=None``): distributed shards first, then
``transformers_weights`` from config.json, then ``model.safetensors``, its index, ``pytorch_model.bin``
and its index, in that order (``_get_resolved_checkpoint_files``), plus the config class's
``extra_files``. Every other weight file in the directory is reported as ``unused-weights``.

Names that come from a file the user downloaded (an index's shards, ``transformers_weights``) are
confined to the directory before they are opened. Where the index and the shards disagree, the
report says so tensor by tensor.

The directory may be remote (an S3 prefix, a repository on the hub): ``remote.RemotePath`` answers the
same questions from one listing per folder, and the shards are then read concurrently.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, overload

from ..errors import CheckpointError, DtypeAuditError, LimitExceeded
from ..inventory import Finding, Inventory, TensorRecord, link_shared_storage
from . import locate, remote, source
from .jsonfile import MAX_JSON_BYTES, within_json_cap
from .locate import AnyPath
from .remote import RemoteError, RemotePath
from .source import SKIPPED_DIRS
from .training import holds_optimizer_state, trainer_state, training_state_finding

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
WEIGHTS_NAME = "pytorch_model.bin"
WEIGHTS_INDEX_NAME = "pytorch_model.bin.index.json"
INDEX_NAMES = (SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_INDEX_NAME)

# transformers.distributed.checkpoint.is_sharded_checkpoint: one such name and from_pretrained reads every
# *.safetensors file in the folder through torch.distributed.checkpoint instead.
_DISTRIBUTED_SHARD = re.compile(r"^shard-[0-9]{5}-model-[0-9]{5}-of-[0-9]{5}\.safetensors$")
# PretrainedConfig.extra_files of the config classes that set it (a class attribute, chosen by model_type).
_EXTRA_FILES: dict[str, tuple[str, ...]] = {"jev": ("head.safetensors", "readout.safetensors")}
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt")
_SHARD_NAME = re.compile(r"-\d{5}-of-\d{5}\.(safetensors|bin)$")


@dataclass(frozen=True)
class _Document:
    """A JSON file parsed once: its value as ``json.loads`` gives it (a key given twice keeps its last value,
    as from_pretrained reads config.json) and the first key given twice, which the strict readings refuse."""

    value: Any
    duplicate: str | None
    size: int = 0
    """The bytes it was parsed from."""
    carried: bool = False
    """Parsed before this read and handed to it (``Documents``' ``known``): its bytes are not yet counted in this
    read's ``bytes_read``."""


class Documents:
    """A model folder's JSON files (config.json, the index), each read and parsed once however many questions
    (which files load, which dtype, which keys repeat) are asked of it: one is made per read of a folder, or per
    question whether a folder is a model, and handed to every function that asks.

    ``known``: the documents of ``folder`` parsed before, by their names in it (``under``: what a scan's expansion
    parsed to tell that the folder is a model, carried in its ``TargetRef.documents``), answered without reading
    them again; the bytes they were read from still count in the read's ``bytes_read``, once."""

    def __init__(self, known: Mapping[str, _Document] | None = None, *, folder: AnyPath | None = None) -> None:
        self._parsed: dict[str, _Document] = (
            {str(folder / name): replace(doc, carried=True) for name, doc in (known or {}).items()} if folder is not None else {}
        )

    def under(self, folder: AnyPath) -> dict[str, _Document]:
        """The documents parsed so far that lie in ``folder`` or below it, by their names relative to it (so that they
        still apply where the folder is named otherwise: a worker given its absolute path)."""
        prefix = str(folder / "_")[:-1]  # the folder's path and its separator, local or remote
        return {key[len(prefix) :]: doc for key, doc in self._parsed.items() if key.startswith(prefix)}

    def parse(self, path: AnyPath) -> _Document:
        known = self._parsed.get(str(path))
        if known is not None:
            if known.carried:  # read before this read began: counted in it now, once
                source.count_read(source.current_meter(), known.size)
                self._parsed[str(path)] = known = replace(known, carried=False)
            return known
        within_json_cap(path)
        repeated: list[str] = []

        def last_wins(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
            out: dict[str, Any] = {}
            for key, value in pairs:
                if key in out and not repeated:
                    repeated.append(key)
                out[key] = value
            return out

        raw = locate.read_small(path, MAX_JSON_BYTES)
        value = json.loads(raw.decode("utf-8"), object_pairs_hook=last_wins)
        self._parsed[str(path)] = doc = _Document(value, repeated[0] if repeated else None, len(raw))
        return doc

    def load_json(self, path: AnyPath) -> Any:
        """A JSON file we do not trust: a key written twice is an error, not a silent overwrite."""
        try:
            doc = self.parse(path)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"not valid JSON ({exc})", path=str(path)) from None
        if doc.duplicate is not None:
            raise CheckpointError(f"'{doc.duplicate}' is listed twice", path=str(path))
        return doc.value


def _unsafe_name(name: str) -> bool:
    return not name or name.startswith(("/", "\\")) or ":" in name[:3] or any(p == ".." for p in name.replace("\\", "/").split("/"))


_CACHE_REPO = re.compile(r"^(models|datasets|spaces)--.+")


def link_allowed(root: AnyPath, resolved: AnyPath) -> bool:
    """Whether a link under ``root`` may be followed to ``resolved``: inside ``root``, or, where ``root`` is a
    snapshot in the Hugging Face cache (``models--org--name/snapshots/<rev>/``, whose files huggingface_hub
    lays out as links to ``../../blobs/<hash>``), into that same repository's ``blobs/``. Remote stores have
    no links: a remote name is allowed where it stays under ``root``."""
    if isinstance(root, RemotePath) or isinstance(resolved, RemotePath):
        return isinstance(root, RemotePath) and isinstance(resolved, RemotePath) and resolved.is_relative_to(root)
    if resolved.is_relative_to(root.resolve()):
        return True
    here = root.absolute()
    for snapshots in here.parents:
        if snapshots.name == "snapshots" and _CACHE_REPO.match(snapshots.parent.name):
            blobs = snapshots.parent / "blobs"
            return blobs.is_dir() and resolved.parent == blobs.resolve()
    return False


@overload
def confine(root: Path, name: str, *, origin: AnyPath) -> Path: ...
@overload
def confine(root: RemotePath, name: str, *, origin: AnyPath) -> RemotePath: ...
def confine(root: AnyPath, name: str, *, origin: AnyPath) -> AnyPath:
    """The shard ``name`` inside ``root``, refusing absolute paths, ``..`` and links that lead out (except a
    cache snapshot's links into its own blobs, see ``link_allowed``)."""
    if _unsafe_name(name):
        raise CheckpointError(f"shard name '{name}' leaves the directory; refused", path=str(origin))
    candidate = root / name
    resolved = candidate.resolve()
    if not link_allowed(root, resolved):
        raise CheckpointError(f"shard '{name}' is a link that leads outside the directory; refused", path=str(origin))
    if not candidate.is_file():
        raise CheckpointError(f"shard '{name}' named by the index is missing", path=str(origin))
    return candidate


def _relative(p: AnyPath, root: AnyPath) -> str:
    if isinstance(p, RemotePath) and isinstance(root, RemotePath):
        return p.relative_to(root).as_posix()
    if isinstance(p, Path) and isinstance(root, Path):
        return p.relative_to(root).as_posix()
    raise ValueError(f"{p} is not under {root}")


def _label(name: str) -> str:
    """A file's name relative to the directory, as reports show it (``sub/x.safetensors``)."""
    return os.path.normpath(name.replace("\\", "/")).replace(os.sep, "/")


# -- which files from_pretrained reads ------------------------------------------------------------


@dataclass(frozen=True)
class Resolution:
    """The weight files of a directory, in the order the loader reads them (a later file wins a name)."""

    files: tuple[str, ...]
    """Names relative to the directory."""
    chosen: str
    """How they were chosen, for messages: ``model.safetensors``, ``the shards of model.safetensors.index.json``."""
    index: str | None = None
    """The index whose weight_map named them."""
    weight_map: dict[str, str] | None = None
    from_pretrained: bool = True
    """False where from_pretrained finds nothing to load and dtypeaudit reads the shards it sees instead."""


def _config(path: AnyPath, docs: Documents) -> dict[str, Any]:
    """config.json as from_pretrained reads it: ``json.loads``, so a key given twice keeps its last value;
    {} where there is none or it does not parse; refused over the JSON cap."""
    config = path / "config.json"
    if not config.is_file():
        return {}
    try:
        cfg = docs.parse(config).value
    except (RemoteError, LimitExceeded):
        raise  # over the cap: from_pretrained would read it, so a verdict without it would not be about its model
    except (CheckpointError, OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return cfg if isinstance(cfg, dict) else {}


def _duplicate_key(path: AnyPath, docs: Documents) -> str | None:
    """A key config.json gives twice (from_pretrained keeps the last), or None."""
    try:
        docs.load_json(path / "config.json")
    except CheckpointError as exc:
        return exc.message if "listed twice" in exc.message else None
    except OSError:
        return None
    return None


def _weight_map(path: AnyPath, index_name: str, docs: Documents) -> dict[str, str]:
    index_path = path / index_name
    index = docs.load_json(index_path)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise CheckpointError("index has no weight_map of tensor names to shard files", path=str(index_path))
    return weight_map


def _sharded(path: AnyPath, index_name: str, chosen: str, docs: Documents) -> Resolution:
    weight_map = _weight_map(path, index_name, docs)
    # get_checkpoint_shard_files: sorted(set(weight_map.values())), each joined to the model directory
    # (not to the index's own folder); merged in that order, so a later shard wins a name.
    shards = sorted(set(weight_map.values()))
    labels = {name: _shard_label(path, name, origin=path / index_name) for name in shards}
    for label in labels.values():
        confine(path, label, origin=path / index_name)
    named = {tensor: labels[name] for tensor, name in weight_map.items()}
    return Resolution(tuple(dict.fromkeys(labels[s] for s in shards)), chosen, index_name, named)


def _shard_label(root: AnyPath, name: str, *, origin: AnyPath) -> str:
    """The file an index's shard name opens, relative to ``root``: the loader joins the name to the folder and
    the system walks it, so ``sub/../shard`` is a shard of the folder (``sub`` must exist, and a link ``sub``
    leads where it leads). Refused where it leaves the folder; ``..`` is not followed in a remote store."""
    parts = name.split("/")
    if not _unsafe_name(name):
        return _label(name)
    if ".." not in parts or "\\" in name or name.startswith("/") or ":" in name[:3] or not isinstance(root, Path):
        return name  # confine refuses it
    folder, base = root / "/".join(parts[:-1]), parts[-1]
    leaves = _label(name).split("/")[0] == ".."
    if not leaves and (base in ("", ".", "..") or not folder.is_dir()):
        raise CheckpointError(f"shard '{name}' named by the index is missing", path=str(origin))
    if leaves or not folder.resolve().is_relative_to(root.resolve()):
        raise CheckpointError(f"shard name '{name}' leaves the directory; refused", path=str(origin))
    return _label(str((folder.resolve() / base).relative_to(root.resolve())))


def resolve(path: AnyPath, docs: Documents | None = None) -> Resolution | None:
    """The files ``from_pretrained(path)`` loads, or None where it finds none of its names. ``docs``: the folder's
    JSON files parsed so far (a fresh store where none is given)."""
    if docs is None:
        docs = Documents()
    names = sorted(locate.listdir(path))
    if any(_DISTRIBUTED_SHARD.match(n) for n in names):
        # _get_resolved_distributed_checkpoint_files: every name ending .safetensors, sorted.
        files = tuple(n for n in names if n.endswith(".safetensors") and (path / n).is_file())
        return Resolution(files, "every *.safetensors file here, as distributed shards")
    cfg = _config(path, docs)
    explicit = cfg.get("transformers_weights")
    if explicit is not None:
        origin = path / "config.json"
        if not isinstance(explicit, str) or not (
            explicit.endswith((".safetensors", ".safetensors.index.json")) or explicit == "adapter_model.bin"
        ):
            raise CheckpointError(
                f"config.json's transformers_weights {explicit!r} is not a safetensors file or index; from_pretrained refuses it",
                path=str(origin),
            )
        if _unsafe_name(explicit):
            raise CheckpointError(f"config.json's transformers_weights '{explicit}' leaves the directory; refused", path=str(origin))
        if not (path / explicit).is_file():
            raise CheckpointError(f"config.json's transformers_weights names '{explicit}', which is missing", path=str(origin))
        confine(path, explicit, origin=origin)
        if explicit.endswith(".safetensors.index.json"):
            res = _sharded(path, explicit, f"the shards of {_label(explicit)}, named by config.json's transformers_weights", docs)
        else:
            res = Resolution((_label(explicit),), f"{_label(explicit)}, named by config.json's transformers_weights")
    elif (path / SAFE_WEIGHTS_NAME).is_file():
        res = Resolution((SAFE_WEIGHTS_NAME,), SAFE_WEIGHTS_NAME)
    elif (path / SAFE_WEIGHTS_INDEX_NAME).is_file():
        res = _sharded(path, SAFE_WEIGHTS_INDEX_NAME, f"the shards of {SAFE_WEIGHTS_INDEX_NAME}", docs)
    elif (path / WEIGHTS_NAME).is_file():
        res = Resolution((WEIGHTS_NAME,), WEIGHTS_NAME)
    elif (path / WEIGHTS_INDEX_NAME).is_file():
        res = _sharded(path, WEIGHTS_INDEX_NAME, f"the shards of {WEIGHTS_INDEX_NAME}", docs)
    else:
        return None
    model_type = cfg.get("model_type")
    extra_names = _EXTRA_FILES.get(model_type, ()) if isinstance(model_type, str) else ()
    extra = [f for f in extra_names if (path / f).is_file() and f not in res.files]
    if extra:
        res = Resolution(res.files + tuple(extra), f"{res.chosen} and {', '.join(extra)}", res.index, res.weight_map)
    return res


def shard_files(path: AnyPath) -> list[AnyPath]:
    safetensors: list[AnyPath] = sorted((p for p in path.glob("*.safetensors") if p.is_file()), key=lambda p: p.name)
    if safetensors:
        return safetensors
    return sorted((p for p in path.glob("pytorch_model*.bin") if p.is_file()), key=lambda p: p.name)


def find_index(path: AnyPath) -> AnyPath | None:
    for name in INDEX_NAMES:
        if (path / name).is_file():
            return path / name
    return None


def _fallback(path: AnyPath) -> Resolution | None:
    """What dtypeaudit reads where from_pretrained finds none of its names (diffusers' folders, bare
    shards): every ``*.safetensors`` file, else every ``pytorch_model*.bin``."""
    shards = shard_files(path)
    if not shards:
        return None
    names = tuple(s.name for s in shards)
    return Resolution(names, ", ".join(names), from_pretrained=False)


def is_model_directory(path: AnyPath, docs: Documents | None = None) -> bool:
    """A config.json next to weights from_pretrained would load, an index, or shard files with a
    config.json or numbered like ``model-00001-of-00004``. A folder that merely holds a few
    unrelated checkpoints is not one model. ``docs``: the folder's JSON files parsed so far, and those this parses."""
    has_config = (path / "config.json").is_file()
    try:
        if has_config and resolve(path, docs) is not None:
            return True
    except (DtypeAuditError, OSError):
        return True  # its index or config is broken: reading it says how
    if find_index(path) is not None:
        return True
    shards = shard_files(path)
    return bool(shards) and (has_config or all(_SHARD_NAME.search(s.name) for s in shards))


# -- walking a tree -------------------------------------------------------------------------------


def walk_files(
    root: AnyPath,
    *,
    stop_at: Callable[[Any], bool] | None = None,
    on_skip: Callable[[AnyPath, str], None] | None = None,
) -> Iterator[AnyPath]:
    """Every file under ``root`` in sorted order. A folder below ``root`` for which ``stop_at`` is true is
    yielded itself instead of entered.

    Links to files are followed wherever they lead, as torch.load and from_pretrained follow them (a link out
    of ``root`` is read where it leads, never written to); links to folders are not entered (inside the tree
    their files are reached anyway). What is passed over is told to ``on_skip`` with the reason: VCS folders,
    links to folders out of the tree, dangling links, what is not a regular file (a FIFO would block a read),
    folders that cannot be listed."""
    skip = on_skip or (lambda p, why: None)
    if isinstance(root, RemotePath):
        yield from root.walk(stop_at)
        return
    top = root.resolve()
    stack = [root]
    while stack:
        here = stack.pop()
        if here != root and stop_at is not None and stop_at(here):
            yield here
            continue
        try:
            with os.scandir(here) as it:
                entries = sorted(it, key=lambda e: e.name)
        except OSError as exc:
            skip(here, f"a folder that cannot be listed ({exc.strerror or exc})")
            continue
        subdirs = []
        for entry in entries:
            p = Path(entry.path)
            try:
                if entry.is_symlink():
                    target = p.resolve()
                    if target.is_file():
                        yield p
                    elif target.is_dir():
                        if not (target.is_relative_to(top) or link_allowed(root, target)):
                            skip(p, f"a link to a folder outside the tree ({target}); not entered: scan it by name")
                    elif target.exists():
                        skip(p, "a link to something that is not a regular file")
                    else:
                        skip(p, "a dangling link")
                elif entry.is_dir(follow_symlinks=False):
                    if entry.name in SKIPPED_DIRS:
                        skip(p, "a version-control folder")
                    else:
                        subdirs.append(p)
                elif entry.is_file(follow_symlinks=False):
                    yield p
                else:
                    skip(p, "not a regular file (a FIFO, socket or device)")
            except OSError as exc:
                skip(p, f"cannot be looked at ({exc.strerror or exc})")
            except RuntimeError:  # pathlib's resolve() on Python < 3.13 raises this for a link loop, not an OSError
                yield p  # bad input, not ours to pass over: reading it says so (source.missing_local_path), exit 2
        stack.extend(reversed(subdirs))


def link_out_note(root: AnyPath, p: AnyPath) -> str | None:
    """Where a file reached under ``root`` is a link leading out of it: the note that says it was read there."""
    if isinstance(p, RemotePath) or not isinstance(root, Path) or not p.is_symlink():
        return None
    target = p.resolve()
    if target.is_relative_to(root.resolve()) or link_allowed(root, target):
        return None
    return f"{_relative(p, root)} is a link out of the folder, to {target}; it was read there"


def excluded_by(label: str, exclude: tuple[str, ...]) -> str | None:
    """The ``--exclude`` pattern that matches a file's path relative to the folder, or its name."""
    for pattern in exclude:
        if fnmatch.fnmatchcase(label, pattern) or fnmatch.fnmatchcase(label.rsplit("/", 1)[-1], pattern):
            return pattern
    return None


def left_out_finding(left_out: list[tuple[str, str]], *, file: str | None = None) -> Finding:
    """One ``left-out`` note listing every file a walk did not read, each with why."""
    shown = "; ".join(f"{name} ({why})" for name, why in left_out)
    return Finding("left-out", "info", f"{len(left_out)} file{'s' if len(left_out) != 1 else ''} not read: {shown}", file=file)


# -- reading --------------------------------------------------------------------------------------


def _as_companion(finding: Finding, label: str) -> Finding:
    """A companion file's finding, as the folder's: its file named from the folder; an unsafe global says what to
    do next, since a Trainer's own ``training_args.bin`` (TrainingArguments, which ``weights_only`` refuses) is
    the common case and no loader reads it for weights."""
    message = finding.message
    if finding.rule == "unsafe-global":
        message += f"; the model loader does not read {label}: --exclude {label} leaves it out, if you trust where it came from"
    return replace(finding, file=f"{label}/{finding.file}" if finding.file else label, message=message)


def _resolved(p: AnyPath) -> AnyPath:
    """``p.resolve()``, or ``p`` itself for a link loop (pathlib raises RuntimeError before Python 3.13): reading
    it then says what it is."""
    try:
        return p.resolve()
    except RuntimeError:
        return p


# The files save_pretrained, a tokenizer, a processor and the hub put beside the weights. Each is still read for
# safety; where its content is no format any loader reads, it is passed over without a left-out note.
_KNOWN_COMPANIONS = frozenset(
    {
        "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
        "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "spiece.model",
        "sentencepiece.bpe.model", "preprocessor_config.json", "processor_config.json", "chat_template.jinja",
        "chat_template.json", "readme.md", "license", "license.md", "license.txt", ".gitattributes",
    }
)  # fmt: skip


def _is_known_companion(label: str) -> bool:
    """Whether ``label`` (a path in the folder) names one of the usual non-weight files of a model folder."""
    return label.replace("\\", "/").rsplit("/", 1)[-1].lower() in _KNOWN_COMPANIONS


def companions(
    path: AnyPath,
    used: set[Any],
    read_file: Callable[[Any], Inventory],
    *,
    exclude: tuple[str, ...] = (),
    unused_message: Callable[[str], str] | None = None,
    excluded: dict[str, str] | None = None,
    training: dict[str, tuple[str, Inventory | None]] | None = None,
) -> list[Finding]:
    """Every file under ``path`` that the loader does not read as the model (``used``, resolved paths) is read
    for safety: its findings (``unsafe-global`` above all) become the folder's, so one unsafe file beside the
    weights (``training_args.bin``, ``optimizer.pt``, ``rng_state.pth``) fails the folder, whatever the layout.
    Its tensors are not audited with the model; ``unused_message(label)`` words the ``unused-weights`` warning
    for a file that holds some. A file that cannot be read refuses the folder (one line naming it); files left
    out (``exclude``, or content no loader reads) are listed in one ``left-out`` note, never skipped silently.
    ``excluded`` gains each file ``exclude`` left out (its label -> the pattern): never read, so never carried forward.
    A Trainer's training-state file (``optimizer.pt``, ``rng_state.pth``, ``trainer_state.json`` ...: ``training``)
    that holds what its name says is one ``training-state`` note, not weights nobody loads; ``training`` gains each
    (its label -> what it holds, and its inventory)."""
    from .sniff import leave_out_reason

    state: dict[str, tuple[str, Inventory | None]] = {}

    left: list[tuple[str, str]] = []
    walked = list(walk_files(path, on_skip=lambda p, why: left.append((_relative(p, path), why))))
    to_read: list[AnyPath] = []
    for p in walked:
        if _resolved(p) in used:  # a blob the loader reads through a link is read with the model
            continue
        label = _relative(p, path)
        pattern = excluded_by(label, exclude)
        why = f"--exclude {pattern}" if pattern else leave_out_reason(p)
        if why and not pattern and _is_known_companion(label):
            continue  # read, and no loader would take it for weights: a model folder's usual file is no news
        if why and not pattern and (held := trainer_state(label, None)) is not None:
            state[label] = (held, None)  # trainer_state.json: the Trainer reads it as JSON, nothing to run
            continue
        if why:
            left.append((label, why))
            if pattern and excluded is not None:
                excluded[label] = pattern
        else:
            to_read.append(p)

    def read_one(p: AnyPath) -> Inventory:
        label = _relative(p, path)
        try:
            return read_file(p)
        except RemoteError:
            raise  # the network failed: say so, rather than guess
        except DtypeAuditError as exc:
            message = exc.message
        except PermissionError:
            message = "permission denied"
        except OSError as exc:
            message = f"cannot read ({exc.strerror or exc})"
        except (RecursionError, MemoryError):
            message = "structure too large or too deep to read"
        raise CheckpointError(
            f"{label}: {message}; every file in a checkpoint folder is read for safety, so the folder is refused"
            " (--exclude it to leave it out)",
            path=str(path),
        )

    invs = remote.concurrent_map(read_one, to_read) if isinstance(path, RemotePath) else [read_one(p) for p in to_read]
    out: list[Finding] = []
    for p, inv in zip(to_read, invs, strict=True):
        label = _relative(p, path)
        note = link_out_note(path, p)
        if note:
            out.append(Finding("followed-link", "info", note, file=label))
        out.extend(_as_companion(f, label) for f in inv.findings)
        if (held := trainer_state(label, inv)) is not None:
            state[label] = (held, inv)
        elif inv.tensors and unused_message is not None:
            out.append(Finding("unused-weights", "warning", unused_message(label), file=label))
    if state:
        out.append(training_state_finding({label: held for label, (held, _) in state.items()}))
        if training is not None:
            training.update(state)
    if left:
        out.append(left_out_finding(left))
    return out


def read(path: AnyPath, read_file: Callable[[Any], Inventory], docs: Documents, *, exclude: tuple[str, ...] = ()) -> Inventory:
    """The model folder ``path`` as from_pretrained loads it; ``docs``: its JSON files parsed so far (each parsed once)."""
    res = resolve(path, docs) or _fallback(path)
    if res is None:
        raise CheckpointError("directory holds no checkpoint: no index, no *.safetensors, no pytorch_model*.bin", path=str(path))
    findings: list[Finding] = []
    tensors: list[TensorRecord] = []
    holder: dict[str, str] = {}
    shards = [path / label for label in res.files]
    # Remote shards are read at once (their headers are a round trip each); the first failure in file order is raised.
    invs = remote.concurrent_map(read_file, shards) if isinstance(path, RemotePath) else None
    first_tensors: tuple[TensorRecord, ...] = ()
    parts: dict[str, Inventory] = {}
    for i, label in enumerate(res.files):
        inv = invs[i] if invs is not None else read_file(shards[i])
        parts[label] = inv
        if i == 0:
            first_tensors = inv.tensors
        findings.extend(f if f.file else replace(f, file=label) for f in inv.findings)
        for t in inv.tensors:
            if t.name in holder:
                findings.append(
                    Finding("index-mismatch", "error", f"tensor is stored in both {holder[t.name]} and {label}", tensor=t.name, file=label)
                )
                continue
            holder[t.name] = label
            tensors.append(t.with_(file=label, shares_with=()))

    if res.weight_map is not None and res.index is not None:
        index_label = _label(res.index)
        for name, shard_name in res.weight_map.items():
            where = holder.get(name)
            if where is None:
                findings.append(
                    Finding(
                        "index-mismatch", "error", f"index lists it in {shard_name}, but no shard holds it", tensor=name, file=index_label
                    )
                )
            elif _label(shard_name) != where:
                findings.append(
                    Finding(
                        "index-mismatch", "error", f"index says {shard_name}, but it is stored in {where}", tensor=name, file=index_label
                    )
                )
        for name, where in holder.items():
            if name not in res.weight_map:
                findings.append(
                    Finding("index-mismatch", "warning", f"stored in {where} but missing from the index", tensor=name, file=where)
                )
    if res.from_pretrained:
        chose = res.chosen

        def unused(label: str) -> str:
            return f"{label} holds weights that from_pretrained would not load (it loads {chose})"
    else:

        def unused(label: str) -> str:
            return f"{label} holds weights not audited with the model (from_pretrained finds no weights file here; read: {res.chosen})"

    # config.json and the index are read by from_pretrained too, as JSON: they are not left out
    also_read = [path / "config.json", *([path / res.index] if res.index else [])]
    used = {s.resolve() for s in shards} | {p.resolve() for p in also_read if p.is_file()}
    excluded: dict[str, str] = {}
    training: dict[str, tuple[str, Inventory | None]] = {}
    findings.extend(companions(path, used, read_file, exclude=exclude, unused_message=unused, excluded=excluded, training=training))

    metadata: dict[str, object] = {"shards": list(res.files)}
    if excluded:
        metadata["excluded"] = excluded  # not read for safety: a conversion does not carry them forward
    if training:
        metadata["training_state"] = {label: held for label, (held, _) in training.items()}
        # the optimizer's state is kept with the weight files' parts, for the policies that judge it (checks.py);
        # conversion writes the shards alone and copies these files as they are
        parts.update({label: inv for label, (_, inv) in training.items() if inv is not None and holds_optimizer_state(label)})
    if res.index is not None:
        metadata["index"] = _label(res.index)
    if not res.from_pretrained:
        metadata["from_pretrained"] = "finds no weights file here"
    cfg = _config(path, docs)
    if isinstance(cfg.get("quantization_config"), dict):
        # read by dtypeaudit.quant.group; the config's dtype then applies to the unquantized parts only
        metadata["quantization_config"] = cfg["quantization_config"]
        from .hfload import config_dtype_value

        declared = config_dtype_value(cfg)
        if isinstance(declared, str):
            metadata["config_dtype"] = declared
    if res.from_pretrained:
        findings.extend(_load_dtype(path, res, cfg, first_tensors, metadata, [t.name for t in tensors], docs))
    return Inventory(str(path), "hf-directory", link_shared_storage(tensors), tuple(findings), metadata, parts=parts)


def _load_dtype(
    path: AnyPath,
    res: Resolution,
    cfg: dict[str, Any],
    first: tuple[TensorRecord, ...],
    metadata: dict[str, object],
    names: list[str],
    docs: Documents,
) -> list[Finding]:
    """What dtype and name from_pretrained gives each of the stored tensors ``names`` (``hfload``), stored in
    ``metadata`` for the checks; findings for a config.json key given twice. Refuses a dtype from_pretrained fails on."""
    from . import hfload

    out = []
    duplicate = _duplicate_key(path, docs)
    if duplicate:
        out.append(
            Finding("duplicate-key", "warning", f"config.json: {duplicate}; from_pretrained keeps the last value", file="config.json")
        )
    method = cfg["quantization_config"].get("quant_method") if isinstance(cfg.get("quantization_config"), dict) else None
    index_meta = None
    if res.index is not None:
        index = docs.load_json(path / res.index)
        index_meta = index.get("metadata") if isinstance(index, dict) else None
    if "quantization_config" in cfg and method not in ("fp8", "mxfp4", "compressed-tensors"):
        # a quantizer decides the parts' dtypes: not modelled here, but the model's own dtype is from_pretrained's
        # (model.config.dtype, which bitsandbytes' dequantize casts to). fp8, mxfp4 and compressed-tensors dequantize
        # on CPU into it, and the same dtype plan decides the rest (tests/test_quant_edges.py loads them)
        found = hfload.main_dtype(cfg, index_meta, res.files[0] if res.files else None, first)
        if found is not None:
            metadata["model_dtype"] = found[0]
        return out
    has_config = (path / "config.json").is_file()
    load = hfload.resolve(cfg, index_meta, res.files[0] if res.files else None, first, names, config_json=has_config)
    if load is None:
        declared = hfload.config_dtype_value(cfg)
        where = "index metadata.dtype" if declared is None else "config.json's dtype"
        shown = declared if declared is not None else (index_meta or {}).get("dtype")
        raise CheckpointError(f"{where} {shown!r} is not a torch dtype; from_pretrained fails on it", path=str(path))
    if hfload.config_dtype_value(cfg) is not None:
        metadata["config_dtype"] = load.dtype
    metadata["from_pretrained_dtype"] = hfload.as_metadata(load)
    return out
