"""``convert --to bf16|fp16|fp32`` on a quantized checkpoint: every logical weight dequantized on the CPU.

Shard by shard, a piece at a time: each output shard is the source shard with its quantized storage
(packed values, scales, zero points, group indices, quant states) replaced by the dequantized weights at
their logical names, every other floating tensor cast to the target and the rest copied. config.json loses
its ``quantization_config`` and names the target dtype, so that a plain ``from_pretrained`` loads the result
as the model it was. The pieces compute on a few threads while the previous ones are written; memory stays
bounded by ``PIPELINE_BYTES`` plus the largest single weight of a scheme dequantized whole (its storage, its
float32 dequantization and its cast), never the shard. FP8 block weights and every tensor stored whole are
read and cast with numpy (``quant.dequant.fp8_block_cast_np``, ``npcast``): converting an FP8 checkpoint never
imports torch. Anything that cannot be dequantized exactly is refused before the output appears (the output
is written to a temporary and renamed only when verified).

The values get a cast's checks and verdict: each piece's values (dequantized, or read) are folded by
``values.ValueCheck`` as it is made, and ``checks.apply_value_policy`` decides, as for a cast: NaN/Inf, overflow
and underflow refuse the output (exit 1, nothing written), ``--clamp`` saturates overflow. ``--dry-run
--check-values`` makes every piece and writes none.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from .. import dtypes, npcast
from ..errors import ConversionError, UsageError
from ..inventory import Format, Inventory, Span, TensorRecord
from ..quant import model as qm
from ..values import ValueStats

if TYPE_CHECKING:
    import torch

    from ..policy import Policy
    from .mapped import MappedCheckpoint, Progress
    from .plan import Plan
    from .result import Result
    from .verify import Written

DEQUANTIZE = "dequantize"
"""The plan action of a logical weight written dequantized (its storage tensors are dropped)."""
DROP_REASON = "quantized storage, replaced by its dequantized weight"


@dataclass
class _Entry:
    """One tensor of an output shard: a source tensor (cast or copied) or a dequantized logical weight."""

    name: str
    target: str
    shape: tuple[int, ...]
    tensor: TensorRecord | None = None
    weight: qm.LogicalWeight | None = None


@dataclass
class _Shard:
    label: str
    entries: list[_Entry] = field(default_factory=list)


def supported(view: qm.QuantView) -> None:
    """Refuse, before anything is read, what no dequantizer here reads exactly."""
    for w in view.weights:
        if w.missing:
            raise ConversionError(
                f"'{w.name}' ({w.scheme.name}) lacks its {', '.join(w.missing)}: the loader would leave it at random; refused"
            )
        fam = w.scheme.family
        if fam == qm.MXFP4 and "blocks" not in w.storage:
            raise ConversionError(f"'{w.name}': compressed-tensors mxfp4-pack-quantized is not dequantized yet; refused")
        if fam == qm.AWQ:
            version = str(view.config.get("version", "gemm")).lower()
            if version != "gemm":
                raise ConversionError(f"'{w.name}': AWQ version '{version}' packs differently from GEMM; refused")
        if fam not in qm.FAMILIES:
            raise ConversionError(f"'{w.name}': no dequantizer for the {fam} family ({w.scheme.name}); refused")


@dataclass(frozen=True)
class Reading:
    """What every piece of a dequantizing conversion reads from: the source's mapped files by label, its tensors by
    name (every weight looks its storage up: a large MoE checkpoint has tens of thousands), and ``--clamp``."""

    files: dict[str, MappedCheckpoint]
    by_name: dict[str, TensorRecord]
    clamp: bool = False

    def file_of(self, t: TensorRecord) -> MappedCheckpoint:
        return self.files[t.file]


def _raw(src: MappedCheckpoint, t: TensorRecord) -> torch.Tensor:
    """A storage tensor as the dtype its file declares (GGUF's quantized blocks as bytes)."""
    from .mapped import materialize

    if src.inv.format == Format.GGUF or t.dtype not in dtypes.DTYPES:
        start = src.spans[t.name].offset if t.name in src.spans else t.offset
        return src.tensor_at("uint8", t.nbytes, start)
    if t.storage is None and t.name in src.spans:  # safetensors: the tensor's own contiguous bytes
        return src.tensor_at(t.dtype, t.numel, src.spans[t.name].offset).reshape(t.shape)
    return materialize(src, t)


def _storage(weight: qm.LogicalWeight, reading: Reading) -> dict[str, torch.Tensor]:
    out = {}
    for role, name in weight.storage.items():
        t = reading.by_name[name]
        out[role] = _raw(reading.file_of(t), t)
    return out


def logical_shape(weight: qm.LogicalWeight, reading: Reading) -> tuple[int, ...]:
    """The shape the dequantized weight has: from the small tensors that record it where there are some
    (compressed-tensors' ``weight_shape``, bitsandbytes' quant state), else from the grouping."""
    from ..quant import dequant

    by = reading.by_name
    if "shape" in weight.storage:
        t = by[weight.storage["shape"]]
        return tuple(int(x) for x in _raw(reading.file_of(t), t).tolist())
    if weight.scheme.family == qm.BNB4 and "quant_state" in weight.storage:
        t = by[weight.storage["quant_state"]]
        shape = dequant.bnb_quant_state(_raw(reading.file_of(t), t)).get("shape")
        if isinstance(shape, list) and all(isinstance(d, int) for d in shape):
            return tuple(shape)
    if weight.shape is None:
        raise ConversionError(f"'{weight.name}' ({weight.scheme.name}): its logical shape is not known; refused")
    return tuple(weight.shape)


def make_dequant_plan(inv: Inventory, view: qm.QuantView, target: str, reading: Reading, *, is_dir: bool) -> tuple[Plan, list[_Shard]]:
    """What each tensor becomes, and the output shards in the source's order: the one plan of a quantized source,
    made whole here (a dequantize, a cast, a copy or a drop per record)."""
    from .plan import Plan, TensorPlan

    owner = view.by_storage()
    emitted: set[str] = set()
    plans: list[TensorPlan] = []
    shards: dict[str, _Shard] = {}
    for t in inv.tensors:
        shard = shards.setdefault(t.file, _Shard(t.file))
        w = owner.get(t.name)
        if w is not None:
            plans.append(TensorPlan(t, t.dtype, "drop", DROP_REASON))
            if w.name in emitted:
                continue
            emitted.add(w.name)
            shape = logical_shape(w, reading)
            record = TensorRecord(w.name, w.scheme.value, shape, 0, kind="parameter", file=w.file or t.file, scheme=w.scheme.name)
            plans.append(TensorPlan(record, target, DEQUANTIZE, f"{w.scheme.name} dequantized"))
            shards.setdefault(w.file or t.file, _Shard(w.file or t.file)).entries.append(_Entry(w.name, target, shape, weight=w))
            continue
        if t.dtype in dtypes.CASTABLE and t.layout == "strided":
            action = "leave" if t.dtype == target else "cast"
            plans.append(TensorPlan(t, target, action, f"already {target}" if action == "leave" else ""))
            shard.entries.append(_Entry(t.name, target, t.shape, tensor=t))
        else:
            plans.append(TensorPlan(t, t.dtype, "leave", f"{t.dtype} tensors are left exactly as they are"))
            shard.entries.append(_Entry(t.name, t.dtype, t.shape, tensor=t))
    n = len(view.weights)
    schemes = ", ".join(sorted({w.scheme.name for w in view.weights}))
    if n:
        notes = [
            f"{n} quantized weight{'s' if n != 1 else ''} ({schemes}) {'are' if n != 1 else 'is'} dequantized to {target}; "
            "quantization_config is removed from config.json"
        ]
    else:  # an all-float GGUF comes this way too (inventory.Format.dequantizes), with nothing to dequantize
        notes = [f"no quantized weights: a {inv.format} file is converted by the dequantizing writer, to safetensors"]
    plan = Plan(inv, target, plans, clamp=reading.clamp, notes=notes, config_dtype=target if is_dir else None)
    return plan, list(shards.values())


# -- value checks: the same figures, and the same verdict (conversion/value_policy.py), as a cast's --------------------


_THREAD = threading.local()


def _value_check() -> Any:
    """This thread's ``values.ValueCheck`` (its buffers are reused chunk after chunk)."""
    from ..values import ValueCheck

    check = getattr(_THREAD, "check", None)
    if check is None:
        check = _THREAD.check = ValueCheck()
    return check


def _fold(stats: ValueStats, values: Any, clamp: bool) -> None:
    """Fold float32 ``values`` (any shape, contiguous) into ``stats``, a chunk at a time, as a cast's checks fold."""
    import numpy as np

    from ..values import CHUNK_BYTES

    flat = np.ascontiguousarray(values, dtype=np.float32).reshape(-1)
    check = _value_check()
    step = CHUNK_BYTES // 4
    for start in range(0, len(flat), step):
        chunk = flat[start : start + step]
        check.fold(stats, chunk, chunk, clamp=clamp)


class Computed(NamedTuple):
    """The bytes of part of an output tensor, and what the value checks found in them (None: nothing to check)."""

    data: Any
    stats: ValueStats | None = None
    looked: bool = True
    """False where the checks had nothing to look at (an FP8 piece whose values are all plainly held): its cast
    errors were not measured."""


def _cast(x: torch.Tensor, target: str, name: str, clamp: bool) -> Computed:
    """A dequantized weight cast by torch (as the loader's ``.to`` casts it), its values checked first."""
    import torch

    stats = ValueStats(name, dtypes.name_of(x.dtype), target)
    if x.is_floating_point():
        _fold(stats, x.detach().to(torch.float32).numpy(), clamp)
        if clamp and target in ("float16", "bfloat16"):
            top = torch.finfo(getattr(torch, target)).max
            x = x.clamp(-top, top)
    from .write import tensor_bytes

    return Computed(tensor_bytes(x.to(getattr(torch, target))), stats)


PIPELINE_BYTES = 64 << 20
"""Results computed ahead of the writer, at most (plus one): a few FP8 pieces, or one whole weight of another scheme."""
COPY_BYTES = 8 << 20
"""Source bytes per piece of a tensor copied or cast."""

Task = tuple[Callable[[], Any], int]
"""A piece of an output tensor: what computes its ``Computed``, and the bytes it holds."""


class _Blocked(Exception):
    """Thrown into an output whose values block it: the temporary is removed, and the Result says why."""


def _write_shard(shard: _Shard, reading: Reading, out: Path | None, progress: Progress | None, found: dict[str, ValueStats]) -> Written:
    """One safetensors file, its tensors' bytes computed a piece at a time on a few threads while this one writes
    the pieces before them, across tensors (a weight's dequantization overlaps the previous one's write); returns
    what it wrote (each tensor and its bytes' CRC-32) for verification, each tensor's value figures left in
    ``found``. ``out`` None: the values are read and checked, nothing is written (``--dry-run --check-values``)."""
    import traceback

    try:
        return _write_pieces(shard, reading, out, progress, found)
    except BaseException as exc:
        # The frames it leaves behind hold numpy views of the source mappings, which then could not close
        # (BufferError) and would hide this error: drop their locals.
        traceback.clear_frames(exc.__traceback__)
        raise


def _write_pieces(shard: _Shard, reading: Reading, out: Path | None, progress: Progress | None, found: dict[str, ValueStats]) -> Written:
    from ..crc import crc32
    from ..pieces import Writeback, ordered
    from ..pieces import thread_count as workers
    from .verify import Written
    from .write import safetensors_header

    written = Written(tensors={e.name: (e.target, e.shape) for e in shard.entries})
    crcs = written.crcs
    plans = [_pieces(e, reading) for e in shard.entries]

    def tasks() -> Iterator[Task]:
        for e, (pieces, _) in zip(shard.entries, plans, strict=True):
            yield from pieces
            yield partial(_itself, e), 0  # the entry itself, once all of its pieces are written

    with ExitStack() as stack:
        if any(uses_torch for _, uses_torch in plans):
            from ..torchcast import one_thread
            from .write import require_torch

            e = next(e for e, (_, uses_torch) in zip(shard.entries, plans, strict=True) if uses_torch)
            require_torch(
                f"dequantizing '{e.name}' ({e.weight.scheme.name})" if e.weight is not None else f"'{e.name}' is a view torch gathers"
            )

            # each task's torch ops on one thread: under load, torch's intra-op threads on a small piece spin
            # far more than they compute
            stack.enter_context(one_thread())
        fh = stack.enter_context(out.open("wb")) if out is not None else None
        writeback = stack.enter_context(Writeback()) if out is not None else None
        if fh is not None:
            fh.write(safetensors_header([(e.name, e.target, e.shape) for e in shard.entries], {"format": "pt"}))
        crc, landed = 0, fh.tell() if fh is not None else 0  # what the writeback has been told of
        stats: ValueStats | None = None
        looked = True
        for piece in ordered(tasks(), workers(), budget=PIPELINE_BYTES):
            if isinstance(piece, _Entry):
                crcs[piece.name] = crc
                crc = 0
                # a figure not measured is not shown as if it were: such a tensor's figures only when it has problems
                if stats is not None and (looked or stats.problems()):
                    found[piece.name] = stats
                stats, looked = None, True
                _release(reading, piece)
                if fh is not None and writeback is not None:
                    fh.flush()
                    writeback.landed(str(out), fh.tell() - landed)
                    landed = fh.tell()
                continue
            looked = looked and piece.looked
            if piece.stats is not None:
                if stats is None:
                    stats = piece.stats
                else:
                    stats.merge(piece.stats)
            n = memoryview(piece.data).nbytes
            if n and fh is not None:
                fh.write(piece.data)
                crc = crc32(piece.data, crc)
            if progress:
                progress(n)
    return written


def _itself(e: _Entry) -> _Entry:
    return e


def _release(reading: Reading, e: _Entry) -> None:
    """Unmap the source pages an entry read (they stay in the page cache): a read-only mapping's pages would
    otherwise count in the process's RSS until the whole shard is done."""
    import mmap

    names = list(e.weight.storage.values()) if e.weight is not None else [e.name]
    for name in names:
        t = reading.by_name.get(name)
        src = reading.files.get(t.file) if t is not None else None
        if src is None or not isinstance(src.mm, mmap.mmap) or name not in src.spans or not hasattr(mmap, "MADV_DONTNEED"):
            continue
        span = src.spans[name]
        start = span.offset - span.offset % mmap.PAGESIZE
        end = min(len(src.mm), span.offset + span.length)
        if end > start:
            src.mm.madvise(mmap.MADV_DONTNEED, start, end - start)


def _pieces(e: _Entry, reading: Reading) -> tuple[Iterator[Task], bool]:
    """An output tensor's bytes as tasks in order, and whether any of them needs torch: FP8 block weights and
    tensors stored whole (safetensors, GGUF) are read and cast with numpy; other schemes, and views a
    torch.save file holds, with torch."""
    if e.weight is not None:
        fp8 = _fp8_tasks(e.weight, e.shape, e.target, reading)
        if fp8 is not None:
            return iter(fp8), False
        return iter([(partial(_dequantized, e.weight, e.shape, e.target, reading), 8 * _numel(e.shape))]), True
    from .mapped import contiguous_span

    t = e.tensor
    assert t is not None
    src = reading.file_of(t)
    span = contiguous_span(src, t) if t.dtype in dtypes.DTYPES else None
    if span is None:
        return iter([(partial(_gathered, src, t, e.target, reading.clamp), t.numel * dtypes.get(e.target).itemsize)]), True
    return _cast_pieces(src, span, t, e.target, reading.clamp), False


def _dequantized(w: qm.LogicalWeight, shape: tuple[int, ...], target: str, reading: Reading) -> Computed:
    """A whole weight dequantized by its scheme's dequantizer and cast to ``target``, as bytes."""
    from ..quant import dequant

    value = dequant.dequantize(w, _storage(w, reading))
    if tuple(value.shape) != shape:
        if value.numel() != _numel(shape):
            raise ConversionError(f"'{w.name}' dequantizes to {list(value.shape)}, not {list(shape)}; refused")
        value = value.reshape(shape)
    return _cast(value, target, w.name, reading.clamp)


def _gathered(src: MappedCheckpoint, t: TensorRecord, target: str, clamp: bool) -> Computed:
    """A tensor that is a view into its storage (torch.save), gathered and cast by torch, as bytes."""
    from .mapped import materialize

    return _cast(materialize(src, t), target, t.name, clamp)


def _cast_pieces(src: MappedCheckpoint, span: Span, t: TensorRecord, target: str, clamp: bool) -> Iterator[Task]:
    """A contiguous tensor copied (same dtype: quantized storage kept, integers, tensors already in the target) or
    cast by :mod:`dtypeaudit.npcast` (bit-equal to torch's cast but for NaN payloads), a piece at a time; a
    floating one's values checked as a cast's (a copy: NaN/Inf only, as for a tensor a cast leaves)."""
    dtype = t.dtype
    floating = dtype in dtypes.CASTABLE and t.layout == "strided"
    itemsize = dtypes.get(dtype).itemsize if dtype in dtypes.DTYPES else 1
    step = COPY_BYTES // itemsize
    numel = span.length // itemsize
    for first in range(0, numel, step):
        count = min(step, numel - first)
        offset = span.offset + first * itemsize
        if dtype == target:
            yield partial(_copy_piece, src, offset, count, itemsize, t.name, dtype if floating else None), 0
        else:
            yield partial(_cast_piece, src, offset, count, dtype, target, t.name, clamp), count * dtypes.get(target).itemsize


def _copy_piece(src: MappedCheckpoint, offset: int, count: int, itemsize: int, name: str, floating: str | None) -> Computed:
    from ..values import count_nonfinite

    stats = None
    if floating is not None:
        stats = ValueStats(name, floating, floating, numel=count, nonfinite=count_nonfinite(src.mm, floating, offset, count))
    return Computed(src.bytes_at(offset, count * itemsize), stats)


def _cast_piece(src: MappedCheckpoint, offset: int, count: int, dtype: str, target: str, name: str, clamp: bool) -> Computed:
    import numpy as np

    from ..values import float32_chunks

    stats = ValueStats(name, dtype, target)
    check = _value_check()
    for x, original in float32_chunks(src.mm, dtype, offset, count):
        check.fold(stats, x, original, clamp=clamp)
    x = np.frombuffer(src.mm, dtype=npcast.storage_dtype(dtype), count=count, offset=offset)
    return Computed(npcast.cast(x, dtype, target, clamp=clamp).view(np.uint8), stats)


def _array(src: MappedCheckpoint, t: TensorRecord) -> Any:
    """A tensor stored whole in its own bytes (safetensors) as a read-only numpy array of its stored form (float8
    as uint8 codes, bfloat16 as uint16 bits), without copying; None for any other record."""
    import numpy as np

    from ..quant.dequant import FLOAT8_FORMATS

    if src.inv.format == Format.GGUF or t.storage is not None or t.name not in src.spans:
        return None
    if t.dtype in FLOAT8_FORMATS:
        dtype = np.dtype(np.uint8)
    elif t.dtype in npcast.CASTS:
        dtype = npcast.storage_dtype(t.dtype)
    else:
        return None
    span = src.spans[t.name]
    if span.length != t.numel * dtype.itemsize:
        return None
    return np.frombuffer(src.mm, dtype=dtype, count=t.numel, offset=span.offset).reshape(t.shape)


def _fp8_tasks(w: qm.LogicalWeight, shape: tuple[int, ...], target: str, reading: Reading) -> list[Task] | None:
    """An FP8 block-scaled 2-D weight (transformers' ``fp8``) dequantized and cast with numpy, a few blocks of rows
    a task (the pieces compute in parallel and each one's tables stay in cache); None for any other weight."""
    from ..quant.dequant import FLOAT8_FORMATS
    from ..values import CHUNK_BYTES

    group = tuple(w.scheme.group or ())
    if w.scheme.family != qm.FP8 or len(shape) != 2 or len(group) != 2 or not {"weight", "scale"} <= set(w.storage):
        return None
    wt, st = reading.by_name[w.storage["weight"]], reading.by_name[w.storage["scale"]]
    codes, scale = _array(reading.file_of(wt), wt), _array(reading.file_of(st), st)
    bm = group[0]
    if codes is None or scale is None or wt.dtype not in FLOAT8_FORMATS or st.dtype not in npcast.CASTS:
        return None
    if tuple(codes.shape) != shape or scale.ndim != 2 or scale.shape[0] != -(-shape[0] // bm):
        return None
    if st.dtype != "float32":  # the loader multiplies in float32: widen (or round) the scales as torch's cast does
        scale = npcast.cast(scale.reshape(-1), st.dtype, "float32").reshape(scale.shape)
    step = max(1, (4 * CHUNK_BYTES) // max(1, shape[1] * 4) // bm) * bm
    piece_bytes = step * shape[1] * dtypes.get(target).itemsize
    return [
        (
            partial(_fp8_piece, codes[r0 : r0 + step], scale[r0 // bm : (r0 + step) // bm], wt.dtype, group, target, w.name, reading.clamp),
            piece_bytes,
        )
        for r0 in range(0, shape[0], step)
    ]


def _fp8_piece(codes: Any, scale: Any, fp8: str, block: tuple[int, ...], target: str, name: str, clamp: bool) -> Computed:
    import numpy as np

    from ..quant import dequant

    out, products = dequant.fp8_block_cast_np(codes, scale, fp8, block, target, clamp=clamp)
    data = out.reshape(-1).view(np.uint8)
    if products is None:  # every value finite and plainly held: nothing for the checks to count
        return Computed(data, ValueStats(name, "float32", target, numel=codes.size), looked=False)
    stats = ValueStats(name, "float32", target)
    _fold(stats, products, clamp)
    return Computed(data, stats)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _write_directory(
    shards: list[_Shard],
    inv: Inventory,
    src_dir: Path,
    reading: Reading,
    tmp: Path | None,
    target: str,
    progress: Progress | None,
    found: dict[str, ValueStats],
) -> dict[str, Written]:
    """The dequantized shards (each verified against one read of it) and the files beside them; returns each
    shard's name in ``tmp`` -> what it holds. ``tmp`` None: the values are checked, nothing is written."""
    from .modeldir import config_with_dtype, copy_beside_weights, file_mode, output_index, write_index
    from .verify import verify_written

    weight_map: dict[str, str] = {}
    total = 0
    written: dict[str, Written] = {}
    for shard in shards:
        if not shard.entries:
            continue  # a shard that held only storage of weights written elsewhere (scales of another shard's weights)
        out = tmp / shard.label if tmp is not None else None
        written[shard.label] = _write_shard(shard, reading, out, progress, found)
        if out is not None:
            verify_written(out, written[shard.label])
            os.chmod(out, file_mode(reading.files[shard.label].path))
        for e in shard.entries:
            weight_map[e.name] = shard.label
            total += _numel(e.shape) * dtypes.get(e.target).itemsize
    if tmp is None or _blocking(found, reading.clamp):
        return written
    index = output_index(inv)  # its weight map renamed: storage names become the logical weights'
    skip = {*reading.files, *([index] if index else [])}
    copy_beside_weights(src_dir, tmp, skip=skip, edit_config=lambda config: config_with_dtype(config, target, dequantized=True))
    write_index(src_dir, tmp, index, total, weight_map)
    return written


def _blocking(found: dict[str, ValueStats], clamp: bool) -> bool:
    from .value_policy import blocking_values

    return bool(blocking_values(found, clamp=clamp))


def convert_quantized(
    src_path: Path,
    inv: Inventory,
    view: qm.QuantView,
    to: str,
    *,
    output: str | Path | None,
    policy: Policy | None,
    strict: bool,
    clamp: bool,
    dry_run: bool,
    read_values: bool,
    force: bool,
    in_place: bool,
    progress_factory: Callable[[str, int], Progress] | None,
) -> Result:
    """Dequantize ``inv`` (a quantized directory, safetensors file or GGUF file) to ``to``: planned once, its
    output checked as a cast's (``plan.with_findings``, ``strict`` as the caller decided), its values too, with
    the same verdict (``checks.apply_value_policy``: unsafe values refuse the write, ``--clamp`` saturates)."""
    from .atomic import atomic_output, check_destination, default_output
    from .mapped import open_sources
    from .plan import unit_of, with_findings
    from .result import Result
    from .value_policy import apply_value_policy
    from .verify import verify_written

    target = dtypes.conversion_target(to)
    if in_place:
        raise UsageError("--in-place cannot dequantize: the output replaces the quantized files with larger ones; give -o")
    supported(view)
    with ExitStack() as stack:
        sources = open_sources(src_path, inv, stack)
        if inv.format == Format.GGUF:
            for src in sources.values():
                src.spans = {t.name: _span(t) for t in inv.tensors}
        reading = Reading(sources, inv.by_name(), clamp)
        is_dir = src_path.is_dir()
        plan, shards = make_dequant_plan(inv, view, target, reading, is_dir=is_dir)
        plan = with_findings(plan, policy, strict=strict)
        if plan.failing(policy):
            return Result(plan, None, [], dry_run=dry_run, failed=tuple(plan.failing(policy)))
        if dry_run and not read_values:
            return Result(plan, None, [], dry_run=True, values_read=False)
        found: dict[str, ValueStats] = {}
        written: dict[str, Written] = {}
        if dry_run:  # every value read and checked as the real run would, nothing written
            if is_dir:
                _write_directory(shards, inv, src_path, reading, None, target, None, found)
            else:
                for shard in shards:
                    _write_shard(shard, reading, None, None, found)
        else:
            if is_dir:
                dest = Path(output) if output else default_output(src_path, target)
            else:
                dest = Path(output) if output else default_output(src_path, target, "safetensors")
                if dest.suffix != ".safetensors":
                    raise UsageError("a dequantized file is written as safetensors; give -o NAME.safetensors")
            check_destination(src_path, dest, force=force, in_place=False)
            progress = progress_factory("writing", plan.bytes_after) if progress_factory else None

            def unchanged() -> None:
                for src in sources.values():
                    src.check_unchanged()

            try:
                if is_dir:
                    with atomic_output(dest, mode_from=src_path, is_dir=True, sources_unchanged=unchanged) as tmp:
                        written = _write_directory(shards, inv, src_path, reading, tmp, target, progress, found)
                        if _blocking(found, clamp):
                            raise _Blocked
                else:
                    (shard,) = shards if shards else (_Shard(""),)
                    with atomic_output(dest, mode_from=src_path, sources_unchanged=unchanged) as tmp:
                        written = {dest.name: _write_shard(shard, reading, tmp, progress, found)}
                        if _blocking(found, clamp):
                            raise _Blocked
                        verify_written(tmp, written[dest.name])
            except _Blocked:
                written = {}
        units = {p.tensor.name: unit_of(p.tensor) for p in plan.tensors if p.action != "drop"}
        # as a cast's (checks.ValueChecks.outcome): every cast's figures, and a copy's only where it holds NaN/Inf
        values = {units[name]: s for name, s in found.items() if s.source != s.target or s.nonfinite}
        plan, unsafe = apply_value_policy(replace(plan, values=values), keep_unsafe=False)
        if dry_run or unsafe:
            return Result(plan, None, unsafe, dry_run=dry_run)
    return Result(plan, dest, [], written=written)


def _span(t: TensorRecord) -> Any:
    from ..inventory import Span

    return Span(t.offset, t.nbytes)
