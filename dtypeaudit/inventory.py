"""The data model every other module speaks: tensors found, findings raised, reports made.

Frozen dataclasses, no torch: readers produce them, checks and renderers consume them.
"""

from __future__ import annotations

import math
import sys
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import MISSING, dataclass, field, fields, replace
from enum import StrEnum
from operator import attrgetter
from typing import Any, Literal, NamedTuple

from .redact import redact

Severity = Literal["error", "warning", "info"]
SEVERITIES: tuple[Severity, ...] = ("info", "warning", "error")
Kind = Literal["parameter", "buffer", "unknown"]
Region = Literal["model", "optimizer"]


_RANKS: dict[str, int] = {s: i for i, s in enumerate(SEVERITIES)}


def severity_rank(severity: str) -> int:
    """info < warning < error; ValueError for another word."""
    rank = _RANKS.get(severity)
    if rank is None:
        raise ValueError(f"{severity!r} is not a severity")
    return rank


class Format(StrEnum):
    """The format an inventory names (``Inventory.format``), as the JSON report writes it: a ``str`` enum, so a
    member is its string everywhere (comparisons, JSON, f-strings). It knows what ``convert`` does with each."""

    TORCH_ZIP = "torch-zip"
    """A ``torch.save`` zip archive (the default since torch 1.6)."""
    TORCH_LEGACY = "torch-legacy"
    """A pre-1.6 ``torch.save`` file (``_use_new_zipfile_serialization=False``)."""
    TORCHSCRIPT = "torchscript"
    SAFETENSORS = "safetensors"
    GGUF = "gguf"
    PICKLE = "pickle"
    """A bare pickle that is no ``torch.save`` file."""
    ZIP = "zip"
    """A zip archive that is no ``torch.save`` one (its pickles' globals reported, nothing else read)."""
    DCP = "dcp"
    """A ``torch.distributed.checkpoint`` folder."""
    HF_DIRECTORY = "hf-directory"
    """A Hugging Face model folder, as ``from_pretrained`` resolves it."""
    FACTORY = "factory"
    """A model built by the user's code (``file.py:func``)."""
    TRACE = "trace"
    """A model traced on fake tensors (``dtypeaudit trace``)."""
    LIVE = "live"
    """Objects in memory (``dtypeaudit.audit``)."""

    @property
    def casts(self) -> bool:
        """Whether ``convert``'s writers cast this format's tensors in place (its value checks read them too); a
        quantized checkpoint is dequantized instead (``conversion/dequantize.py``)."""
        return self in _CASTS

    @property
    def dequantizes(self) -> bool:
        """Whether ``convert`` writes this format through the dequantizing path, quantized weights or not: no writer
        of ours writes a GGUF file, so even an all-float one is read tensor by tensor and written as safetensors."""
        return self is Format.GGUF

    @property
    def torch_save(self) -> bool:
        """A ``torch.save`` file, whose pickle a conversion re-emits."""
        return self in (Format.TORCH_ZIP, Format.TORCH_LEGACY)

    @property
    def convert_refusal(self) -> str | None:
        """Why ``convert`` refuses this format outright, or None: every format that neither casts nor dequantizes."""
        if self.casts or self.dequantizes:
            return None
        return _CONVERT_REFUSALS.get(self, f"{self.value} input is not a checkpoint file convert can write again")

    @property
    def cast_refusal(self) -> str | None:
        """Why ``convert``'s writers cannot cast this format in place (the plan's refusal), or None: its
        ``convert_refusal``, or for a format only the dequantizing path writes (``--keep-quantized`` keeps its
        quantized storage, so that path is not taken), that."""
        if self.dequantizes:
            return (
                f"{self.value} files are converted by dequantizing them to safetensors; "
                "their tensors cannot be kept as they are (--keep-quantized)"
            )
        return self.convert_refusal


_CASTS = frozenset({Format.TORCH_ZIP, Format.TORCH_LEGACY, Format.SAFETENSORS, Format.HF_DIRECTORY})
_CONVERT_REFUSALS = {
    Format.TORCHSCRIPT: "TorchScript archives carry compiled code and constants typed for the saved dtypes, so their weights "
    "cannot be recast safely; convert the eager model's state_dict and script it again",
    Format.DCP: "torch.distributed.checkpoint directories are written by the training job; convert them with "
    "torch.distributed.checkpoint.format_utils.dcp_to_torch_save first, then convert the .pt",
    Format.FACTORY: "a factory builds a model, it is not a checkpoint file to convert",
    Format.PICKLE: "a bare pickle is not a torch.save checkpoint; nothing in it can be converted without running it",
    Format.ZIP: "a zip archive that is no torch.save file holds nothing convert can cast",
}


def format_of(name: str) -> Format | None:
    """The ``Format`` an inventory's format string names, or None for a name no reader writes."""
    try:
        return Format(name)
    except ValueError:
        return None


@dataclass(frozen=True, slots=True)
class TensorRecord:
    """One tensor as the checkpoint describes it; nothing here needs the tensor's bytes.

    Slots, not a ``__dict__``: a header may describe a million of them, and a dict each would be most of a scan's
    memory."""

    name: str
    """Dotted key path from the checkpoint's root object (``model.fc.weight``)."""
    dtype: str
    """torch's dtype name without prefix (``float32``)."""
    shape: tuple[int, ...]
    """The tensor's size."""
    nbytes: int
    """Bytes of the tensor's own elements (numel x itemsize); 0 for meta tensors."""
    kind: Kind = "unknown"
    """``parameter`` where the file says so, ``buffer`` where it says so, else ``unknown``."""
    file: str = ""
    """The file that holds it, relative to the checkpoint path (``""`` for a single file)."""
    storage: str | None = None
    """Key of the storage it views; tensors with the same ``(file, storage)`` share memory."""
    offset: int = 0
    """Offset into that storage, in elements."""
    stride: tuple[int, ...] | None = None
    """Strides in elements, where the format records them."""
    layout: str = "strided"
    """``strided``, ``sparse_coo``, ``meta`` (no data), ``quantized``."""
    region: Region = "model"
    """``optimizer`` for tensors inside an optimizer state (``state``/``param_groups``), else ``model``."""
    module: str | None = None
    """Type name of the module that owns it (``BatchNorm2d``), where known."""
    shares_with: tuple[str, ...] = ()
    """Names of the other tensors that view the same storage (tied weights, views)."""
    module_guess: str | None = None
    """The module type its names and shapes suggest (``BatchNorm``, ``LayerNorm``, ``RMSNorm``, ``Linear``,
    ``Conv2d``, ``Embedding``), where ``module`` is unknown or not one of PyTorch's own types and the guess is
    sure; None otherwise. Filled by ``structure.annotate``; policy ``module:`` selectors match it too."""
    scheme: str | None = None
    """The quantization scheme of a logical weight (``int4 gptq g128 sym``) in the records policies judge
    (``quant.group.policy_records``); None for a stored tensor."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def with_(self, **changes: object) -> TensorRecord:
        """A copy with ``changes``: ``dataclasses.replace``, at a fraction of its cost per record (a million-tensor
        header's records are annotated one by one)."""
        if not _RECORD_INDEX.keys() >= changes.keys():
            return replace(self, **changes)  # type: ignore[arg-type]  # raises TypeError for the unknown name
        values = list(_record_values(self))
        for name, value in changes.items():
            values[_RECORD_INDEX[name]] = value
        return TensorRecord(*values)

    def with_guess(self, module_guess: str | None) -> TensorRecord:
        """``with_(module_guess=...)`` without its keywords: ``structure.annotate`` tags most records of a header."""
        # every field by position, written out (a third cheaper than slicing ``_record_values``); the field order is
        # checked below
        s = self
        return TensorRecord(
            s.name, s.dtype, s.shape, s.nbytes, s.kind, s.file, s.storage, s.offset, s.stride, s.layout, s.region, s.module,
            s.shares_with, module_guess, s.scheme,
        )  # fmt: skip


_RECORD_INDEX = {f.name: i for i, f in enumerate(fields(TensorRecord))}
_record_values = attrgetter(*_RECORD_INDEX)
assert list(_RECORD_INDEX) == [
    "name", "dtype", "shape", "nbytes", "kind", "file", "storage", "offset", "stride", "layout", "region", "module",
    "shares_with", "module_guess", "scheme",
], "TensorRecord.with_guess names the fields in this order"  # fmt: skip


def slot_init(cls: type) -> None:
    """Give the frozen, slotted dataclass ``cls`` an ``__init__`` of the same signature that sets each slot through
    its descriptor, not through ``object.__setattr__`` (the generic lookup the generated one makes per field): half
    the cost of making a record (0.8 against 1.5 µs for a ``TensorRecord``), made twice per tensor of a
    million-tensor header (read, then annotated). Still frozen: assignment after ``__init__`` raises as before."""
    params: list[str] = []
    sets: list[str] = []
    env: dict[str, Any] = {}
    for f in fields(cls):
        if not f.init:
            continue  # its __post_init__ sets it
        assert f.default_factory is MISSING, f"{cls.__name__}.{f.name}: a field this __init__ cannot make"
        params.append(f.name if f.default is MISSING else f"{f.name}=_default_{f.name}")
        env[f"_default_{f.name}"] = f.default
        env[f"_set_{f.name}"] = cls.__dict__[f.name].__set__
        sets.append(f"    _set_{f.name}(self, {f.name})")
    if hasattr(cls, "__post_init__"):
        sets.append("    self.__post_init__()")
    exec(f"def __init__(self, {', '.join(params)}):\n" + "\n".join(sets), env)  # as dataclasses makes its own
    init = env["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    cls.__init__ = init  # type: ignore[misc]


slot_init(TensorRecord)


@dataclass(frozen=True, slots=True)
class Finding:
    """Something a reader or a check wants the user to know. Slots, not a ``__dict__``: a million-tensor header may
    raise hundreds of thousands."""

    rule: str
    """Stable identifier (``unsafe-global``, ``dtype-mismatch``)."""
    severity: Severity
    """``error``, ``warning`` or ``info``."""
    message: str
    """One sentence, for people."""
    tensor: str | None = None
    """The tensor concerned, if any."""
    file: str | None = None
    """The file concerned inside a directory checkpoint, if any."""
    expected: tuple[str, ...] | None = None
    """The dtypes a rule expected, for dtype findings."""
    actual: str | None = None
    """The dtype found, for dtype findings."""

    def __post_init__(self) -> None:
        # One string for one message: a check raises the same words for each of thousands of alike modules, and a
        # million-tensor header's hundreds of thousands of findings held a copy each (a tenth of the scan's memory).
        if type(self.message) is str:  # sys.intern takes no subclass
            object.__setattr__(self, "message", sys.intern(self.message))


slot_init(Finding)  # hundreds of thousands of them, too


class Span(NamedTuple):
    """``length`` bytes at ``offset`` in a file: where a reader found a storage, a record or a tensor's bytes."""

    offset: int
    length: int


@dataclass(frozen=True)
class Layout:
    """Where one file's parts lie, as its reader found them, so conversion rewrites it without parsing it again."""

    container: str
    """``zip``, ``legacy``, ``safetensors`` or ``gguf``."""
    storages: Mapping[str, Span]
    """Storage key (a tensor's name for safetensors and GGUF) -> where its bytes lie in the file."""
    pickle_offset: int = 0
    """Legacy files: where the main pickle starts."""
    archive_prefix: str = ""
    """Zip archives: the folder every record sits in, with its slash (``archive/``)."""
    records: tuple[str, ...] = ()
    """Zip archives: every record other than ``data.pkl`` and storages, without the prefix, in archive order."""
    record_spans: Mapping[str, Span] = field(default_factory=dict)
    """Zip archives: where ``data.pkl`` and each of ``records`` lie, for those stored uncompressed (as torch.save
    writes them), so that conversion reads them from its mapping instead of opening the archive again."""
    pickle_end: int = 0
    """torch.save files: where the main pickle ends (just past STOP), in the bytes it starts in (``data.pkl``'s for
    a zip archive, the file's for a legacy one)."""
    storage_sites: tuple[tuple[int, str, str, int], ...] = ()
    """torch.save files: each storage record as ``(type_at, key, storage type, none_at)``: where the opcode that pushed
    its storage type starts (-1: none did), and, legacy records, the NONE opcode of their sixth field (else -1); the
    positions are in the bytes the pickle starts in. What a conversion edits instead of running the pickle again."""
    storage_type_pushes: tuple[tuple[int, ...], ...] = ()
    """torch.save files: for each storage-type global the records name, every opcode that pushed it, the one that
    made it first (-1: a reducer returned it)."""
    pickle_frames: tuple[int, ...] = ()
    """torch.save files: where each FRAME opcode (protocol 4 and later) of the main pickle starts."""
    non_tensor: tuple[str, ...] = ()
    """torch.save files: the first few entries of the pickled object that are not tensors (dicts walked, their
    keys dotted; ``<root>`` for a root that is neither): what safetensors could not store."""


@dataclass(frozen=True)
class Inventory:
    """Everything a reader learnt from one checkpoint."""

    path: str
    """The checkpoint as the user named it."""
    format: str
    """``torch-zip``, ``torchscript``, ``torch-legacy``, ``safetensors``, ``hf-directory``, ``dcp``, ``factory``."""
    tensors: tuple[TensorRecord, ...]
    """Every tensor, in file order."""
    findings: tuple[Finding, ...] = ()
    """What the reader noticed (unsafe globals, index disagreements)."""
    metadata: Mapping[str, object] = field(default_factory=dict)
    """Format-specific facts: ``config_dtype`` of a Hugging Face config, safetensors ``__metadata__``."""
    layout: Layout | None = field(default=None, compare=False, repr=False)
    """Where a single file's parts lie (None for directories, DCP and factories)."""
    parts: Mapping[str, Inventory] = field(default_factory=dict, compare=False, repr=False)
    """A model directory: each weight file's own inventory (with its layout), by its label, as the directory's
    reader read it, so that conversion reads no weight file's headers a second time."""
    bytes_read: int | None = field(default=None, compare=False)
    """Bytes read to build it (remote: bytes fetched, whole cached blocks included); None where nothing was read (a factory)."""
    inferred: object = field(default=None, compare=False, repr=False)
    """The module structure ``structure.annotate`` inferred of exactly these tensors (``structure.modules_of`` answers
    from it), so that the checks and plans after it infer nothing again; None before annotation."""

    def by_name(self) -> dict[str, TensorRecord]:
        return {t.name: t for t in self.tensors}


def link_shared_storage(tensors: Iterable[TensorRecord]) -> tuple[TensorRecord, ...]:
    """Fill ``shares_with`` for tensors that view one storage."""
    records = list(tensors)
    groups: dict[tuple[str, str], list[str]] = {}
    for t in records:
        if t.storage is not None:
            groups.setdefault((t.file, t.storage), []).append(t.name)
    out = []
    for t in records:
        names = groups.get((t.file, t.storage), []) if t.storage is not None else []
        others = tuple(n for n in names if n != t.name)
        out.append(replace(t, shares_with=others) if others else t)
    return tuple(out)


@dataclass(frozen=True)
class CheckpointReport:
    """The outcome for one checkpoint: its inventory and findings, or why it could not be read."""

    path: str
    format: str | None
    error: str | None
    """None, or the one-line reason the checkpoint could not be read."""
    inventory: Inventory | None
    findings: tuple[Finding, ...] = ()

    def __post_init__(self) -> None:
        # A path or an error may be a URL with credentials in it (a presigned URL, user:password@): reports never show them.
        for name in ("path", "error"):
            value = getattr(self, name)
            if value and "://" in value:
                object.__setattr__(self, name, redact(value))

    @property
    def tensors(self) -> tuple[TensorRecord, ...]:
        return self.inventory.tensors if self.inventory else ()


@dataclass(frozen=True)
class Report:
    """One run over one or more checkpoints."""

    checkpoints: tuple[CheckpointReport, ...]
    fail_on: Severity = "error"
    """Findings at or above this severity make the run fail."""
    policy: str | None = None
    """Where the policy came from (file or preset), if one was used."""
    strict: bool = False
    """Strict mode: what a loader might read differently from dtypeaudit was raised to an error."""

    @property
    def findings(self) -> list[Finding]:
        return [f for c in self.checkpoints for f in c.findings]

    def failing(self, fail_on: Severity | None = None) -> list[Finding]:
        """The findings that fail the run: at or above ``fail_on`` (the report's own threshold by default)."""
        return failing(self.findings, fail_on or self.fail_on)


def failing(findings: Iterable[Finding], fail_on: Severity) -> list[Finding]:
    """The findings at or above ``fail_on``: the one test of whether a finding fails a run, a plan or a live audit."""
    threshold = severity_rank(fail_on)
    return [f for f in findings if severity_rank(f.severity) >= threshold]


@dataclass(frozen=True)
class DtypeTotals:
    """Per-dtype totals for a summary line."""

    dtype: str
    tensors: int
    numel: int
    nbytes: int
    share: float
    """Fraction of the checkpoint's bytes."""


def unique_tensors(tensors: Iterable[TensorRecord]) -> list[TensorRecord]:
    """Tensors with one copy of each tensor that appears under several names (same storage and view)."""
    records = tensors if isinstance(tensors, (list, tuple)) else list(tensors)
    if set(map(_STORAGE, records)) <= {None} and len(set(map(id, records))) == len(records):
        return list(records)  # no storage named, each record once (safetensors, GGUF): all unique, found in C calls
    seen: set[object] = set()
    out = []
    for t in records:
        key = (t.file, t.storage, t.offset, t.shape, t.stride, t.dtype) if t.storage is not None else id(t)
        if key not in seen:
            seen.add(key)
            out.append(t)
    return out


_STORAGE = attrgetter("storage")
_DTYPE_SHAPE_BYTES = attrgetter("dtype", "shape", "nbytes")


def floating_bytes(tensors: Iterable[TensorRecord]) -> Counter[str]:
    """Bytes by floating dtype (``dtypes.is_floating``), every record counted: which dtype holds a model's weights."""
    from .dtypes import is_floating

    weights: Counter[str] = Counter()
    for t in tensors:
        if is_floating(t.dtype):
            weights[t.dtype] += t.nbytes
    return weights


def dtype_summary(tensors: Iterable[TensorRecord]) -> list[DtypeTotals]:
    """Totals by dtype, largest share first; a tensor under two names counts once."""
    counts: dict[str, list[int]] = {}
    unique = unique_tensors(tensors)
    # counted by (dtype, shape, bytes) in C calls, then summed over the few distinct ones: a header may hold a million
    try:
        alike = Counter(map(_DTYPE_SHAPE_BYTES, unique))
    except TypeError:  # a shape that is no tuple (a list, from the Python API)
        alike = Counter((t.dtype, tuple(t.shape), t.nbytes) for t in unique)
    for (dtype, shape, nbytes), n in alike.items():
        c = counts.setdefault(dtype, [0, 0, 0])
        c[0] += n
        c[1] += n * math.prod(shape)
        c[2] += n * nbytes
    total = sum(c[2] for c in counts.values()) or 1
    rows = [DtypeTotals(d, c[0], c[1], c[2], c[2] / total) for d, c in counts.items()]
    return sorted(rows, key=lambda r: (-r.nbytes, -r.tensors, r.dtype))
