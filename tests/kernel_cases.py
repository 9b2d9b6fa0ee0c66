"""The kernel table's cases: one PyTorch module per kernel, every dtype combination of its input and tensors, run
for real on this machine's CPU. ``tests/test_runtime_truth.py`` compares them with ``dtypeaudit/kernel_table.py``;
this module also (re)measures a backend into that table:

    PYTHONPATH=. python -m tests.kernel_cases                       # this machine, as it runs by default
    ATEN_CPU_CAPABILITY=default PYTHONPATH=. python -m tests.kernel_cases   # ATen's scalar kernels
    PYTHONPATH=. python -m tests.kernel_cases --no-onednn           # oneDNN (mkldnn) switched off

CPU kernels differ by ISA: ATen dispatches on ``torch.backends.cpu.get_cpu_capability()`` (which the
``ATEN_CPU_CAPABILITY`` variable can lower), and oneDNN takes bfloat16 convolutions on CPUs with AVX-512 (and
float16 ones on AVX-512 FP16 / AMX-FP16), where its kernels refuse a bias of another dtype. So a backend is named
by the capability and the low-precision oneDNN paths it has (``backend_id``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import re
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# A forward pass that failed on dtypes, in the words PyTorch's CPU kernels use.
DTYPE_ERROR = re.compile(r"dtype|scalar type|should be the same|mixed dtype")  # RNNs: "RNN input dtype ... does not match"
TABLE = Path(__file__).resolve().parent.parent / "dtypeaudit" / "kernel_table.py"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Outcome:
    """What a real forward pass did."""

    raised: bool
    message: str = ""
    output: str | None = None
    limitation: str | None = None
    """Set when the forward failed for another reason than dtypes (an op this CPU build lacks): not counted."""

    @property
    def entry(self) -> str:
        """The kernel table's spelling: the output dtype, or ``raise``."""
        return "raise" if self.raised else str(self.output)


def run_forward(fn: Callable[[], object]) -> Outcome:
    try:
        with torch.no_grad():
            out = fn()
            out = _main_output(out)
    except (RuntimeError, TypeError, ValueError, NotImplementedError, AssertionError) as exc:  # ValueError: RNN dtype checks
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if DTYPE_ERROR.search(message):
            return Outcome(True, message)
        return Outcome(True, message, limitation=message)
    assert isinstance(out, torch.Tensor), out
    return Outcome(False, output=dtype_name(out.dtype))


def _main_output(out: object) -> object:
    """The tensor a model hands on: transformers' logits, else its first output (``last_hidden_state``, an LSTM's
    output beside its state, attention's output beside its weights)."""
    for attr in ("logits", "logits_per_image", "last_hidden_state"):
        if getattr(out, attr, None) is not None:
            return getattr(out, attr)
    return out[0] if isinstance(out, tuple) else out


def set_dtype(module: nn.Module, leaf: str, dtype: torch.dtype) -> None:
    """Cast one parameter or buffer in place, the way a partial conversion leaves it."""
    t = getattr(module, leaf)
    if isinstance(t, nn.Parameter):
        t.data = t.data.to(dtype)
    else:
        setattr(module, leaf, t.to(dtype))


@dataclass(frozen=True)
class Kernel:
    make: Callable[[], nn.Module]
    example: Callable[[torch.dtype], torch.Tensor]
    leaves: tuple[str, ...]
    """The floating tensors, each cast on its own (running statistics together, as ``stats``)."""


KERNELS: dict[str, Kernel] = {
    "BatchNorm2d": Kernel(lambda: nn.BatchNorm2d(4), lambda d: torch.randn(2, 4, 3, 3, dtype=d), ("weight", "bias", "stats")),
    "Linear": Kernel(lambda: nn.Linear(4, 3), lambda d: torch.randn(2, 4, dtype=d), ("weight", "bias")),
    "Conv2d": Kernel(lambda: nn.Conv2d(3, 4, 3), lambda d: torch.randn(1, 3, 5, 5, dtype=d), ("weight", "bias")),
    "LayerNorm": Kernel(lambda: nn.LayerNorm(4), lambda d: torch.randn(2, 4, dtype=d), ("weight", "bias")),
    "GroupNorm": Kernel(lambda: nn.GroupNorm(2, 4), lambda d: torch.randn(2, 4, 3, dtype=d), ("weight", "bias")),
    "RMSNorm": Kernel(lambda: nn.RMSNorm(4), lambda d: torch.randn(2, 4, dtype=d), ("weight",)),
    "Embedding": Kernel(lambda: nn.Embedding(5, 4), lambda d: torch.tensor([[1, 2, 3]]), ("weight",)),
    # Same kernels, other shapes: the table's rule must hold for them too.
    "BatchNorm1d": Kernel(lambda: nn.BatchNorm1d(4), lambda d: torch.randn(2, 4, dtype=d), ("weight", "bias", "stats")),
    "InstanceNorm2d": Kernel(
        lambda: nn.InstanceNorm2d(4, affine=True, track_running_stats=True),
        lambda d: torch.randn(2, 4, 3, 3, dtype=d),
        ("weight", "bias", "stats"),
    ),
    "Conv1d": Kernel(lambda: nn.Conv1d(3, 4, 3), lambda d: torch.randn(1, 3, 5, dtype=d), ("weight", "bias")),
    "ConvTranspose1d": Kernel(lambda: nn.ConvTranspose1d(3, 4, 3), lambda d: torch.randn(1, 3, 5, dtype=d), ("weight", "bias")),
    "ConvTranspose2d": Kernel(lambda: nn.ConvTranspose2d(3, 4, 3), lambda d: torch.randn(1, 3, 5, 5, dtype=d), ("weight", "bias")),
}


def inputs_of(name: str) -> list[str]:
    return ["int64"] if name == "Embedding" else list(TORCH_DTYPES)


def kernel_cases(names: list[str] | None = None) -> list[tuple[str, str, tuple[str, ...]]]:
    """``(kernel, input dtype, the leaves' dtypes)`` for every combination."""
    cases = []
    for name in names or list(KERNELS):
        k = KERNELS[name]
        for x in inputs_of(name):
            for combo in itertools.product(TORCH_DTYPES, repeat=len(k.leaves)):
                cases.append((name, x, combo))
    return cases


def build_kernel(name: str, combo: tuple[str, ...]) -> nn.Module:
    k = KERNELS[name]
    m = k.make().eval()
    for leaf, d in zip(k.leaves, combo, strict=True):
        for real in ("running_mean", "running_var") if leaf == "stats" else (leaf,):
            set_dtype(m, real, TORCH_DTYPES[d])
    return m


def row_key(name: str, x: str, combo: tuple[str, ...]) -> str:
    """The table's key: ``ConvTranspose2d float16 weight=float16 bias=float32``."""
    leaves = " ".join(f"{leaf}={d}" for leaf, d in zip(KERNELS[name].leaves, combo, strict=True))
    return f"{name} {x} {leaves}"


def run_case(name: str, x: str, combo: tuple[str, ...]) -> Outcome:
    m = build_kernel(name, combo)
    example = KERNELS[name].example(TORCH_DTYPES.get(x, torch.int64))
    return run_forward(lambda: m(example))


def backend_id() -> str:
    """This process's CPU backend: ATen's capability, and the low-precision paths oneDNN takes here.

    ``cpu-avx2``; ``cpu-avx512-onednn-bf16`` where oneDNN runs bfloat16 convolutions; ``...-onednn-fp16`` where it
    runs float16 ones too (AVX-512 FP16, AMX-FP16); ``-no-onednn`` where it is switched off.
    """
    parts = ["cpu", torch.backends.cpu.get_cpu_capability().lower().replace(" ", "")]
    if not torch.backends.mkldnn.is_available() or not torch.backends.mkldnn.enabled:
        parts.append("no-onednn")
    else:
        if torch.ops.mkldnn._is_mkldnn_bf16_supported():
            parts.append("onednn-bf16")
        if torch.ops.mkldnn._is_mkldnn_fp16_supported():
            parts.append("onednn-fp16")
    return "-".join(parts)


def machine() -> str:
    """The CPU model and its vector extensions, for the table's record of where a backend was measured."""
    model, flags = platform.processor() or platform.machine(), ""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        for line in text.splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "Model name":
                model = value.strip()
            elif key.strip() == "Flags":
                flags = " ".join(sorted(f for f in value.split() if re.match(r"(avx|amx|f16c|fma)", f)))
    except OSError:
        pass
    return f"{model} ({flags})" if flags else model


def measure() -> dict[str, str]:
    """Row key -> outcome on this process's backend, for every case whose failure is about dtypes."""
    out = {}
    for name, x, combo in kernel_cases():
        outcome = run_case(name, x, combo)
        if outcome.limitation is None:
            out[row_key(name, x, combo)] = outcome.entry
    return out


def load_table() -> tuple[dict[str, dict[str, str]], dict[str, dict[str, str]]]:
    """``(BACKENDS, OUTCOMES)`` as the table file holds them now."""
    namespace: dict[str, object] = {}
    exec(compile(TABLE.read_text(), str(TABLE), "exec"), namespace)  # our own generated file
    return namespace["BACKENDS"], namespace["OUTCOMES"]  # type: ignore[return-value]


def write_table(backends: dict[str, dict[str, str]], outcomes: dict[str, dict[str, str]]) -> None:
    """One block per backend, one line per row: a new backend is a new block in review."""
    lines = [
        '"""Generated by ``python -m tests.kernel_cases`` (see that module): what PyTorch kernels did with each dtype',
        "combination, per backend, and where each backend was measured. ``dtypeaudit.kernels`` reads it.",
        '"""',
        "",
        "# fmt: off",
        "BACKENDS: dict[str, dict[str, str]] = {",
    ]
    for b in sorted(backends):
        lines.append(f"    {json.dumps(b)}: {{")
        lines += [f"        {json.dumps(k)}: {json.dumps(v)}," for k, v in sorted(backends[b].items())]
        lines.append("    },")
    lines += ["}", "", "OUTCOMES: dict[str, dict[str, str]] = {"]
    for b in sorted(outcomes):
        lines.append(f"    {json.dumps(b)}: {{")
        lines += [f"        {json.dumps(k)}: {json.dumps(v)}," for k, v in sorted(outcomes[b].items())]
        lines.append("    },")
    lines += ["}", "# fmt: on", ""]
    TABLE.write_text("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-onednn", action="store_true", help="measure with oneDNN (mkldnn) switched off")
    args = parser.parse_args()
    if args.no_onednn:
        torch.backends.mkldnn.enabled = False
    backend = backend_id()
    measured = measure()
    backends, outcomes = load_table() if TABLE.exists() else ({}, {})
    how = "ATEN_CPU_CAPABILITY lowered" if torch.backends.cpu.get_cpu_capability() != _native_capability() else "native"
    backends[backend] = {"measured_on": machine(), "torch": torch.__version__, "how": how + (", oneDNN off" if args.no_onednn else "")}
    outcomes[backend] = measured
    write_table(backends, outcomes)
    print(f"{backend}: {len(measured)} rows written to {TABLE}")


def _native_capability() -> str:
    import os
    import sys

    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    code = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout.strip()


if __name__ == "__main__":
    main()
