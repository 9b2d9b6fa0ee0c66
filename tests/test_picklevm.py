"""The pickle interpreter agrees with CPython's unpickler on plain data, and refuses what it must."""

from __future__ import annotations

import pickle
import pickletools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dtypeaudit.errors import CheckpointError, LimitExceeded
from dtypeaudit.formats.picklevm import Global, Limits, Opaque, PickleVM
from dtypeaudit.formats.torchpickle import REDUCERS

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.floats(allow_nan=False),
    st.text(max_size=20),
    st.binary(max_size=20),
)
data = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=5),
        st.tuples(children, children),
        st.dictionaries(st.one_of(st.text(max_size=8), st.integers()), children, max_size=5),
    ),
    max_leaves=30,
)


def vm_load(blob: bytes, **kw: object) -> object:
    return PickleVM(blob, **kw).load()[0]  # type: ignore[arg-type]


@settings(max_examples=300, deadline=None)
@given(value=data, protocol=st.integers(min_value=0, max_value=5))
def test_plain_data_round_trips_like_pickle(value: object, protocol: int) -> None:
    blob = pickle.dumps(value, protocol=protocol)
    ours = PickleVM(blob, reducers=REDUCERS).load()[0]
    assert ours == pickle.loads(blob)


@settings(max_examples=200, deadline=None)
@given(value=data, protocol=st.integers(min_value=2, max_value=5))
def test_optimized_pickles_with_memo_sharing(value: object, protocol: int) -> None:
    blob = pickletools.optimize(pickle.dumps([value, value], protocol=protocol))
    ours = PickleVM(blob, reducers=REDUCERS).load()[0]
    assert ours == pickle.loads(blob)


def test_sets_and_frozensets() -> None:
    for protocol in range(4, 6):
        blob = pickle.dumps({"s": {1, 2}, "f": frozenset({3})}, protocol=protocol)
        assert vm_load(blob) == {"s": {1, 2}, "f": frozenset({3})}


def test_globals_are_names_and_calls_are_opaque() -> None:
    blob = b"\x80\x02cos\nsystem\nX\x02\x00\x00\x00lsq\x00\x85R."
    vm = PickleVM(blob)
    value, _ = vm.load()
    assert isinstance(value, Opaque) and value.callable == Global("os", "system") and value.args == ("ls",)
    assert "os.system" in vm.trace.calls


def test_stack_global_through_memo() -> None:
    # STACK_GLOBAL whose module and name strings come back from the memo.
    blob = b"\x80\x04\x8c\x02os\x94\x8c\x06system\x94h\x00h\x01\x93\x8c\x02id\x85R."
    vm = PickleVM(blob)
    value, _ = vm.load()
    assert isinstance(value, Opaque) and value.qualname == "os.system"


@pytest.mark.parametrize(
    ("blob", "message"),
    [
        (b"\x80\x02}q\x00(K\x01K\x02", "without a STOP"),
        (b"\x80\x02K\x00K\x01K\x02s.", "SETITEM on a int"),
        (b"\x80\x02X\xff\xff\x00\x00abc.", "runs past the end"),
        (b"\x80\x02h\x05.", "memo entry 5 is read before"),
        (b"\x80\x02\xff.", "unknown opcode"),
        (b"\x80\x02\x82\x01.", "EXT1 is not supported"),
        (b"\x80\x05\x97.", "NEXT_BUFFER is not supported"),
        (b"\x80\x02(.", "stack underflow"),
        (b"\x80\x02K\x01Q.", "persistent id appears"),
        (b"\x80\x09N.", "unsupported pickle protocol 9"),
    ],
)
def test_malformed_pickles_fail_closed(blob: bytes, message: str) -> None:
    with pytest.raises(CheckpointError, match=message):
        vm_load(blob)


def test_limits_bound_hostile_cost() -> None:
    with pytest.raises(LimitExceeded, match="opcodes"):
        vm_load(b"\x80\x02" + b"N0" * 100 + b"N.", limits=Limits(max_opcodes=50))
    with pytest.raises(LimitExceeded, match="memo"):
        vm_load(b"\x80\x02" + b"N\x94" * 100 + b".", limits=Limits(max_memo=10))
    with pytest.raises(LimitExceeded, match="nests deeper"):
        vm_load(b"\x80\x02" + b"(" * 2000 + b"N.")
    with pytest.raises(LimitExceeded, match="over the cap"):
        vm_load(b"\x80\x02\x8b\xff\xff\xff\x00.")
