"""fused.py (the compiled float32 -> float16/bfloat16 pass) against torch's own cast and against the numpy path it
replaces (values.ValueCheck + npcast), which tests/test_values.py and tests/test_npcast.py hold against torch:
the same bytes and the same figures, value for value."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from dtypeaudit import fused
from dtypeaudit.npcast import NumpyCaster
from dtypeaudit.values import CHUNK_BYTES, ValueCheck, ValueStats

needs_fused = pytest.mark.skipif(fused.kernel is None, reason="dtypeaudit.fused_kernel was not built (no C compiler at install)")
TARGETS = ["float16", "bfloat16"]


def every_exponent() -> np.ndarray:
    """Each float32 exponent with the mantissas around every rounding boundary (float16's 13 and bfloat16's 16
    dropped bits: ties, one below, one above, the carry), both signs: inf, NaN payloads and subnormals included."""
    exponents = np.arange(256, dtype=np.uint32) << 23
    mantissas = np.array(
        [
            0,
            1,
            2,
            0xFFF,
            0x1000,
            0x1001,
            0x1FFF,
            0x2000,
            0x3000,
            0x7FFF,
            0x8000,
            0x8001,
            0x18000,
            0xFFFF,
            0x10000,
            0x400000,
            0x7FE000,
            0x7FEFFF,
            0x7FF000,
            0x7FF001,
            0x7FFFFF,
        ],
        dtype=np.uint32,
    )
    bits = (exponents[:, None] | mantissas[None, :]).ravel()
    return np.concatenate([bits, bits | 0x80000000]).view(np.float32)


def value_sets() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(18)
    return {
        "every-float16": np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32),
        "every-exponent": every_exponent(),
        "random-bits": rng.integers(0, 1 << 32, 300_001, dtype=np.uint32).view(np.float32),
        "weights": (rng.standard_normal(200_000) * 0.02).astype(np.float32),
        "moments": (rng.standard_normal(100_000) * 1e-6).astype(np.float32),
        "large": (rng.standard_normal(100_000) * 3e4).astype(np.float32),
        "zeros": np.zeros(1000, np.float32),
        "one": np.array([-0.0], np.float32),
    }


def numpy_path(x: np.ndarray, target: str) -> tuple[bytes, list[object]]:
    """What the conversion made before: a fold and a cast per chunk (values.CHUNK_BYTES of float32)."""
    stats, check, step = ValueStats("", "float32", target), ValueCheck(), CHUNK_BYTES // 4
    cast = NumpyCaster("float32", target, capacity=step)
    out = b""
    with np.errstate(all="ignore"):
        for first in range(0, len(x), step):
            chunk = x[first : first + step]
            out += cast(chunk, check.fold(stats, chunk, chunk)).tobytes()
    return out, stats.to_fields()


def fused_path(x: object, n: int, target: str) -> tuple[bytes, list[object]]:
    stats = ValueStats("", "float32", target)
    out = fused.FusedCast(target, capacity=n)(x, stats)
    return bytes(out), stats.to_fields()


@needs_fused
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("values", list(value_sets()), ids=str)
def test_the_same_bytes_and_figures_as_the_numpy_path(target: str, values: str) -> None:
    x = value_sets()[values]
    assert fused_path(x, len(x), target) == numpy_path(x, target)


@needs_fused
@pytest.mark.parametrize("target", TARGETS)
def test_a_source_at_any_alignment_and_length(target: str) -> None:
    """A zip entry need not be 4-aligned: the loop copies such a source through a small aligned buffer."""
    x = (np.random.default_rng(3).standard_normal(5001) * 10).astype(np.float32)
    for shift in (1, 2, 3):
        raw = bytearray(shift) + bytearray(x.tobytes())
        for n in (0, 1, 2047, 2048, 2049, 5001):
            assert fused_path(memoryview(raw)[shift : shift + 4 * n], n, target) == numpy_path(x[:n].copy(), target)


@needs_fused
@pytest.mark.parametrize("target", TARGETS)
def test_bytes_and_errors_are_torchs(target: str) -> None:
    """Every non-NaN value casts to torch's own bits, and the two errors are torch's float32 measure of its cast
    (``|y - x|``, then over ``max(|x|, tiny)``, inf differences left out)."""
    torch = pytest.importorskip("torch")
    x = np.concatenate([value_sets()["every-exponent"], value_sets()["random-bits"], value_sets()["weights"]])
    got, fields = fused_path(x, len(x), target)
    got_bits = np.frombuffer(got, np.uint16)
    t = torch.from_numpy(x)
    y = t.to(getattr(torch, target))
    nan = np.isnan(x)
    assert np.array_equal(got_bits[~nan], y.view(torch.int16).numpy().view(np.uint16)[~nan])
    # NaN as torch's vectorised loop writes it: float16 quieted with its sign and top payload bits, bfloat16 0xFFFF
    payload = (x[nan].view(np.uint32) >> 16 & 0x8000) | 0x7E00 | (x[nan].view(np.uint32) >> 13 & 0x3FF)
    assert np.array_equal(got_bits[nan], payload if target == "float16" else np.full(int(nan.sum()), 0xFFFF))
    stats = ValueStats.from_fields("float32", target, fields)
    finite = torch.isfinite(t) & torch.isfinite(y.float())
    error = (y.float() - t).abs()[finite]
    relative = error / t.abs()[finite].clamp(min=torch.finfo(torch.float32).tiny)
    assert stats.max_abs_error == float(error.max())
    assert stats.max_rel_error == float(relative.max())
    assert stats.overflow == int((torch.isinf(y) & torch.isfinite(t)).sum())
    assert stats.nonfinite == int((~torch.isfinite(t)).sum())


@needs_fused
def test_a_conversion_gives_the_same_output_and_report_either_way(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through convert, on both cores: the compiled pass and the numpy path (``DTYPEAUDIT_NO_FUSED``) write the same
    bytes and find the same values, underflow and subnormals included."""
    torch = pytest.importorskip("torch")
    from dtypeaudit import pieces
    from dtypeaudit.conversion import convert

    g = torch.Generator().manual_seed(7)
    state = {
        "w": torch.randn(1024, 1024, generator=g) * 0.02,
        "m": torch.randn(4096, generator=g) * 1e-5,
        "b": torch.randn(64, generator=g),
    }
    src = tmp_path / "m.pt"
    torch.save(state, src)
    monkeypatch.setattr(pieces, "CHILD_MIN_BYTES", 0)
    monkeypatch.setattr(pieces, "PIECE_ELEMENTS", pieces.CHUNK_ELEMENTS)
    made = {}
    for label, off in (("fused", None), ("numpy", "1")):
        if off:
            monkeypatch.setenv("DTYPEAUDIT_NO_FUSED", off)
        result = convert(src, "fp16", output=str(tmp_path / f"{label}.pt"))
        assert result.output is not None
        made[label] = (torch.load(result.output, weights_only=True), [vars(s) for s in result.plan.values.values()])
    assert fused.available() is False  # the variable turned it off for the second run
    (fast, fast_values), (slow, slow_values) = made["fused"], made["numpy"]
    assert fast.keys() == slow.keys() and all(torch.equal(fast[k], slow[k]) for k in fast)
    assert all(torch.equal(fast[k], v.half()) for k, v in state.items())
    assert fast_values == slow_values
    assert any(v["underflow"] for v in fast_values)  # the moments: the range counts were exercised


def build_loop(where: Path, *flags: str) -> Path:
    """fused_kernel.c built into ``where`` with this Python's own compiler command and ``flags``."""
    compiler = (sysconfig.get_config_var("CC") or "cc").split()
    source = Path(fused.__file__).with_name("fused_kernel.c")
    built = where / f"fused_kernel{sysconfig.get_config_var('EXT_SUFFIX')}"
    include = f"-I{sysconfig.get_paths()['include']}"
    subprocess.run([*compiler, "-O3", *flags, "-shared", "-fPIC", include, str(source), "-o", str(built)], check=True)
    return built


@needs_fused
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="builds the baseline loop with this Python's own compiler command")
def test_the_baseline_loop_gives_the_same_bytes_and_figures(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the CPU has AVX2 the installed module runs its AVX2 clone; the baseline loop (SSE2 on x86-64, what
    other CPUs run) is built here on its own and held to the numpy path as well."""
    built = build_loop(tmp_path, "-DFUSED_BASELINE_ONLY")
    spec = importlib.util.spec_from_file_location("fused_kernel", built)
    assert spec is not None and spec.loader is not None
    baseline = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(baseline)
    monkeypatch.setattr(fused, "kernel", baseline)
    for target in TARGETS:
        for name, x in value_sets().items():
            assert fused_path(x, len(x), target) == numpy_path(x, target), (target, name)


@needs_fused
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="builds a loop with this Python's own compiler command")
def test_a_build_that_rounds_otherwise_is_not_used(tmp_path: Path) -> None:
    """-ffast-math from a user's CFLAGS (setup.py's flags now override it) turns the relative error's division into
    a multiplication by a reciprocal: the probe catches that build and numpy's path runs instead. In a child process:
    such a library also turns on flush-to-zero for every process that loads it."""
    built = build_loop(tmp_path, "-ffast-math")
    code = (
        "import importlib.util, sys\n"
        "from dtypeaudit import fused\n"
        "assert fused.available()\n"  # the installed build passes
        f"spec = importlib.util.spec_from_file_location('fused_kernel', {str(built)!r})\n"
        "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)\n"
        "fused.kernel = module; fused._sound.cache_clear()\n"
        "print(fused.available())\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


def test_the_compiled_pass_needs_no_numpy() -> None:
    """A conversion's first bytes go out before numpy is imported (a tenth of a second of every run)."""
    code = (
        "import sys; from dtypeaudit import fused, values\n"
        "if fused.available():\n"
        "    s = values.ValueStats('', 'float32', 'float16'); out = fused.FusedCast('float16', capacity=4)(bytearray(16), s)\n"
        "    assert bytes(out) == bytes(8) and s.numel == 4, (bytes(out), s)\n"
        "print('numpy' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


def test_it_is_built_wherever_a_c_compiler_is() -> None:
    """The install builds the extension where it can; a build that silently stopped working would only be slower,
    so this is where it shows."""
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(compiler) is None or os.name == "nt":
        pytest.skip(f"no C compiler ({compiler}) here: the numpy path is the one in use")
    assert fused.kernel is not None, "dtypeaudit/fused_kernel.c was not built: reinstall (pip install -e .) and read the build log"
    assert fused.available(), "the built loop fails its probe (fused._EXPECTED): it rounds otherwise than torch"
