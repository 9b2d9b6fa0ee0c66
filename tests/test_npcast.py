"""npcast's casts (ml_dtypes' for bfloat16) against torch's own ``Tensor.to`` on this CPU: bit-equal for every
non-NaN value of every pair, and for float32 to float16 and bfloat16 for NaNs too, contiguous, unaligned or
strided; and a conversion's fold-then-cast gives torch's bytes and torch's measure of the cast's errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dtypeaudit import npcast
from dtypeaudit.conversion.verify import reference_cast
from dtypeaudit.values import CHUNK_BYTES, ValueCheck, ValueStats

TORCH = {"float64": torch.float64, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
PAIRS = [(s, t) for s in TORCH for t in TORCH]


def float32_boundaries() -> np.ndarray:
    """Every float32 high half (sign, exponent, 7 mantissa bits) with low halves at and around every rounding
    boundary of float16 (13 dropped bits) and bfloat16 (16): ties, one under, one over, and extremes."""
    high = np.arange(1 << 16, dtype=np.uint32) << 16
    lows = np.array([0, 1, 0x0FFF, 0x1000, 0x1001, 0x1FFF, 0x2000, 0x2001, 0x7FFF, 0x8000, 0x8001, 0xFFFF], np.uint32)
    bits = (high[:, None] | lows[None, :]).reshape(-1)
    rng = np.random.default_rng(7)
    bits = np.concatenate([bits, rng.integers(0, 1 << 32, 1 << 20, dtype=np.uint64).astype(np.uint32)])
    return bits.view(np.float32)


def source_values(source: str) -> np.ndarray:
    if source in ("float16", "bfloat16"):  # every pattern
        return np.arange(1 << 16, dtype=np.uint16).view(npcast.storage_dtype(source))
    f32 = float32_boundaries()
    if source == "float32":
        return f32
    rng = np.random.default_rng(11)  # doubles: float32 boundaries widened, plus random bits, plus out of float32's range
    extra = rng.integers(0, 1 << 63, 1 << 18, dtype=np.uint64).view(np.float64)
    with np.errstate(invalid="ignore"):
        return np.concatenate([f32.astype(np.float64), extra, np.array([1e39, -1e39, 3.5e38, 65519.99, 65520.0])])


def torch_bits(x: np.ndarray, source: str, target: str, clamp: bool) -> np.ndarray:
    t = torch.from_numpy(x.copy()).view(TORCH[source])
    if clamp:
        largest = torch.finfo(TORCH[target]).max
        if largest < torch.finfo(TORCH[source]).max:
            # bfloat16 cannot hold float16's 65504 (it rounds to 65536, which becomes inf): clamp it widened
            t = (t.float() if source == "bfloat16" else t).clamp(-largest, largest)
    return t.to(TORCH[target]).view({8: torch.int64, 4: torch.int32, 2: torch.int16}[TORCH[target].itemsize]).numpy()


def as_float(bits: np.ndarray, target: str) -> np.ndarray:
    if target == "bfloat16":
        return (bits.astype(np.uint32) << 16).view(np.float32)
    return bits.view(npcast.storage_dtype(target))


def assert_same(ours: np.ndarray, theirs: np.ndarray, target: str, *, nan_bits: bool = True) -> None:
    width = {"float64": np.uint64, "float32": np.uint32, "float16": np.uint16, "bfloat16": np.uint16}[target]
    ours_bits, theirs_bits = ours.view(width), theirs.view(width)
    nan_ours, nan_theirs = np.isnan(as_float(ours_bits, target)), np.isnan(as_float(theirs_bits, target))
    assert np.array_equal(nan_ours, nan_theirs)
    # NaN bits too, as torch's vectorised loop writes them; its scalar loop casts the last few elements otherwise
    body = (np.arange(len(ours_bits)) < len(ours_bits) - 32) & nan_bits
    differ = np.flatnonzero((ours_bits != theirs_bits) & (~nan_theirs | body))
    assert differ.size == 0, f"{differ.size} values differ, first at {differ[:5]}: {ours_bits[differ[:5]]} vs {theirs_bits[differ[:5]]}"


@pytest.mark.parametrize("clamp", [False, True], ids=["plain", "clamp"])
@pytest.mark.parametrize(("source", "target"), PAIRS, ids=[f"{s}-{t}" for s, t in PAIRS])
def test_cast_is_bit_equal_to_torch(source: str, target: str, clamp: bool) -> None:
    x = source_values(source)
    with np.errstate(all="ignore"):
        ours = npcast.cast(x, source, target, clamp=clamp)
    assert ours.dtype == npcast.storage_dtype(target)
    # torch's casts from float16 go through other loops (a signalling NaN quieted on widening, 0x7FC0 for bfloat16)
    assert_same(ours, torch_bits(x, source, target, clamp), target, nan_bits=source != "float16")


@pytest.mark.parametrize("clamp", [False, True], ids=["plain", "clamp"])
@pytest.mark.parametrize(("source", "target"), PAIRS, ids=[f"{s}-{t}" for s, t in PAIRS])
def test_verifications_second_cast_is_bit_equal_to_torch(source: str, target: str, clamp: bool) -> None:
    """Verification's ``reference_cast`` (numpy's own float16 conversion, bfloat16 by integer rounding) gives
    torch's bits for every value but a NaN's, which only has to stay a NaN."""
    x = source_values(source)
    ours = reference_cast(x, source, target, clamp=clamp)
    assert ours.dtype == npcast.storage_dtype(target)
    assert_same(ours, torch_bits(x, source, target, clamp), target, nan_bits=False)


def test_reused_buffers_give_each_chunk_its_own_result() -> None:
    x = float32_boundaries()[: 3 * 4096]
    caster = npcast.NumpyCaster("float32", "bfloat16", capacity=4096)
    pieces = [caster(x[i : i + 4096]).copy() for i in range(0, len(x), 4096)]
    assert_same(np.concatenate(pieces), torch_bits(x, "float32", "bfloat16", False), "bfloat16")
    assert len(caster(x[:10])) == 10


@pytest.mark.parametrize("clamp", [False, True], ids=["plain", "clamp"])
@pytest.mark.parametrize("source", ["float32", "bfloat16", "float64"])
def test_float16_from_mostly_normal_chunks_with_a_few_special_values(source: str, clamp: bool) -> None:
    # Chunks of weights: float16-normal values (cast on the bits) with a few zeros, subnormals, values that round
    # up to the smallest normal or to inf, overflow, inf and NaN among them (cast by numpy, in place).
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(1 << 16) * rng.choice([1e-3, 1.0, 300.0], 1 << 16)).astype(np.float32)
    special = np.array(
        [
            0.0,
            -0.0,
            1e-8,
            -3e-6,
            2.0**-25,
            2.0**-14,
            np.float32(2.0**-14) - np.float32(2.0**-38),
            65504.0,
            65519.99,
            65520.0,
            -65520.0,
            1e6,
            np.inf,
            -np.inf,
            np.nan,
        ],
        np.float32,
    )
    x[rng.choice(len(x), 400, replace=False)] = rng.choice(special, 400)
    x[::4096] = special[np.arange(len(x[::4096])) % len(special)]
    values = {"float32": x, "float64": x.astype(np.float64), "bfloat16": (x.view(np.uint32) >> 16).astype(np.uint16)}[source]
    caster = npcast.NumpyCaster(source, "float16", clamp=clamp, capacity=4096)
    with np.errstate(all="ignore"):
        ours = np.concatenate([caster(values[i : i + 4096]).copy() for i in range(0, len(values), 4096)])
    assert_same(ours, torch_bits(values, source, "float16", clamp), "float16")


def test_a_float16_cast_given_what_a_value_check_found_is_bit_equal_to_torch() -> None:
    """Conversion folds a chunk's value checks, then casts it with what the fold found (``values.Looked``: |x|,
    its largest, the indices below float16's normal range) instead of finding it again: every float32 rounding
    boundary, chunk by chunk, comes out as torch's cast, and as the cast that finds them itself."""
    from dtypeaudit.values import ValueCheck, ValueStats

    x = float32_boundaries()
    check, stats = ValueCheck(), ValueStats("x", "float32", "float16")
    given = npcast.NumpyCaster("float32", "float16", capacity=1 << 18)
    alone = npcast.NumpyCaster("float32", "float16", capacity=1 << 18)
    ours, found = [], []
    with np.errstate(all="ignore"):
        for first in range(0, len(x), 1 << 18):
            chunk = x[first : first + (1 << 18)]
            looked = check.fold(stats, chunk, chunk)
            assert looked is not None and looked.top == int((chunk.view(np.uint32) & 0x7FFFFFFF).max())
            ours.append(given(chunk, looked).copy())
            found.append(alone(chunk).copy())
    assert np.array_equal(np.concatenate(ours).view(np.uint16), np.concatenate(found).view(np.uint16))  # NaN bits too
    assert_same(np.concatenate(ours), torch_bits(x, "float32", "float16", False), "float16")


def test_refuses_a_dtype_it_does_not_cast() -> None:
    with pytest.raises(ValueError, match="no numpy cast from int8"):
        npcast.NumpyCaster("int8", "float16", capacity=1)


@pytest.mark.slow
@pytest.mark.parametrize("target", ["float16", "bfloat16"])
def test_every_float32_value(target: str) -> None:
    caster = npcast.NumpyCaster("float32", target, capacity=1 << 24)
    for start in range(0, 1 << 32, 1 << 24):
        x = np.arange(start, start + (1 << 24), dtype=np.uint64).astype(np.uint32).view(np.float32)
        with np.errstate(all="ignore"):
            ours = caster(x)
        assert_same(ours, torch_bits(x, "float32", target, False), target)


@pytest.mark.slow
@pytest.mark.parametrize("target", ["float16", "bfloat16"])
def test_verifications_second_cast_of_every_float32_value(target: str) -> None:
    for start in range(0, 1 << 32, 1 << 24):
        x = np.arange(start, start + (1 << 24), dtype=np.uint64).astype(np.uint32).view(np.float32)
        assert_same(reference_cast(x, "float32", target), torch_bits(x, "float32", target, False), target, nan_bits=False)


# -- the engine's float32 casts, NaN bits included, against torch's on this CPU -----------------------------------


def engine_values() -> np.ndarray:
    """Every float16 value's float32 image, every float32 rounding boundary of both targets, random bit patterns,
    and the special values: NaNs of both signs with quiet, signalling and odd payloads, inf, -0, the float32
    subnormals, and the subnormal and overflow boundaries of float16 and bfloat16."""
    every_half = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)
    nans = np.array([0x7FC00000, 0x7F800001, 0x7FBFFFFF, 0x7FFFFFFF, 0x7FC12345, 0x7FA00000, 0x7F802000], np.uint32)
    special = np.concatenate([nans, nans | 0x80000000, np.array([0x7F800000, 0xFF800000, 0, 0x80000000, 1, 0x807FFFFF], np.uint32)])
    boundaries = np.array([2.0**-24, 2.0**-25, 3 * 2.0**-26, 2.0**-14, 65504.0, 65519.99, 65520.0, 3.3895313e38, 3.4028235e38], np.float32)
    return np.concatenate([every_half, float32_boundaries(), special.view(np.float32), boundaries, -boundaries])


def torch_bits_of(t: torch.Tensor, target: str) -> np.ndarray:
    return t.to(TORCH[target]).view(torch.int16).numpy().view(np.uint16)


@pytest.mark.parametrize("target", ["float16", "bfloat16"])
def test_the_engines_float32_casts_are_torchs_bits_nans_included(target: str) -> None:
    """float32 to float16 (npcast's bits) and to bfloat16 (ml_dtypes', its NaNs fixed up) give torch's own bits
    for every value, NaN payloads and signs included, whether the source is contiguous, unaligned (a zip entry
    need not be 4-aligned), strided (torch's scalar loop: bfloat16 NaN is 0x7FC0 there) or cast chunk by chunk."""
    x = engine_values()

    def ours(values: np.ndarray) -> np.ndarray:
        return npcast.cast(values, "float32", target).view(np.uint16)

    with np.errstate(all="ignore"):
        whole = ours(x)
        assert np.array_equal(whole, torch_bits_of(torch.from_numpy(x), target))
        raw = bytearray(3) + bytearray(x.tobytes())
        unaligned = np.frombuffer(raw, np.float32, len(x), 3)
        assert not unaligned.flags.aligned
        assert np.array_equal(ours(unaligned), whole)
        for step in (2, 3):
            assert np.array_equal(ours(x[::step]), torch_bits_of(torch.from_numpy(x)[::step], target)), step
        caster = npcast.NumpyCaster("float32", target, capacity=4099)
        chunked = np.concatenate([caster(x[i : i + 4099]).view(np.uint16).copy() for i in range(0, len(x), 4099)])
        assert np.array_equal(chunked, whole)
    nan = np.isnan(x)
    if target == "bfloat16":  # the NaN fix-up was exercised: ml_dtypes alone writes 0x7FC0 with the sign
        assert set(whole[nan].tolist()) == {0xFFFF}


def checked_and_cast(x: np.ndarray, target: str) -> tuple[np.ndarray, ValueStats]:
    """What a conversion's piece makes of float32 values: each chunk's value checks folded (``values.ValueCheck``),
    then cast with what the fold found."""
    stats, check, step = ValueStats("", "float32", target), ValueCheck(), CHUNK_BYTES // 4
    cast = npcast.NumpyCaster("float32", target, capacity=step)
    out = []
    with np.errstate(all="ignore"):
        for first in range(0, len(x), step):
            chunk = x[first : first + step]
            out.append(cast(chunk, check.fold(stats, chunk, chunk)).copy())
    return np.concatenate(out).view(np.uint16), stats


@pytest.mark.parametrize("target", ["float16", "bfloat16"])
def test_checks_and_cast_give_torchs_bytes_and_errors(target: str) -> None:
    """Through the value checks, as a conversion makes them: every value casts to torch's own bits, and the two
    errors are torch's float32 measure of its cast (``|y - x|``, then over ``max(|x|, tiny)``, inf differences
    left out); the overflow and non-finite counts are torch's too."""
    rng = np.random.default_rng(18)
    random_bits = rng.integers(0, 1 << 32, 300_001, dtype=np.uint32).view(np.float32)
    weights = (rng.standard_normal(200_000) * 0.02).astype(np.float32)
    x = np.concatenate([engine_values(), random_bits, weights])
    got, stats = checked_and_cast(x, target)
    t = torch.from_numpy(x)
    y = t.to(TORCH[target])
    assert np.array_equal(got, y.view(torch.int16).numpy().view(np.uint16))
    finite = torch.isfinite(t) & torch.isfinite(y.float())
    error = (y.float() - t).abs()[finite]
    relative = error / t.abs()[finite].clamp(min=torch.finfo(torch.float32).tiny)
    assert stats.max_abs_error == float(error.max())
    assert stats.max_rel_error == float(relative.max())
    assert stats.overflow == int((torch.isinf(y) & torch.isfinite(t)).sum())
    assert stats.nonfinite == int((~torch.isfinite(t)).sum())
