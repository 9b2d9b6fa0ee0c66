"""``convert --to bf16|fp16|fp32`` on a quantized checkpoint: every logical weight dequantized on the CPU.

Shard by shard, a tensor at a time: each output shard is the source shard with its quantized storage
(packed values, scales, zero points, group indices, quant states) replaced by the dequantized weights at
their logical names, every other floating tensor cast to the target and the rest copied. config.json loses
its ``quantization_config`` and names the target dtype, so that a plain ``from_pretrained`` loads the result
as the model it was. Memory stays bounded by the largest single weight (its storage, its float32
dequantization and its cast), never the shard. Anything that cannot be dequantized exactly is refused
before the output appears (the output is written to a temporary and renamed only when verified).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import dtypes
from ..errors import ConversionError, UsageError
from ..formats import directory as hfdir
from ..inventory import Format, Inventory, TensorRecord
from ..quant import model as qm

if TYPE_CHECKING:
    import torch

    from ..policy import Policy
    from . import Result
    from .plan import Plan
    from .source import MappedCheckpoint, Progress
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


_RECORDS: list[tuple[Inventory, dict[str, TensorRecord]]] = []


def _records(inv: Inventory) -> dict[str, TensorRecord]:
    """``inv.by_name()``, built once per inventory: every weight looks its storage up in it, and a large MoE
    checkpoint has tens of thousands of tensors."""
    if not _RECORDS or _RECORDS[0][0] is not inv:
        _RECORDS[:] = [(inv, inv.by_name())]
    return _RECORDS[0][1]


def _raw(src: MappedCheckpoint, t: TensorRecord) -> torch.Tensor:
    """A storage tensor as the dtype its file declares (GGUF's quantized blocks as bytes)."""
    from .source import materialize

    if src.inv.format == Format.GGUF or t.dtype not in dtypes.DTYPES:
        start = src.spans[t.name].offset if t.name in src.spans else t.offset
        return src.tensor_at("uint8", t.nbytes, start)
    if t.storage is None and t.name in src.spans:  # safetensors: the tensor's own contiguous bytes
        return src.tensor_at(t.dtype, t.numel, src.spans[t.name].offset).reshape(t.shape)
    return materialize(src, t)


def _storage(weight: qm.LogicalWeight, inv: Inventory, sources: dict[str, MappedCheckpoint]) -> dict[str, torch.Tensor]:
    by = _records(inv)
    out = {}
    for role, name in weight.storage.items():
        t = by[name]
        out[role] = _raw(sources[t.file], t)
    return out


def logical_shape(weight: qm.LogicalWeight, inv: Inventory, sources: dict[str, MappedCheckpoint]) -> tuple[int, ...]:
    """The shape the dequantized weight has: from the small tensors that record it where there are some
    (compressed-tensors' ``weight_shape``, bitsandbytes' quant state), else from the grouping."""
    from ..quant import dequant

    by = _records(inv)
    if "shape" in weight.storage:
        t = by[weight.storage["shape"]]
        return tuple(int(x) for x in _raw(sources[t.file], t).tolist())
    if weight.scheme.family == qm.BNB4 and "quant_state" in weight.storage:
        t = by[weight.storage["quant_state"]]
        shape = dequant.bnb_quant_state(_raw(sources[t.file], t)).get("shape")
        if isinstance(shape, list) and all(isinstance(d, int) for d in shape):
            return tuple(shape)
    if weight.shape is None:
        raise ConversionError(f"'{weight.name}' ({weight.scheme.name}): its logical shape is not known; refused")
    return tuple(weight.shape)


def make_dequant_plan(inv: Inventory, view: qm.QuantView, target: str, sources: dict[str, MappedCheckpoint]) -> tuple[Plan, list[_Shard]]:
    """What each tensor becomes, and the output shards in the source's order."""
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
            shape = logical_shape(w, inv, sources)
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
    plan = Plan(inv, target, plans)
    n = len(view.weights)
    schemes = ", ".join(sorted({w.scheme.name for w in view.weights}))
    plan.notes.append(
        f"{n} quantized weight{'s' if n != 1 else ''} ({schemes}) {'are' if n != 1 else 'is'} dequantized to {target}; "
        "quantization_config is removed from config.json"
    )
    return plan, list(shards.values())


def _cast(x: torch.Tensor, target: str, name: str) -> torch.Tensor:
    import torch

    y = x.to(getattr(torch, target))
    if target == "float16" and x.is_floating_point():
        # A dequantized value beyond float16's range would silently become inf: refuse instead.
        overflow = int((torch.isinf(y) & torch.isfinite(x)).sum())
        if overflow:
            raise ConversionError(f"'{name}' has {overflow} dequantized values beyond float16's range; convert --to bf16 or fp32; refused")
    return y


def _write_shard(shard: _Shard, inv: Inventory, sources: dict[str, MappedCheckpoint], out: Path, progress: Progress | None) -> Written:
    """One safetensors file, tensor by tensor; returns what it wrote (each tensor and its bytes' CRC-32) for verification."""
    from ..formats.zipwrite import crc32
    from .atomic import Writeback
    from .source import contiguous_span
    from .verify import Written
    from .write import safetensors_header, stream_cast, tensor_bytes

    written = Written(tensors={e.name: (e.target, e.shape) for e in shard.entries})
    crcs = written.crcs
    with out.open("wb") as fh, Writeback(fh) as writeback:
        fh.write(safetensors_header([(e.name, e.target, e.shape) for e in shard.entries], {"format": "pt"}))
        for e in shard.entries:
            crcs[e.name] = 0

            def sink(data: Any, name: str = e.name) -> None:
                fh.write(data)
                crcs[name] = crc32(data, crcs[name])

            if e.weight is not None:
                for y in _in_order(_piece_tasks(e.weight, e.shape, e.target, inv, sources)):
                    if y.numel():
                        sink(tensor_bytes(y))
                    if progress:
                        progress(y.numel() * y.element_size())
                    del y
            else:
                t = e.tensor
                assert t is not None
                src = sources[t.file]
                span = contiguous_span(src, t) if t.dtype in dtypes.DTYPES else None
                stream_cast(src, span, t.dtype, e.target, sink, progress, clamp=False, tensor=t)
            _release(inv, sources, e)
            writeback()
    return written


def _release(inv: Inventory, sources: dict[str, MappedCheckpoint], e: _Entry) -> None:
    """Unmap the source pages an entry read (they stay in the page cache): a read-only mapping's pages would
    otherwise count in the process's RSS until the whole shard is done."""
    import mmap

    by = _records(inv)
    names = list(e.weight.storage.values()) if e.weight is not None else [e.name]
    for name in names:
        t = by.get(name)
        src = sources.get(t.file) if t is not None else None
        if src is None or not isinstance(src.mm, mmap.mmap) or name not in src.spans or not hasattr(mmap, "MADV_DONTNEED"):
            continue
        span = src.spans[name]
        start = span.offset - span.offset % mmap.PAGESIZE
        end = min(len(src.mm), span.offset + span.length)
        if end > start:
            src.mm.madvise(mmap.MADV_DONTNEED, start, end - start)


def _piece_tasks(
    w: qm.LogicalWeight, shape: tuple[int, ...], target: str, inv: Inventory, sources: dict[str, MappedCheckpoint]
) -> Iterator[Callable[[], torch.Tensor]]:
    """The dequantized weight, cast to ``target``, in row order, as tasks that compute one piece each: FP8 a few
    blocks of rows at a time (its float32 products stay in cache, memory stays bounded by a chunk, and the
    pieces compute in parallel), every other scheme whole (a weight at a time)."""
    from ..quant import dequant
    from ..values import CHUNK_BYTES

    storage = _storage(w, inv, sources)
    group = tuple(w.scheme.group or ())
    if w.scheme.family == qm.FP8 and len(shape) == 2 and len(group) == 2 and {"weight", "scale"} <= set(storage):
        weight, scale = storage["weight"], storage["scale"]
        bm = group[0]
        if scale.ndim == 2 and scale.shape[0] == -(-shape[0] // bm) and tuple(weight.shape) == shape:
            step = max(1, (4 * CHUNK_BYTES) // max(1, shape[1] * 4) // bm) * bm
            for r0 in range(0, shape[0], step):
                part, part_scale = weight[r0 : r0 + step], scale[r0 // bm : (r0 + step) // bm]
                yield partial(_fp8_piece, part, part_scale, group, target, w.name)
            return

    def whole() -> torch.Tensor:
        value = dequant.dequantize(w, storage)
        if tuple(value.shape) != shape:
            if value.numel() != _numel(shape):
                raise ConversionError(f"'{w.name}' dequantizes to {list(value.shape)}, not {list(shape)}; refused")
            value = value.reshape(shape)
        return _cast(value, target, w.name)

    yield whole


def _fp8_piece(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, ...], target: str, name: str) -> torch.Tensor:
    import torch

    from ..quant import dequant

    y = dequant.fp8_block_cast(weight, scale, block, target)
    if target == "float16" and bool(torch.isinf(y).any()):
        # a product beyond float16's range, or an inf code: the general path tells which
        return _cast(dequant.fp8_block(weight, scale, block), target, name)
    return y


def _in_order(tasks: Iterator[Callable[[], torch.Tensor]]) -> Iterator[torch.Tensor]:
    """Run ``tasks`` on a few threads (torch and numpy release the GIL), results in order, at most two per
    thread in flight (memory stays bounded by a few pieces). Each task's torch ops run on one thread: under
    load, torch's own intra-op threads on a small piece spin far more than they compute."""
    import torch

    from ..quant.parallel import ordered

    threads = torch.get_num_threads()
    workers = max(1, min(4, threads))
    torch.set_num_threads(1)
    try:
        for y in ordered(tasks, workers):
            yield y.contiguous()
    finally:
        torch.set_num_threads(threads)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _write_directory(
    shards: list[_Shard],
    inv: Inventory,
    src_dir: Path,
    sources: dict[str, MappedCheckpoint],
    tmp: Path,
    target: str,
    progress: Progress | None,
) -> None:
    from .modeldir import config_with_dtype, copy_beside_weights, file_mode, write_index
    from .verify import verify

    weight_map: dict[str, str] = {}
    total = 0
    for shard in shards:
        if not shard.entries:
            continue  # a shard that held only storage of weights written elsewhere (scales of another shard's weights)
        out = tmp / shard.label
        verify(out, _write_shard(shard, inv, sources, out, progress))
        os.chmod(out, file_mode(sources[shard.label].path))
        for e in shard.entries:
            weight_map[e.name] = shard.label
            total += _numel(e.shape) * dtypes.get(e.target).itemsize
    copy_beside_weights(src_dir, tmp, skip=set(sources), edit_config=lambda config: config_with_dtype(config, target, dequantized=True))
    index = next((src_dir / n for n in hfdir.INDEX_NAMES if (src_dir / n).is_file()), None)
    if index is not None:
        write_index(tmp, index, index.name, total, weight_map)


def convert_quantized(
    src_path: Path,
    inv: Inventory,
    view: qm.QuantView,
    to: str,
    *,
    output: str | Path | None,
    policy: Policy | None,
    dry_run: bool,
    force: bool,
    in_place: bool,
    progress_factory: Callable[[str, int], Progress] | None,
) -> Result:
    """Dequantize ``inv`` (a quantized directory, safetensors file or GGUF file) to ``to``."""
    from ..checks import check
    from . import Result
    from .atomic import atomic_output, check_destination, default_output
    from .source import open_sources
    from .verify import verify

    target = dtypes.conversion_target(to)
    if in_place:
        raise UsageError("--in-place cannot dequantize: the output replaces the quantized files with larger ones; give -o")
    supported(view)
    with ExitStack() as stack:
        sources = open_sources(src_path, inv, stack)
        if inv.format == Format.GGUF:
            for src in sources.values():
                src.spans = {t.name: _span(t) for t in inv.tensors}
        plan, shards = make_dequant_plan(inv, view, target, sources)
        is_dir = src_path.is_dir()
        plan.config_dtype = target if is_dir else None
        out_inv = plan.output_inventory()
        out_inv = replace(out_inv, metadata={k: v for k, v in out_inv.metadata.items() if k != "quantization_config"})
        plan.findings = check(out_inv, policy, strict=bool(policy and policy.strict))
        if plan.failing(policy):
            return Result(plan, None, [], dry_run=dry_run, failed=tuple(plan.failing(policy)))
        if dry_run:
            return Result(plan, None, [], dry_run=True)
        if is_dir:
            dest = Path(output) if output else default_output(src_path, target)
        else:
            dest = Path(output) if output else default_output(src_path, target, "safetensors")
            if dest.suffix != ".safetensors":
                raise UsageError("a dequantized file is written as safetensors; give -o NAME.safetensors")
        check_destination(src_path, dest, force=force, in_place=False)
        total = plan.bytes_after
        progress = progress_factory("writing", total) if progress_factory else None
        if is_dir:
            with atomic_output(dest, mode_from=src_path, is_dir=True) as tmp:
                _write_directory(shards, inv, src_path, sources, tmp, target, progress)
        else:
            (shard,) = shards if shards else (_Shard(""),)
            with atomic_output(dest, mode_from=src_path) as tmp:
                verify(tmp, _write_shard(shard, inv, sources, tmp, progress))
    return Result(plan, dest, [])


def _span(t: TensorRecord) -> Any:
    from ..inventory import Span

    return Span(t.offset, t.nbytes)
