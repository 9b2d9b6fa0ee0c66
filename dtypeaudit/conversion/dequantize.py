"""``convert --to bf16|fp16|fp32`` on a quantized checkpoint: every logical weight dequantized on the CPU.

Shard by shard, a piece at a time: each output shard is the source shard with its quantized storage
(packed values, scales, zero points, group indices, quant states) replaced by the dequantized weights at
their logical names, every other floating tensor cast to the target and the rest copied. config.json loses
its ``quantization_config`` and names the target dtype, so that a plain ``from_pretrained`` loads the result
as the model it was. Each shard is written by the one safetensors writer (``write.write_safetensors_records``):
a dequantized weight is a computed record whose pieces compute on a few threads while the previous ones are
written, every other tensor a cast's or a copy's record; memory stays bounded by ``write.COMPUTED_BYTES`` plus
the largest single weight of a scheme dequantized whole (its storage, its float32 dequantization and its
cast), never the shard. FP8 block weights and every tensor stored whole are
read and cast with numpy (``quant.dequant.fp8_block_cast_np``, ``npcast``): converting an FP8 checkpoint never
imports torch. Anything that cannot be dequantized exactly is refused before the output appears (the output
is written to a temporary and renamed only when verified).

The values get a cast's checks and verdict: a dequantized weight's values are folded by ``values.ValueCheck``
as each piece is made, the other tensors' by the writer's own checks (``value_policy.ValueChecks``), and
``value_policy.apply_value_policy`` decides, as for a cast: NaN/Inf, overflow and underflow refuse the output
(exit 1, nothing written), ``--clamp`` saturates overflow. ``--dry-run --check-values`` makes every piece and
writes none.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
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

    from ..options import ConvertSettings
    from ..pieces import Workers
    from .mapped import MappedCheckpoint, Progress
    from .plan import Plan
    from .result import Result
    from .verify import Written
    from .write import Record

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


def supported(view: qm.QuantView, fp8_reference: str | None = None) -> None:
    """Refuse, before anything is read, what no dequantizer here reads exactly, and an FP8 weight whose references
    part where ``fp8_reference`` (``--fp8-reference``) does not say which to follow (``dequant.loader_refusal``)."""
    from ..quant.dequant import loader_refusal

    for w in view.weights:
        refused = loader_refusal(w, fp8_reference)
        if refused:
            raise ConversionError(refused)
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
    name (every weight looks its storage up: a large MoE checkpoint has tens of thousands), ``--clamp`` and
    ``--fp8-reference``."""

    files: dict[str, MappedCheckpoint]
    by_name: dict[str, TensorRecord]
    clamp: bool = False
    fp8_reference: str | None = None
    """Which reference an FP8 weight follows where transformers' and DeepSeek's part (``dequant.fp8_block_of``)."""

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
    from .plan import Plan, TensorPlan, loader_keeps

    owner = view.by_storage()
    loader_kept = loader_keeps(inv, target)
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
            plans.append(TensorPlan(record, target, DEQUANTIZE, f"{w.scheme.name} dequantized{_followed(w, reading)}"))
            shards.setdefault(w.file or t.file, _Shard(w.file or t.file)).entries.append(_Entry(w.name, target, shape, weight=w))
            continue
        if t.dtype in dtypes.CASTABLE and t.layout == "strided":
            # what from_pretrained keeps in float32 (DeepSeek-V3's strict e_score_correction_bias) stays float32,
            # as in a plain folder's plan (plan.loader_keeps)
            kept = loader_kept(t.name)
            want = "float32" if kept else target
            action = ("keep" if kept else "leave") if t.dtype == want else "cast"
            plans.append(TensorPlan(t, want, action, kept or (f"already {target}" if action == "leave" else "")))
            shard.entries.append(_Entry(t.name, want, t.shape, tensor=t))
        else:
            plans.append(TensorPlan(t, t.dtype, "leave", f"{t.dtype} tensors are left exactly as they are"))
            shard.entries.append(_Entry(t.name, t.dtype, t.shape, tensor=t))
    n = len(view.weights)
    schemes = ", ".join(sorted({w.scheme.name for w in view.weights}))
    if n:
        # only a folder's config.json holds a quantization_config to remove (a GGUF or single file has none)
        dropped = "; quantization_config is removed from config.json" if "quantization_config" in inv.metadata else ""
        notes = [f"{n} quantized weight{'s' if n != 1 else ''} ({schemes}) {'are' if n != 1 else 'is'} dequantized to {target}{dropped}"]
        parted = sum(1 for w in view.weights if _followed(w, reading))
        if parted:
            who = "DeepSeek's weight_dequant" if reading.fp8_reference == "deepseek" else "transformers' from_pretrained"
            plural = "s" if parted != 1 else ""
            notes.append(f"{parted} FP8 weight{plural} that the two references read differently follow {who} (--fp8-reference)")
    else:  # an all-float GGUF comes this way too (inventory.Format.dequantizes), with nothing to dequantize
        notes = [f"no quantized weights: a {inv.format} file is converted by the dequantizing writer, to safetensors"]
    plan = Plan(inv, target, plans, clamp=reading.clamp, notes=notes, config_dtype=target if is_dir else None)
    return plan, list(shards.values())


def _followed(w: qm.LogicalWeight, reading: Reading) -> str:
    """Which reference a weight follows where the default refuses it (``--fp8-reference``), for its plan line."""
    from ..quant.dequant import fp8_block_of, loader_refusal

    if reading.fp8_reference is None or loader_refusal(w) is None:
        return ""
    block = fp8_block_of(w, reading.fp8_reference) or ()
    who = "DeepSeek's weight_dequant" if reading.fp8_reference == "deepseek" else "from_pretrained"
    return f" as {who} reads it ({'x'.join(map(str, block))} blocks)"


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


Task = tuple[Callable[[], Any], int]
"""A piece of an output tensor: what computes its ``Computed``, and the bytes it holds."""


class _Blocked(Exception):
    """Thrown into an output whose values block it: the temporary is removed, and the Result says why."""


@dataclass
class _Folded:
    """A dequantized weight's value figures, folded piece by piece as the writer writes them."""

    stats: ValueStats | None = None
    looked: bool = True

    def add(self, piece: Computed) -> None:
        self.looked = self.looked and piece.looked
        if piece.stats is not None:
            if self.stats is None:
                self.stats = piece.stats
            else:
                self.stats.merge(piece.stats)

    def shown(self) -> ValueStats | None:
        """A figure not measured is not shown as if it were: such a weight's figures only when it has problems."""
        return self.stats if self.stats is not None and (self.looked or self.stats.problems()) else None


def _records(shard: _Shard, reading: Reading) -> tuple[list[Record], dict[str, _Folded], str | None]:
    """The shard's records for the one writer (``write.make_records``): a dequantized weight's computed by its
    scheme's tasks (FP8 block weights with numpy, others with torch), every other tensor cast or copied from its
    span as a cast's records are (a view a torch.save file holds gathered by torch); each weight's figures, and
    why torch is needed (None: numpy makes every byte)."""
    from .mapped import contiguous_span
    from .write import Record

    records: list[Record] = []
    folds: dict[str, _Folded] = {}
    needs_torch: str | None = None
    where = 0
    for e in shard.entries:
        if e.weight is not None:
            tasks = _fp8_tasks(e.weight, e.shape, e.target, reading)
            if tasks is None:
                tasks = [(partial(_dequantized, e.weight, e.shape, e.target, reading), 8 * _numel(e.shape))]
                needs_torch = needs_torch or f"dequantizing '{e.name}' ({e.weight.scheme.name})"
            folded = folds[e.name] = _Folded()
            records.append(Record(None, None, "float32", e.target, where, computed=tuple(tasks), fold=folded.add))
        else:
            t = e.tensor
            assert t is not None
            src = reading.file_of(t)
            span = contiguous_span(src, t) if t.dtype in dtypes.DTYPES else src.storage(t.name)
            if span is None:
                needs_torch = needs_torch or f"'{e.name}' is a view torch gathers"
            records.append(Record(src, span, t.dtype, e.target, where, t))
        where += _numel(e.shape) * dtypes.get(e.target).itemsize
    return records, folds, needs_torch


def _write_shard(
    shard: _Shard, reading: Reading, plan: Plan, out: Path | None, workers: Workers, progress: Progress | None, found: dict[str, ValueStats]
) -> Written:
    """One safetensors file through the one writer (``write.write_safetensors_records``); returns what it wrote
    (each tensor and its bytes' CRC-32) for verification, each dequantized weight's figures left in ``found``
    (the casts' and copies' fold into ``workers``' checks). ``out`` None: the values are made and checked,
    nothing is written (``--dry-run --check-values``)."""
    import traceback

    from ..torchcast import one_thread
    from .verify import Written
    from .write import require_torch, write_safetensors_records

    records, folds, needs_torch = _records(shard, reading)
    tensors = [(e.name, e.target, e.shape) for e in shard.entries]
    try:
        with ExitStack() as stack:
            if needs_torch is not None:
                require_torch(needs_torch)
                # each task's torch ops on one thread: under load, torch's intra-op threads on a small piece spin
                # far more than they compute
                stack.enter_context(one_thread())
            crcs = write_safetensors_records(out, tensors, {"format": "pt"}, records, plan, workers, progress)
    except BaseException as exc:
        # The frames it leaves behind hold numpy views of the source mappings, which then could not close
        # (BufferError) and would hide this error: drop their locals.
        traceback.clear_frames(exc.__traceback__)
        raise
    for e in shard.entries:
        _release(reading, e)
    found.update((name, stats) for name, f in folds.items() if (stats := f.shown()) is not None)
    return Written(
        tensors={name: (dtype, shape) for name, dtype, shape in tensors}, crcs=dict(zip([n for n, _, _ in tensors], crcs, strict=True))
    )


def _release(reading: Reading, e: _Entry) -> None:
    """Unmap the source pages an entry read (they stay in the page cache): a read-only mapping's pages would
    otherwise count in the process's RSS until the whole checkpoint is done (each shard's, once it is written)."""
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


def _dequantized(w: qm.LogicalWeight, shape: tuple[int, ...], target: str, reading: Reading) -> Computed:
    """A whole weight dequantized by its scheme's dequantizer and cast to ``target``, as bytes."""
    from ..quant import dequant

    value = dequant.dequantize(w, _storage(w, reading), reading.fp8_reference)
    if tuple(value.shape) != shape:
        if value.numel() != _numel(shape):
            raise ConversionError(f"'{w.name}' dequantizes to {list(value.shape)}, not {list(shape)}; refused")
        value = value.reshape(shape)
    return _cast(value, target, w.name, reading.clamp)


def _array(src: MappedCheckpoint, t: TensorRecord) -> Any:
    """A tensor stored whole in its own bytes (safetensors) as a read-only numpy array of its stored form (float8
    as uint8 codes, bfloat16 as uint16 bits), without copying; None for any other record."""
    import numpy as np

    from ..quant.dequant import FLOAT8_FORMATS

    if src.inv.format == Format.GGUF or t.storage is not None or t.name not in src.spans:
        return None
    if t.dtype in FLOAT8_FORMATS or t.dtype == "uint8":  # float8 codes; uint8 bytes (E8M0 scales)
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
    from ..quant.dequant import FLOAT8_FORMATS, e8m0_float32, fp8_block_of
    from ..values import CHUNK_BYTES

    group = tuple(fp8_block_of(w, reading.fp8_reference) or ())
    if w.scheme.family != qm.FP8 or len(shape) != 2 or len(group) != 2 or not {"weight", "scale"} <= set(w.storage):
        return None
    wt, st = reading.by_name[w.storage["weight"]], reading.by_name[w.storage["scale"]]
    codes, scale = _array(reading.file_of(wt), wt), _array(reading.file_of(st), st)
    bm = group[0]
    if codes is None or scale is None or wt.dtype not in FLOAT8_FORMATS or st.dtype not in {*npcast.CASTS, "uint8"}:
        return None
    if tuple(codes.shape) != shape or scale.ndim != 2 or scale.shape[0] != -(-shape[0] // bm):
        return None
    if st.dtype == "uint8":  # E8M0 exponents, as the loader reads them
        scale = e8m0_float32(scale)
    elif st.dtype != "float32":  # the loader multiplies in float32: widen (or round) the scales as torch's cast does
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
    plan: Plan,
    tmp: Path | None,
    workers: Workers,
    progress: Progress | None,
    found: dict[str, ValueStats],
) -> dict[str, Written]:
    """The dequantized shards (each verified against one read of it); returns each shard's name in ``tmp`` ->
    what it holds. ``tmp`` None: the values are checked, nothing is written. The files beside them are
    ``_beside``'s."""
    from .modeldir import file_mode
    from .verify import verify_written

    written: dict[str, Written] = {}
    for shard in shards:
        if not shard.entries:
            continue  # a shard that held only storage of weights written elsewhere (scales of another shard's weights)
        out = tmp / shard.label if tmp is not None else None
        written[shard.label] = _write_shard(shard, reading, plan, out, workers, progress, found)
        if out is not None:
            verify_written(out, written[shard.label])
            os.chmod(out, file_mode(reading.files[shard.label].path))
    return written


def _beside(shards: list[_Shard], inv: Inventory, src_dir: Path, reading: Reading, tmp: Path, target: str) -> None:
    """config.json (its quantization_config gone, the target dtype named), the index (its weight map renamed:
    storage names become the logical weights') and every other file of the folder."""
    from .modeldir import config_with_dtype, copy_beside_weights, output_index, write_index

    weight_map = {e.name: shard.label for shard in shards for e in shard.entries}
    total = sum(_numel(e.shape) * dtypes.get(e.target).itemsize for shard in shards for e in shard.entries)
    index = output_index(inv)
    skip = {*reading.files, *([index] if index else [])}
    copy_beside_weights(src_dir, tmp, source=inv, skip=skip, edit_config=lambda config: config_with_dtype(config, target, dequantized=True))
    write_index(src_dir, tmp, index, total, weight_map)


def convert_quantized(
    src_path: Path,
    inv: Inventory,
    view: qm.QuantView,
    settings: ConvertSettings,
    *,
    output: str | Path | None,
    progress_factory: Callable[[str, int], Progress] | None,
) -> Result:
    """Dequantize ``inv`` (a quantized directory, safetensors file or GGUF file) to ``settings.to``: planned once,
    its output checked as a cast's (``plan.with_findings``, ``strict`` as the settings decided), its values too,
    with the same verdict (``apply_value_policy``: unsafe values refuse the write, ``--clamp`` saturates), written
    by the one writer."""
    from .atomic import atomic_output, check_destination, default_output
    from .mapped import open_sources
    from .plan import unit_of, with_findings
    from .result import Result
    from .value_policy import ValueChecks, apply_value_policy, blocking_values, workers_for
    from .verify import verify_written

    s = settings
    if s.in_place:
        raise UsageError("--in-place cannot dequantize: the output replaces the quantized files with larger ones; give -o")
    supported(view, s.fp8_reference)
    with ExitStack() as stack:
        sources = open_sources(src_path, inv, stack)
        if inv.format == Format.GGUF:
            for src in sources.values():
                src.spans = {t.name: _span(t) for t in inv.tensors}
        reading = Reading(sources, inv.by_name(), s.clamp, s.fp8_reference)
        is_dir = src_path.is_dir()
        plan, shards = make_dequant_plan(inv, view, s.to, reading, is_dir=is_dir)
        plan = with_findings(plan, s.policy, strict=s.strict)
        if plan.failing(s.policy):
            return Result(plan, None, [], dry_run=s.dry_run, failed=tuple(plan.failing(s.policy)))
        if s.dry_run and not s.read_values:
            return Result(plan, None, [], dry_run=True, values_read=False)
        if not s.dry_run:
            if is_dir:
                dest = Path(output) if output else default_output(src_path, s.to)
            else:
                dest = Path(output) if output else default_output(src_path, s.to, "safetensors")
                if dest.suffix != ".safetensors":
                    raise UsageError("a dequantized file is written as safetensors; give -o NAME.safetensors")
            check_destination(src_path, dest, force=s.force, in_place=False)
        checks = ValueChecks(plan, sources)  # the casts' and copies' figures, as a cast's (value_policy.py)
        found: dict[str, ValueStats] = {}
        units = {p.tensor.name: unit_of(p.tensor) for p in plan.tensors if p.action == DEQUANTIZE}

        def values() -> dict[str, ValueStats]:
            # a dequantized weight's figures as a cast's: where it was cast, and where it holds NaN/Inf
            made = {units[name]: st for name, st in found.items() if st.source != st.target or st.nonfinite}
            return {**checks.outcome(), **made}

        def write(tmp: Path | None, progress: Progress | None) -> dict[str, Written]:
            with workers_for(plan, sources, checks) as workers:
                if is_dir:
                    written = _write_directory(shards, inv, src_path, reading, plan, tmp, workers, progress, found)
                else:
                    (shard,) = shards if shards else (_Shard(""),)
                    written = {dest.name if tmp else "": _write_shard(shard, reading, plan, tmp, workers, progress, found)}
                workers.run(checks.remaining())  # a record torch gathered or cast: checked apart, as for a cast
            return written

        written: dict[str, Written] = {}
        if s.dry_run:  # every value read and checked as the real run would, nothing written
            write(None, None)
        else:
            # as the writer counts: a dequantized weight by the bytes it makes, every other record by those it reads
            total = sum(p.out_nbytes if p.action == DEQUANTIZE else p.tensor.nbytes for p in plan.tensors if p.action != "drop")
            progress = progress_factory("writing", total) if progress_factory else None
            try:

                def unchanged() -> None:
                    for src in sources.values():
                        src.check_unchanged()

                with atomic_output(dest, mode_from=src_path, is_dir=is_dir, sources_unchanged=unchanged) as tmp:
                    written = write(tmp, progress)
                    if blocking_values(values(), clamp=s.clamp):
                        raise _Blocked
                    if is_dir:
                        _beside(shards, inv, src_path, reading, tmp, s.to)
                    else:
                        verify_written(tmp, written[dest.name])
            except _Blocked:
                written = {}
        plan, unsafe = apply_value_policy(replace(plan, values=values()), keep_unsafe=False)
        if s.dry_run or unsafe:
            return Result(plan, None, unsafe, dry_run=s.dry_run)
    return Result(plan, dest, [], written=written)


def _span(t: TensorRecord) -> Any:

    return Span(t.offset, t.nbytes)
