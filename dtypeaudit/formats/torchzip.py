"""torch.save zip archives (``.pt .pth .bin .ckpt``, Lightning checkpoints) and TorchScript archives.

Reads the central directory and the pickles only; storage records are checked by size, never read.
Mirrors ``PyTorchStreamReader`` (caffe2/serialize/inline_container.cc) and ``_load`` in
torch/serialization.py, torch 2.13: the archive's folder is the first entry's; records are looked up
case-insensitively (miniz); a ``version`` record from 1 to 10 is required; ``byteorder`` must read
exactly ``little`` or ``big``; an archive with ``constants.pkl`` is TorchScript, which torch.load hands
to torch.jit.load. Every pickle in the archive is interpreted for its globals, not only ``data.pkl``.
"""

from __future__ import annotations

import re

from ..errors import CheckpointError
from ..inventory import Finding, Inventory, Layout, Span
from . import locate
from .barepickle import read_pickle
from .legacy import read_legacy
from .locate import AnyPath
from .picklevm import Global, Opaque, PickleVM
from .source import Source
from .torchpickle import (
    Found,
    StorageRef,
    global_findings,
    module_findings,
    shadow_findings,
    tensor_records,
    torch_vm,
    trailing_findings,
    walk,
)
from .torchrebuild import non_tensor_entries, storage_sites
from .ziparchive import ZipArchive, ZipEntry

MAX_PICKLE_BYTES = 1 << 30
MIN_VERSION, MAX_VERSION = 1, 10
"""The archive format versions torch 2.13's reader accepts (caffe2/serialize/versions.h)."""


def _prefix(za: ZipArchive, path: str) -> str:
    if not za.entries:
        raise CheckpointError("zip archive is empty", path=str(path))
    first = za.entries[0].name
    if "/" not in first:
        raise CheckpointError(f"zip archive's first entry '{first}' is not in a folder; torch refuses such files", path=str(path))
    prefix = first[: first.index("/") + 1]
    strays = [e.name for e in za.entries if not e.name.startswith(prefix)]
    if strays:
        raise CheckpointError(f"zip archive mixes folders: '{strays[0]}' is outside '{prefix}', which torch ignores", path=str(path))
    return prefix


def _record(za: ZipArchive, prefix: str, name: str) -> ZipEntry | None:
    return za.find(prefix + name)


def _read(za: ZipArchive, entry: ZipEntry, cap: int = MAX_PICKLE_BYTES) -> bytes:
    return za.read(entry, cap)


def _version(za: ZipArchive, prefix: str, path: str) -> None:
    entry = _record(za, prefix, ".data/version") or _record(za, prefix, "version")
    if entry is None:
        raise CheckpointError("zip archive has no version record; torch refuses it", path=str(path))
    text = _read(za, entry, cap=64).decode("ascii", "replace")
    m = re.match(r"\s*\+?(\d+)", text)  # std::stoull: leading space, a sign, digits, anything after
    if m is None:
        raise CheckpointError(f"zip archive's version record '{text[:20]}' is not a number; torch refuses it", path=str(path))
    if not MIN_VERSION <= int(m.group(1)) <= MAX_VERSION:
        what = f"zip archive format version {m.group(1)} is outside the {MIN_VERSION}-{MAX_VERSION} torch reads"
        raise CheckpointError(what, path=str(path))


def _check_storages(za: ZipArchive, prefix: str, storages: list[StorageRef], path: str) -> dict[str, Span]:
    """Each storage's record, which torch requires to be stored and exactly the size the pickle says."""
    spans: dict[str, Span] = {}
    for ref in storages:
        name = f"{prefix}data/{ref.key}"
        entry = za.find(name)
        if entry is None:
            raise CheckpointError(f"storage '{ref.key}' is missing from the archive (no {name})", path=str(path))
        if entry.method != 0:
            raise CheckpointError(f"storage record {name} is compressed; torch writes them stored, so it was not read", path=str(path))
        if entry.size != ref.nbytes:
            raise CheckpointError(f"storage record {name} holds {entry.size} bytes but the pickle needs {ref.nbytes}", path=str(path))
        spans.setdefault(ref.key, Span(*za.span(entry)))
    return spans


_TS_CLASS = re.compile(r"^class ([\w.]+)\(Module\):\n  __parameters__ = \[([^\]]*)\]\n  __buffers__ = \[([^\]]*)\]", re.M)


def _torchscript_kinds(za: ZipArchive, prefix: str) -> dict[str, dict[str, str]]:
    """Class qualname -> {attribute: 'parameter'|'buffer'}, from the archive's generated code (text, not run)."""
    kinds: dict[str, dict[str, str]] = {}
    for entry in za.entries:
        name = entry.name
        if not (name.startswith(prefix + "code/") and name.endswith(".py")):
            continue
        module = name[len(prefix + "code/") : -len(".py")].replace("/", ".")
        text = _read(za, entry, cap=64 << 20).decode("utf-8", "replace")
        for m in _TS_CLASS.finditer(text):
            attrs = {a: "parameter" for a in re.findall(r'"([^"]+)"', m.group(2))}
            attrs.update({a: "buffer" for a in re.findall(r'"([^"]+)"', m.group(3))})
            kinds[f"{module}.{m.group(1)}"] = attrs
    return kinds


def _other_pickles(za: ZipArchive, main: ZipEntry, path: str, *, torchscript: bool) -> list[Finding]:
    """Globals of every other pickle in the archive (a second data.pkl, constants.pkl, a stray .pkl)."""
    out: list[Finding] = []
    for entry in za.pickle_entries():
        if entry == main:
            continue
        data = _read(za, entry)
        vm = PickleVM(data, persistent_load=lambda pid: None, source=f"{path}:{entry.name}")
        try:
            _, end = vm.load()
        except CheckpointError as exc:
            what = f"the archive's {entry.name} cannot be interpreted ({exc.message}), so what it holds cannot be checked"
            raise CheckpointError(what, path=str(path)) from None
        label = entry.name
        out += global_findings(vm.trace, file=label, torchscript=torchscript)
        out += [Finding(f.rule, f.severity, f.message, file=label) for f in trailing_findings(data, end, f"{path}:{entry.name}")]
    return out


def read_zip(where: AnyPath | Source) -> Inventory:
    with locate.opened(where) as src, ZipArchive.open(src) as za:
        path = src.name
        first = za.entries[0].name if za.entries else ""
        main = za.find(first[: first.index("/") + 1] + "data.pkl") if "/" in first else None
        if main is None:
            return _foreign_zip(za, path)
        prefix = _prefix(za, path)
        _version(za, prefix, path)
        # torch.load's test for TorchScript: a record named exactly constants.pkl (get_all_records, then `in`).
        torchscript = any(e.name == prefix + "constants.pkl" for e in za.entries)
        metadata: dict[str, object] = {"archive_prefix": prefix.rstrip("/")}
        byteorder = _record(za, prefix, "byteorder")
        if byteorder is not None:
            order = _read(za, byteorder, cap=64)
            if order not in (b"little", b"big"):
                what = order[:20].decode("ascii", "replace")
                raise CheckpointError(f"unknown byteorder '{what}' in the archive; torch refuses it", path=str(path))
            metadata["byteorder"] = order.decode()
        data = _read(za, main)
        storages: list[StorageRef] = []
        vm = torch_vm(data, source=str(path), on_storage=storages.append)
        root, end = vm.load()
        objects: list[Opaque] = []
        found = list(walk(root, on_object=objects.append))
        extra = trailing_findings(data, end, str(path)) + module_findings(objects) + shadow_findings(found)
        extra += _other_pickles(za, main, path, torchscript=torchscript)
        spans = _check_storages(za, prefix, storages, path)
        records = tuple(e.name[len(prefix) :] for e in za.entries if e != main and not e.name.startswith(prefix + "data/"))
        stored = [(name, za.find(prefix + name)) for name in ("data.pkl", *records)]
        record_spans = {name: Span(*za.span(e)) for name, e in stored if e is not None and e.method == 0}
        layout = Layout(
            "zip",
            spans,
            archive_prefix=prefix,
            records=records,
            record_spans=record_spans,
            pickle_end=end,
            non_tensor=non_tensor_entries(root),
            **storage_sites(vm),
        )
        if torchscript:
            kinds = _torchscript_kinds(za, prefix)

            def module_of(f: Found) -> tuple[str | None, str]:
                if f.owner is None or not isinstance(f.owner.callable, Global):
                    return None, f.tensor.kind
                owner = f.owner.callable.qualname
                attr = f.name.rsplit(".", 1)[-1]
                return _module_type(owner), kinds.get(owner, {}).get(attr, f.tensor.kind)

            findings = global_findings(vm.trace, torchscript=True) + extra
            findings.append(
                Finding(
                    "loader-divergence",
                    "warning",
                    "a TorchScript archive: torch.load(weights_only=True) refuses it, and torch.jit.load (where torch.load "
                    "sends it otherwise) compiles and runs the code it carries; dtypeaudit reads its data.pkl",
                )
            )
            return Inventory(str(path), "torchscript", tensor_records(found, module_of=module_of), tuple(findings), metadata, layout)
        findings = global_findings(vm.trace, weights_only_loader=True, file_name=str(path)) + extra
        return Inventory(str(path), "torch-zip", tensor_records(found), tuple(findings), metadata, layout)


def _foreign_zip(za: ZipArchive, path: str) -> Inventory:
    """A zip that is no torch archive: still report what its pickles would call, else say what it is not."""
    if not za.entries:
        raise CheckpointError("zip archive is empty", path=str(path))
    first = za.entries[0].name
    findings: list[Finding] = []
    for entry in za.pickle_entries():
        data = _read(za, entry)
        vm = PickleVM(data, persistent_load=lambda pid: None, source=f"{path}:{entry.name}")
        try:
            vm.load()
        except CheckpointError:
            continue
        findings += global_findings(vm.trace, file=entry.name)
    if any(f.severity == "error" for f in findings):
        return Inventory(str(path), "zip", (), tuple(findings), {})
    if "/" not in first and any(e.name.lower() == "data.pkl" for e in za.entries):
        raise CheckpointError(f"zip archive has no top-level folder (its first entry is '{first}'); torch needs one", path=str(path))
    if any(e.name.lower().endswith("/data.pkl") for e in za.entries):
        raise CheckpointError("zip archive's data.pkl is not in the folder of its first entry, where torch looks", path=str(path))
    raise CheckpointError("zip archive has no data.pkl: not a torch.save or TorchScript file", path=str(path))


def _module_type(qualname: str) -> str:
    return qualname.rsplit(".", 1)[-1]


__all__ = ["read_zip", "read_legacy", "read_pickle", "MAX_PICKLE_BYTES"]
