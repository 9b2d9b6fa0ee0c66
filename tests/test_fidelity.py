"""What dtypeaudit audits is what torch loads, or dtypeaudit refuses.

Each test crafts a file one of the ways a gate can be fooled (issue: "The gate cannot be fooled"),
loads it with the real loader (torch.load(weights_only=True); weights_only=False only on files
torch.save itself wrote from our own tensors) and asserts dtypeaudit lists the same tensors, or
refuses with exit 2 and a reason.
"""

from __future__ import annotations

import pickle
import struct
import zipfile
from collections import Counter, OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dtypeaudit.errors import CheckpointError
from dtypeaudit.formats import read_checkpoint
from dtypeaudit.formats.picklevm import PickleVM

from . import oracle
from .helpers import facts, run_cli
from .hostile import call, global_op, text, with_data_pkl
from .pickles import FALSE, NONE, TRUE, build, dictionary, integer, ordered_dict, pickle2, storage, tensor, tup

F4 = struct.pack("<4f", 1, 2, 3, 4)


def crafted(tmp_path: Path, name: str, body: bytes, storages: dict[str, bytes]) -> Path:
    return with_data_pkl(tmp_path / name, pickle2(body), storages=storages)


def torch_facts(path: Path) -> dict[str, tuple[str, tuple[int, ...], str]]:
    return oracle.facts(oracle.load(path))


def refused(path: Path, *keywords: str) -> str:
    with pytest.raises(CheckpointError) as info:
        read_checkpoint(path)
    message = info.value.one_line()
    for k in keywords:
        assert k in message, (k, message)
    return message


# -- 1. pickle semantics ---------------------------------------------------------------------------


@pytest.mark.parametrize("protocol", [1, 2, 3, 4, 5])
def test_legacy_files_of_every_protocol_read_as_torch_reads_them(tmp_path: Path, protocol: int) -> None:
    state = {"w": torch.ones(2, 3), "h": torch.zeros(4, dtype=torch.float16), "n": {"i": torch.arange(3)}}
    path = tmp_path / f"legacy{protocol}.pt"
    torch.save(state, path, _use_new_zipfile_serialization=False, pickle_protocol=protocol)
    inv = read_checkpoint(path)
    assert inv.format == "torch-legacy"
    # Our own file, written by torch.save from our own tensors: the full loader is safe to run on it.
    assert facts(inv) == oracle.facts(oracle.walk(torch.load(path, weights_only=False)))
    assert {t.name for t in inv.tensors} == {"w", "h", "n.i"}


@pytest.mark.parametrize("protocol", [3, 4, 5])
def test_zip_files_of_newer_protocols_note_that_weights_only_refuses_them(tmp_path: Path, protocol: int) -> None:
    path = tmp_path / f"zip{protocol}.pt"
    torch.save({"w": torch.ones(2, dtype=torch.bfloat16)}, path, pickle_protocol=protocol)
    inv = read_checkpoint(path)
    assert facts(inv) == oracle.facts(oracle.walk(torch.load(path, weights_only=False)))
    notes = [f for f in inv.findings if f.rule == "loader-divergence"]
    try:
        torch.load(path, weights_only=True)
        assert notes == []
    except pickle.UnpicklingError:
        assert len(notes) == 1 and "weights_only=True" in notes[0].message and notes[0].severity == "warning"


def test_a_storage_key_keeps_the_first_type_torch_sees(tmp_path: Path) -> None:
    body = dictionary(
        (text("a"), tensor(storage("0", "FloatStorage", 4), (4,))),
        (text("b"), tensor(storage("0", "HalfStorage", 8), (4,))),
    )
    path = crafted(tmp_path, "two_types.pt", body, {"0": F4})
    assert torch_facts(path)["b"][0] == "float32"
    assert facts(read_checkpoint(path)) == torch_facts(path)


def test_an_empty_storage_takes_each_records_own_type(tmp_path: Path) -> None:
    body = dictionary(
        (text("a"), tensor(storage("0", "FloatStorage", 0), (0,))),
        (text("b"), tensor(storage("0", "HalfStorage", 0), (0,))),
    )
    path = crafted(tmp_path, "empty_types.pt", body, {"0": b""})
    assert facts(read_checkpoint(path)) == torch_facts(path) == {"a": ("float32", (0,), "unknown"), "b": ("float16", (0,), "unknown")}


def test_a_rebuild_that_casts_reports_the_cast_dtype(tmp_path: Path) -> None:
    cast = call(
        global_op("torch._utils", "_rebuild_device_tensor_from_cpu_tensor"),
        tensor(storage("0"), (4,)),
        global_op("torch", "float16"),
        text("cpu"),
        FALSE,
    )
    path = crafted(tmp_path, "cast.pt", dictionary((text("a"), cast)), {"0": F4})
    assert torch_facts(path) == {"a": ("float16", (4,), "unknown")}
    assert facts(read_checkpoint(path)) == torch_facts(path)


def test_a_rebuild_state_that_replaces_data_is_refused(tmp_path: Path) -> None:
    state = dictionary((text("data"), tensor(storage("1", "HalfStorage", 4), (4,))))
    param = call(global_op("torch._utils", "_rebuild_parameter_with_state"), tensor(storage("0"), (4,)), FALSE, ordered_dict(), state)
    path = crafted(tmp_path, "state.pt", dictionary((text("a"), param)), {"0": F4, "1": F4[:8]})
    assert torch_facts(path)["a"][0] == "float16"  # the float32 storage is not what torch ends up with
    refused(path, "state sets 'data'", "refused")


def test_harmless_parameter_attributes_are_kept_and_their_tensors_listed(tmp_path: Path) -> None:
    state = dictionary((text("_no_weight_decay"), TRUE), (text("scale"), tensor(storage("1", "HalfStorage", 4), (4,))))
    param = call(global_op("torch._utils", "_rebuild_parameter_with_state"), tensor(storage("0"), (4,)), FALSE, ordered_dict(), state)
    path = crafted(tmp_path, "attrs.pt", dictionary((text("a"), param)), {"0": F4, "1": F4[:8]})
    loaded = torch.load(path, weights_only=True)["a"]
    assert loaded.dtype == torch.float32 and loaded.scale.dtype == torch.float16
    assert facts(read_checkpoint(path)) == {"a": ("float32", (4,), "parameter"), "a.scale": ("float16", (4,), "unknown")}


def test_build_on_a_parameter_that_replaces_its_data_is_refused(tmp_path: Path) -> None:
    param = call(global_op("torch._utils", "_rebuild_parameter"), tensor(storage("0"), (4,)), FALSE, ordered_dict())
    state = tup(tensor(storage("1", "HalfStorage", 4), (4,)), NONE, NONE, FALSE, NONE)  # Tensor.__setstate__'s 5-tuple
    path = crafted(tmp_path, "build.pt", dictionary((text("a"), build(param, state))), {"0": F4, "1": F4[:8]})
    assert torch_facts(path)["a"][0] == "float16"
    refused(path, "BUILD on a tensor", "refused")


def test_tensors_used_as_dict_keys_are_listed(tmp_path: Path) -> None:
    path = crafted(tmp_path, "key.pt", dictionary((tensor(storage("0"), (4,)), integer(1))), {"0": F4})
    (key,) = torch.load(path, weights_only=True)
    assert isinstance(key, torch.Tensor) and key.dtype == torch.float32
    assert facts(read_checkpoint(path)) == {"__key0__": ("float32", (4,), "unknown")}


def test_tensors_set_as_ordereddict_attributes_are_listed(tmp_path: Path) -> None:
    hidden = build(ordered_dict(), dictionary((text("hidden"), tensor(storage("0"), (4,)))))
    path = crafted(tmp_path, "attr.pt", dictionary((text("a"), hidden)), {"0": F4})
    loaded = torch.load(path, weights_only=True)["a"]
    assert loaded == OrderedDict() and loaded.hidden.dtype == torch.float32  # invisible to a walk of items
    assert facts(read_checkpoint(path)) == {"a.__dict__.hidden": ("float32", (4,), "unknown")}


def test_counters_are_dicts_torch_allows(tmp_path: Path) -> None:
    counter = call(global_op("collections", "Counter"), dictionary((text("x"), tensor(storage("0"), (4,)))))
    path = crafted(tmp_path, "counter.pt", dictionary((text("c"), counter)), {"0": F4})
    assert isinstance(torch.load(path, weights_only=True)["c"], Counter)
    inv = read_checkpoint(path)
    assert facts(inv) == {"c.x": ("float32", (4,), "unknown")} and inv.findings == ()


def test_newobj_makes_an_empty_ordereddict_whatever_its_arguments(tmp_path: Path) -> None:
    pairs = b"](" + tup(text("x"), tensor(storage("0"), (4,))) + b"e"
    newobj = global_op("collections", "OrderedDict") + tup(pairs) + b"\x81"
    path = crafted(tmp_path, "newobj.pt", dictionary((text("c"), newobj)), {"0": F4})
    assert torch.load(path, weights_only=True) == {"c": OrderedDict()}
    assert read_checkpoint(path).tensors == ()


def test_byte_strings_decode_as_utf8_as_torch_load_decodes_them(tmp_path: Path) -> None:
    path = crafted(tmp_path, "utf8.pt", dictionary((b"U\x05caf\xc3\xa9", tensor(storage("0"), (4,)))), {"0": F4})
    assert set(torch.load(path, weights_only=True)) == {"café"}
    assert [t.name for t in read_checkpoint(path).tensors] == ["café"]
    bad = crafted(tmp_path, "latin1.pt", dictionary((b"U\x02\xff\xfe", tensor(storage("0"), (4,)))), {"0": F4})
    with pytest.raises(UnicodeDecodeError):
        torch.load(bad, weights_only=True)
    refused(bad, "utf-8")


def test_an_integer_tensor_that_requires_grad_is_refused_as_torch_refuses_it(tmp_path: Path) -> None:
    path = crafted(tmp_path, "grad.pt", dictionary((text("a"), tensor(storage("0", "LongStorage", 2), (2,), grad=TRUE))), {"0": F4})
    with pytest.raises(RuntimeError, match="require gradients"):
        torch.load(path, weights_only=True)
    refused(path, "requires_grad")


def test_a_python2_name_that_the_loaders_resolve_differently_is_refused(tmp_path: Path) -> None:
    body = dictionary((text("s"), call(global_op("__builtin__", "set"), b"](" + integer(1) + b"e")))
    path = with_data_pkl(tmp_path / "py2.pt", b"\x80\x03" + body + b".")
    with pytest.warns(UserWarning, match="protocol 3"):
        assert torch.load(path, weights_only=True) == {"s": {1}}  # weights_only maps the name; CPython would not
    refused(path, "__builtin__.set", "loaders disagree")


def test_legacy_constructors_are_refused_not_guessed(tmp_path: Path) -> None:
    body = dictionary((text("t"), call(global_op("torch", "HalfTensor"), integer(3))))
    path = crafted(tmp_path, "ctor.pt", body, {})
    assert torch.load(path, weights_only=True)["t"].dtype == torch.float16
    refused(path, "torch.HalfTensor", "not modelled")


def test_bytes_after_the_pickle_that_do_not_interpret_fail_the_file(tmp_path: Path) -> None:
    path = with_data_pkl(
        tmp_path / "junk.pt", pickle2(dictionary((text("a"), tensor(storage("0"), (4,))))) + b"\x80\x02\xff", storages={"0": F4}
    )
    assert torch_facts(path) == {"a": ("float32", (4,), "unknown")}  # torch never looks past STOP
    refused(path, "after the pickle", "cannot be checked")


def test_a_whole_pickled_module_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "whole.pt"
    torch.save(torch.nn.Linear(2, 2), path)
    rules = {f.rule: f for f in read_checkpoint(path).findings}
    assert rules["pickled-module"].severity == "error" and "state_dict" in rules["pickled-module"].message


# CPython's C unpickler (what weights_only=False and pickle.load run) parses protocol-0 text its own way.
_LINES = st.one_of(
    st.from_regex(r"\A[ +-]?(0[xX][0-9a-fA-F]{1,4}|0[0-7]{0,4}|[1-9][0-9_]{0,6}|0[0-9]{1,3})\Z"),
    st.text(alphabet="0123456789xX+- _.eEinfa", max_size=8),
)


@settings(max_examples=300, deadline=None)
@given(line=_LINES, op=st.sampled_from([b"I", b"L", b"F"]))
def test_protocol0_numbers_parse_as_cpython_parses_them(line: str, op: bytes) -> None:
    data = op + line.encode() + b"\n."  # data-only: nothing in it can name a global
    try:
        expected: Any = pickle.loads(data)
    except Exception:
        expected = "error"
    try:
        got: Any = PickleVM(data).load()[0]
    except CheckpointError:
        got = "error"
    assert got == expected or (got != got and expected != expected), (data, got, expected)
    assert type(got) is type(expected)


@settings(max_examples=200, deadline=None)
@given(raw=st.binary(max_size=12), op=st.sampled_from([b"U", b"T", b"S"]), encoding=st.sampled_from(["utf-8", "ASCII", "latin-1"]))
def test_byte_string_opcodes_decode_as_cpython_decodes_them(raw: bytes, op: bytes, encoding: str) -> None:
    if op == b"U":
        data = b"U" + bytes([len(raw)]) + raw + b"."
    elif op == b"T":
        data = b"T" + struct.pack("<i", len(raw)) + raw + b"."
    else:
        data = b"S" + repr(raw)[1:].encode() + b"\n."
    try:
        expected: Any = pickle.loads(data, encoding=encoding)
    except Exception:
        expected = "error"
    try:
        got: Any = PickleVM(data, encoding=encoding).load()[0]
    except CheckpointError:
        got = "error"
    assert got == expected, (data, got, expected)


# -- 2. zip semantics ------------------------------------------------------------------------------


def _rewrite(src: Path, dest: Path, rename: dict[str, str] | None = None, replace: dict[str, bytes] | None = None) -> Path:
    rename, replace = rename or {}, replace or {}
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dest, "w") as zout:
        for info in zin.infolist():
            zout.writestr(rename.get(info.filename, info.filename), replace.get(info.filename, zin.read(info.filename)))
    return dest


def test_records_are_found_whatever_their_case_as_miniz_finds_them(tmp_path: Path) -> None:
    src = tmp_path / "src.pt"
    torch.save({"w": torch.arange(4, dtype=torch.float32)}, src)
    upper = _rewrite(src, tmp_path / "upper.pt", rename={"src/data.pkl": "src/DATA.PKL"})
    assert torch_facts(upper) == facts(read_checkpoint(upper))
    big = _rewrite(src, tmp_path / "big.pt", rename={"src/byteorder": "src/BYTEORDER"}, replace={"src/byteorder": b"big"})
    assert torch.load(big, weights_only=True)["w"].tolist() != [0.0, 1.0, 2.0, 3.0]  # torch read the big-endian mark
    assert read_checkpoint(big).metadata["byteorder"] == "big"


def test_a_second_pickle_in_the_archive_is_scanned_for_globals(tmp_path: Path) -> None:
    src = tmp_path / "src.pt"
    torch.save({"w": torch.ones(2)}, src)
    dest = tmp_path / "second.pt"
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dest, "w") as zout:
        for info in zin.infolist():
            zout.writestr(info.filename, zin.read(info.filename))
        zout.writestr("src/extra.pkl", pickle2(call(global_op("posix", "system"), text("touch /tmp/never"))))
    inv = read_checkpoint(dest)
    errors = [f for f in inv.findings if f.rule == "unsafe-global"]
    assert errors and errors[0].file == "src/extra.pkl" and "posix.system" in errors[0].message
    assert run_cli("scan", str(dest)).returncode == 1


def test_a_missing_version_record_is_refused_as_torch_refuses_it(tmp_path: Path) -> None:
    src = tmp_path / "src.pt"
    torch.save({"w": torch.ones(2)}, src)
    dest = tmp_path / "noversion.pt"
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dest, "w") as zout:
        for info in zin.infolist():
            if not info.filename.endswith("/version"):
                zout.writestr(info.filename, zin.read(info.filename))
    with pytest.raises(RuntimeError, match="version"):
        torch.load(dest, weights_only=True)
    refused(dest, "no version record")


# -- 5. every stream, every global -----------------------------------------------------------------


def test_protocol0_pickles_are_read_for_their_globals(tmp_path: Path) -> None:
    path = tmp_path / "old.pkl"
    path.write_bytes(b"cposix\nsystem\n(S'touch /tmp/never'\ntR.")
    proc = run_cli("scan", str(path), "-f", "json")
    assert proc.returncode == 1, proc.stderr
    assert "posix.system" in proc.stdout and "unsafe-global" in proc.stdout


def test_strict_fails_on_what_weights_only_would_refuse(tmp_path: Path) -> None:
    path = tmp_path / "p4.pt"
    torch.save({"w": torch.ones(2)}, path, pickle_protocol=4)
    assert run_cli("scan", str(path)).returncode == 0
    proc = run_cli("scan", str(path), "--strict")
    assert proc.returncode == 1 and "loader-divergence" in proc.stdout


def test_a_zip_that_is_not_torchs_but_holds_a_payload_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "bundle.zip"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("model/weights.pkl", pickle2(call(global_op("os", "system"), text("id"))))
    proc = run_cli("scan", str(path), "-f", "json")
    assert proc.returncode == 1 and "os.system" in proc.stdout


# -- found by fuzz/fuzz_differential.py ------------------------------------------------------------


def test_a_cast_or_a_plain_tensor_rebuild_of_a_parameter_is_no_parameter(tmp_path: Path) -> None:
    param = call(global_op("torch._utils", "_rebuild_parameter"), tensor(storage("0"), (4,)), FALSE, ordered_dict())
    cast = call(
        global_op("torch._utils", "_rebuild_device_tensor_from_cpu_tensor"), param, global_op("torch", "float16"), text("cpu"), FALSE
    )
    as_tensor = call(
        global_op("torch._tensor", "_rebuild_from_type_v2"),
        global_op("torch._utils", "_rebuild_parameter"),
        global_op("torch", "Tensor"),
        tup(tensor(storage("1"), (4,)), FALSE, ordered_dict()),
        dictionary(),
    )
    path = crafted(tmp_path, "kinds.pt", dictionary((text("cast"), cast), (text("plain"), as_tensor)), {"0": F4, "1": F4})
    assert torch_facts(path) == {"cast": ("float16", (4,), "unknown"), "plain": ("float32", (4,), "unknown")}
    assert facts(read_checkpoint(path)) == torch_facts(path)


def test_one_cast_tensor_under_two_names_is_shared(tmp_path: Path) -> None:
    rebuild = global_op("torch._utils", "_rebuild_device_tensor_from_cpu_tensor")
    cast = call(rebuild, tensor(storage("0"), (4,)), global_op("torch", "float16"), text("cpu"), FALSE) + b"q\x10"
    path = crafted(tmp_path, "shared.pt", dictionary((text("a"), cast), (text("b"), b"h\x10")), {"0": F4})
    assert oracle.sharing(oracle.load(path)) == {frozenset({"a", "b"})}
    assert read_checkpoint(path).by_name()["a"].shares_with == ("b",)


def test_a_storage_key_torch_cannot_look_up_is_refused(tmp_path: Path) -> None:
    body = dictionary((text("a"), tensor(storage("0"), (4,)))).replace(text("0"), b"X\x03\x00\x00\x00\xed\xa0\x80")  # a lone surrogate
    path = crafted(tmp_path, "surrogate.pt", body, {"0": F4})
    with pytest.raises(TypeError, match="get_storage_from_record"):
        torch.load(path, weights_only=True)
    refused(path, "storage", "missing")


def test_tuple_keys_read_as_python_prints_them(tmp_path: Path) -> None:
    path = crafted(tmp_path, "tuple.pt", dictionary((tup(text("t"), integer(1)), tensor(storage("0"), (4,)))), {"0": F4})
    assert set(oracle.load(path)) == {"('t', 1)"}
    assert [t.name for t in read_checkpoint(path).tensors] == ["('t', 1)"]


def test_a_nested_tensor_built_on_a_parameter_is_no_parameter(tmp_path: Path) -> None:
    buffer = call(global_op("torch._utils", "_rebuild_parameter"), tensor(storage("0", "HalfStorage", 3), (3,)), FALSE, ordered_dict())
    sizes = tensor(storage("1", "LongStorage", 2), (2, 1))
    strides = tensor(storage("2", "LongStorage", 2), (2, 1))
    offsets = tensor(storage("3", "LongStorage", 2), (2,))
    nested = call(global_op("torch._utils", "_rebuild_nested_tensor"), buffer, sizes, strides, offsets)
    longs = struct.pack("<2q", 1, 2), struct.pack("<2q", 1, 1), struct.pack("<2q", 0, 1)
    path = crafted(tmp_path, "nested.pt", dictionary((text("n"), nested)), {"0": bytes(6), "1": longs[0], "2": longs[1], "3": longs[2]})
    loaded = torch.load(path, weights_only=True)["n"]
    assert loaded.is_nested and not isinstance(loaded, torch.nn.Parameter)
    (t,) = read_checkpoint(path).tensors
    assert (t.name, t.dtype, t.kind, t.layout) == ("n", "float16", "unknown", "nested")


def test_modules_torch_load_renames_are_read_as_it_reads_them(tmp_path: Path) -> None:
    from .diff_oracle import SAFE

    rebuild = global_op("torch.tensor", "_rebuild_from_type_v2")  # torch.load maps torch.tensor to torch._tensor
    value = call(rebuild, global_op("torch._utils", "_rebuild_tensor_v2"), global_op("torch", "Tensor"), _v2_args(), dictionary())
    path = crafted(tmp_path, "renamed.pt", dictionary((text("a"), value)), {"0": F4})
    with pytest.raises(pickle.UnpicklingError):
        torch.load(path, weights_only=True)
    full = torch.load(path, weights_only=False, pickle_module=SAFE)  # an allowlist-only unpickler: nothing else resolves
    inv = read_checkpoint(path)
    assert facts(inv) == oracle.facts(oracle.walk(full)) == {"a": ("float32", (4,), "unknown")}
    assert [f.rule for f in inv.findings] == ["loader-divergence"] and "torch.tensor" in inv.findings[0].message


def _v2_args() -> bytes:
    return tup(storage("0"), integer(0), tup(integer(4)), tup(integer(1)), FALSE, ordered_dict())
