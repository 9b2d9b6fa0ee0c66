"""Conversion: plan -> check values -> stream-write to a temporary file -> verify -> atomic rename.

Nothing from the checkpoint is executed. A torch.save archive is re-emitted from its own pickle with
only the storage types changed (see formats/pickleout.py); every other byte of meaning is kept.
Memory stays bounded by a chunk (a tensor, for non-contiguous views into safetensors), never the file.
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import stat
import struct
import zipfile
import zlib
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import dtypes
from .errors import CheckpointError, ConversionError, UsageError
from .formats import directory as hfdir
from .formats import read_checkpoint
from .formats import safetensors as st_reader
from .formats.pickleout import Persistent, dumps, keep_persistent
from .formats.picklevm import Global, Opaque, PickleVM
from .formats.storage import Span, legacy_storage_spans, zip_storage_spans
from .formats.torchzip import legacy_header, legacy_storage_keys
from .inventory import Finding, Inventory, Severity, TensorRecord
from .policy import Matcher, Policy, compile_matcher, decide
from .values import UNDERFLOW_BLOCK_FRACTION, WRITE_CHUNK_BYTES, ValueStats, cast_chunk, chunks, errors, frombuffer, update

CASTABLE = frozenset({"float64", "float32", "float16", "bfloat16"})
TARGETS = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}
ALIGN = 64
Progress = Callable[[int], None]


# -- the plan ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorPlan:
    """What happens to one tensor."""

    tensor: TensorRecord
    target: str
    """The dtype it will have (its own when left or kept)."""
    action: str
    """``cast``, ``keep`` (a rule or --keep holds it), ``leave`` (not convertible or already there), ``drop``."""
    reason: str = ""

    @property
    def out_nbytes(self) -> int:
        return (
            0
            if self.action == "drop"
            else self.tensor.numel * dtypes.get(self.target).itemsize
            if self.tensor.layout == "strided"
            else self.tensor.nbytes
        )


@dataclass
class Plan:
    source: Inventory
    target: str
    tensors: list[TensorPlan]
    clamp: bool = False
    values: dict[str, ValueStats] = field(default_factory=dict)
    """Range checks (NaN/Inf, overflow, underflow) by unit, for every unit bound for float16."""
    notes: list[str] = field(default_factory=list)

    @property
    def bytes_before(self) -> int:
        return _unique_bytes([(p.tensor, p.tensor.dtype) for p in self.tensors])

    @property
    def bytes_after(self) -> int:
        return _unique_bytes([(p.tensor, p.target) for p in self.tensors if p.action != "drop"])

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for p in self.tensors:
            out[p.action] = out.get(p.action, 0) + 1
        return out


def _unique_bytes(items: list[tuple[TensorRecord, str]]) -> int:
    seen: set[tuple[object, ...]] = set()
    total = 0
    for t, dtype in items:
        key = (t.file, t.storage, t.offset, t.shape, t.stride) if t.storage is not None else (t.file, t.name)
        if key in seen:
            continue
        seen.add(key)
        total += t.numel * dtypes.get(dtype).itemsize if t.layout == "strided" else t.nbytes
    return total


def _unit(t: TensorRecord) -> str:
    """The unit of conversion: a storage in torch archives (views and ties convert together), else the tensor."""
    return f"{t.file}\0{t.storage}" if t.storage is not None else f"{t.file}\0{t.name}"


def make_plan(
    inv: Inventory,
    to: str,
    *,
    policy: Policy | None = None,
    keep: tuple[str, ...] = (),
    include_optimizer: bool = False,
    strip_optimizer: bool = False,
    clamp: bool = False,
) -> Plan:
    target = TARGETS.get(to, dtypes.canonical(to) or to)
    if target not in TARGETS.values():
        raise UsageError(f"--to must be fp16, bf16 or fp32, not '{to}'")
    if inv.format in ("torchscript", "dcp", "factory", "pickle"):
        raise ConversionError(_REFUSALS[inv.format], path=inv.path)
    keepers: list[Matcher] = []
    for pattern in keep:
        try:
            keepers.append(compile_matcher(pattern))
        except ValueError as exc:
            raise UsageError(f"--keep {pattern!r}: {exc}") from None

    def one(t: TensorRecord) -> TensorPlan:
        if strip_optimizer and t.region == "optimizer":
            return TensorPlan(t, t.dtype, "drop", "optimizer state stripped (--strip-optimizer)")
        if t.dtype not in CASTABLE or t.layout != "strided":
            what = t.layout if t.layout != "strided" else t.dtype
            return TensorPlan(t, t.dtype, "leave", f"{what} tensors are left exactly as they are")
        if t.region == "optimizer" and not include_optimizer:
            return TensorPlan(t, t.dtype, "leave", "optimizer state is left as is (--include-optimizer to cast it)")
        for m in keepers:
            if m(t.name):
                return TensorPlan(t, t.dtype, "keep", f"--keep {m.text}")
        want = target
        if policy is not None and not decide(policy, t.with_(dtype=target)).ok:
            d = decide(policy, t)
            if d.ok:
                return TensorPlan(t, t.dtype, "keep", f"policy: {d.rule.label if d.rule else 'default'} expects {_names(d.expected)}")
            choices = sorted((d.expected or frozenset()) & CASTABLE)
            if len(choices) != 1:
                return TensorPlan(t, t.dtype, "keep", f"policy expects {_names(d.expected)}")
            want = choices[0]
        if t.dtype == want:
            return TensorPlan(t, want, "leave", f"already {want}")
        return TensorPlan(t, want, "cast")

    plans = [one(t) for t in inv.tensors]
    # Tensors that share one storage convert together, or not at all.
    units: dict[str, set[str]] = {}
    for p in plans:
        if p.action != "drop":
            units.setdefault(_unit(p.tensor), set()).add(p.target)
    for i, p in enumerate(plans):
        if p.action == "cast" and len(units[_unit(p.tensor)]) > 1:
            plans[i] = TensorPlan(p.tensor, p.tensor.dtype, "keep", "shares its storage with a tensor that stays as it is")
    return Plan(inv, target, plans, clamp=clamp)


def _names(expected: frozenset[str] | None) -> str:
    return "any dtype" if expected is None else " or ".join(sorted(expected))


_REFUSALS = {
    "torchscript": "TorchScript archives carry compiled code and constants typed for the saved dtypes, so their weights "
    "cannot be recast safely; convert the eager model's state_dict and script it again",
    "dcp": "torch.distributed.checkpoint directories are written by the training job; convert them with "
    "torch.distributed.checkpoint.format_utils.dcp_to_torch_save first, then convert the .pt",
    "factory": "a factory builds a model, it is not a checkpoint file to convert",
    "pickle": "a bare pickle is not a torch.save checkpoint; nothing in it can be converted without running it",
}


# -- reading the source's bytes -----------------------------------------------------------------


class Source:
    """mmap access to one checkpoint file's tensor bytes."""

    def __init__(self, path: Path, inv: Inventory, stack: ExitStack) -> None:
        self.path = path
        self.inv = inv
        fh = stack.enter_context(path.open("rb"))
        self.mm = stack.enter_context(mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)) if path.stat().st_size else b""
        if isinstance(self.mm, mmap.mmap) and hasattr(mmap, "MADV_SEQUENTIAL"):
            self.mm.madvise(mmap.MADV_SEQUENTIAL)  # read ahead: every pass walks the file front to back
        self.spans: dict[str, Span] = {}
        if inv.format == "torch-zip":
            if inv.metadata.get("byteorder", "little") != "little":
                raise ConversionError("big-endian archives are not supported for conversion", path=str(path))
            self.spans = zip_storage_spans(path)
        elif inv.format == "torch-legacy":
            self.spans = _legacy_spans(path)
        elif inv.format == "safetensors":
            _, start = st_reader.read_header(path)
            self.spans = {t.name: Span(start + t.offset, t.nbytes) for t in inv.tensors}

    def storage(self, key: str) -> Span:
        try:
            return self.spans[key]
        except KeyError:
            raise CheckpointError(f"storage '{key}' not found", path=str(self.path)) from None


def _legacy_spans(path: Path) -> dict[str, Span]:
    from .formats.torchpickle import REDUCERS, storage_loader

    with path.open("rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        header = legacy_header(mm, path)
        if not header.little_endian:
            raise ConversionError("big-endian legacy files are not supported for conversion", path=str(path))
        storages: list[Any] = []
        _, pos = PickleVM(mm, reducers=REDUCERS, persistent_load=storage_loader(storages.append, legacy=True)).load(header.main)
        keys, data_start, _ = legacy_storage_keys(mm, pos, path)
    sizes = {s.key: dtypes.get(s.dtype).itemsize for s in storages}
    return legacy_storage_spans(path, keys, sizes, data_start)


# -- value checks --------------------------------------------------------------------------------


def check_values(plan: Plan, sources: dict[str, Source], progress: Progress | None = None) -> dict[str, ValueStats]:
    """Before anything is written: range checks for every unit bound for float16 (NaN/Inf, overflow,
    underflow, subnormals), and the max absolute and relative error of every cast."""
    results: dict[str, ValueStats] = {}
    for unit, (src, dtype, span, names, target) in _units_to_cast(plan, sources).items():
        stats = ValueStats(", ".join(names), dtype, target)
        # float16 is the narrow range; bfloat16 and float32 keep float32's exponent.
        ranged = target == "float16" and dtype != "float16"
        itemsize = dtypes.get(dtype).itemsize
        for x in chunks(src.mm, dtype, span.offset, span.length // itemsize, itemsize):
            y = update(stats, x, clamp=plan.clamp) if ranged else cast_chunk(x, target, clamp=plan.clamp)
            errors(stats, x, y)
            if progress:
                progress(x.numel() * itemsize)
        results[unit] = stats
    plan.values = results
    return results


def _units_to_cast(plan: Plan, sources: dict[str, Source]) -> dict[str, tuple[Source, str, Span, list[str], str]]:
    units: dict[str, tuple[Source, str, Span, list[str], str]] = {}
    for p in plan.tensors:
        if p.action != "cast":
            continue
        t = p.tensor
        src = sources[t.file]
        unit = _unit(t)
        if unit in units:
            units[unit][3].append(t.name)
            continue
        span = src.storage(t.storage) if t.storage is not None else src.storage(t.name)
        units[unit] = (src, t.dtype, span, [t.name], p.target)
    return units


def apply_value_policy(plan: Plan, *, keep_unsafe: bool) -> list[ValueStats]:
    """With --keep-unsafe, unsafe units stay as they are; returns the unsafe units left blocking."""
    unsafe = {u: s for u, s in plan.values.items() if s.unsafe and not (plan.clamp and not s.nonfinite and not _underflow_blocks(s))}
    if not unsafe:
        return []
    if not keep_unsafe:
        return list(unsafe.values())
    for i, p in enumerate(plan.tensors):
        if p.action == "cast" and _unit(p.tensor) in unsafe:
            plan.tensors[i] = TensorPlan(p.tensor, p.tensor.dtype, "keep", "unsafe values kept at full precision (--keep-unsafe)")
    for u in unsafe:
        plan.values.pop(u)
    return []


def _underflow_blocks(s: ValueStats) -> bool:
    return s.underflow_fraction > UNDERFLOW_BLOCK_FRACTION


# -- writing -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Origin:
    """Where a written record's bytes came from, so verification can recompute them independently."""

    src: Source
    span: Span | None
    """The source bytes; None for a view that had to be gathered (``tensor`` says which)."""
    dtype: str
    target: str
    tensor: TensorRecord | None = None
    names: tuple[str, ...] = ()
    """The tensors these bytes hold, for the error report."""


@dataclass
class Written:
    """What the writer produced: for each record (zip member or safetensors tensor), its origin and the
    CRC-32 of the bytes handed to the file (zip members carry theirs in the archive)."""

    origins: dict[str, Origin] = field(default_factory=dict)
    crcs: dict[str, int] = field(default_factory=dict)


def _crc_sink(sink: Callable[[Any], Any], into: dict[str, int], name: str) -> Callable[[Any], None]:
    into[name] = 0

    def write(data: Any) -> None:
        sink(data)
        into[name] = zlib.crc32(data, into[name])

    return write


def _stream(
    src: Source, span: Span, dtype: str, target: str, clamp: bool, sink: Callable[[bytes | memoryview], None], progress: Progress | None
) -> None:
    """Write ``span`` cast from ``dtype`` to ``target`` into ``sink``, a chunk at a time."""
    if dtype == target:
        for start in range(0, span.length, WRITE_CHUNK_BYTES):
            piece = memoryview(src.mm)[span.offset + start : span.offset + min(span.length, start + WRITE_CHUNK_BYTES)]
            sink(piece)
            if progress:
                progress(len(piece))
        return
    itemsize = dtypes.get(dtype).itemsize
    for x in chunks(src.mm, dtype, span.offset, span.length // itemsize, itemsize, WRITE_CHUNK_BYTES):
        sink(_tensor_bytes(cast_chunk(x, target, clamp=clamp)))
        if progress:
            progress(x.numel() * itemsize)


def _tensor_bytes(y: Any) -> memoryview:
    import torch

    return memoryview(y.contiguous().view(torch.uint8).numpy())


def _open_aligned(zf: zipfile.ZipFile, name: str, size: int) -> Any:
    """Open a stored member whose data starts on a 64-byte boundary, as torch.save lays them out for mmap."""
    info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
    info.compress_type = zipfile.ZIP_STORED
    info.file_size = size
    info.compress_size = 0
    info.CRC = 0
    zip64 = size * 1.05 > zipfile.ZIP64_LIMIT
    assert zf.fp is not None
    start = zf.fp.tell() + len(info.FileHeader(zip64))
    pad = (-start) % ALIGN
    if 0 < pad < 4:
        pad += ALIGN
    if pad:
        info.extra = struct.pack("<HH", 0x4246, pad - 4) + b"Z" * (pad - 4)
    return zf.open(info, "w", force_zip64=zip64)


def _main_pickle(src: Source) -> tuple[bytes | mmap.mmap, int, str, dict[str, bytes]]:
    """Where the checkpoint's object graph is pickled (buffer, offset), its archive prefix, and its other small records."""
    if src.inv.format == "torch-zip":
        with zipfile.ZipFile(src.path) as zf:
            names = zf.namelist()
            prefix = next(n for n in names if n.endswith("/data.pkl") and n.count("/") == 1)[: -len("data.pkl")]
            data = zf.read(prefix + "data.pkl")
            extras = {n[len(prefix) :]: zf.read(n) for n in names if not n.startswith((prefix + "data/", prefix + "data.pkl"))}
        return data, 0, prefix, extras
    legacy_extras = {"byteorder": b"little", "version": b"3\n", ".format_version": b"1", ".storage_alignment": b"64"}
    return src.mm, legacy_header(src.mm, src.path).main, "archive/", legacy_extras


def _faithful_root(src: Source) -> tuple[Any, str, dict[str, bytes]]:
    """The source's pickle as a faithful graph, its archive prefix, and its other small records."""
    buf, pos, prefix, extras = _main_pickle(src)
    root, _ = PickleVM(buf, persistent_load=keep_persistent, source=str(src.path)).load(pos)
    return root, prefix, extras


def _walk_graph(obj: Any, visit: Callable[[Persistent], None], seen: set[int] | None = None) -> None:
    seen = set() if seen is None else seen
    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, (str, bytes, int, float, bool, Global)) or o is None or id(o) in seen:
            continue
        seen.add(id(o))
        if isinstance(o, Persistent):
            visit(o)
        elif isinstance(o, dict):
            stack.extend(o.keys())
            stack.extend(o.values())
        elif isinstance(o, (list, tuple, set, frozenset)):
            stack.extend(o)
        elif isinstance(o, Opaque):
            stack.extend((o.callable, o.args, o.state, *o.list_items, *o.items.keys(), *o.items.values()))


def _is_optimizer(value: Any) -> bool:
    def keys(v: Any) -> set[Any]:
        if isinstance(v, dict):
            return set(v)
        if isinstance(v, Opaque):
            return set(v.items) | (set(v.state) if isinstance(v.state, dict) else set())
        return set()

    if {"state", "param_groups"} <= keys(value):
        return True
    return isinstance(value, list) and bool(value) and all({"state", "param_groups"} <= keys(v) for v in value)


def _strip_optimizer(root: Any) -> list[str]:
    mapping = root if isinstance(root, dict) else root.items if isinstance(root, Opaque) else None
    if mapping is None:
        return []
    dropped = [k for k, v in mapping.items() if _is_optimizer(v)]
    for k in dropped:
        del mapping[k]
    return [str(k) for k in dropped]


def write_torch_zip(plan: Plan, src: Source, out: Path, *, strip_optimizer: bool, progress: Progress | None) -> Written:
    root, prefix, extras = _faithful_root(src)
    if strip_optimizer:
        plan.notes += [f"stripped optimizer state '{k}'" for k in _strip_optimizer(root)]
    storage_target: dict[str, str] = {}
    for p in plan.tensors:
        if p.tensor.storage is not None and p.action != "drop":
            storage_target[p.tensor.storage] = p.target
    keys: dict[str, str] = {}

    def retype(ref: Persistent) -> None:
        pid = ref.pid
        if not (isinstance(pid, tuple) and len(pid) >= 5 and pid[0] == "storage" and isinstance(pid[1], Global)):
            raise ConversionError("unexpected persistent id in the pickle", path=str(src.path))
        key = str(pid[2])
        if pid[1].name == "UntypedStorage":  # bytes for dtypes with no typed storage class (float8, uint16...): copied
            source_dtype = target = "uint8"
        else:
            source_dtype = dtypes.STORAGE_CLASSES.get(pid[1].name, "")
            target = storage_target.get(key, source_dtype)
        if not source_dtype:
            raise ConversionError(f"unknown storage type {pid[1].qualname}", path=str(src.path))
        cls = pid[1] if target == source_dtype else Global("torch", dtypes.STORAGE_CLASS_OF[target])
        ref.pid = ("storage", cls, key, pid[3], pid[4])
        keys[key] = source_dtype
        storage_target[key] = target

    _walk_graph(root, retype)
    written = Written()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr(zipfile.ZipInfo(prefix + "data.pkl", date_time=(1980, 1, 1, 0, 0, 0)), dumps(root))
        for name in (".format_version", ".storage_alignment", "byteorder"):
            if name in extras:
                zf.writestr(zipfile.ZipInfo(prefix + name, date_time=(1980, 1, 1, 0, 0, 0)), extras[name])
        for key, dtype in keys.items():
            span = src.storage(key)
            target = storage_target[key]
            size = span.length // dtypes.get(dtype).itemsize * dtypes.get(target).itemsize
            with _open_aligned(zf, f"{prefix}data/{key}", size) as fh:
                _stream(src, span, dtype, target, plan.clamp, fh.write, progress)
            names = tuple(p.tensor.name for p in plan.tensors if p.tensor.storage == key and p.action != "drop")
            written.origins[f"{prefix}data/{key}"] = Origin(src, span, dtype, target, names=names)
        for name, data in extras.items():
            if name not in (".format_version", ".storage_alignment", "byteorder"):
                zf.writestr(zipfile.ZipInfo(prefix + name, date_time=(1980, 1, 1, 0, 0, 0)), data)
    return written


def write_safetensors(plan: Plan, src: Source, out: Path, *, progress: Progress | None) -> Written:
    """Tensors only; a tensor under several names (tied weights) is written once, the aliases kept in metadata."""
    if src.inv.format in ("torch-zip", "torch-legacy"):
        _refuse_non_tensor_content(src)
    meta = dict(src.inv.metadata.get("safetensors_metadata") or {"format": "pt"})  # type: ignore[call-overload]
    return _write_safetensors_file([(p, src) for p in plan.tensors], out, meta, clamp=plan.clamp, progress=progress)


def _write_safetensors_file(
    items: list[tuple[TensorPlan, Source]], out: Path, meta: dict[str, str], *, clamp: bool, progress: Progress | None
) -> Written:
    entries: list[tuple[TensorPlan, Source, Span | None]] = []
    aliases: dict[str, str] = {}
    first_of: dict[tuple[object, ...], str] = {}
    for p, src in items:
        if p.action == "drop":
            continue
        t = p.tensor
        if t.layout != "strided":
            raise ConversionError(f"tensor '{t.name}' is {t.layout}; safetensors holds dense tensors only", path=str(src.path))
        if t.dtype not in dtypes.SAFETENSORS_CODE_OF or p.target not in dtypes.SAFETENSORS_CODE_OF:
            raise ConversionError(f"tensor '{t.name}' is {t.dtype}, which safetensors cannot store", path=str(src.path))
        tie = (str(src.path), t.storage, t.offset, t.shape, t.stride) if t.storage is not None else None
        if tie is not None and tie in first_of:
            aliases[t.name] = first_of[tie]
            continue
        if tie is not None:
            first_of[tie] = t.name
        entries.append((p, src, _contiguous_span(src, t)))
    header: dict[str, Any] = {}
    offset = 0
    for p, _, _ in entries:
        size = p.tensor.numel * dtypes.get(p.target).itemsize
        header[p.tensor.name] = {
            "dtype": dtypes.SAFETENSORS_CODE_OF[p.target],
            "shape": list(p.tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    meta = dict(meta)
    if aliases:
        meta["dtypeaudit.aliases"] = json.dumps(aliases, sort_keys=True)
    text = json.dumps({"__metadata__": meta, **header}, separators=(",", ":")).encode()
    text += b" " * ((-len(text)) % 8)
    written = Written()
    with out.open("wb") as fh:
        fh.write(struct.pack("<Q", len(text)) + text)
        for p, src, span in entries:
            t = p.tensor
            sink = _crc_sink(fh.write, written.crcs, t.name)
            if span is not None:
                _stream(src, span, t.dtype, p.target, clamp, sink, progress)
            else:
                sink(_tensor_bytes(cast_chunk(_materialize(src, t), p.target, clamp=clamp)))
                if progress:
                    progress(t.nbytes)
            written.origins[t.name] = Origin(src, span, t.dtype, p.target, t, names=(t.name,))
    return written


def _contiguous_span(src: Source, t: TensorRecord) -> Span | None:
    """The bytes of ``t`` as one span if it is a contiguous run of its storage, else None."""
    itemsize = dtypes.get(t.dtype).itemsize
    if t.storage is None:
        return src.storage(t.name)
    expected, run = [], 1
    for size in reversed(t.shape):
        expected.append(run)
        run *= size
    if (
        t.stride is not None
        and t.numel > 1
        and tuple(s for s, d in zip(t.stride, t.shape, strict=True) if d > 1)
        != tuple(s for s, d in zip(reversed(expected), t.shape, strict=True) if d > 1)
    ):
        return None
    base = src.storage(t.storage)
    return Span(base.offset + t.offset * itemsize, t.numel * itemsize)


def _materialize(src: Source, t: TensorRecord) -> Any:
    import torch

    base = src.storage(t.storage or t.name)
    itemsize = dtypes.get(t.dtype).itemsize
    flat = frombuffer(src.mm, t.dtype, base.length // itemsize, base.offset)
    return torch.as_strided(flat, t.shape, t.stride or (), t.offset).contiguous()


def _refuse_non_tensor_content(src: Source) -> None:
    """safetensors stores tensors only: refuse rather than silently drop an epoch or hyper-parameters."""
    from .formats.torchpickle import REDUCERS, TensorRef, storage_loader

    buf, pos, _, _ = _main_pickle(src)
    root, _ = PickleVM(buf, reducers=REDUCERS, persistent_load=storage_loader(legacy=src.inv.format == "torch-legacy")).load(pos)
    extra: list[str] = []

    def walk(v: Any, name: str) -> None:
        if isinstance(v, TensorRef) or len(extra) > 3:
            return
        if isinstance(v, dict):
            for k, x in v.items():
                walk(x, f"{name}.{k}" if name else str(k))
        else:
            extra.append(name or "<root>")

    walk(root, "")
    if extra:
        raise ConversionError(
            f"holds non-tensor content ({', '.join(extra[:3])}{', ...' if len(extra) > 3 else ''}) that safetensors cannot store; "
            "convert to .pt instead, or save a plain state_dict first",
            path=str(src.path),
        )


# -- atomic output -------------------------------------------------------------------------------


def default_output(source: Path, target: str, out_format: str | None = None) -> Path:
    short = {v: k for k, v in TARGETS.items()}[target]
    if source.is_dir():
        return source.with_name(f"{source.name}-{short}")
    suffix = ".safetensors" if out_format == "safetensors" else source.suffix
    return source.with_name(f"{source.stem}.{short}{suffix}")


def check_destination(source: Path, dest: Path, *, force: bool, in_place: bool) -> None:
    if not dest.parent.is_dir():
        raise ConversionError("output directory does not exist", path=str(dest.parent))
    if not os.access(dest.parent, os.W_OK):
        raise ConversionError("output directory is not writable", path=str(dest.parent))
    if dest.exists() or dest.is_symlink():
        same = dest.exists() and os.path.samefile(source, dest)
        if same and not in_place:
            raise ConversionError(
                "output is the input itself (the same file by another name, link or hard link); pass --in-place to replace it",
                path=str(dest),
            )
        if not same and not force:
            raise ConversionError("output already exists; pass --force to replace it", path=str(dest))


@contextmanager
def atomic_output(dest: Path, *, mode_from: Path, is_dir: bool = False) -> Iterator[Path]:
    """Yield a temporary path beside ``dest``; on success fsync it and rename it into place, else remove it."""
    tmp = dest.parent / f".{dest.name}.dtypeaudit-{os.getpid()}.tmp"
    if is_dir:
        tmp.mkdir()
    try:
        yield tmp
        for f in tmp.rglob("*") if is_dir else [tmp]:
            if f.is_file():
                with f.open("rb+") as fh:
                    os.fsync(fh.fileno())
        if not is_dir:
            os.chmod(tmp, stat.S_IMODE(mode_from.stat().st_mode))
        if is_dir and dest.exists():
            backup = dest.parent / f".{dest.name}.dtypeaudit-{os.getpid()}.old"
            os.replace(dest, backup)
            os.replace(tmp, dest)
            shutil.rmtree(backup, ignore_errors=True)
        else:
            os.replace(tmp, dest)
        _fsync_dir(dest.parent)
    except BaseException:
        if is_dir:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        raise


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# -- verification --------------------------------------------------------------------------------


def verify(plan: Plan, out: Path, written: Written) -> None:
    """Re-read what was written: names, shapes, dtypes as planned, ties kept, bytes equal to torch's cast."""
    got = read_checkpoint(out)
    want = {p.tensor.name: p for p in plan.tensors if p.action != "drop"}
    have = got.by_name()
    st_meta = got.metadata.get("safetensors_metadata")
    aliases = json.loads(st_meta.get("dtypeaudit.aliases", "{}")) if isinstance(st_meta, dict) else {}
    missing = [n for n in want if n not in have and n not in aliases]
    if missing:
        raise ConversionError(f"verification failed: {len(missing)} tensors missing from the output (first: {missing[0]})", path=str(out))
    for name, p in want.items():
        t = have.get(aliases.get(name, name))
        assert t is not None
        if t.shape != p.tensor.shape or t.dtype != p.target:
            raise ConversionError(
                f"verification failed: '{name}' is {t.dtype}{list(t.shape)}, planned {p.target}{list(p.tensor.shape)}", path=str(out)
            )
    if got.format == "torch-zip":
        src_groups = {frozenset((n, *want[n].tensor.shares_with)) & set(want) for n in want if want[n].tensor.shares_with}
        out_groups = {frozenset((t.name, *t.shares_with)) for t in got.tensors if t.shares_with}
        if {g for g in src_groups if len(g) > 1} != out_groups:
            raise ConversionError("verification failed: storage sharing (ties, views) differs from the source", path=str(out))
        from .formats.storage import zip_record_span

        with zipfile.ZipFile(out) as zf:
            spans = {name: zip_record_span(out, zf.getinfo(name)) for name in written.origins}
            expected_crcs = {name: zf.getinfo(name).CRC for name in written.origins}
    else:
        _, start = st_reader.read_header(out)
        spans = {t.name: Span(start + t.offset, t.nbytes) for t in got.tensors if t.name in written.origins}
        expected_crcs = written.crcs
    with out.open("rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        for name, span in spans.items():
            origin = written.origins[name]
            if _crc(mm, span) != expected_crcs[name] or not _matches_cast(mm, span, origin, plan.clamp):
                raise ConversionError(f"verification failed: {name} on disk differs from torch's cast of the source", path=str(out))


def _crc(buffer: Any, span: Span) -> int:
    crc = 0
    view = memoryview(buffer)
    try:
        for start in range(0, span.length, WRITE_CHUNK_BYTES):
            crc = zlib.crc32(view[span.offset + start : span.offset + min(span.length, start + WRITE_CHUNK_BYTES)], crc)
    finally:
        view.release()
    return crc


def _matches_cast(mm: Any, span: Span, origin: Origin, clamp: bool) -> bool:
    """Whether the bytes at ``span`` equal torch's own ``tensor.to(target)`` of the source, recomputed here.

    The whole record is covered by the CRC check against what the writer produced; this recomputes
    the cast independently for its first, middle and last chunks, which catches a wrong offset,
    dtype or clamp without paying for a second full cast.
    """
    import torch

    if origin.dtype == origin.target and origin.span is not None:
        # A copied record (quantized, complex, ints...): its bytes must be the source's, byte for byte.
        origin = Origin(origin.src, origin.span, "uint8", "uint8", origin.tensor, origin.names)
    target = getattr(torch, origin.target)

    def cast(x: Any) -> Any:
        if clamp and x.dtype != target:
            limit = float(torch.finfo(target).max)
            x = torch.clamp(x, -limit, limit)
        return x.to(target)

    if origin.span is None:
        assert origin.tensor is not None
        expected = cast(_materialize(origin.src, origin.tensor)).reshape(-1).view(torch.uint8)
        return span.length == expected.numel() and torch.equal(frombuffer(mm, "uint8", span.length, span.offset), expected)
    itemsize = dtypes.get(origin.dtype).itemsize
    out_itemsize = dtypes.get(origin.target).itemsize
    numel = origin.span.length // itemsize
    if span.length != numel * out_itemsize:
        return False
    step = max(1, (1 << 20) // itemsize)
    starts = sorted({0, (numel // 2) // step * step, max(0, (numel - 1) // step * step)}) if numel else []
    for first in starts:
        count = min(step, numel - first)
        x = frombuffer(origin.src.mm, origin.dtype, count, origin.span.offset + first * itemsize)
        got = frombuffer(mm, origin.target, count, span.offset + first * out_itemsize)
        if not torch.equal(got.view(torch.uint8), cast(x).view(torch.uint8)):
            return False
    return True


# -- the whole job -------------------------------------------------------------------------------


@dataclass
class Result:
    plan: Plan
    output: Path | None
    unsafe: list[ValueStats]
    dry_run: bool = False


def output_format(source_format: str, dest: Path, source: Path) -> str:
    if source.is_dir():
        return "hf-directory"
    if dest.suffix == ".safetensors":
        return "safetensors"
    if source_format == "safetensors":
        raise UsageError("safetensors input converts to safetensors output; give -o NAME.safetensors")
    return "torch-zip"


def convert(
    source: str | Path,
    to: str,
    *,
    output: str | Path | None = None,
    policy: Policy | None = None,
    keep: tuple[str, ...] = (),
    include_optimizer: bool = False,
    strip_optimizer: bool = False,
    clamp: bool = False,
    keep_unsafe: bool = False,
    dry_run: bool = False,
    force: bool = False,
    in_place: bool = False,
    progress_factory: Callable[[int], Progress] | None = None,
    max_shard_size: str | None = None,
) -> Result:
    """Plan, check values, write atomically and verify. Unsafe values block (see ``Result.unsafe``)."""
    src_path = Path(source)
    inv = read_checkpoint(src_path)
    if include_optimizer and strip_optimizer:
        raise UsageError("--include-optimizer and --strip-optimizer contradict each other")
    plan = make_plan(inv, to, policy=policy, keep=keep, include_optimizer=include_optimizer, strip_optimizer=strip_optimizer, clamp=clamp)
    dest = src_path if in_place else Path(output) if output else default_output(src_path, plan.target)
    out_format = output_format(inv.format, dest, src_path)
    if out_format == "safetensors" and not output and not in_place:
        dest = default_output(src_path, plan.target, "safetensors")
    if max_shard_size and out_format != "hf-directory":
        raise UsageError("--max-shard-size applies to Hugging Face directories")
    if strip_optimizer and out_format != "torch-zip":
        plan.notes.append("safetensors output holds no optimizer state anyway")
    with ExitStack() as stack:
        files = _source_files(src_path, inv)
        sources = {label: Source(path, sub, stack) for label, (path, sub) in files.items()}
        to_check = sum(s[2].length for s in _units_to_cast(plan, sources).values())
        check_values(plan, sources, progress_factory(to_check) if progress_factory and to_check else None)
        unsafe = apply_value_policy(plan, keep_unsafe=keep_unsafe)
        if dry_run or unsafe:
            return Result(plan, None, unsafe, dry_run=dry_run)
        check_destination(src_path, dest, force=force, in_place=in_place)
        total = sum(p.tensor.nbytes for p in plan.tensors if p.action != "drop")
        progress = progress_factory(total) if progress_factory else None
        if out_format == "hf-directory":
            with atomic_output(dest, mode_from=src_path, is_dir=True) as tmp:
                _write_directory(
                    plan,
                    src_path,
                    sources,
                    tmp,
                    strip_optimizer=strip_optimizer,
                    progress=progress,
                    max_shard_size=parse_size(max_shard_size) if max_shard_size else None,
                )
        else:
            ((label, src),) = sources.items()
            with atomic_output(dest, mode_from=src_path) as tmp:
                written = _write_file(plan, src, tmp, out_format, strip_optimizer=strip_optimizer, progress=progress)
                verify(plan, tmp, written)
    return Result(plan, dest, [])


def _source_files(path: Path, inv: Inventory) -> dict[str, tuple[Path, Inventory]]:
    if inv.format != "hf-directory":
        return {"": (path, inv)}
    out: dict[str, tuple[Path, Inventory]] = {}
    shards = inv.metadata.get("shards", [])
    assert isinstance(shards, list)
    for shard in shards:
        p = hfdir.confine(path, str(shard), origin=path)
        out[str(shard)] = (p, read_checkpoint(p))
    return out


def _write_file(plan: Plan, src: Source, out: Path, out_format: str, *, strip_optimizer: bool, progress: Progress | None) -> Written:
    if out_format == "safetensors":
        return write_safetensors(plan, src, out, progress=progress)
    return write_torch_zip(plan, src, out, strip_optimizer=strip_optimizer, progress=progress)


def parse_size(text: str) -> int:
    """``5GB``, ``500MB``, ``2GiB``, ``10KB`` or a plain byte count, as transformers' max_shard_size reads them."""
    import re

    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*", text, re.I)
    if not m:
        raise UsageError(f"--max-shard-size must look like 5GB, 500MB or 2GiB, not '{text}'")
    unit = (m.group(2) or "B").upper()
    scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}[unit]
    return int(float(m.group(1)) * scale)


def _write_directory(
    plan: Plan,
    src_dir: Path,
    sources: dict[str, Source],
    out_dir: Path,
    *,
    strip_optimizer: bool,
    progress: Progress | None,
    max_shard_size: int | None = None,
) -> None:
    total = 0
    weight_map: dict[str, str] | None = None
    if max_shard_size is not None:
        if any(src.inv.format != "safetensors" for src in sources.values()):
            raise UsageError("--max-shard-size re-shards safetensors directories only")
        weight_map, total = _reshard(plan, sources, out_dir, max_shard_size, progress)
    else:
        for label, src in sources.items():
            sub = Plan(src.inv, plan.target, [_relabel(p) for p in plan.tensors if p.tensor.file == label], clamp=plan.clamp)
            out = out_dir / label
            written = _write_file(
                sub,
                src,
                out,
                "safetensors" if src.inv.format == "safetensors" else "torch-zip",
                strip_optimizer=strip_optimizer,
                progress=progress,
            )
            verify(sub, out, written)
            total += sub.bytes_after
    index_name = hfdir.INDEX_NAMES[0] if (src_dir / hfdir.INDEX_NAMES[0]).exists() or weight_map is not None else hfdir.INDEX_NAMES[1]
    for item in src_dir.iterdir():
        if item.name in sources or item.name.startswith(".") or item.name in hfdir.INDEX_NAMES:
            continue
        dest = out_dir / item.name
        if item.name == "config.json" and item.is_file():
            config = json.loads(item.read_text(encoding="utf-8"))
            for key in ("torch_dtype", "dtype"):
                if key in config or key == "torch_dtype":
                    config[key] = plan.target
            dest.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        elif item.is_dir():
            shutil.copytree(item, dest, symlinks=True)
        else:
            shutil.copy2(item, dest)
    source_index = src_dir / index_name
    if weight_map is not None or source_index.is_file():
        index = json.loads(source_index.read_text(encoding="utf-8")) if source_index.is_file() else {}
        index.setdefault("metadata", {})["total_size"] = total
        if weight_map is not None:
            index["weight_map"] = weight_map
        (out_dir / index_name).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")


def _reshard(plan: Plan, sources: dict[str, Source], out_dir: Path, limit: int, progress: Progress | None) -> tuple[dict[str, str], int]:
    """Pack tensors, in order, into shards of at most ``limit`` bytes (a larger tensor gets a shard of its own)."""
    groups: list[list[TensorPlan]] = [[]]
    size = 0
    for p in plan.tensors:
        if p.action == "drop":
            continue
        if groups[-1] and size + p.out_nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(p)
        size += p.out_nbytes
    weight_map: dict[str, str] = {}
    total = 0
    for i, group in enumerate(groups):
        name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        items = [(_relabel(p), sources[p.tensor.file]) for p in group]
        written = _write_safetensors_file(items, out_dir / name, {"format": "pt"}, clamp=plan.clamp, progress=progress)
        sub = Plan(plan.source, plan.target, [p for p, _ in items], clamp=plan.clamp)
        verify(sub, out_dir / name, written)
        weight_map.update({p.tensor.name: name for p in group})
        total += sub.bytes_after
    return weight_map, total


def _relabel(p: TensorPlan) -> TensorPlan:
    return TensorPlan(p.tensor.with_(file=""), p.target, p.action, p.reason)


# -- scan --values -------------------------------------------------------------------------------


def value_findings(inv: Inventory, to: str = "fp16") -> list[Finding]:
    """What a cast to ``to`` would do to each floating tensor, as findings (``scan --values``)."""
    if inv.format not in ("torch-zip", "torch-legacy", "safetensors", "hf-directory"):
        return []
    plan = make_plan(inv, to, include_optimizer=True)
    out: list[Finding] = []
    with ExitStack() as stack:
        sources = {label: Source(path, sub, stack) for label, (path, sub) in _source_files(Path(inv.path), inv).items()}
        for stats in check_values(plan, sources).values():
            first = stats.name.split(", ")[0]
            figures = f"max |x| {stats.max_abs:.4g}, max abs error {stats.max_abs_error:.3g}, max rel error {stats.max_rel_error:.3g}"
            if stats.nonfinite:
                out.append(Finding("non-finite", "error", f"{stats.nonfinite} NaN/Inf values already present", tensor=first))
            if stats.overflow:
                out.append(
                    Finding(
                        "fp16-overflow",
                        "error",
                        f"{stats.overflow} of {stats.numel} values would become inf in {plan.target} ({figures})",
                        tensor=first,
                    )
                )
            if stats.underflow:
                severity: Severity = "error" if stats.underflow_fraction > UNDERFLOW_BLOCK_FRACTION else "warning"
                out.append(
                    Finding(
                        "fp16-underflow",
                        severity,
                        f"{stats.underflow} non-zero values ({stats.underflow_fraction:.2%}) would become 0 in {plan.target} ({figures})",
                        tensor=first,
                    )
                )
            if stats.subnormal and not stats.underflow:
                out.append(
                    Finding(
                        "fp16-subnormal",
                        "info",
                        f"{stats.subnormal} values land in {plan.target}'s subnormal range ({figures})",
                        tensor=first,
                    )
                )
    return out
