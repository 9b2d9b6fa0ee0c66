"""values.py against torch's own cast: the range checks read bits, so every threshold is checked against
what ``tensor.half()`` really does, and the errors against a direct computation on the real cast."""

from __future__ import annotations

import math
import os
import threading
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import dtypeaudit.values as values
from dtypeaudit import pieces
from dtypeaudit.conversion import convert
from dtypeaudit.torchcast import TorchCaster
from dtypeaudit.values import ValueCheck, ValueStats, count_nonfinite, float32_chunks


def oracle_stats(x: torch.Tensor, *, clamp: bool = False) -> dict[str, float]:
    """The range statistics from the cast itself, as the thresholds must reproduce them."""
    y = x.half()
    finite = torch.isfinite(x)
    smallest_normal = torch.finfo(torch.float16).smallest_normal
    return {
        "numel": x.numel(),
        "nonzero": int(torch.count_nonzero(x)),
        "nonfinite": int((~finite).sum()),
        "overflow": 0 if clamp else int((torch.isinf(y) & finite).sum()),
        "underflow": int(((y == 0) & (x != 0)).sum()),
        "subnormal": int(((y.abs() < smallest_normal) & (y != 0)).sum()),
        "max_abs": float(x[finite].abs().max()) if bool(finite.any()) else 0.0,
    }


def folded(x: torch.Tensor, *, clamp: bool = False) -> dict[str, float]:
    stats = ValueStats("t", str(x.dtype).removeprefix("torch."), "float16")
    raw = x.contiguous().view(torch.uint8).numpy().tobytes()
    check = ValueCheck()
    for chunk, original in float32_chunks(raw, stats.source, 0, x.numel()):
        check.fold(stats, chunk, original, clamp=clamp)
    return {k: getattr(stats, k) for k in ("numel", "nonzero", "nonfinite", "overflow", "underflow", "subnormal", "max_abs")}


def around(value: float, ulps: int = 40) -> torch.Tensor:
    """float32 values from ``ulps`` steps below to ``ulps`` steps above ``value``, both signs."""
    bits = int(np.float32(value).view(np.uint32))
    pattern = np.arange(bits - ulps, bits + ulps + 1, dtype=np.uint32).view(np.float32)
    return torch.from_numpy(np.concatenate([pattern, -pattern]))


@pytest.mark.parametrize(
    "edge",
    [65504.0, 65520.0, 2.0**-25, 2.0**-24, 2.0**-14 - 2.0**-25, 2.0**-14, 1.0],
    ids=["max", "inf-tie", "zero-tie", "smallest-subnormal", "normal-tie", "smallest-normal", "one"],
)
def test_thresholds_match_torch_around_every_edge(edge: float) -> None:
    x = around(edge)
    assert folded(x) == oracle_stats(x)


def test_every_exponent_and_the_specials() -> None:
    rng = np.random.default_rng(0)
    exponents = np.repeat(np.arange(256, dtype=np.uint32), 64)
    mantissas = rng.integers(0, 1 << 23, exponents.size, dtype=np.uint32)
    signs = rng.integers(0, 2, exponents.size, dtype=np.uint32) << 31
    x = torch.from_numpy((signs | (exponents << 23) | mantissas).view(np.float32))  # includes inf and NaN patterns
    x = torch.cat([x, torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan")])])
    assert folded(x) == oracle_stats(x)
    assert folded(x, clamp=True) == oracle_stats(x, clamp=True)


def test_chunking_does_not_change_the_counts() -> None:
    x = torch.randn(3 * values.CHUNK_BYTES // 4 + 17) * 0.02
    x[5] = 1e5
    x[-1] = 1e-30
    assert folded(x) == oracle_stats(x)


def test_double_goes_through_float32_as_torch_does() -> None:
    # Just above the float16 tie between 1 and 1 + 2^-10: float32 rounds it onto the tie, which goes to even.
    x = torch.tensor([1 + 2**-11 + 2**-40, 1e39, -1e39, 2.0**-25 + 2.0**-60, 3.0], dtype=torch.float64)
    assert x.half()[0] == 1.0  # torch rounds twice (double -> float -> half)
    got = folded(x)
    assert got == oracle_stats(x)
    assert got["overflow"] == 2 and got["nonfinite"] == 0 and got["max_abs"] == 1e39


def test_bfloat16_source() -> None:
    x = torch.cat([around(2.0**-25, 3), torch.tensor([70000.0, 1.0])]).to(torch.bfloat16)
    assert folded(x) == oracle_stats(x.float())


def specials(source: torch.dtype) -> torch.Tensor:
    """Values at every edge a cast to float16, bfloat16 or float32 has, NaN and Inf, in ``source``."""
    edges = [65504.0, 65520.0, 3.3895313892515355e38, 3.3961775292304e38, 3.4028234663852886e38, 1.0, 2.0**-25, 2.0**-133]
    x = torch.cat([around(e, 3) for e in edges] + [torch.tensor([0.0, float("inf"), -float("inf"), float("nan")])])
    if source == torch.float64:  # doubles beyond float32's range, and either side of the ties in double precision
        wide = torch.tensor(
            [1e39, -1e300, 3.4028235677973366e38, 3.4028235677973362e38, 3.3961775292304e38 * (1 - 2**-40)], dtype=torch.float64
        )
        return torch.cat([x.double(), wide])
    return x.to(source)


@pytest.mark.parametrize("source", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("target", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("clamp", [False, True])
def test_nonfinite_and_overflow_for_every_target(source: torch.dtype, target: torch.dtype, clamp: bool) -> None:
    """NaN/Inf and overflow are counted for every cast (a NaN is as lost in bfloat16 as in float16), and for a
    tensor written as it is (source == target: nothing can overflow)."""
    x = specials(source)
    name, to = str(source).removeprefix("torch."), str(target).removeprefix("torch.")
    stats = ValueStats("t", name, to)
    check = ValueCheck()
    for chunk, original in float32_chunks(x.contiguous().view(torch.uint8).numpy().tobytes(), name, 0, x.numel()):
        check.fold(stats, chunk, original, clamp=clamp)
    finite = torch.isfinite(x)
    overflow = 0 if clamp else int((torch.isinf(x.to(target)) & finite).sum())
    assert (stats.numel, stats.nonfinite, stats.overflow) == (x.numel(), int((~finite).sum()), overflow)
    assert stats.max_abs == float(x[finite].double().abs().max())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_count_nonfinite(dtype: torch.dtype) -> None:
    x = torch.tensor([1.0, float("nan"), -float("inf"), 0.0, float("inf"), -2.0], dtype=dtype)
    raw = x.view(torch.uint8).numpy().tobytes()
    assert count_nonfinite(raw, str(dtype).removeprefix("torch."), 0, x.numel()) == 3


@pytest.mark.parametrize(
    ("source", "target"), [("float32", "float16"), ("float32", "bfloat16"), ("float64", "float32"), ("float16", "float32")]
)
def test_caster_is_torchs_cast_and_measures_its_errors(source: str, target: str) -> None:
    x = (torch.randn(values.CHUNK_BYTES // 2 + 5, dtype=torch.float64) * 0.02).to(getattr(torch, source))
    x[:100] = 0
    x[100] = 1e-9  # underflows in float16: relative error 1
    stats = ValueStats("t", source, target)
    cast = TorchCaster(source, target, clamp=False, stats=stats)
    step = values.CHUNK_BYTES // x.element_size()
    pieces = [cast(piece).clone() for piece in x.split(step)]
    y = torch.cat(pieces)
    assert torch.equal(y.view(torch.uint8), x.to(getattr(torch, target)).view(torch.uint8))
    diff = (y.to(x.dtype) - x).abs()
    assert stats.max_abs_error == float(diff.max())
    rel = diff / x.abs().clamp_min(torch.finfo(x.dtype).tiny)
    assert stats.max_rel_error == float(rel.max())


def test_relative_error_without_underflow_is_measured_exactly() -> None:
    x = torch.tensor([1.0 + 2**-12, 3.0, 1000.1, -7.3e-3])
    stats = ValueStats("t", "float32", "float16")
    TorchCaster("float32", "float16", clamp=False, stats=stats)(x)
    y = x.half().float()
    assert stats.max_rel_error == float(((y - x).abs() / x.abs()).max()) and 0 < stats.max_rel_error < 1e-3


def test_clamped_cast_measures_finite_errors() -> None:
    x = torch.tensor([1.0, 1e6, -float("inf"), 2.0])
    stats = ValueStats("t", "float32", "float16")
    y = TorchCaster("float32", "float16", clamp=True, stats=stats)(x)
    assert y.tolist() == [1.0, 65504.0, -65504.0, 2.0]
    assert stats.max_abs_error == 1e6 - 65504 and math.isclose(stats.max_rel_error, (1e6 - 65504) / 1e6, rel_tol=1e-6)


def bits(exponents: np.ndarray, mantissas: np.ndarray, signs: np.ndarray) -> torch.Tensor:
    pattern = (signs.astype(np.uint32) << 31) | (exponents.astype(np.uint32) << 23) | mantissas.astype(np.uint32)
    return torch.from_numpy(pattern.view(np.float32))


def adversarial(target: str, region: str) -> torch.Tensor:
    """float32 values that stress rounding to ``target``: random mantissas, exact ties, a step either side."""
    rng = np.random.default_rng(7)
    drop = 13 if target == "float16" else 16
    low, high = {"normal": (113, 143) if target == "float16" else (1, 255), "small": (90, 113), "all": (0, 256)}[region]
    exponents = rng.integers(low, high, 20000)
    mantissas = rng.integers(0, 1 << 23, exponents.size)
    half = 1 << (drop - 1)
    tie = (mantissas >> drop << drop) | half  # exactly halfway between two neighbours in the target
    near = np.concatenate([tie, tie - 1, tie + 1, mantissas])
    signs = rng.integers(0, 2, near.size)
    return bits(np.tile(exponents, 4), near, signs)


def bit_errors(x: torch.Tensor, target: str, clamp: bool) -> tuple[float, float]:
    stats = ValueStats("t", "float32", target)
    check = ValueCheck()
    for chunk, original in float32_chunks(x.numpy().tobytes(), "float32", 0, x.numel()):
        check.fold(stats, chunk, original, clamp=clamp)
    assert stats.errors_measured
    return stats.max_abs_error, stats.max_rel_error


def torch_errors(x: torch.Tensor, target: str, clamp: bool) -> tuple[float, float]:
    stats = ValueStats("t", "float32", target)
    cast = TorchCaster("float32", target, clamp=clamp, stats=stats)
    for piece in x.split(values.CHUNK_BYTES // 4):
        cast(piece)
    return stats.max_abs_error, stats.max_rel_error


@pytest.mark.parametrize("target", ["float16", "bfloat16"])
@pytest.mark.parametrize("region", ["normal", "small", "all"])
@pytest.mark.parametrize("clamp", [False, True])
def test_errors_from_bits_equal_errors_measured_on_torchs_cast(target: str, region: str, clamp: bool) -> None:
    x = adversarial(target, region)
    got = bit_errors(x, target, clamp)
    assert got == torch_errors(x, target, clamp)
    if region == "normal":  # no underflow: the relative error is measured, not capped at 1
        assert 0 < got[1] < 0.01


@pytest.mark.parametrize("target", ["float16", "bfloat16"])
def test_errors_on_weight_like_values_take_the_shortcuts_and_stay_exact(target: str, monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4 * values.CHUNK_BYTES // 4, generator=g) * 0.02
    full_passes: list[int] = []
    real = ValueCheck._errors
    monkeypatch.setattr(ValueCheck, "_errors", lambda self, m, t, c: full_passes.append(len(m)) or real(self, m, t, c))
    assert bit_errors(x, target, False) == torch_errors(x, target, False)
    if target == "float16":  # the top binade and the subnormal range decide; no chunk is measured whole
        assert max(full_passes) < values.CHUNK_BYTES // 4 // 10


def test_a_top_binade_without_error_sends_the_check_to_every_value() -> None:
    x = torch.tensor([1.0, -1.0] + [0.7 + k * 1e-6 for k in range(50)] + [3e-6, 1e-7])
    for target in ("float16", "bfloat16"):
        assert bit_errors(x, target, False) == torch_errors(x, target, False)


def test_errors_per_value_match_one_by_one() -> None:
    """A single-value check catches an error that a max over many values could hide."""
    for target in ("float16", "bfloat16"):
        for value in adversarial(target, "all")[::997].tolist() + [65519.9, 65520.0, 1e-8, 2.0**-25, 3e38, -0.0]:
            x = torch.tensor([value], dtype=torch.float32)
            assert bit_errors(x, target, True) == torch_errors(x, target, True), (target, value)


def _threads(monkeypatch: pytest.MonkeyPatch, n: int) -> list[str]:
    """Make every conversion's pieces on ``n`` threads, in pieces of one chunk (many pieces, as a large
    checkpoint's are); the names of the threads that made each piece, recorded."""
    made_on: list[str] = []
    real = pieces.Maker.make

    def make(self: pieces.Maker, piece: pieces.Piece) -> Any:
        made_on.append(threading.current_thread().name)
        return real(self, piece)

    monkeypatch.setattr(pieces, "thread_count", lambda most=4: n)
    monkeypatch.setattr(pieces, "PIECE_ELEMENTS", pieces.CHUNK_ELEMENTS)
    monkeypatch.setattr(pieces.Maker, "make", make)
    return made_on


def test_value_checks_on_the_pool_match_one_thread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The checks folded piece by piece on several threads, merged in record order, are the figures one thread's
    pass gives, and the verdicts with them."""
    src = tmp_path / "m.pt"
    g = torch.Generator().manual_seed(1)
    state = {f"w{i}": torch.randn(300, 200, generator=g) * 10.0 ** (-i) for i in range(8)}
    state["emb"] = torch.randn(3 << 20, generator=g) * 0.02  # twelve pieces of one chunk
    state["big"] = torch.tensor([1.0, 7e4, -2e5])
    state["d"] = torch.randn(50, dtype=torch.float64) * 1e-8
    torch.save(state, src)
    on_one = _threads(monkeypatch, 1)
    alone = convert(src, "fp16", dry_run=True)
    assert set(on_one) == {threading.current_thread().name}  # one thread: the caller's own, no pool
    on_pool = _threads(monkeypatch, 3)
    pooled = convert(src, "fp16", dry_run=True)
    assert len(on_pool) > 12 and all(name.startswith("dtypeaudit-work") for name in on_pool)
    assert [vars(s) for s in pooled.plan.values.values()] == [vars(s) for s in alone.plan.values.values()]
    unsafe = {s.name: s for s in pooled.unsafe}
    assert set(unsafe) == {"big", "w6", "w7", "d"}  # overflow; more than 1% flushed to zero
    assert unsafe["big"].overflow == 2 and unsafe["w6"].underflow_fraction > 0.01


def _mapped(path: Path) -> tuple[Any, Any]:
    """A ``view(path, offset, length)`` over one file mapped read-only, and its closer."""
    import mmap

    with path.open("rb") as fh:
        mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)

    def view(name: str, offset: int, length: int) -> memoryview:
        if name != str(path):
            raise FileNotFoundError(name)
        return memoryview(mm)[offset : offset + length]

    return view, mm.close


def test_progress_moves_within_a_large_tensor(tmp_path: Path) -> None:
    """A bar that only moves when a whole tensor is done sits still for seconds on an embedding: progress is
    reported piece by piece, from every thread, and the reports add up to exactly the bytes checked."""
    import json
    import struct

    from safetensors.torch import save_file

    src = tmp_path / "big.safetensors"
    save_file({"emb": torch.randn(10 << 20) * 0.02, "b": torch.ones(5)}, str(src))
    raw = src.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + size])
    jobs = [
        pieces.Job(str(src), 8 + size + h["data_offsets"][0], h["data_offsets"][1] - h["data_offsets"][0], "float32", "float16", unit=name)
        for name, h in header.items()
        if name != "__metadata__"
    ]
    stats = {j.unit: values.ValueStats(str(j.unit), "float32", "float16") for j in jobs}
    seen: list[int] = []
    view, unmap = _mapped(src)
    try:
        with pieces.Workers(clamp=False, view=view, checks=stats, threads=2) as workers:
            workers.run(jobs, progress=seen.append)
    finally:
        unmap()
    assert sum(seen) == sum(j.length for j in jobs) == (10 << 20) * 4 + 20
    assert len(seen) >= (10 << 20) * 4 // (pieces.PIECE_ELEMENTS * 4) + 1
    assert stats["emb"].numel == 10 << 20 and stats["b"].numel == 5 and stats["b"].nonzero == 5
    whole = values.ValueStats("emb", "float32", "float16")  # the same values, folded in one pass here
    check = values.ValueCheck()
    x = torch.frombuffer(
        bytearray(raw[8 + size + header["emb"]["data_offsets"][0] : 8 + size + header["emb"]["data_offsets"][1]]), dtype=torch.float32
    ).numpy()
    for first in range(0, len(x), pieces.CHUNK_ELEMENTS):
        chunk = x[first : first + pieces.CHUNK_ELEMENTS]
        check.fold(whole, chunk, chunk)
    assert vars(stats["emb"]) | {"name": "emb"} == vars(whole)


@pytest.mark.parametrize("target", ["float16", "bfloat16"])
def test_relative_error_of_normal_values_needs_no_full_pass_and_stays_exact(target: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Normal values' relative error is found from a few candidates, whatever the first values look like: exact
    ones (every value then a candidate), a weak sample, or the worst value last; always equal to torch's figure."""
    g = torch.Generator().manual_seed(11)
    weights = torch.randn(values.CHUNK_BYTES // 4 - 8192, generator=g) * 0.02
    exact = torch.full((8192,), 2.0**-8)  # representable in both targets, and below the weights' top binade
    worst = bits(np.array([120]), np.array([1 << 15 if target == "bfloat16" else 1 << 12]), np.array([0]))
    full_passes: list[int] = []
    real = ValueCheck._errors
    monkeypatch.setattr(ValueCheck, "_errors", lambda self, m, t, c: full_passes.append(len(m)) or real(self, m, t, c))
    for x in (torch.cat([exact, weights]), torch.cat([weights, exact]), torch.cat([weights, worst])):
        assert bit_errors(x, target, False) == torch_errors(x, target, False)
    assert max(full_passes) < values.CHUNK_BYTES // 4 // 10
    half = 1 << (12 if target == "float16" else 15)  # half a step of the target: a tie, on the smallest such mantissa
    largest = float(np.float32(half) / np.float32((1 << 23) + half))  # the largest relative error a normal value can have
    assert bit_errors(worst, target, False)[1] == torch_errors(worst, target, False)[1] == largest
    if target == "bfloat16":  # (float16 flushes some weights to zero: a relative error of 1)
        assert bit_errors(torch.cat([weights, worst]), target, False)[1] == largest


def test_runs_fold_into_the_same_checks_and_leave_no_thread_or_descriptor(tmp_path: Path) -> None:
    """Two runs in one context fold into the same statistics; after each, no thread of the pool is left and the
    outputs its makers opened are closed. An error in a piece is raised here, after the threads stop."""
    src, out = tmp_path / "x.bin", tmp_path / "out.bin"
    src.write_bytes(np.random.default_rng(1).standard_normal(1 << 20).astype(np.float32).tobytes())
    out.write_bytes(bytes(2 << 20))
    stats = {"x": values.ValueStats("x", "float32", "float16")}
    job = pieces.Job(str(src), 0, 4 << 20, "float32", "float16", out=str(out), unit="x")
    fds = len(os.listdir("/proc/self/fd"))
    view, unmap = _mapped(src)
    try:
        with pieces.Workers(clamp=False, view=view, checks=stats, threads=2) as workers:
            first = workers.run([job])
            assert not [t for t in threading.enumerate() if t.name.startswith("dtypeaudit-work")]
            assert workers.run([job]) == first
            with pytest.raises(FileNotFoundError, match="missing"):  # raised in a worker, surfaced here
                workers.run([pieces.Job("missing", 0, 8, "float32", "float16", unit="x")])
            assert not [t for t in threading.enumerate() if t.name.startswith("dtypeaudit-work")]
    finally:
        unmap()
    assert len(os.listdir("/proc/self/fd")) == fds
    assert stats["x"].numel == 2 << 20  # both runs folded, the failed one not at all
    assert first == [zlib.crc32(torch.frombuffer(bytearray(src.read_bytes()), dtype=torch.float32).half().numpy().tobytes())]
