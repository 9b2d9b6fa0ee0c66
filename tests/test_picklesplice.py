"""The rewrite of a torch.save pickle by editing the opcodes that name its storage types (formats/picklesplice.py).

Every source here is written by torch.save, converted by ``convert``, and the output compared with what torch
loads: ``torch.load(out, weights_only=True)`` (the default loader) against ``.half()`` / ``.bfloat16()`` of the
source's tensors. The output's pickle must differ from the source's only by the edits: a storage type's memo read
or GLOBAL turned into ``GLOBAL torch <NewStorage>``, POP + GLOBAL after a STACK_GLOBAL, a legacy record's NONE gone.
"""

from __future__ import annotations

import io
import pickle
import pickletools
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from dtypeaudit.conversion import convert
from dtypeaudit.conversion import write as conversion_write
from dtypeaudit.formats import read_checkpoint

CAST = {"fp16": torch.float16, "bf16": torch.bfloat16}
STORAGE = {"fp16": "HalfStorage", "bf16": "BFloat16Storage"}


@pytest.fixture
def spliced_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail if a conversion re-emits the pickle from a second run instead of editing it."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the pickle was re-emitted from a second run")

    monkeypatch.setattr(conversion_write, "_reemitted", refuse)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.LayerNorm(4)
        self.lin = nn.Linear(4, 3)
        self.norm = nn.LayerNorm(3)
        self.bn = nn.BatchNorm1d(3)  # num_batches_tracked: an int64 buffer
        self.head = nn.Linear(3, 4, bias=False)


def _state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    sd = Net().state_dict()
    sd["tied"] = sd["lin.weight"]  # the same tensor under two names
    sd["row"] = sd["head.weight"][1]  # a view: several tensors on one storage
    return sd


def _pickle_of(path: Path) -> bytes:
    with zipfile.ZipFile(path) as z:
        (name,) = [n for n in z.namelist() if n.endswith("/data.pkl")]
        return z.read(name)


def _legacy_pickle(path: Path) -> bytes:
    layout = read_checkpoint(path).layout
    assert layout is not None
    return path.read_bytes()[layout.pickle_offset : layout.pickle_end]


def _ops(data: bytes) -> list[tuple[str, Any]]:
    # a FRAME's length is the one argument an edit inside the frame changes
    return [(op.name, None if op.name == "FRAME" else arg) for op, arg, _ in pickletools.genops(data)]


def _names_storage(op: tuple[str, Any]) -> bool:
    return op[0] == "GLOBAL" and op[1].startswith("torch ") and op[1].endswith("Storage")


Ops = list[tuple[str, Any]]


def _edits(before: bytes, after: bytes) -> list[tuple[Ops, Ops]]:
    """Where ``after``'s opcodes differ from ``before``'s, as (what was there, what is there now); fails on any
    difference other than an edit the splice makes."""
    a, b = _ops(before), _ops(after)
    i = j = 0
    edits: list[tuple[Ops, Ops]] = []
    while i < len(a) or j < len(b):
        if i < len(a) and j < len(b) and a[i] == b[j]:
            i, j = i + 1, j + 1
        elif j + 1 < len(b) and b[j][0] == "POP" and _names_storage(b[j + 1]):
            edits.append(([], b[j : j + 2]))
            j += 2
        elif i < len(a) and a[i][0] == "NONE":
            edits.append(([a[i]], []))
            i += 1
        elif i < len(a) and j < len(b) and a[i][0] in ("BINGET", "LONG_BINGET", "GLOBAL") and _names_storage(b[j]):
            edits.append(([a[i]], [b[j]]))
            i, j = i + 1, j + 1
        else:
            raise AssertionError(f"the pickles differ beyond a storage type's edit at opcode {i}: {a[i : i + 3]} / {b[j : j + 3]}")
    return edits


def _only_storage_edits(before: bytes, after: bytes) -> list[tuple[Ops, Ops]]:
    edits = _edits(before, after)
    for old, new in edits:
        assert all(op in ("BINGET", "LONG_BINGET", "GLOBAL", "NONE") for op, _ in old), (old, new)
        assert all(op == "GLOBAL" and arg.startswith("torch ") and arg.endswith("Storage") for op, arg in old if op == "GLOBAL")
        assert all(op == "POP" or (op == "GLOBAL" and arg.startswith("torch ") and arg.endswith("Storage")) for op, arg in new), new
    return edits


def _framed_load(data: bytes) -> Any:
    """Unpickle with CPython's pure-Python unpickler, which checks every FRAME's length exactly (the C one does not);
    globals and persistent ids come back as names and tuples, nothing is imported or called."""

    class Anything(dict[str, Any]):
        def __init__(self, *args: Any) -> None:
            super().__init__()
            self.args = args

        def __setstate__(self, state: Any) -> None:
            self.state = state

    class Checking(pickle._Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            return f"{module}.{name}" if name.endswith("Storage") else Anything

        def persistent_load(self, pid: Any) -> Any:
            return pid

    return Checking(io.BytesIO(data)).load()


def _frames_fit(data: bytes) -> int:
    """Check that each FRAME's length reaches exactly to the next FRAME (the last: to the end, STOP included), as
    CPython's pickler frames; the number of frames."""
    starts = [pos for op, _, pos in pickletools.genops(data) if op.name == "FRAME" and pos is not None]
    for here, there in zip(starts, [*starts[1:], len(data)], strict=True):
        assert here + 9 + int.from_bytes(data[here + 1 : here + 9], "little") == there
    return len(starts)


def _pids(obj: Any) -> set[tuple[Any, ...]]:
    out: set[tuple[Any, ...]] = set()
    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, tuple) and len(o) == 5 and o[0] == "storage":
            out.add(o)
        elif isinstance(o, dict):
            stack.extend(o.values())
            stack.extend(getattr(o, "args", ()))
        elif isinstance(o, (list, tuple)):
            stack.extend(o)
    return out


def _check_cast(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], to: str, kept: tuple[str, ...] = ()) -> None:
    assert list(got) == list(want)
    for name, w in want.items():
        expected = w.to(CAST[to]) if w.dtype == torch.float32 and not name.startswith(kept) else w
        assert got[name].dtype == expected.dtype, name
        assert torch.equal(got[name], expected), name


@pytest.mark.parametrize("to", ["fp16", "bf16"])
@pytest.mark.parametrize("protocol", [2, 4])
def test_state_dict_retyped_in_place(tmp_path: Path, to: str, protocol: int, spliced_only: None) -> None:
    src, out = tmp_path / "model.pt", tmp_path / "out.pt"
    torch.save(_state(), src, pickle_protocol=protocol)
    result = convert(src, to, output=out)
    assert result.output == out
    want = torch.load(src, weights_only=protocol == 2)
    # protocol 4's FRAME and STACK_GLOBAL are outside weights_only's opcodes: the source never loaded with it either
    got = torch.load(out, weights_only=protocol == 2)
    _check_cast(got, want, to)
    assert got._metadata == want._metadata  # the OrderedDict's attributes, as written
    assert got["tied"] is got["lin.weight"]
    assert got["row"].untyped_storage().data_ptr() == got["head.weight"].untyped_storage().data_ptr()
    before, after = _pickle_of(src), _pickle_of(out)
    edits = _only_storage_edits(before, after)
    renamed = {arg for _, new in edits for op, arg in new if op == "GLOBAL"}
    assert renamed == {f"torch {STORAGE[to]}"}
    # FloatStorage is made once and read from the memo after, by each float storage's record (a view's storage twice)
    layout = read_checkpoint(src).layout
    assert layout is not None
    float_sites = [site for site in layout.storage_sites if site[2] == "FloatStorage"]
    assert len(float_sites) == 12 and len({site[1] for site in float_sites}) == 11
    pids = _pids(_framed_load(after))  # every FRAME's new length holds exactly its content
    assert {pid[1] for pid in pids} == {f"torch.{STORAGE[to]}", "torch.LongStorage"}
    if protocol == 2:
        # the GLOBAL is renamed, and with it the memo entry every later record reads
        assert edits == [([("GLOBAL", "torch FloatStorage")], [("GLOBAL", f"torch {STORAGE[to]}")])]
        assert "POP" not in {op for op, _ in _ops(after)}  # weights_only refuses POP
    else:
        # STACK_GLOBAL keeps what it makes and memoises: POP and GLOBAL follow it, and each later read is renamed
        assert edits[0] == ([], [("POP", None), ("GLOBAL", f"torch {STORAGE[to]}")])
        assert [old[0][0] for old, _ in edits[1:]] == ["BINGET"] * (len(float_sites) - 1)
        assert _frames_fit(before) == _frames_fit(after) >= 1
    assert len(after) - len(before) == sum(len(_bytes_of(new)) - len(_bytes_of(old)) for old, new in edits)


def _bytes_of(ops: list[tuple[str, Any]]) -> bytes:
    """The bytes a run of opcodes takes (re-spelt; the edits' opcodes have one spelling each)."""
    out = b""
    for op, arg in ops:
        if op == "GLOBAL":
            module, name = arg.split(" ")
            out += b"c" + module.encode() + b"\n" + name.encode() + b"\n"
        elif op in ("POP", "NONE"):
            out += b"0" if op == "POP" else b"N"
        elif op == "BINGET":
            out += b"h" + bytes([arg])
        elif op == "LONG_BINGET":
            out += b"j" + arg.to_bytes(4, "little")
        else:
            raise AssertionError(op)
    return out


@pytest.mark.parametrize("kept", ["pre", "norm"])
def test_kept_float32_beside_cast_storages(tmp_path: Path, kept: str, spliced_only: None) -> None:
    """One memoised FloatStorage global, some of its storages cast and some kept: kept first (the GLOBAL stays, later
    memo reads become HalfStorage) or cast first (the GLOBAL and its memo entry become HalfStorage, the kept storage's
    memo read becomes FloatStorage)."""
    src, out = tmp_path / "model.pt", tmp_path / "out.pt"
    state = _state()
    torch.save(state, src)
    assert convert(src, "fp16", output=out, keep=(f"{kept}.*",)).output == out
    got, want = torch.load(out, weights_only=True), torch.load(src, weights_only=True)
    _check_cast(got, want, "fp16", kept=(f"{kept}.",))
    assert got[f"{kept}.weight"].dtype == torch.float32 and got["head.weight"].dtype == torch.float16
    edits = _only_storage_edits(_pickle_of(src), _pickle_of(out))
    news = [arg for _, new in edits for op, arg in new if op == "GLOBAL"]
    if kept == "pre":  # the first float storage is kept: its GLOBAL stays, every later float record's read is renamed
        assert news == ["torch HalfStorage"] * 10  # lin (2), norm (2), bn (4), head, and row's record of head's storage
        assert all(old[0][0] == "BINGET" for old, _ in edits)
    else:  # the first is cast: its GLOBAL is renamed, the kept storages' memo reads name FloatStorage again
        assert edits[0] == ([("GLOBAL", "torch FloatStorage")], [("GLOBAL", "torch HalfStorage")])
        assert news.count("torch FloatStorage") == 2  # norm.weight and norm.bias
        assert all(old[0][0] == "BINGET" for old, _ in edits[1:])


def test_legacy_source_written_as_an_archive(tmp_path: Path, spliced_only: None) -> None:
    src, out = tmp_path / "legacy.pt", tmp_path / "out.pt"
    torch.save({"model": _state(), "epoch": 2}, src, _use_new_zipfile_serialization=False)
    assert convert(src, "bf16", output=out).output == out
    got, want = torch.load(out, weights_only=True), torch.load(src, weights_only=True)
    assert got["epoch"] == 2
    _check_cast(got["model"], want["model"], "bf16")
    assert got["model"]["tied"] is got["model"]["lin.weight"]
    edits = _only_storage_edits(_legacy_pickle(src), _pickle_of(out))
    layout = read_checkpoint(src).layout
    assert layout is not None
    assert sum(old == [("NONE", None)] and new == [] for old, new in edits) == len(layout.storage_sites)  # each sixth field gone
    assert [(old, new) for old, new in edits if old != [("NONE", None)]] == [
        ([("GLOBAL", "torch FloatStorage")], [("GLOBAL", "torch BFloat16Storage")])
    ]


def test_lightning_checkpoint(lightning_ckpt: Path, tmp_path: Path, spliced_only: None) -> None:
    out = tmp_path / "out.ckpt"
    assert convert(lightning_ckpt, "fp16", output=out).output == out
    # AttributeDict (hyper_parameters) is outside weights_only: this test's own files, loaded in full
    want, got = torch.load(lightning_ckpt, weights_only=False), torch.load(out, weights_only=False)
    assert set(got) == set(want)
    for key in set(want) - {"state_dict", "optimizer_states"}:
        assert got[key] == want[key], key
    assert type(got["hyper_parameters"]) is type(want["hyper_parameters"])
    _check_cast(got["state_dict"], want["state_dict"], "fp16")
    # optimizer state is left as it is (no --include-optimizer)
    assert got["optimizer_states"][0]["param_groups"] == want["optimizer_states"][0]["param_groups"]
    got_state = got["optimizer_states"][0]["state"]
    for i, s in want["optimizer_states"][0]["state"].items():
        for name, t in s.items():
            assert got_state[i][name].dtype == t.dtype and torch.equal(got_state[i][name], t)
    _only_storage_edits(_pickle_of(lightning_ckpt), _pickle_of(out))


def test_a_storage_type_also_used_as_a_value_is_re_emitted(tmp_path: Path) -> None:
    """A memoised FloatStorage that is also a plain value after the tensor (no writer does this, but torch loads it):
    renaming the GLOBAL would change the value too, so the edit is refused and the pickle re-emitted instead."""
    src, out = tmp_path / "odd.pt", tmp_path / "out.pt"
    torch.save({"w": torch.ones(3), "kind": torch.FloatStorage}, src)
    layout = read_checkpoint(src).layout
    assert layout is not None and len(layout.storage_type_pushes[0]) == 2  # made for the record, read again for the value
    with pytest.raises(conversion_write.SpliceRefused, match="also used where no storage record names it"):
        conversion_write.retype(
            _pickle_of(src),
            0,
            layout.pickle_end,
            layout.storage_sites,
            layout.storage_type_pushes,
            layout.pickle_frames,
            {"0": "HalfStorage"},
        )
    assert convert(src, "fp16", output=out).output == out
    got, want = torch.load(out, weights_only=True), torch.load(src, weights_only=True)
    assert got["w"].dtype == torch.float16 and torch.equal(got["w"], want["w"].half())
    assert type(got["kind"]) is type(want["kind"]) and got["kind"].dtype == want["kind"].dtype == torch.float32


def test_edits_across_many_frames(tmp_path: Path, spliced_only: None) -> None:
    """Protocol 4 frames a pickle in 64 KiB pieces: each frame's length grows by the edits inside it."""
    src, out = tmp_path / "many.pt", tmp_path / "out.pt"
    torch.manual_seed(0)
    state = {f"layer{i}.weight": torch.randn(2) for i in range(1500)}
    state.update({f"layer{i}.steps": torch.tensor([i]) for i in range(0, 1500, 100)})  # LongStorage reads among them
    torch.save(state, src, pickle_protocol=4)
    assert convert(src, "fp16", output=out).output == out
    before, after = _pickle_of(src), _pickle_of(out)
    assert _frames_fit(before) == _frames_fit(after) >= 2
    _only_storage_edits(before, after)
    got = torch.load(out, weights_only=False)  # this test's own file (weights_only refuses protocol 4's opcodes)
    _check_cast(got, state, "fp16")


@pytest.mark.parametrize("keep", [("b",), ("a", "c")], ids=["keep-b", "keep-a-c"])
def test_a_record_that_reuses_anothers_persistent_id_is_re_emitted(tmp_path: Path, keep: tuple[str, ...]) -> None:
    """A valid pickle may fetch an earlier storage record's pid tuple from the memo instead of building its own: the
    type push the reader noted then belongs to another record, so the splice refuses and the pickle is re-emitted
    (before, the wrong storage was retyped and verification failed). Found by review; torch.load reads the file."""
    torch.manual_seed(0)
    base = torch.randn(16)
    src = tmp_path / "src.pt"
    torch.save({"a": base, "b": torch.randn(8), "c": base[4:12]}, src)
    with zipfile.ZipFile(src) as z:
        names = z.namelist()
        (pkl,) = [n for n in names if n.endswith("/data.pkl")]
        records = {n: z.read(n) for n in names}
    data = records[pkl]
    ops = list(pickletools.genops(data))
    persids = [i for i, (op, _, _) in enumerate(ops) if op.name == "BINPERSID"]
    assert ops[persids[0] - 1][0].name == "BINPUT"  # a's pid tuple is memoised
    memo = ops[persids[0] - 1][1]
    mark = max(i for i in range(persids[-2] + 1, persids[-1]) if ops[i][0].name == "MARK")  # c's pid tuple
    crafted = data[: ops[mark][2]] + b"h" + bytes([memo]) + data[ops[persids[-1]][2] :]
    odd = tmp_path / "odd.pt"
    with zipfile.ZipFile(odd, "w", zipfile.ZIP_STORED) as zo:
        for n in names:
            zo.writestr(n, crafted if n == pkl else records[n])
    want = torch.load(odd, weights_only=True)
    result = convert(odd, "fp16", output=tmp_path / "out.pt", keep=keep)
    got = torch.load(result.output, weights_only=True)
    for name, t in want.items():
        target = t.dtype if name in keep else torch.float16
        assert got[name].dtype == target and torch.equal(got[name], t.to(target)), name
