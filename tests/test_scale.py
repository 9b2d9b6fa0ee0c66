"""Big inputs (issue 31): the behaviour that keeps a million-tensor header cheap. Its cost is measured by
benchmarks/bench_scale.py, not asserted here: these tests hold what the report says and that its bytes do not change."""

from __future__ import annotations

import itertools
import json
import string
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from dtypeaudit.formats import read_checkpoint
from dtypeaudit.inventory import CheckpointReport, Finding, Report
from dtypeaudit.pipeline import scan
from dtypeaudit.render import json as json_render
from dtypeaudit.render import text
from dtypeaudit.render.blocks import TABLE_ROWS
from dtypeaudit.structure import annotate, infer_modules, modules_of

from .helpers import run_cli

ROWS = TABLE_ROWS + 25


def _names(count: int) -> list[str]:
    """Names with no number in them, so that the tensor table folds none of them into one row."""
    words = ("".join(p) for p in itertools.product(string.ascii_lowercase, repeat=2))
    return [f"{w}.weight" for w in itertools.islice(words, count)]


@pytest.fixture
def wide_file(tmp_path: Path) -> Path:
    """ROWS tensors, each its own row of the table, in safetensors' real writer."""
    from safetensors.torch import save_file

    path = tmp_path / "wide.safetensors"
    save_file({name: torch.zeros(3) for name in _names(ROWS)}, str(path))
    return path


def test_the_table_shows_its_first_rows_and_how_many_more(wide_file: Path) -> None:
    proc = run_cli("scan", str(wide_file), "-f", "plain")
    assert proc.returncode == 0, proc.stderr
    names = _names(ROWS)
    listed = [n for n in names if n in proc.stdout]
    assert listed == names[:TABLE_ROWS]
    assert f"… {ROWS - TABLE_ROWS} more rows (--all shows every one)" in proc.stdout
    assert f"{ROWS} tensors" in proc.stdout  # the header line still counts them all


def test_all_shows_every_row(wide_file: Path) -> None:
    proc = run_cli("scan", str(wide_file), "-f", "plain", "--all")
    assert proc.returncode == 0, proc.stderr
    assert all(n in proc.stdout for n in _names(ROWS))
    assert "more rows" not in proc.stdout


def test_a_table_at_the_limit_says_nothing_more(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    path = tmp_path / "just.safetensors"
    save_file({name: torch.zeros(3) for name in _names(TABLE_ROWS)}, str(path))
    proc = run_cli("scan", str(path), "-f", "plain")
    assert all(n in proc.stdout for n in _names(TABLE_ROWS))
    assert "more row" not in proc.stdout


def _report_of_findings(count: int) -> Report:
    # One finding group per rule: what the findings table folds into rows; the errors sort first.
    findings = tuple(Finding(f"rule-{i:03d}", "error" if i >= count - 3 else "warning", f"cause {i}", tensor=f"t{i}") for i in range(count))
    return Report((CheckpointReport("x.safetensors", "safetensors", None, None, findings),))


def test_the_findings_table_shows_the_worst_rows_first() -> None:
    count = TABLE_ROWS + 7
    out = text.render(_report_of_findings(count), color=False, all_rows=False)
    shown = [i for i in range(count) if f"rule-{i:03d}" in out]
    assert len(shown) == TABLE_ROWS
    assert set(range(count - 3, count)) <= set(shown)  # the three errors, whatever their place in the list
    assert "… 7 more rows of findings (--all shows every one)" in out
    assert "1 checkpoint: 3 errors, 44 warnings" in out  # the verdict counts every finding
    every = text.render(_report_of_findings(count), color=False)
    assert all(f"rule-{i:03d}" in every for i in range(count)) and "more rows" not in every


def test_verbose_lists_every_tensor_as_it_says(wide_file: Path) -> None:
    proc = run_cli("scan", str(wide_file), "-f", "plain", "-v")
    assert all(n in proc.stdout for n in _names(ROWS))


def test_json_written_in_pieces_is_the_report(wide_file: Path, tmp_path: Path) -> None:
    """The pieces the CLI writes as they come are byte for byte the report's one string, and the CLI's output."""
    other = tmp_path / "other.safetensors"
    from safetensors.torch import save_file

    save_file({"a.weight": torch.zeros(2, dtype=torch.float16), "a.bias": torch.zeros(2)}, str(other))
    report = scan([str(wide_file), str(other), str(tmp_path / "missing.safetensors")], jobs=1)
    whole = json_render.render(report)
    assert "".join(json_render.chunks(report, size=100)) == whole
    assert whole == json_render.dumps(json_render.report_dict(report)) + "\n"
    doc = json.loads(whole)
    assert [len(c["tensors"]) for c in doc["checkpoints"]] == [ROWS, 2, 0]
    proc = run_cli("scan", str(wide_file), str(other), str(tmp_path / "missing.safetensors"), "--format", "json")
    assert [c["tensors"] for c in json.loads(proc.stdout)["checkpoints"]] == [c["tensors"] for c in doc["checkpoints"]]


def test_annotate_over_many_modules_matches_inference_alone(tmp_path: Path) -> None:
    """annotate's records carry each module's guess, and its modules are inference's over those records."""
    from safetensors.torch import save_file

    state: dict[str, torch.Tensor] = {}
    for i in range(30):
        state[f"layers.{i}.proj.weight"] = torch.zeros(4, 4, dtype=torch.float16)
        state[f"layers.{i}.proj.bias"] = torch.zeros(4, dtype=torch.float32 if i % 7 == 0 else torch.float16)
        state[f"layers.{i}.norm.weight"] = torch.zeros(4)
    path = tmp_path / "m.safetensors"
    save_file(state, str(path))
    inv = read_checkpoint(path)
    done = annotate(inv)
    plain = infer_modules(inv)
    assert [(m.prefix, m.kind, m.guessed_type, m.kernel_dtypes) for m in infer_modules(done)] == [
        (m.prefix, m.kind, m.guessed_type, m.kernel_dtypes) for m in plain
    ]
    guesses = {t.name: m.guessed_type for m in plain for t in m.tensors}
    assert [t.module_guess for t in done.tensors] == [guesses[t.name] for t in inv.tensors]
    assert guesses["layers.0.proj.weight"] == "Linear" and guesses["layers.0.norm.weight"] == "RMSNorm"
    by_name = done.by_name()
    for m in modules_of(done):  # what annotate carries: its modules hold the annotated records themselves
        assert all(by_name[t.name] is t for t in m.tensors)


def _rewritten(tmp_path: Path, source: Path, spelled: str) -> Path:
    """``source``'s header written again as ``spelled`` says (the crate writes it compact, metadata first), its data
    unchanged: by hand, since no writer spells a header otherwise."""
    raw = source.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    meta = {"__metadata__": header.pop("__metadata__")}
    if spelled == "indented":
        text = json.dumps({**meta, **header}, indent=2)
    elif spelled == "metadata last":
        text = json.dumps({**header, **meta}, separators=(",", ":"))
    elif spelled == "spaced":
        text = " \n" + json.dumps({**header, **meta}, separators=(" ,\t", " : ")) + "\r\n"
    else:
        raise AssertionError(spelled)
    body = text.encode() + b" " * (-len(text) % 8)
    path = tmp_path / f"{spelled.replace(' ', '-')}.safetensors"
    path.write_bytes(len(body).to_bytes(8, "little") + body + raw[8 + n :])
    return path


@pytest.mark.parametrize("spelled", ["indented", "metadata last", "spaced"])
def test_a_header_spelled_otherwise_reads_as_the_crate_reads_it(tmp_path: Path, spelled: str) -> None:
    """A header is parsed an entry at a time; whitespace between tokens and the metadata's place change nothing of
    what safe_open gives."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    source = tmp_path / "a.safetensors"
    save_file({"a.weight": torch.zeros(2, 3), "a.bias": torch.ones(2, dtype=torch.float16), "b": torch.zeros(0)}, str(source), {"k": "v"})
    path = _rewritten(tmp_path, source, spelled)
    with safe_open(str(path), "pt") as f:
        loaded = {k: (str(f.get_tensor(k).dtype).removeprefix("torch."), tuple(f.get_tensor(k).shape)) for k in f.keys()}  # noqa: SIM118
        metadata = f.metadata()
    inv = read_checkpoint(path)
    assert {t.name: (t.dtype, t.shape) for t in inv.tensors} == loaded
    assert inv.metadata["safetensors_metadata"] == metadata
    assert [t.name for t in inv.tensors] == [t.name for t in read_checkpoint(source).tensors]
    assert dict(inv.layout.storages) == {  # type: ignore[union-attr]
        k: (s.offset + len(path.read_bytes()) - len(source.read_bytes()), s.length)
        for k, s in read_checkpoint(source).layout.storages.items()  # type: ignore[union-attr]
    }


def test_a_name_twice_is_refused_however_the_header_is_read(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    from dtypeaudit.errors import CheckpointError

    source = tmp_path / "a.safetensors"
    save_file({"a": torch.zeros(1), "b": torch.zeros(1)}, str(source))
    raw = source.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    text = raw[8 : 8 + n].decode().rstrip().replace('"b"', '"a"')
    body = text.encode() + b" " * (-len(text) % 8)
    path = tmp_path / "twice.safetensors"
    path.write_bytes(len(body).to_bytes(8, "little") + body + raw[8 + n :])
    with pytest.raises(CheckpointError, match="names 'a' twice"):
        read_checkpoint(path)


def test_each_tensor_line_is_what_the_encoder_writes_of_its_dict() -> None:
    """The JSON report writes the usual record's line out itself; every kind of record gives the encoder's text."""
    from dtypeaudit.inventory import TensorRecord

    records = [
        TensorRecord("a.weight", "float16", (2, 3), 12),
        TensorRecord('odd "name"\\ é\n\u2028', "bfloat16", (), 2, kind="parameter", file="sub/w.safetensors", offset=7),
        TensorRecord("b", "float32", (0, 4), 0, storage="3", offset=2, module="Linear", module_guess="Linear"),
        TensorRecord("c", "float32", (4,), 16, storage="3", stride=(1,), shares_with=("d",), layout="sparse_coo"),
        TensorRecord("e", "int8", (True, 2), 2),  # type: ignore[arg-type]  # no plain integer: the encoder's path
        TensorRecord("f", "float32", (1 << 70,), 4, region="optimizer"),
    ]
    encoded = [json_render._encode(json_render.tensor_dict(t)) for t in records]
    assert [json_render._tensor_line(t) for t in records] == encoded
    records.insert(4, TensorRecord("e0", "int8", (1, 2), 2))  # equal to (True, 2) as a tuple: the encoder writes each its way
    encoded = [json_render._encode(json_render.tensor_dict(t)) for t in records]
    records.append(TensorRecord("g", "float32", [2], 8))  # type: ignore[arg-type]  # a list: the encoder's path
    encoded = [json_render._encode(json_render.tensor_dict(t)) for t in records]
    twice = records + records[::-1]  # each kind of record met before, and not
    assert list(json_render._tensor_lines(twice)) == encoded + encoded[::-1]


def test_each_finding_line_is_what_the_encoder_writes_of_its_dict() -> None:
    """Alike findings share their text but for the tensor and the file; every line is still the encoder's."""
    findings = [
        Finding("dtype-outlier", "warning", "same words", tensor="a", file="x.safetensors", expected=("float16",), actual="float32"),
        Finding("dtype-outlier", "warning", "same words", tensor='odd "b"\\ é\n', file=None, expected=("float16",), actual="float32"),
        Finding("dtype-outlier", "warning", "same words", tensor=None, file="y", expected=("float16",), actual="float32"),
        Finding("dtype-outlier", "error", "same words", tensor="c", file="x.safetensors", expected=("float16",), actual="float32"),
        Finding("other", "info", "other words", expected=None, actual=None),
        Finding("other", "info", "other words", tensor=7, expected=None, actual=None),  # type: ignore[arg-type]  # the encoder's path
        Finding("other", "info", "other words", tensor="d"),
        Finding("odd", "info", "odd words", expected=(1,), actual=1),  # type: ignore[arg-type]  # equal values, two encodings
        Finding("odd", "info", "odd words", expected=(True,), actual=1.0),  # type: ignore[arg-type]
        Finding("odd", "info", "odd words", expected=["x"]),  # type: ignore[arg-type]  # unhashable: the encoder's path
    ]
    assert list(json_render._finding_lines(findings)) == [json_render._encode(json_render.finding_dict(f)) for f in findings]


def _respelled(source: Path, tmp_path: Path, edit: Callable[[str], str], label: str) -> Path:
    raw = source.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    text = edit(raw[8 : 8 + n].decode().rstrip())
    body = text.encode() + b" " * (-len(text.encode()) % 8)
    path = tmp_path / f"{label}.safetensors"
    path.write_bytes(len(body).to_bytes(8, "little") + body + raw[8 + n :])
    return path


def _swap_first_two(text: str) -> str:
    header = json.loads(text)
    names = [k for k in header if k != "__metadata__"]
    header[names[0]], header[names[1]] = header.pop(names[1]), header.pop(names[0])  # other order, same offsets
    return json.dumps(header, separators=(",", ":"))


RESPELLINGS: dict[str, Callable[[str], str]] = {
    "escaped name": lambda t: t.replace('"a.bias"', '"a.\\u0062ias"'),
    "escaped quote in a name": lambda t: t.replace('"a.bias"', '"a.\\"bias"'),
    "escaped newline in a name": lambda t: t.replace('"a.bias"', '"a.\\nbias"'),
    "raw control character in a name": lambda t: t.replace('"a.bias"', '"a.\tbias"'),
    "an unknown escape": lambda t: t.replace('"a.bias"', '"a.\\qbias"'),
    "a leading zero in an offset": lambda t: t.replace(',"data_offsets":[0,', ',"data_offsets":[00,', 1),
    "a leading zero in a shape": lambda t: t.replace('"shape":[2,3]', '"shape":[02,3]'),
    "a negative zero in a shape": lambda t: t.replace('"shape":[2,3]', '"shape":[2,-0,3]'),
    "a float in a shape": lambda t: t.replace('"shape":[2,3]', '"shape":[2,3.0]'),
    "a 20-digit offset": lambda t: t.replace(',"data_offsets":[0,', ',"data_offsets":[18446744073709551615,', 1),
    "spaces inside a shape": lambda t: t.replace('"shape":[2,3]', '"shape":[ 2 , 3 ]'),
    "an empty shape spaced": lambda t: t.replace('"shape":[0]', '"shape":[ ]'),
    "fields in another order": lambda t: t.replace('{"dtype":"F32","shape":[2,3],', '{"shape":[2,3],"dtype":"F32",'),
    "an extra field": lambda t: t.replace('"shape":[2,3],', '"shape":[2,3],"extra":[1,{"x":null}],'),
    "entries in another order than their data": _swap_first_two,
    "an unknown code": lambda t: t.replace('"dtype":"F32"', '"dtype":"F33"', 1),
    "metadata in the middle": lambda t: (
        _swap_first_two(t).replace('{"__metadata__":{"k":"v"},', "{").replace('"a.bias"', '"__metadata__":{"k":"v"},"a.bias"')
    ),
    "metadata twice": lambda t: t.replace('{"__metadata__":{"k":"v"},', '{"__metadata__":{"k":"v"},"__metadata__":{"k":"w"},'),
    "metadata twice, the first null": lambda t: t.replace('{"__metadata__":{"k":"v"},', '{"__metadata__":null,"__metadata__":{"k":"v"},'),
    "a key twice in the metadata": lambda t: t.replace('{"__metadata__":{"k":"v"}', '{"__metadata__":{"k":"v","k":"w"}'),
    "a number in the metadata": lambda t: t.replace('{"__metadata__":{"k":"v"}', '{"__metadata__":{"k":1}'),
    "a name twice": lambda t: t.replace('"b"', '"a.bias"'),
    "a tensor called __metadata__": lambda t: t.replace('{"__metadata__":{"k":"v"},', "{").replace('"b"', '"__metadata__"'),
    "trailing garbage": lambda t: t + "x",
}


REFUSED_ON_PURPOSE = {"a key twice in the metadata", "a name twice"}  # and where the crate refuses as well
"""The crate keeps the last of two equal names; other JSON readers keep the first, so the header is refused, naming it."""


@pytest.mark.parametrize("label", list(RESPELLINGS))
def test_a_respelled_header_reads_as_the_crate_reads_it(tmp_path: Path, label: str) -> None:
    """The crate's own reader decides: where safe_open refuses the header, the read is refused; where it reads it,
    the inventory holds what it gives, whichever of the two readings (quick or careful) took the header."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from dtypeaudit.errors import CheckpointError

    source = tmp_path / "a.safetensors"
    save_file({"a.weight": torch.zeros(2, 3), "a.bias": torch.ones(2, dtype=torch.float16), "b": torch.zeros(0)}, str(source), {"k": "v"})
    path = _respelled(source, tmp_path, RESPELLINGS[label], label.replace(" ", "-"))
    assert path.read_bytes() != source.read_bytes() or label == "an empty shape spaced"
    try:
        with safe_open(str(path), "pt") as f:
            loaded = {k: (str(f.get_tensor(k).dtype).removeprefix("torch."), tuple(f.get_tensor(k).shape)) for k in f.keys()}  # noqa: SIM118
            metadata = f.metadata()
    except Exception:  # the crate refuses it (SafetensorError, or a decode error raised through it)
        with pytest.raises(CheckpointError):
            read_checkpoint(path)
        return
    if label in REFUSED_ON_PURPOSE:
        with pytest.raises(CheckpointError, match="twice"):
            read_checkpoint(path)
        return
    inv = read_checkpoint(path)
    assert {t.name: (t.dtype, t.shape) for t in inv.tensors} == loaded
    assert inv.metadata["safetensors_metadata"] == metadata


def test_the_crates_own_header_takes_the_quick_reading(tmp_path: Path) -> None:
    """What keeps a million-tensor header cheap (benchmarks/SCALE.md): the crate's spelling, and json.dumps' default
    spacing, are read by the one-pattern reading, not the careful one."""
    from safetensors.torch import save_file

    from dtypeaudit.formats import locate
    from dtypeaudit.formats import safetensors as st

    source = tmp_path / "a.safetensors"
    save_file({"a.weight": torch.zeros(2, 3), "a.bias": torch.ones(2, dtype=torch.float16), "b": torch.zeros(0)}, str(source), {"k": "v"})
    spaced = _respelled(source, tmp_path, lambda t: json.dumps(json.loads(t)), "spaced")
    for path in (source, spaced):
        with locate.opened(path) as src:
            header = st._quick(src, *st._header_text(src))
        assert header.names == ("a.weight", "b", "a.bias")  # in data order: the crate puts float32 first
        assert header.shapes == ((2, 3), (0,), (2,))
        assert header.metadata == {"k": "v"}
