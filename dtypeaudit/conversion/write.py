"""Streaming writers: torch.save archives re-emitted from their own pickle, safetensors files, model directories."""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

from .. import dtypes, npcast, torchcast
from ..crc import crc32
from ..errors import ConversionError, UsageError
from ..formats.pickleout import Persistent, dumps
from ..formats.picklesplice import SpliceRefused, retype
from ..formats.picklevm import Global, Opaque
from ..formats.torchpickle import children, is_optimizer_state
from ..formats.training import is_training_state
from ..formats.zipwrite import StoredZipWriter
from ..inventory import Format, Inventory, Span, TensorRecord
from ..pieces import Job, Workers, Writeback, ordered, thread_count, write_at
from ..values import CHUNK_BYTES, ValueStats, measures_errors
from .atomic import flushing
from .mapped import MappedCheckpoint, Progress, contiguous_span, materialize
from .modeldir import config_with_dtype, copy_beside_weights, file_mode, output_index, write_index
from .plan import Plan, TensorPlan, unit_of
from .value_policy import workers_for
from .verify import Origin, Written, verify_written


@dataclass(frozen=True)
class Record:
    """One record of an output file, written at ``out_offset``: ``span`` of ``src`` cast from ``dtype`` to
    ``target`` (copied when they are equal), or, with no span, ``tensor``, a view torch gathers first; or, with
    ``computed``, bytes its own tasks make (a dequantized weight). ``stats``: the unit's statistics, into which
    torch's cast folds the errors the value checks do not measure."""

    src: MappedCheckpoint | None
    span: Span | None
    dtype: str
    target: str
    out_offset: int
    tensor: TensorRecord | None = None
    stats: ValueStats | None = None
    computed: tuple[tuple[Callable[[], Any], int], ...] = ()
    """The tasks that make the record's bytes in order, each with the bytes its result holds; a result has the
    bytes as ``data`` and is handed to ``fold`` once written (its value figures)."""
    fold: Callable[[Any], None] | None = None


COMPUTED_BYTES = 64 << 20
"""Results of computed records made ahead of the writer, at most (plus one): a few FP8 pieces, or one whole
weight of another scheme dequantized."""


def make_records(records: list[Record], out: Path | None, plan: Plan, workers: Workers | None, progress: Progress | None) -> list[int]:
    """Write every record into ``out`` (already laid out: each record's place reserved) and return their
    CRC-32s: the one per-record pipeline, bytes -> (dequantize) -> cast -> value figures -> CRC -> written at
    its place. numpy makes what it can (``casts_with_numpy``), piece by piece on the threads (``pieces.Workers``,
    folding the value checks that claim those bytes); computed records' tasks run on the same threads
    (``pieces.ordered``); torch the rest, here, one after another. ``out`` None: every record is made and
    checked, nothing written (a dry run's value checks; torch's casts are left to the checks alone)."""
    crcs = [0] * len(records)
    computed = [i for i, r in enumerate(records) if r.computed]
    with_torch = [i for i, r in enumerate(records) if not r.computed and _torch_makes(r, plan)]
    fd = os.open(out, os.O_WRONLY) if out is not None and (computed or with_torch) else None
    try:
        if computed:
            _make_computed([(i, records[i]) for i in computed], fd, str(out), crcs, progress)
        if fd is not None:
            for i in with_torch:
                crcs[i] = _torch_cast_into(fd, records[i], clamp=plan.clamp, progress=progress)
    finally:
        if fd is not None:
            os.close(fd)
    made = set(computed) | set(with_torch)
    numpy_made = [i for i in range(len(records)) if i not in made]
    if not numpy_made:
        return crcs
    with ExitStack() as stack:
        if workers is None:
            workers = stack.enter_context(workers_for(plan, {str(r.src.path): r.src for r in records if r.src is not None}, None))
        jobs = []
        for i in numpy_made:
            r = records[i]
            assert r.span is not None and r.src is not None
            source = str(r.src.path)
            unit = workers.unit_of(source, r.span.offset, r.span.length)
            jobs.append(Job(source, r.span.offset, r.span.length, r.dtype, r.target, str(out) if out else None, r.out_offset, unit))
        for i, crc in zip(numpy_made, workers.run(jobs, progress=progress), strict=True):
            crcs[i] = crc
    return crcs


def _make_computed(records: list[tuple[int, Record]], fd: int | None, out: str, crcs: list[int], progress: Progress | None) -> None:
    """The computed records' tasks on the threads, in order, each result written after the one before it."""

    def tasks() -> Iterator[tuple[Callable[[], tuple[int, Any]], int]]:
        for i, r in records:
            for task, cost in r.computed:
                yield partial(_indexed, i, task), cost

    at = {i: r.out_offset for i, r in records}
    folds = {i: r.fold for i, r in records}
    with Writeback() as disk:
        for i, piece in ordered(tasks(), thread_count(), budget=COMPUTED_BYTES):
            data = memoryview(piece.data).cast("B")
            if fd is not None and len(data):
                write_at(fd, data, at[i])
                crcs[i] = crc32(data, crcs[i])
                disk.landed(out, len(data))
            at[i] += len(data)
            fold = folds[i]
            if fold is not None:
                fold(piece)
            if progress:
                progress(len(data))


def _indexed(i: int, task: Callable[[], Any]) -> tuple[int, Any]:
    return i, task()


def _torch_makes(r: Record, plan: Plan) -> bool:
    """Whether torch makes a record: a view it gathers, or a cast the plan gives torch (``casts_need_torch``) or
    numpy cannot make as wanted (``casts_with_numpy``). A copy never needs it."""
    if r.span is None:
        return True
    if r.dtype == r.target:
        return False
    errors_wanted = r.stats is not None and not r.stats.errors_measured
    return plan.casts_with_torch or not casts_with_numpy(r.dtype, r.target, errors_wanted=errors_wanted)


def _torch_cast_into(fd: int, r: Record, *, clamp: bool, progress: Progress | None) -> int:
    """torch's cast of one record (gathered first when it is a view), written at its place; its CRC-32."""
    itemsize = dtypes.get(r.dtype).itemsize
    assert r.src is not None
    if r.span is not None:
        numel = r.span.length // itemsize
        pieces = iter(r.src.tensor_at(r.dtype, numel, r.span.offset).split(max(1, CHUNK_BYTES // itemsize)) if numel else ())
    else:
        assert r.tensor is not None
        pieces = iter(materialize(r.src, r.tensor).reshape(-1).split(max(1, CHUNK_BYTES // itemsize)))
    cast = torchcast.TorchCaster(r.dtype, r.target, clamp=clamp, stats=None if r.stats is None or r.stats.errors_measured else r.stats)
    crc, where = 0, r.out_offset
    for x in pieces:
        data = tensor_bytes(cast(x))
        crc = crc32(data, crc)
        write_at(fd, data, where)
        where += len(data)
        if progress:
            progress(x.numel() * itemsize)
    return crc


def casts_with_numpy(dtype: str, target: str, *, errors_wanted: bool) -> bool:
    """Whether the writer casts a contiguous ``dtype`` record to ``target`` with numpy (``npcast``, bit-equal to
    torch's cast) rather than torch: when npcast casts the pair and, where the cast's errors are wanted, the
    value checks measure them from the bits (float32's, see ``values.measures_errors``); torch's cast measures
    the others as it is made."""
    if dtype not in npcast.CASTS or target not in npcast.CASTS:
        return False
    return not errors_wanted or measures_errors(dtype, target)


def torch_needed_for(plan: Plan, sources: dict[str, MappedCheckpoint]) -> str | None:
    """Why writing ``plan`` needs torch, or None when numpy makes every byte: a view that must be gathered
    (``materialize``), or a cast whose errors the value checks do not measure (the writer measures them on
    torch's cast). A plain conversion (float32 weights to float16 or bfloat16) needs none, so the light
    install converts it."""
    for p in plan.tensors:
        t = p.tensor
        if p.action == "drop":
            continue
        if t.layout != "strided" or contiguous_span(sources[t.file], t) is None:
            return f"'{t.name}' is a view torch gathers"
        # the value checks give every cast weight its statistics (training state goes unchecked: check_values)
        if t.dtype != p.target and not casts_with_numpy(t.dtype, p.target, errors_wanted=not is_training_state(t)):
            return f"'{t.name}': only torch's cast measures the errors of {t.dtype} to {p.target}"
    return None


def casts_need_torch(plan: Plan, sources: dict[str, MappedCheckpoint]) -> bool:
    """Whether torch makes the casts: only where it must (``torch_needed_for``). numpy's pass runs on every core
    while torch's cast would follow the checks on one thread, so numpy is sooner at every size
    (benchmarks/CONVERT.md, round 4)."""
    return torch_needed_for(plan, sources) is not None


def require_torch(reason: str) -> None:
    """The one line that names the torch extra, for a conversion that needs torch (``reason`` says why)."""
    from ..extras import require

    require("torch", f"dtypeaudit convert ({reason})")


def tensor_bytes(y: Any) -> memoryview:
    """A tensor's bytes, as the file stores them (its elements in order, native little-endian)."""
    import torch

    return memoryview(y.contiguous().view(torch.uint8).numpy())


def _walk_graph(obj: Any, visit: Callable[[Persistent], None]) -> None:
    """Call ``visit`` on every persistent id (storage record) in the faithful graph, once each."""
    seen: set[int] = set()
    stack = [obj]
    while stack:
        o = stack.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        if isinstance(o, Persistent):
            visit(o)
        else:
            stack.extend(child for _, child, _ in children(o))


def _is_optimizer(value: Any) -> bool:
    if is_optimizer_state(value):
        return True
    return isinstance(value, list) and bool(value) and all(is_optimizer_state(v) for v in value)


def _keys(value: Any) -> Any:
    return value.items if isinstance(value, Opaque) else value


def _is_scaler_state(value: Any) -> bool:
    """torch.amp.GradScaler's state_dict (what AMP training and Lightning's MixedPrecision plugin save)."""
    keys = _keys(value)
    return isinstance(keys, dict) and {"scale", "growth_factor", "backoff_factor", "growth_interval"} <= set(keys)


def _is_scheduler_state(value: Any) -> bool:
    """An LRScheduler's state_dict: it steps an optimizer that is no longer there."""
    keys = _keys(value)
    return isinstance(keys, dict) and {"base_lrs", "last_epoch"} <= set(keys)


def is_lightning(root: Any) -> bool:
    """A checkpoint Lightning's Trainer wrote (``trainer.save_checkpoint``)."""
    keys = _keys(root)
    return isinstance(keys, dict) and "state_dict" in keys and ("pytorch-lightning_version" in keys or "optimizer_states" in keys)


# Lightning's weights-only checkpoint (ModelCheckpoint(save_weights_only=True), lightning 2.6's
# _CheckpointConnector.dump_checkpoint) leaves out exactly these, and the precision plugin's state.
LIGHTNING_TRAINING_KEYS = ("optimizer_states", "lr_schedulers", "callbacks")


def _training_state(value: Any) -> bool:
    return (
        _is_optimizer(value)
        or _is_scaler_state(value)
        or _is_scheduler_state(value)
        or (isinstance(value, list) and bool(value) and all(_is_scheduler_state(x) for x in value))
    )


def _training_state_paths(root: Any, *, max_depth: int = 8) -> list[tuple[str, ...]]:
    """The mapping entries --strip-optimizer removes, as key paths: optimizer state under any key, the LR
    schedulers and GradScaler state that step it, and for Lightning what its own weights-only
    checkpoints leave out (at the top level)."""
    out: list[tuple[str, ...]] = []
    lightning = is_lightning(root)

    def walk(value: Any, path: tuple[str, ...]) -> None:
        mapping = _keys(value)
        if not isinstance(mapping, dict) or len(path) >= max_depth:
            return
        for k, v in mapping.items():
            if not isinstance(k, str):
                continue
            if _training_state(v) or (lightning and not path and k in LIGHTNING_TRAINING_KEYS):
                out.append((*path, k))
            else:
                walk(v, (*path, k))

    walk(root, ())
    return out


def strip_keys(src: MappedCheckpoint) -> tuple[tuple[str, ...], ...]:
    """What ``--strip-optimizer`` removes from one torch.save file, as key paths (nothing from safetensors)."""
    if not Format(src.inv.format).torch_save or not src.layout.non_tensor:
        return ()  # a state dict of tensors alone holds no training state: the faithful graph is not needed
    root, _, _ = src.faithful
    return tuple(_training_state_paths(root))


def strip_notes(stripped: dict[str, tuple[tuple[str, ...], ...]], sources: dict[str, MappedCheckpoint]) -> list[str]:
    """What the plan says about --strip-optimizer, file by file."""
    out = []
    for label, paths in stripped.items():
        where = f" from {label}" if label else ""
        out.append(f"stripped {', '.join(repr('.'.join(p)) for p in paths)}{where} (--strip-optimizer)")
        if ("optimizer_states",) in paths and is_lightning(sources[label].faithful[0]):
            out.append(
                "a Lightning weights-only checkpoint, as ModelCheckpoint(save_weights_only=True) writes: "
                "LightningModule.load_from_checkpoint and Trainer.validate/test/predict(ckpt_path=...) load it; "
                "Trainer.fit(ckpt_path=...) cannot resume from it (Lightning requires optimizer_states), "
                "so load the weights and fit anew"
            )
    return out


def _strip(root: Any, paths: tuple[tuple[str, ...], ...]) -> None:
    for path in paths:
        mapping = _keys(root)
        for k in path[:-1]:
            mapping = _keys(mapping.get(k)) if isinstance(mapping, dict) else None
        if isinstance(mapping, dict):
            mapping.pop(path[-1], None)


def _source_dtype(storage_type: str) -> str:
    """The dtype a storage type holds; UntypedStorage's bytes (float8, uint16...: no typed storage class) are copied."""
    return "uint8" if storage_type == "UntypedStorage" else dtypes.STORAGE_CLASSES.get(storage_type, "")


def _typed_once(keys: dict[str, str], key: str, storage_type: str, src: MappedCheckpoint) -> str:
    """Note ``key``'s dtype in ``keys``: torch keeps the first type it sees for a key; a rewrite cannot keep both."""
    source_dtype = _source_dtype(storage_type)
    if not source_dtype:
        raise ConversionError(f"unknown storage type {storage_type}", path=str(src.path))
    if keys.setdefault(key, source_dtype) != source_dtype:
        raise ConversionError(f"storage '{key}' is named with two types ({keys[key]}, {source_dtype}); refused", path=str(src.path))
    return source_dtype


def _spliced(src: MappedCheckpoint, buf: Any, start: int, storage_target: dict[str, str]) -> tuple[bytes, dict[str, str]]:
    """The source's pickle with each storage type the plan changes renamed where the reader found it, and each
    storage key's source dtype (``storage_target`` gains the untouched ones)."""
    layout = src.layout
    keys: dict[str, str] = {}
    for _, key, storage_type, _ in layout.storage_sites:
        source_dtype = _typed_once(keys, key, storage_type, src)
        storage_target[key] = source_dtype if source_dtype == "uint8" else storage_target.get(key, source_dtype)
    if set(keys) != set(layout.storages):  # a storage the sites do not name would be left out of the archive
        raise SpliceRefused("the storage records the reader noted are not the storages it found")
    renamed = {key: dtypes.STORAGE_CLASS_OF[storage_target[key]] for key, dtype in keys.items() if storage_target[key] != dtype}
    legacy = layout.container == "legacy"
    pickle = retype(
        buf, start, layout.pickle_end, layout.storage_sites, layout.storage_type_pushes, layout.pickle_frames, renamed, drop_sixth=legacy
    )
    return pickle, keys


def _reemitted(src: MappedCheckpoint, strip: tuple[tuple[str, ...], ...], storage_target: dict[str, str]) -> tuple[bytes, dict[str, str]]:
    """The faithful graph (a second run of the pickle) with ``strip`` left out and its storage types changed, written
    anew; and each storage key's source dtype."""
    root = src.faithful[0]  # changed in place: planning has read it already
    _strip(root, strip)
    keys: dict[str, str] = {}

    def retype_record(ref: Persistent) -> None:
        pid = ref.pid
        if not (isinstance(pid, tuple) and len(pid) >= 5 and pid[0] == "storage" and isinstance(pid[1], Global)):
            raise ConversionError("unexpected persistent id in the pickle", path=str(src.path))
        key = str(pid[2])
        source_dtype = _typed_once(keys, key, pid[1].name, src)
        target = source_dtype if source_dtype == "uint8" else storage_target.get(key, source_dtype)
        cls = pid[1] if target == source_dtype else Global("torch", dtypes.STORAGE_CLASS_OF[target])
        ref.pid = ("storage", cls, key, pid[3], pid[4])
        storage_target[key] = target

    _walk_graph(root, retype_record)
    return dumps(root), keys


def write_torch_zip(
    plan: Plan,
    src: MappedCheckpoint,
    out: Path,
    *,
    strip: tuple[tuple[str, ...], ...],
    progress: Progress | None,
    workers: Workers | None = None,
) -> Written:
    """``strip``: the entries to leave out, as key paths (--strip-optimizer, decided by ``strip_keys`` when planning).

    The pickle is the source's own bytes with the storage types edited where the reader found them
    (formats/picklesplice.py); only a stripped checkpoint (or one whose types the edits cannot reach) is
    re-emitted from its faithful graph, which runs the pickle a second time."""
    storage_target: dict[str, str] = {}
    for p in plan.tensors:
        if p.tensor.storage is not None and p.action != "drop":
            storage_target[p.tensor.storage] = p.target
    buf, start, prefix, extras = src.main_pickle()
    pickle: bytes | None = None
    if not strip:
        try:
            pickle, keys = _spliced(src, buf, start, storage_target)
        except SpliceRefused:
            pickle = None
    if pickle is None:
        pickle, keys = _reemitted(src, strip, storage_target)
    stats_of = {p.tensor.storage: plan.values[unit_of(p.tensor)] for p in plan.tensors if unit_of(p.tensor) in plan.values}
    names_of: dict[str | None, list[str]] = {}
    for p in plan.tensors:
        if p.action != "drop":
            names_of.setdefault(p.tensor.storage, []).append(p.tensor.name)
    written = Written.planned(plan, sharing=True)
    with out.open("wb") as fh:
        zf = StoredZipWriter(fh)
        zf.add(prefix + "data.pkl", pickle)
        for name in (".format_version", ".storage_alignment", "byteorder"):
            if name in extras:
                zf.add(prefix + name, extras[name])
        records: list[Record] = []
        for key, dtype in keys.items():
            span = src.storage(key)
            target = storage_target[key]
            size = span.length // dtypes.get(dtype).itemsize * dtypes.get(target).itemsize
            records.append(Record(src, span, dtype, target, zf.reserve(f"{prefix}data/{key}", size), stats=stats_of.get(key)))
            written.origins[key] = Origin(src, span, dtype, target, names=tuple(names_of.get(key, ())))
        fh.flush()  # the records are written beside this file object, at their reserved places
        for key, crc in zip(keys, make_records(records, out, plan, workers, progress), strict=True):
            zf.fill(f"{prefix}data/{key}", crc)
            written.crcs[key] = crc
        for name, data in extras.items():
            if name not in (".format_version", ".storage_alignment", "byteorder"):
                zf.add(prefix + name, data)
        zf.close()
    return written


TIES_NOTE = (
    "{aliases} stored once, under {targets} (safetensors holds no shared tensors; the tie is kept in the metadata "
    "as dtypeaudit.aliases): a strict load_state_dict(load_file(PATH)) misses {them}. Load with "
    "safetensors.torch.load_model(model, PATH), or load_state_dict(load_file(PATH), strict=False) then model.tie_weights(); "
    "or convert with --materialize-ties to write every name"
)


def write_safetensors(
    plan: Plan,
    src: MappedCheckpoint,
    out: Path,
    *,
    progress: Progress | None,
    materialize_ties: bool = False,
    workers: Workers | None = None,
) -> Written:
    """Tensors only; a tensor under several names (tied weights) is written once, the aliases kept in metadata
    and said in a note with the load that restores them, unless ``materialize_ties`` writes a copy per name."""
    if Format(src.inv.format).torch_save:
        _refuse_non_tensor_content(src)
    meta = dict(src.inv.metadata.get("safetensors_metadata") or {"format": "pt"})  # type: ignore[call-overload]
    items = [(p, src) for p in plan.tensors]
    written = _write_safetensors_file(items, out, meta, plan, progress=progress, materialize_ties=materialize_ties, workers=workers)
    if written.aliases:
        names = sorted(written.aliases)
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        targets = ", ".join(sorted(set(written.aliases.values()))[:3])
        plan.notes.append(
            TIES_NOTE.format(
                aliases=shown + (" is" if len(names) == 1 else " are"), targets=targets, them="it" if len(names) == 1 else "them"
            )
        )
    return written


def _write_safetensors_file(
    items: list[tuple[TensorPlan, MappedCheckpoint]],
    out: Path,
    meta: dict[str, str],
    plan: Plan,
    *,
    progress: Progress | None,
    materialize_ties: bool = False,
    workers: Workers | None = None,
) -> Written:
    entries: list[tuple[TensorPlan, MappedCheckpoint, Span | None]] = []
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
        tie = (str(src.path), t.storage, t.offset, t.shape, t.stride) if t.storage is not None and not materialize_ties else None
        if tie is not None and tie in first_of:
            aliases[t.name] = first_of[tie]
            continue
        if tie is not None:
            first_of[tie] = t.name
        entries.append((p, src, contiguous_span(src, t)))
    meta = dict(meta)
    if aliases:
        meta["dtypeaudit.aliases"] = json.dumps(aliases, sort_keys=True)
    written = Written.planned(plan)
    written.aliases = aliases
    records: list[Record] = []
    where = 0
    for p, src, span in entries:
        t = p.tensor
        records.append(Record(src, span, t.dtype, p.target, where, t, plan.values.get(unit_of(t))))
        written.origins[t.name] = Origin(src, span, t.dtype, p.target, t, names=(t.name,))
        where += p.out_nbytes
    tensors = [(p.tensor.name, p.target, p.tensor.shape) for p, _, _ in entries]
    for (p, _, _), crc in zip(entries, write_safetensors_records(out, tensors, meta, records, plan, workers, progress), strict=True):
        written.crcs[p.tensor.name] = crc
    return written


def write_safetensors_records(
    out: Path | None,
    tensors: list[tuple[str, str, tuple[int, ...]]],
    meta: dict[str, str],
    records: list[Record],
    plan: Plan,
    workers: Workers | None,
    progress: Progress | None,
) -> list[int]:
    """The one safetensors writer: the header of ``tensors`` (name, dtype, shape, in order), then each tensor's
    record (``out_offset`` counted from the end of the header) made at its place (``make_records``); their
    CRC-32s. ``out`` None: made and checked, nothing written."""
    header = safetensors_header(tensors, meta)
    records = [replace(r, out_offset=len(header) + r.out_offset) for r in records]
    if out is not None:
        with out.open("wb") as fh:
            fh.write(header)
            fh.truncate(len(header) + sum(math.prod(shape) * dtypes.get(dtype).itemsize for _, dtype, shape in tensors))
    return make_records(records, out, plan, workers, progress)


def safetensors_header(tensors: list[tuple[str, str, tuple[int, ...]]], meta: dict[str, str]) -> bytes:
    """A safetensors file's first bytes for ``(name, dtype, shape)`` tensors stored in that order: the header's
    length (8 bytes, little-endian), then its JSON, padded with spaces to 8 bytes as safetensors writes it."""
    header: dict[str, Any] = {}
    offset = 0
    for name, dtype, shape in tensors:
        size = math.prod(shape) * dtypes.get(dtype).itemsize
        header[name] = {"dtype": dtypes.SAFETENSORS_CODE_OF[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps({"__metadata__": meta, **header}, separators=(",", ":")).encode()
    text += b" " * ((-len(text)) % 8)
    return struct.pack("<Q", len(text)) + text


def _refuse_non_tensor_content(src: MappedCheckpoint) -> None:
    """safetensors stores tensors only: refuse rather than silently drop an epoch or hyper-parameters (what the
    reader found beside the tensors, ``Layout.non_tensor``)."""
    extra = src.layout.non_tensor
    if extra:
        raise ConversionError(
            f"holds non-tensor content ({', '.join(extra[:3])}{', ...' if len(extra) > 3 else ''}) that safetensors cannot store; "
            "convert to .pt instead, or save a plain state_dict first",
            path=str(src.path),
        )


def write_file(
    plan: Plan,
    src: MappedCheckpoint,
    out: Path,
    out_format: str,
    *,
    strip: tuple[tuple[str, ...], ...] = (),
    progress: Progress | None,
    materialize_ties: bool = False,
    workers: Workers | None = None,
) -> Written:
    if out_format == Format.SAFETENSORS:
        return write_safetensors(plan, src, out, progress=progress, materialize_ties=materialize_ties, workers=workers)
    return write_torch_zip(plan, src, out, strip=strip, progress=progress, workers=workers)


def write_directory(
    plan: Plan,
    src_dir: Path,
    sources: dict[str, MappedCheckpoint],
    out_dir: Path,
    *,
    progress: Progress | None,
    max_shard_size: int | None = None,
    workers: Workers | None = None,
) -> dict[str, Written]:
    """Every shard converted (or re-packed), config.json's dtype set to ``plan.config_dtype``, every other file
    copied; each file keeps its source's mode. Links are followed where they stay inside the directory or
    lead into the Hugging Face cache's blobs/ of the same repository (a snapshot), and refused elsewhere.

    Returns what each weight file holds (its name in ``out_dir`` -> its ``Written``), each already verified
    against one read of the file."""
    total = 0
    weight_map: dict[str, str] | None = None
    written: dict[str, Written] = {}
    if max_shard_size is not None:
        if any(src.inv.format != Format.SAFETENSORS for src in sources.values()):
            raise UsageError("--max-shard-size re-shards safetensors directories only")
        weight_map, total = _reshard(plan, sources, out_dir, max_shard_size, progress, workers, written)
        shard_mode = file_mode(next(iter(sources.values())).path)
        for name in set(weight_map.values()):
            os.chmod(out_dir / name, shard_mode)
    else:
        for label, src in sources.items():
            sub = _subplan(src.inv, plan, [p for p in plan.tensors if p.tensor.file == label])
            out = out_dir / label
            written[label] = write_file(
                sub,
                src,
                out,
                Format.SAFETENSORS if src.inv.format == Format.SAFETENSORS else Format.TORCH_ZIP,
                strip=plan.stripped.get(label, ()),
                progress=progress,
                workers=workers,
            )
            with flushing(out):
                verify_written(out, written[label])
            os.chmod(out, file_mode(src.path))
            total += sub.bytes_after
    index = output_index(plan.source, repacked=weight_map is not None)
    skip = {*sources, *([index] if index else [])}
    copy_beside_weights(
        src_dir, out_dir, source=plan.source, skip=skip, edit_config=lambda config: config_with_dtype(config, plan.config_dtype)
    )
    write_index(src_dir, out_dir, index, total, weight_map)
    return written


def _reshard(
    plan: Plan,
    sources: dict[str, MappedCheckpoint],
    out_dir: Path,
    limit: int,
    progress: Progress | None,
    workers: Workers | None,
    records: dict[str, Written],
) -> tuple[dict[str, str], int]:
    """Pack tensors, in order, into shards of at most ``limit`` bytes (a larger tensor gets a shard of its own);
    each shard's ``Written`` lands in ``records``."""
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
        sub = _subplan(plan.source, plan, group)
        items = [(p, sources[original.tensor.file]) for p, original in zip(sub.tensors, group, strict=True)]
        records[name] = _write_safetensors_file(items, out_dir / name, {"format": "pt"}, sub, progress=progress, workers=workers)
        with flushing(out_dir / name):
            verify_written(out_dir / name, records[name])
        weight_map.update({p.tensor.name: name for p in group})
        total += sub.bytes_after
    return weight_map, total


def _subplan(source: Inventory, plan: Plan, plans: list[TensorPlan]) -> Plan:
    """The part of ``plan`` that goes into one output file, its tensors relabelled as that file's own;
    their value statistics are shared with ``plan``, so the errors measured while writing land there."""
    relabelled = [TensorPlan(p.tensor.with_(file=""), p.target, p.action, p.reason) for p in plans]
    sub = Plan(source, plan.target, relabelled, clamp=plan.clamp)
    for p, r in zip(plans, relabelled, strict=True):
        if unit_of(p.tensor) in plan.values:
            sub.values[unit_of(r.tensor)] = plan.values[unit_of(p.tensor)]
    return sub
