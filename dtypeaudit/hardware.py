"""Hardware targets: which floating dtypes a device computes natively, emulates, or cannot compute at all.

``--target NAME`` (scan, convert --dry-run, trace) and a policy's ``target:`` hold every floating tensor to
one row of this table: ``unsupported-dtype`` (error) where the device cannot compute the dtype, and
``emulated-dtype`` (warning) where it runs, but through conversions to a wider type at a fraction of the
speed. No torch here: the table is facts about hardware, and the check reads metadata only.

Each row cites the vendor documentation it follows; the facts are written in our words. "Native" means
the device has arithmetic (matrix units or vector instructions) for the type; "emulated" means frameworks
convert to a wider type and compute there; "unsupported" means the usual kernels refuse the type on that
device (torch.float8 matmuls before compute capability 8.9, float64 on Apple's MPS).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Literal

from . import dtypes
from .errors import UsageError
from .inventory import Finding, Inventory, Severity, failing

Support = Literal["native", "emulated", "unsupported"]

# Table columns: a label and the torch dtypes it stands for. tf32 is a matmul mode for float32 tensors (no tensor
# holds it), so it is listed for people and never raises a finding. float8_e8m0fnu is the block-scale type of the
# MX formats (MXFP8, MXFP4), which come with fp4 on the same hardware.
COLUMNS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("fp64", ("float64",)),
    ("fp32", ("float32",)),
    ("tf32", ()),
    ("fp16", ("float16",)),
    ("bf16", ("bfloat16",)),
    ("fp8-e4m3", ("float8_e4m3fn",)),
    ("fp8-e5m2", ("float8_e5m2",)),
    ("fp8-fnuz", ("float8_e4m3fnuz", "float8_e5m2fnuz")),
    ("fp4/mx", ("float4_e2m1fn_x2", "float8_e8m0fnu")),
)
COLUMN_OF: dict[str, str] = {d: label for label, members in COLUMNS for d in members}
VENDORS = ("cpu", "nvidia", "amd", "apple")


@dataclass(frozen=True)
class Target:
    """One device class and what it computes."""

    name: str
    """What ``--target`` takes (``v100``)."""
    vendor: str
    """``cpu``, ``nvidia``, ``amd`` or ``apple``: the target class."""
    label: str
    """The device in words (``NVIDIA V100, Volta, compute capability 7.0``)."""
    support: Mapping[str, Support]
    """Column label -> native, emulated or unsupported; every column of ``COLUMNS``."""
    notes: Mapping[str, str] = field(default_factory=dict)
    """Column label -> why it is emulated or unsupported, for the findings' messages."""
    aliases: tuple[str, ...] = ()
    """Other names ``--target`` takes for it (``mi300x``, ``sm_90``)."""
    compute_capability: tuple[int, int] | None = None
    """NVIDIA's compute capability, for NVIDIA rows."""
    source: str = ""
    """The vendor documentation the row follows."""

    def supports(self, dtype: str) -> Support | None:
        """How the device handles ``dtype``; None for dtypes the table does not judge (integers, bool, complex)."""
        column = COLUMN_OF.get(dtype)
        return self.support[column] if column is not None else None

    def native_dtypes(self) -> tuple[str, ...]:
        """The floating tensor dtypes it computes natively, widest first."""
        return tuple(d for label, members in COLUMNS for d in members if self.support[label] == "native")


def _row(native: Iterable[str], emulated: Iterable[str] = ()) -> dict[str, Support]:
    out: dict[str, Support] = {label: "unsupported" for label, _ in COLUMNS}
    for label in native:
        out[label] = "native"
    for label in emulated:
        out[label] = "emulated"
    return out


# -- CPUs --------------------------------------------------------------------------------------------------------

_CPU_FP16 = "no fp16 arithmetic instructions before AVX512-FP16, so PyTorch converts to float32 (F16C) and computes there"
_CPU_BF16 = "no bf16 dot-product instructions before AVX512_BF16, so PyTorch converts to float32 and computes there"
_CPU_FP8 = (
    "no CPU computes fp8: torch upcasts it in software for matmuls, and elementwise kernels such as add are not implemented for fp8 on CPU"
)
_CPU_FP4 = "no CPU kernel computes packed fp4 or MX block scales; dequantize first"
_TF32_NONE = "no TensorFloat-32 mode: float32 matmuls run in full float32"
_CPU_FP8S = dict.fromkeys(("fp8-e4m3", "fp8-e5m2", "fp8-fnuz"), _CPU_FP8)

_CPUS = (
    # Intel's ISA extensions programming reference and the PyTorch/Intel CPU float16 RFC (pytorch/pytorch#97068):
    # CPUs with AVX2 (and AVX-512 without BF16/FP16) have no 16-bit float arithmetic; F16C only converts fp16, so
    # PyTorch computes fp16 and bf16 in float32. https://www.intel.com/content/www/us/en/developer/articles/technical/intel-sdm.html
    Target(
        "cpu",
        "cpu",
        "x86-64 or Arm CPU without bf16 or fp16 arithmetic: AVX2, or AVX-512 without BF16",
        _row(("fp64", "fp32"), ("fp16", "bf16", "fp8-e4m3", "fp8-e5m2", "fp8-fnuz")),
        {"tf32": _TF32_NONE, "fp16": _CPU_FP16, "bf16": _CPU_BF16, **_CPU_FP8S, "fp4/mx": _CPU_FP4},
        aliases=("x86", "x86-64", "avx2"),
        source="Intel 64 and IA-32 Architectures Software Developer's Manual; pytorch/pytorch#97068 (CPU float16 RFC)",
    ),
    # Intel's "Intel Deep Learning Boost New Instruction: bfloat16" article: AVX512_BF16 (3rd Gen Xeon "Cooper Lake")
    # adds VDPBF16PS, a bf16 dot product accumulating in fp32, and bf16 conversions; no fp16 arithmetic. AMD's
    # Software Optimization Guide for Family 19h lists AVX512_BF16 for Zen 4 (EPYC 9004, Ryzen 7000).
    # https://www.intel.com/content/www/us/en/developer/articles/technical/intel-deep-learning-boost-new-instruction-bfloat16.html
    Target(
        "cpu-avx512bf16",
        "cpu",
        "CPU with AVX512_BF16 and no AMX: Intel Cooper Lake, AMD Zen 4 and Zen 5",
        _row(("fp64", "fp32", "bf16"), ("fp16", "fp8-e4m3", "fp8-e5m2", "fp8-fnuz")),
        {"tf32": _TF32_NONE, "fp16": _CPU_FP16, **_CPU_FP8S, "fp4/mx": _CPU_FP4},
        aliases=("avx512bf16", "avx512_bf16", "cooper-lake", "zen4", "zen5"),
        source="Intel: Intel Deep Learning Boost New Instruction bfloat16; AMD Software Optimization Guide for Family 19h",
    ),
    # Intel's Advanced Matrix Extensions overview: 4th Gen Xeon ("Sapphire Rapids") and later have AMX tiles for bf16
    # (AMX-BF16) and AVX512-FP16 for fp16 arithmetic; Xeon 6 ("Granite Rapids") adds AMX-FP16. oneDNN uses both for
    # PyTorch's matmuls and convolutions. https://www.intel.com/content/www/us/en/products/docs/accelerator-engines/advanced-matrix-extensions/overview.html
    Target(
        "cpu-amx",
        "cpu",
        "CPU with AMX and AVX512-FP16: Intel 4th Gen Xeon (Sapphire Rapids) and later",
        _row(("fp64", "fp32", "fp16", "bf16"), ("fp8-e4m3", "fp8-e5m2", "fp8-fnuz")),
        {"tf32": _TF32_NONE, **_CPU_FP8S, "fp4/mx": _CPU_FP4},
        aliases=("amx", "sapphire-rapids", "emerald-rapids", "granite-rapids", "xeon4"),
        source="Intel: Advanced Matrix Extensions overview; Intel Neural Compressor mixed-precision guide (AVX512-FP16 on 4th Gen Xeon)",
    ),
)


# -- NVIDIA, by compute capability --------------------------------------------------------------------------------
# The PTX ISA's warp-level matrix instructions (mma) take .f16 from sm_70, .bf16 and .tf32 from sm_80, .e4m3 and
# .e5m2 from sm_89, and fp4/MX block-scaled types from sm_100 (tcgen05.mma); NVIDIA's Transformer Engine support
# matrix states the same thresholds (BF16 needs 8.0, FP8 8.9, MXFP8/NVFP4 10.0). Before 8.0, CUDA's bf16 math
# (cuda_bf16.h) converts to float32: it runs, without tensor cores. PyTorch's fp8 matmul (torch._scaled_mm)
# refuses devices below 8.9. No NVIDIA GPU computes the FNUZ fp8 variants (AMD's).
# https://docs.nvidia.com/cuda/parallel-thread-execution/#warp-level-matrix-instructions
# https://nvidia.github.io/TransformerEngine/support_matrix.html
_NVIDIA_SOURCE = "NVIDIA PTX ISA (mma data types by sm_XX); NVIDIA Transformer Engine support matrix; developer.nvidia.com/cuda-gpus"


def _nvidia(name: str, label: str, cc: tuple[int, int], aliases: tuple[str, ...] = ()) -> Target:
    native = ["fp64", "fp32", "fp16"]
    emulated = []
    notes = {"fp8-fnuz": "the FNUZ fp8 variants are AMD's (MI300); NVIDIA GPUs compute the OCP float8_e4m3fn and float8_e5m2"}
    if cc >= (8, 0):
        native += ["bf16", "tf32"]
    else:
        emulated.append("bf16")
        notes["bf16"] = "bf16 tensor cores start at compute capability 8.0 (Ampere); before that CUDA computes bf16 in float32"
        notes["tf32"] = "TensorFloat-32 starts at compute capability 8.0"
    if cc >= (8, 9):
        native += ["fp8-e4m3", "fp8-e5m2"]
    else:
        text = "fp8 tensor cores start at compute capability 8.9 (Ada, Hopper); torch._scaled_mm refuses earlier devices"
        notes.update(dict.fromkeys(("fp8-e4m3", "fp8-e5m2"), text))
    if cc >= (10, 0):
        native.append("fp4/mx")
    else:
        notes["fp4/mx"] = "fp4 and MX block-scaled formats start at compute capability 10.0 (Blackwell)"
    return Target(
        name,
        "nvidia",
        f"{label}, compute capability {cc[0]}.{cc[1]}",
        _row(native, emulated),
        notes,
        aliases=(*aliases, f"sm_{cc[0]}{cc[1]}"),
        compute_capability=cc,
        source=_NVIDIA_SOURCE,
    )


_NVIDIA = (
    # developer.nvidia.com/cuda-gpus: Tesla V100 is compute capability 7.0 (Volta, first fp16 tensor cores).
    _nvidia("v100", "NVIDIA V100, Volta", (7, 0), ("volta",)),
    # developer.nvidia.com/cuda-gpus: T4 is 7.5 (Turing: fp16/int8 tensor cores, no bf16).
    _nvidia("t4", "NVIDIA T4, Turing", (7, 5), ("turing", "rtx2080")),
    # developer.nvidia.com/cuda-gpus: A100 is 8.0 (Ampere: bf16 and tf32 tensor cores, no fp8).
    _nvidia("a100", "NVIDIA A100, Ampere", (8, 0), ("ampere", "a30")),
    # developer.nvidia.com/cuda-gpus: A10, A10G, A40 and the RTX 30 series are 8.6 (Ampere).
    _nvidia("a10", "NVIDIA A10/A10G/A40 and RTX 30 series, Ampere", (8, 6), ("a10g", "a40", "rtx3090")),
    # developer.nvidia.com/cuda-gpus: L4, L40, L40S and the RTX 40 series are 8.9 (Ada: fp8 tensor cores).
    _nvidia("l4", "NVIDIA L4/L40/L40S and RTX 40 series, Ada Lovelace", (8, 9), ("ada", "l40", "l40s", "rtx4090")),
    # developer.nvidia.com/cuda-gpus: H100, H200 and GH200 are 9.0 (Hopper: fp8 tensor cores).
    _nvidia("h100", "NVIDIA H100/H200, Hopper", (9, 0), ("hopper", "h200", "gh200")),
    # developer.nvidia.com/cuda-gpus: B200 and GB200 are 10.0 (Blackwell: fp4 and MX formats).
    _nvidia("b200", "NVIDIA B200/GB200, Blackwell", (10, 0), ("blackwell", "b100", "gb200")),
)


# -- AMD Instinct ----------------------------------------------------------------------------------------------------
_AMD_SOURCE = "AMD ROCm: Data types and precision support; ROCm Compute Profiler, CDNA architecture data type table"
_AMD_OCP_FP8 = (
    "MI300's matrix cores compute fp8 in the FNUZ variants (float8_e4m3fnuz, float8_e5m2fnuz; e4m3fnuz reaches 240, "
    "not 448); the OCP float8_e4m3fn/float8_e5m2 start with gfx950 (MI350)"
)
_AMD = (
    # ROCm Compute Profiler's CDNA data type table: CDNA2 (MI210, MI250, MI250X; gfx90a) has FP64, FP32, FP16 and BF16
    # matrix operations, and neither TF32 nor FP8/BF8 GEMMs. torch._scaled_mm runs on MI300 and later only.
    # https://rocm.docs.amd.com/projects/rocprofiler-compute/en/latest/conceptual/performance-model.html
    Target(
        "mi200",
        "amd",
        "AMD Instinct MI210/MI250/MI250X, CDNA2 (gfx90a)",
        _row(("fp64", "fp32", "fp16", "bf16")),
        {
            "tf32": "CDNA2 has no TF32 matrix operations (they start with CDNA3, MI300)",
            **dict.fromkeys(("fp8-e4m3", "fp8-e5m2", "fp8-fnuz"), "CDNA2 has no fp8 matrix operations (they start with CDNA3, MI300)"),
            "fp4/mx": "fp4 and MX formats start with CDNA4 (MI350)",
        },
        aliases=("mi210", "mi250", "mi250x", "gfx90a", "cdna2"),
        source=_AMD_SOURCE,
    ),
    # ROCm's "Data types and precision support": CDNA3 (MI300A, MI300X, MI325X; gfx942) adds TF32 and FP8/BF8 matrix
    # operations, in the FNUZ encodings (no infinities, no negative zero); the OCP encodings come with gfx950.
    # https://rocm.docs.amd.com/en/latest/reference/precision-support.html
    Target(
        "mi300",
        "amd",
        "AMD Instinct MI300A/MI300X/MI325X, CDNA3 (gfx942)",
        _row(("fp64", "fp32", "tf32", "fp16", "bf16", "fp8-fnuz")),
        {**dict.fromkeys(("fp8-e4m3", "fp8-e5m2"), _AMD_OCP_FP8), "fp4/mx": "fp4 and MX formats start with CDNA4 (MI350)"},
        aliases=("mi300x", "mi300a", "mi325x", "gfx942", "cdna3"),
        source=_AMD_SOURCE,
    ),
)


# -- Apple ---------------------------------------------------------------------------------------------------------
_APPLE = (
    # Apple's MPSDataType documentation: Metal Performance Shaders compute float32 and float16, and bfloat16 from
    # macOS 14 (Sonoma); there is no float64 or fp8 type, so PyTorch refuses float64 and fp8 tensors on "mps"
    # ("the MPS framework doesn't support float64"). https://developer.apple.com/documentation/metalperformanceshaders/mpsdatatype
    Target(
        "mps",
        "apple",
        "Apple silicon GPU through Metal Performance Shaders, bf16 from macOS 14",
        _row(("fp32", "fp16", "bf16")),
        {
            "fp64": "Metal Performance Shaders have no float64 type; PyTorch refuses float64 tensors on mps",
            "tf32": _TF32_NONE,
            **dict.fromkeys(("fp8-e4m3", "fp8-e5m2", "fp8-fnuz"), "Metal Performance Shaders have no fp8 type; PyTorch refuses fp8 on mps"),
            "fp4/mx": "Metal Performance Shaders have no fp4 or MX types",
        },
        aliases=("apple", "metal", "apple-silicon", "m1", "m2", "m3", "m4"),
        source="Apple: MPSDataType (Metal Performance Shaders); pytorch/pytorch#119641 (bf16 on macOS 14)",
    ),
)

TARGETS: tuple[Target, ...] = (*_CPUS, *_NVIDIA, *_AMD, *_APPLE)


def _key(name: str) -> str:
    return name.strip().lower().replace("_", "-")


_BY_NAME: dict[str, Target] = {_key(n): t for t in TARGETS for n in (t.name, *t.aliases)}
_SM = re.compile(r"^(?:sm-?(\d{1,2})(\d)|(?:cc|compute-?)?(\d{1,2})\.(\d))$")


def names() -> list[str]:
    """Every target's name, in table order."""
    return [t.name for t in TARGETS]


def resolve(name: str) -> Target:
    """The target ``name`` or an alias names; ``sm_86``, ``cc8.6`` or ``8.6`` give an NVIDIA GPU of that compute capability.

    Raises UsageError (exit 2) naming the valid targets for anything else.
    """
    key = _key(name)
    found = _BY_NAME.get(key)
    if found is not None:
        return found
    m = _SM.match(key)
    if m:
        major, minor = (int(m.group(1)), int(m.group(2))) if m.group(1) else (int(m.group(3)), int(m.group(4)))
        named = _BY_NAME.get(f"sm-{major}{minor}")
        if named is not None:
            return named
        if (major, minor) >= (7, 0):
            return _nvidia(f"sm_{major}{minor}", "NVIDIA GPU", (major, minor))
        raise UsageError(f"target '{name}': compute capability {major}.{minor} is below 7.0, which the table does not cover")
    raise UsageError(f"unknown target '{name}'", hint=f"`dtypeaudit targets` lists them: {', '.join(names())}; or sm_XY for NVIDIA")


_FP8_TWIN = {
    "float8_e4m3fn": "float8_e4m3fnuz",
    "float8_e4m3fnuz": "float8_e4m3fn",
    "float8_e5m2": "float8_e5m2fnuz",
    "float8_e5m2fnuz": "float8_e5m2",
}


def suggestion(target: Target, dtype: str) -> str | None:
    """The dtype to use instead of ``dtype`` on ``target``: the other fp8 encoding where the device computes it, else
    the narrowest natively computed dtype at least as wide (fp16 before bf16), else the widest one it computes."""
    native = [d for d in target.native_dtypes() if d != "float8_e8m0fnu"]
    twin = _FP8_TWIN.get(dtype)
    if twin in native:
        return twin
    width = dtypes.get(dtype).itemsize if dtype in dtypes.DTYPES else 4
    wide_enough = [d for d in native if dtypes.get(d).itemsize >= width]
    if wide_enough:
        return min(wide_enough, key=lambda d: (dtypes.get(d).itemsize, native.index(d)))
    return max(native, key=lambda d: dtypes.get(d).itemsize) if native else None


def finding_for(target: Target, dtype: str, *, tensor: str | None = None, file: str | None = None) -> Finding | None:
    """The finding a ``dtype`` tensor raises on ``target``: None where the device computes it natively."""
    support = target.supports(dtype)
    if support is None or support == "native":
        return None
    column = COLUMN_OF[dtype]
    why = target.notes.get(column, "")
    instead = suggestion(target, dtype)
    hint = f"; use {instead}" if instead else ""
    if support == "emulated":
        rule, severity, verb = "emulated-dtype", "warning", "runs emulated (slowly) on"
    else:
        rule, severity, verb = "unsupported-dtype", "error", "cannot be computed on"
    return Finding(
        rule,
        severity,  # type: ignore[arg-type]
        f"{dtype} {verb} {target.name} ({target.label}): {why}{hint}",
        tensor=tensor,
        file=file,
        expected=target.native_dtypes(),
        actual=dtype,
    )


def target_findings(inv: Inventory, target: Target | str) -> list[Finding]:
    """``unsupported-dtype`` and ``emulated-dtype`` for every floating tensor the target does not compute natively.

    Optimizer state counts too (it is computed on the device during the step).
    """
    t = resolve(target) if isinstance(target, str) else target
    out = []
    for rec in inv.tensors:
        f = finding_for(t, rec.dtype, tensor=rec.name, file=rec.file or None)
        if f is not None:
            out.append(f)
    return out


def check_for(target: Target | str) -> Callable[[Inventory], list[Finding]]:
    """A check (Inventory -> findings) for ``target``, to append to ``checks_for``'s list."""
    # a partial, not a closure: checks travel to worker processes and Dask workers (fleet.py) by pickle
    return partial(target_findings, target=resolve(target) if isinstance(target, str) else target)


# -- rendering the table -------------------------------------------------------------------------------------------

_CELL = {"native": "native", "emulated": "emulated", "unsupported": "-"}


def render_text(targets: Iterable[Target] = TARGETS) -> str:
    """The table as aligned plain text, one target per line."""
    rows = [["target", "class", *(label for label, _ in COLUMNS), "device"]]
    for t in targets:
        rows.append([t.name, t.vendor, *(_CELL[t.support[label]] for label, _ in COLUMNS), t.label])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r[:-1], widths, strict=True)) + "  " + r[-1] for r in rows]
    return "\n".join(line.rstrip() for line in lines) + "\n"


def render_markdown(targets: Iterable[Target] = TARGETS) -> str:
    """The table in Markdown, as docs/targets.md shows it."""
    head = ["target", *(label for label, _ in COLUMNS), "device"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for t in targets:
        cells = [f"`{t.name}`", *(_CELL[t.support[label]] for label, _ in COLUMNS), t.label]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def render_detail(t: Target) -> str:
    """One target: every column, why it is not native, its aliases and its source."""
    lines = [f"{t.name}: {t.label}"]
    if t.aliases:
        lines.append(f"  also: {', '.join(t.aliases)}")
    for label, members in COLUMNS:
        why = t.notes.get(label) if t.support[label] != "native" else None
        dtype_names = f" ({', '.join(members)})" if members else " (float32 matmul mode)"
        lines.append(f"  {label:9} {t.support[label]:11}{dtype_names}" + (f": {why}" if why else ""))
    lines.append(f"  source: {t.source}")
    return "\n".join(lines) + "\n"


def as_json(targets: Iterable[Target] = TARGETS) -> list[dict[str, object]]:
    """The table as plain data (``dtypeaudit targets --format json``)."""
    return [
        {
            "name": t.name,
            "class": t.vendor,
            "device": t.label,
            "aliases": list(t.aliases),
            "compute_capability": f"{t.compute_capability[0]}.{t.compute_capability[1]}" if t.compute_capability else None,
            "support": {label: t.support[label] for label, _ in COLUMNS},
            "dtypes": {d: t.support[label] for label, members in COLUMNS for d in members},
            "notes": dict(t.notes),
            "source": t.source,
        }
        for t in targets
    ]


def plan_json(planned: Inventory, target: Target, *, fail_on: Severity = "error") -> tuple[dict[str, object], bool]:
    """``convert --dry-run --target --format json``: the report's ``hardware_target`` section (the target's findings
    on the planned output), and whether any fails at ``fail_on`` (``plan_report``'s verdict)."""
    from .render.json import finding_dict

    found = target_findings(planned, target)
    section: dict[str, object] = {"name": target.name, "device": target.label, "findings": [finding_dict(f) for f in found]}
    return section, bool(failing(found, fail_on))


def plan_report(text: str, planned: Inventory, target: Target, *, fail_on: Severity = "error") -> tuple[str, bool]:
    """``convert --dry-run --target``: the plan's text report with the target's findings on the planned output
    added, and whether any fails at ``fail_on`` (the policy's, as for the plan's own findings; by default only a
    dtype the target cannot compute)."""
    found = target_findings(planned, target)
    unfit = bool(failing(found, fail_on))
    lines = [text.rstrip("\n")]
    if not found:
        lines.append(f"target {target.name} ({target.label}): computes every floating dtype of the planned output natively")
    groups: dict[tuple[str, str, str], list[str]] = {}
    for f in found:
        groups.setdefault((f.severity, f.rule, f.message), []).append(f.tensor or "")
    for (severity, rule, message), names in groups.items():
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        lines.append(f"{severity}: {rule}: {len(names)} tensor{'s' if len(names) != 1 else ''} ({shown}): {message}")
    return "\n".join(lines) + "\n", unfit
