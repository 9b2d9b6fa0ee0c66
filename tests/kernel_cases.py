"""The kernel table's cases: one PyTorch module per kernel, every dtype combination of its input and tensors, run
for real on this machine's CPU. ``tests/test_runtime_truth.py`` compares them with ``dtypeaudit/data/kernels.json``;
``scripts/measure_kernels.py`` measures a backend into that table with them.

CPU kernels differ by ISA: ATen dispatches on ``torch.backends.cpu.get_cpu_capability()`` (which the
``ATEN_CPU_CAPABILITY`` variable can lower), and oneDNN takes bfloat16 convolutions on CPUs with AVX-512 (and
float16 ones on AVX-512 FP16 / AMX-FP16), where its kernels refuse a bias of another dtype. So a backend is named
by the capability and the low-precision oneDNN paths it has (``backend_id``).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# A forward pass that failed on dtypes, in the words PyTorch's CPU kernels use.
DTYPE_ERROR = re.compile(r"dtype|scalar type|should be the same|mixed dtype")  # RNNs: "RNN input dtype ... does not match"


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
