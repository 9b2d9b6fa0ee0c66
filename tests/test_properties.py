"""Laws, checked on random inputs: our inventory is torch's own; damaged files give a clean error or a true inventory."""

from __future__ import annotations

import io
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dtypeaudit.errors import DtypeAuditError
from dtypeaudit.formats import read_checkpoint

from . import oracle
from .helpers import facts, sharing

DTYPES = [getattr(torch, n) for n in oracle.SAVABLE_DTYPES]
shapes = st.lists(st.integers(min_value=0, max_value=4), min_size=0, max_size=3).map(tuple)


@st.composite
def tensors(draw: st.DrawFn, pool: list[torch.Tensor]) -> torch.Tensor:
    """A fresh tensor, a view of one drawn before (sharing its storage), or the very same tensor again."""
    choice = draw(st.sampled_from(["fresh", "fresh", "view", "same"])) if pool else "fresh"
    if choice == "fresh":
        dtype = draw(st.sampled_from(DTYPES))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t = torch.empty(draw(shapes), dtype=dtype)
        if draw(st.booleans()) and dtype.is_floating_point and t.numel():
            t = torch.nn.Parameter(t, requires_grad=False)
        pool.append(t)
        return t
    base = draw(st.sampled_from(pool))
    if choice == "same" or base.numel() == 0 or base.dim() == 0:
        return base
    flat = base.detach().reshape(-1) if base.is_contiguous() else base.detach()
    if flat.dim() != 1:
        return flat
    start = draw(st.integers(min_value=0, max_value=flat.numel() - 1))
    return flat[start:]


@st.composite
def checkpoints(draw: st.DrawFn) -> object:
    pool: list[torch.Tensor] = []
    keys = st.text(alphabet="abcxyz_0123", min_size=1, max_size=6)

    def node(depth: int) -> object:
        kind = draw(st.sampled_from(["tensor", "tensor", "dict", "list", "scalar"] if depth < 3 else ["tensor", "scalar"]))
        if kind == "tensor":
            return draw(tensors(pool))
        if kind == "scalar":
            return draw(st.one_of(st.integers(), st.text(max_size=5), st.none(), st.floats(allow_nan=False)))
        if kind == "dict":
            return {k: node(depth + 1) for k in draw(st.lists(keys, max_size=4, unique=True))}
        return [node(depth + 1) for _ in range(draw(st.integers(0, 3)))]

    return {k: node(1) for k in draw(st.lists(keys, min_size=1, max_size=5, unique=True))}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(obj=checkpoints(), legacy=st.booleans())
def test_inventory_equals_torch(tmp_path: Path, obj: object, legacy: bool) -> None:
    path = tmp_path / "random.pt"
    if legacy and any(
        t.dtype in (torch.uint16, torch.uint32, torch.uint64, torch.bits8, torch.bits16, torch.complex32)
        or "float8" in str(t.dtype)
        or "float4" in str(t.dtype)
        for t in oracle.walk(obj).values()
    ):
        legacy = False  # the legacy format predates these dtypes
    torch.save(obj, path, _use_new_zipfile_serialization=not legacy)
    inv = read_checkpoint(path)
    expected = oracle.load(path)
    assert facts(inv) == oracle.facts(expected)
    assert sharing(inv) == oracle.sharing(expected)
    by = inv.by_name()
    for name, t in expected.items():
        assert by[name].nbytes == t.numel() * t.element_size()
        if t.layout == torch.strided:
            assert by[name].offset == t.storage_offset() and by[name].stride == t.stride()


def _valid_file() -> bytes:
    buf = io.BytesIO()
    torch.save({"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "n": {"b": torch.ones(2, dtype=torch.bfloat16)}, "e": 3}, buf)
    return buf.getvalue()


VALID = _valid_file()


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_mutations_give_a_clean_error_or_a_true_inventory(tmp_path: Path, data: st.DataObject) -> None:
    blob = bytearray(VALID)
    for _ in range(data.draw(st.integers(1, 8))):
        pos = data.draw(st.integers(0, len(blob) - 1))
        op = data.draw(st.sampled_from(["flip", "set", "cut", "dup"]))
        if op == "flip":
            blob[pos] ^= 1 << data.draw(st.integers(0, 7))
        elif op == "set":
            blob[pos] = data.draw(st.integers(0, 255))
        elif op == "cut":
            del blob[pos : pos + data.draw(st.integers(1, 64))]
        else:
            blob[pos:pos] = blob[pos : pos + data.draw(st.integers(1, 32))]
    path = tmp_path / "mutant.pt"
    path.write_bytes(bytes(blob))
    try:
        inv = read_checkpoint(path)
    except DtypeAuditError as exc:
        assert exc.one_line().startswith(str(path)) and "\n" not in exc.one_line()
        return
    # It read: whatever torch can load of it must agree with what we listed.
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loaded = oracle.load(path)
    except Exception:
        return  # torch refuses it: our inventory is at most a description of a file torch will not load
    got = facts(inv)
    assert set(got) == set(loaded), "the two readers list different tensors"
    for name, t in loaded.items():
        assert got[name][0] == str(t.dtype)[6:] and got[name][1] == tuple(t.shape)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    blob=st.binary(max_size=2048),
    prefix=st.sampled_from([b"", b"PK\x03\x04", b"\x80\x02", b"\x80\x02\x8a\x0a", b"\x10\x00\x00\x00\x00\x00\x00\x00{"]),
)
def test_random_bytes_give_a_clean_answer(tmp_path: Path, blob: bytes, prefix: bytes) -> None:
    path = tmp_path / "random.bin"
    path.write_bytes(prefix + blob)
    try:
        read_checkpoint(path)
    except DtypeAuditError as exc:
        assert "\n" not in exc.one_line()


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_pickle_protocols_match_cpython(protocol: int) -> None:
    import pickle

    from dtypeaudit.formats.picklevm import PickleVM
    from dtypeaudit.formats.torchpickle import REDUCERS

    value = {"a": [1, 2.5, "x", b"\x00\xff", None, True], "b": (1, (2, 3)), "c": {1, 2}, "d": frozenset({"z"})}
    assert PickleVM(pickle.dumps(value, protocol=protocol), reducers=REDUCERS).load()[0] == value
