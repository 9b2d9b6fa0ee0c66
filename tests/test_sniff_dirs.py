"""What dtypeaudit audits is what the loaders load: format by content (torch.load's order), files that are
two formats at once, every safetensors dtype and header rule of the crate, and directories as
``from_pretrained`` resolves them. Each case is compared with the real loader, or refused."""

from __future__ import annotations

import io
import json
import pickle
import shutil
import struct
import tarfile
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dtypeaudit import dtypes
from dtypeaudit.errors import CheckpointError, UsageError
from dtypeaudit.formats import directory, read_checkpoint
from dtypeaudit.formats.sniff import is_candidate, sniff_kind
from dtypeaudit.pipeline import expand

from . import oracle
from .helpers import facts, json_report, run_cli

# -- torch.load's order: zip, tar, then the first pickle ------------------------------------------


@pytest.mark.parametrize("protocol", [1, 2, 3, 4, 5])
def test_legacy_files_of_every_pickle_protocol(tmp_path: Path, protocol: int) -> None:
    state = {"w": torch.ones(2, 3), "h": torch.zeros(4, dtype=torch.float16)}
    path = tmp_path / "legacy.pt"
    torch.save(state, path, _use_new_zipfile_serialization=False, pickle_protocol=protocol)
    assert sniff_kind(path) == "legacy"
    if protocol in (2, 3):
        loaded = oracle.load(path)
    else:
        # torch's weights-only unpickler knows no FRAME (4, 5) and no text opcodes (1); this file is
        # torch.save's own output, so the full unpickler may read it.
        loaded = oracle.walk(torch.load(path, weights_only=False))
    assert facts(read_checkpoint(path)) == oracle.facts(loaded)
    code, doc, _ = json_report("scan", str(path), "--preset", "fp16")
    assert code == 1  # the fp32 tensor fails the fp16 preset: not "0 tensors, passed"


def test_protocol_0_pickle_reports_its_globals(tmp_path: Path) -> None:
    path = tmp_path / "payload.pkl"
    path.write_bytes(b"cposix\nsystem\n(S'echo owned'\ntR.")  # protocol 0: no 0x80 header
    with pytest.raises(Exception):  # noqa: B017 - torch refuses it, one way or another
        torch.load(path, weights_only=True)
    assert sniff_kind(path) == "pickle"
    code, doc, _ = json_report("scan", str(path))
    assert code == 1
    assert any(f["rule"] == "unsafe-global" and "posix.system" in f["message"] for f in doc["checkpoints"][0]["findings"])


@pytest.mark.parametrize("protocol", [0, 1])
def test_benign_old_protocol_pickles_are_pickles(tmp_path: Path, protocol: int) -> None:
    path = tmp_path / "data.bin"
    path.write_bytes(pickle.dumps({"a": [1, 2.5, "x"], "b": None}, protocol=protocol))
    assert sniff_kind(path) == "pickle"
    assert read_checkpoint(path).tensors == ()


@pytest.mark.parametrize(
    ("content", "words"),
    [
        (b"version https://git-lfs.github.com/spec/v1\noid sha256:00\nsize 1\n", "Git LFS pointer"),
        (b"\x89PNG\r\n\x1a\n" + b"\0" * 40, "PNG image"),
        (b'{"architectures": ["GPT2"], "dtype": "float32"}', "JSON file"),
        (b"<!DOCTYPE html><html></html>", "HTML page"),
        (b"import torch\nprint('hello')\n", "not a checkpoint"),
    ],
)
def test_what_is_not_a_checkpoint_says_what_it_is(tmp_path: Path, content: bytes, words: str) -> None:
    path = tmp_path / "model.pt"
    path.write_bytes(content)
    with pytest.raises(CheckpointError, match=words):
        sniff_kind(path)


def test_tar_archives_are_refused_as_torch_does(tmp_path: Path) -> None:
    path = tmp_path / "old.pt"
    with tarfile.open(path, "w:", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("sys_info")
        info.size = 3
        tar.addfile(info, io.BytesIO(b"abc"))
    with pytest.raises(RuntimeError, match="legacy .tar format"):
        torch.load(path, weights_only=True)
    with pytest.raises(CheckpointError, match="tar archive"):
        sniff_kind(path)
    zeros = tmp_path / "zeros.pt"
    zeros.write_bytes(b"\0" * 2048)  # tarfile opens it as an empty archive, and so does torch.load
    with pytest.raises(CheckpointError, match="empty tar archive"):
        sniff_kind(zeros)


# -- files that are two formats at once -----------------------------------------------------------


def _torch_zip_members(state: dict[str, torch.Tensor]) -> list[tuple[str, bytes]]:
    buf = io.BytesIO()
    torch.save(state, buf)
    with zipfile.ZipFile(buf) as z:
        return [(i.filename, z.read(i)) for i in z.infolist()]


def _zip_and_safetensors(path: Path) -> None:
    """``PK\\x03\\x04`` and four zero bytes read as a safetensors header length of 67,324,752 bytes
    (under the crate's 100 MB cap). Byte 8 opens the JSON header; the zip torch reads lies inside the
    data of a U8 tensor, its central directory at the end of the file where miniz looks for it."""
    length_field = b"PK\x03\x04\x00\x00\x00\x00"
    n = int.from_bytes(length_field, "little")
    x = torch.ones(2, dtype=torch.float16).numpy().tobytes()
    zip_at = 8 + n + len(x)
    with path.open("wb") as f:
        f.truncate(zip_at)
        f.seek(zip_at)
        with zipfile.ZipFile(f, "w") as z:  # offsets are absolute: the archive starts at zip_at
            for name, data in _torch_zip_members({"w": torch.arange(4, dtype=torch.float32)}):
                z.writestr(zipfile.ZipInfo(name), data)
        zip_len = f.tell() - zip_at
    header = json.dumps(
        {
            "x": {"dtype": "F16", "shape": [2], "data_offsets": [0, 4]},
            "z": {"dtype": "U8", "shape": [zip_len], "data_offsets": [4, 4 + zip_len]},
        }
    ).encode()
    with path.open("r+b") as f:
        f.write(length_field + header + b" " * (n - len(header)) + x)


def test_zip_that_is_also_safetensors_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "both.bin"
    _zip_and_safetensors(path)
    # Both real loaders read it, and read different tensors.
    torch_view = oracle.facts(oracle.load(path))
    with safe_open(str(path), "pt") as f:
        st_view = {k: (str(f.get_tensor(k).dtype)[6:], tuple(f.get_tensor(k).shape), "unknown") for k in f.keys()}  # noqa: SIM118
    assert torch_view == {"w": ("float32", (4,), "unknown")}
    assert set(st_view) == {"x", "z"} and st_view["x"][0] == "float16"
    with pytest.raises(CheckpointError, match="is both a zip archive and a safetensors file; torch.load and safetensors"):
        read_checkpoint(path)
    proc = run_cli("scan", str(path), "--preset", "fp16")
    assert proc.returncode == 2 and "is both a zip archive and a safetensors file" in proc.stderr


def _tar_and_safetensors(path: Path) -> None:
    """A safetensors file whose first 512 bytes are also a valid tar header: the octal fields tarfile
    parses (bytes 100-155 and 329-344) lie inside a JSON string of ``__metadata__``."""
    tensor = torch.arange(3, dtype=torch.float32).numpy().tobytes()
    prefix = '{"__metadata__":{"pad":"'
    fields = "0000644 " + "0000000 " + "0000000 " + "00000000000 " + "00000000000 "  # mode uid gid size mtime
    lead = "a" * (100 - 8 - len(prefix))
    rest = '"},"t":{"dtype":"F32","shape":[3],"data_offsets":[0,12]}}'
    # checksum (blank for now), type '0', link name, then devmajor and devminor at 329
    body = prefix + lead + fields + " " * 8 + "0" + "b" * (329 - 157) + "0000000 0000000 " + "c" * 200 + rest
    text = bytearray(body.encode())
    n = len(text)
    block = bytearray(struct.pack("<Q", n) + bytes(text))[:512]
    checksum = sum(block[:148]) + 8 * 32 + sum(block[156:512])
    text[148 - 8 : 156 - 8] = f"{checksum:07o} ".encode()
    path.write_bytes(struct.pack("<Q", n) + bytes(text) + tensor)


def test_tar_that_is_also_safetensors_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "both.pt"
    _tar_and_safetensors(path)
    with tarfile.open(path, "r:") as tar:
        assert tar.firstmember is not None
    assert list(load_file(str(path))) == ["t"]
    with pytest.raises(RuntimeError, match="legacy .tar format"):
        torch.load(path, weights_only=True)  # torch takes the tar, safetensors the header
    with pytest.raises(CheckpointError, match="is both a tar archive and a safetensors file"):
        read_checkpoint(path)


def test_suffix_never_decides(tmp_path: Path, safetensors_file: Path, all_dtypes_pt: Path) -> None:
    st_named_pt = tmp_path / "weights.pt"
    shutil.copy(safetensors_file, st_named_pt)
    zip_named_st = tmp_path / "weights.safetensors"
    shutil.copy(all_dtypes_pt, zip_named_st)
    assert read_checkpoint(st_named_pt).format == "safetensors"
    assert read_checkpoint(zip_named_st).format == "torch-zip"


# -- safetensors: every dtype the crate knows, as load_file gives it ------------------------------


def _st_file(path: Path, header: str | bytes | dict[str, Any], data: bytes = b"") -> Path:
    raw = header if isinstance(header, bytes) else (header if isinstance(header, str) else json.dumps(header)).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def _load_file_facts(path: Path) -> dict[str, tuple[str, tuple[int, ...], str]] | None:
    try:
        loaded = load_file(str(path))
    except Exception:
        return None
    return {k: (str(v.dtype)[6:], tuple(v.shape), "unknown") for k, v in loaded.items()}


def _our_facts(path: Path) -> dict[str, tuple[str, tuple[int, ...], str]] | None:
    try:
        return facts(read_checkpoint(path))
    except CheckpointError:
        return None


def test_every_dtype_save_file_writes(tmp_path: Path) -> None:
    state = {}
    for name in sorted(set(dtypes.SAFETENSORS_CODES.values())):
        dt = getattr(torch, name)
        state[name] = torch.arange(8 * dt.itemsize, dtype=torch.uint8).reshape(2, -1).view(dt)
    path = tmp_path / "all.safetensors"
    save_file(state, str(path))
    expected = _load_file_facts(path)
    assert expected is not None and expected["float4_e2m1fn_x2"][1] == (2, 4)  # the header says [2, 8]
    assert _our_facts(path) == expected
    inv = read_checkpoint(path)
    assert {t.name: t.nbytes for t in inv.tensors} == {k: v.numel() * v.element_size() for k, v in load_file(str(path)).items()}


@pytest.mark.parametrize("code", [*dtypes.SAFETENSORS_CODES, *sorted(dtypes.SAFETENSORS_TORCHLESS), "C128", "I4", "U4", "F8_E4M3FN"])
def test_each_code_reads_as_load_file_or_is_refused(tmp_path: Path, code: str) -> None:
    bits = dtypes.safetensors_bits(code) if code in dtypes.SAFETENSORS_CODES or code in dtypes.SAFETENSORS_TORCHLESS else 8
    shape = [4, 8]
    nbytes = 32 * bits // 8
    path = _st_file(tmp_path / "t.safetensors", {"t": {"dtype": code, "shape": shape, "data_offsets": [0, nbytes]}}, b"\0" * nbytes)
    assert _our_facts(path) == _load_file_facts(path)
    if code in dtypes.SAFETENSORS_CODES:
        assert _our_facts(path) is not None


@pytest.mark.parametrize(
    ("shape", "ok"),
    [([2, 4], True), ([2, 2], True), ([0], True), ([4, 3], False), ([3], False), ([], False)],
)
def test_f4_shapes(tmp_path: Path, shape: list[int], ok: bool) -> None:
    numel = 1
    for d in shape:
        numel *= d
    nbytes = (numel + 1) // 2
    path = _st_file(tmp_path / "f4.safetensors", {"x": {"dtype": "F4", "shape": shape, "data_offsets": [0, nbytes]}}, b"\0" * nbytes)
    ours, theirs = _our_facts(path), _load_file_facts(path)
    assert ours == theirs
    assert (ours is not None) == ok


X = '"dtype":"F32","shape":[1],"data_offsets":[0,4]'
_HEADERS: list[tuple[str, str | bytes]] = [
    ("leading_ws", "  {" + f'"x":{{{X}}}' + "}"),
    ("trailing_ws", "{" + f'"x":{{{X}}}' + "}\t\r\n "),
    ("trailing_nul", b'{"x":{' + X.encode() + b"}}\0"),
    ("bom", "\ufeff{" + f'"x":{{{X}}}' + "}"),
    ("nbsp", "\u00a0{" + f'"x":{{{X}}}' + "}"),
    ("meta_null", '{"__metadata__":null,' + f'"x":{{{X}}}' + "}"),
    ("meta_int", '{"__metadata__":{"a":1},' + f'"x":{{{X}}}' + "}"),
    ("meta_empty", '{"__metadata__":{},' + f'"x":{{{X}}}' + "}"),
    ("meta_escaped_name", '{"__metadata\\u005f_":{"a":"b"},' + f'"x":{{{X}}}' + "}"),
    ("extra_field", '{"x":{' + X + ',"foo":[1,{"a":null}]}}'),
    ("dup_field", '{"x":{"dtype":"F32","dtype":"F16","shape":[2],"data_offsets":[0,4]}}'),
    ("neg_zero_dim", '{"x":{"dtype":"F32","shape":[-0],"data_offsets":[0,0]}}'),
    ("float_dim", '{"x":{"dtype":"F32","shape":[1.0],"data_offsets":[0,4]}}'),
    ("bool_dim", '{"x":{"dtype":"F32","shape":[true],"data_offsets":[0,4]}}'),
    ("three_offsets", '{"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4,4]}}'),
    ("reversed_offsets", '{"x":{"dtype":"F32","shape":[0],"data_offsets":[4,0]}}'),
    ("u64_max_offset", '{"x":{"dtype":"F32","shape":[1],"data_offsets":[0,18446744073709551615]}}'),
    ("overflow_then_zero", '{"x":{"dtype":"F32","shape":[4294967296,4294967296,0],"data_offsets":[0,0]}}'),
    ("zero_then_big", '{"x":{"dtype":"F32","shape":[0,4294967296,4294967296],"data_offsets":[0,0]}}'),
    ("dim_over_i64", '{"x":{"dtype":"U8","shape":[0,9223372036854775808],"data_offsets":[0,0]}}'),
    ("dim_i64_max", '{"x":{"dtype":"U8","shape":[0,9223372036854775807],"data_offsets":[0,0]}}'),
    ("empty_header", "{}"),
    ("array_header", "[]"),
    ("only_whitespace", "   "),
    ("metadata_only", '{"__metadata__":{"a":"b"}}'),
    ("not_utf8", b'{"__metadata__":{"a":"\xff"}}'),
    ("lone_surrogate_name", '{"\\ud800":{' + X + "}}"),
    ("lone_low_surrogate_ignored", '{"x":{' + X + ',"foo":"\\udc00"}}'),
    ("surrogate_pair_name", '{"\\ud83d\\ude00":{' + X + "}}"),
    ("nul_name", '{"\\u0000":{' + X + "}}"),
    ("empty_name", '{"":{' + X + "}}"),
    ("lowercase_dtype", '{"x":{"dtype":"f32","shape":[1],"data_offsets":[0,4]}}'),
    ("escaped_dtype", '{"x":{"dtype":"F\\u0033\\u0032","shape":[1],"data_offsets":[0,4]}}'),
    ("dtype_as_unit_variant", '{"x":{"dtype":{"F32":null},"shape":[1],"data_offsets":[0,4]}}'),
    ("dtype_variant_with_value", '{"x":{"dtype":{"F32":1},"shape":[1],"data_offsets":[0,4]}}'),
    ("dtype_two_variants", '{"x":{"dtype":{"F32":null,"F16":null},"shape":[1],"data_offsets":[0,4]}}'),
    ("dtype_null", '{"x":{"dtype":null,"shape":[1],"data_offsets":[0,4]}}'),
    ("entry_as_array", '{"x":["F32",[1],[0,4]]}'),
    ("entry_array_of_two", '{"x":["F32",[1]]}'),
    ("entry_array_of_four", '{"x":["F32",[1],[0,4],1]}'),
    ("missing_shape", '{"x":{"dtype":"F32","data_offsets":[0,4]}}'),
    ("nan_value", '{"x":{' + X + ',"foo":NaN}}'),
    ("huge_float_ignored", '{"x":{' + X + ',"foo":1e400}}'),
    ("huge_int_ignored", '{"x":{' + X + ',"foo":1' + "0" * 400 + "}}"),
    ("big_int_ignored", '{"x":{' + X + ',"foo":123456789012345678901234567890}}'),
    ("neg_zero_ignored", '{"x":{' + X + ',"foo":-0}}'),
    ("control_char", '{"x":{' + X + ',"foo":"a\tb"}}'),
    ("trailing_comma", '{"x":{' + X + "},}"),
    ("two_documents", '{"x":{' + X + "}} {}"),
    ("deep_but_allowed", '{"x":{' + X + ',"foo":' + '{"a":' * 125 + "1" + "}" * 125 + "}}"),
    ("too_deep", '{"x":{' + X + ',"foo":' + '{"a":' * 126 + "1" + "}" * 126 + "}}"),
    ("too_deep_arrays", '{"x":{' + X + ',"foo":' + "[" * 126 + "]" * 126 + "}}"),
    ("zero_size_at_one_offset", '{"a":{"dtype":"F32","shape":[0],"data_offsets":[0,0]},'
                                '"b":{"dtype":"F32","shape":[0],"data_offsets":[0,0]},"c":{' + X + "}}"),
]  # fmt: skip


@pytest.mark.parametrize(("label", "header"), _HEADERS, ids=[h[0] for h in _HEADERS])
def test_header_rules_match_the_crate(tmp_path: Path, label: str, header: str | bytes) -> None:
    text = header.encode() if isinstance(header, str) else header
    data = b"\0" * 4 if b'"data_offsets":[0,4]' in text or b"[0,4]]" in text else b""
    path = _st_file(tmp_path / f"{label}.safetensors", text, data)
    assert _our_facts(path) == _load_file_facts(path)


def test_names_written_twice_are_refused_though_the_crate_keeps_the_last(tmp_path: Path) -> None:
    path = _st_file(
        tmp_path / "dup.safetensors",
        '{"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"x":{"dtype":"F16","shape":[2],"data_offsets":[0,4]}}',
        b"\0" * 4,
    )
    assert _load_file_facts(path) == {"x": ("float16", (2,), "unknown")}  # the crate: the last one
    with pytest.raises(CheckpointError, match="names 'x' twice; readers disagree"):
        read_checkpoint(path)


# -- directories walked by content ----------------------------------------------------------------


def _plain_tree(root: Path, outside: Path) -> dict[str, bool]:
    """name -> whether a walk must scan it."""
    root.mkdir()
    (root / "sub").mkdir()
    (root / ".git" / "objects").mkdir(parents=True)
    torch.save({"w": torch.ones(2)}, root / "weights")
    torch.save({"w": torch.ones(2)}, root / "old_format", _use_new_zipfile_serialization=False)
    torch.save({"w": torch.ones(2, dtype=torch.float16)}, root / "sub" / "inner.data")
    save_file({"s": torch.ones(2)}, str(root / "tensors.dat"))
    torch.save({"w": torch.ones(2)}, root / ".git" / "objects" / "blob")
    (root / "proto0").write_bytes(pickle.dumps({"a": 1}, protocol=0))
    (root / "notes.txt").write_text("(c) 2024 some text\nI like pickles\n")
    (root / "config.yaml").write_text("lr: 0.1\n")
    (root / "meta.json").write_text('{"a": 1}')
    (root / "train.py").write_text("import torch\n")
    (root / "tokenizer.model").write_bytes(b"\x0a\x0b" + bytes(range(200)))
    (root / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 64)
    (root / "empty").write_bytes(b"")
    (root / "pointer.safetensors").write_text("version https://git-lfs.github.com/spec/v1\noid sha256:00\nsize 1\n")
    with zipfile.ZipFile(root / "docs.zip", "w") as z:
        z.writestr("readme.txt", "hello")
    with zipfile.ZipFile(root / "bundle.zip", "w") as z:
        z.writestr("x/DATA.PKL", b"\x80\x02}q\x00.")
    torch.save({"w": torch.ones(2)}, outside)
    (root / "link_out").symlink_to(outside)
    (root / "link_in").symlink_to(root / "weights")
    return {
        "weights": True,
        "old_format": True,
        "sub/inner.data": True,
        "tensors.dat": True,
        "proto0": True,
        "pointer.safetensors": True,
        "bundle.zip": True,
        "notes.txt": False,
        "config.yaml": False,
        "meta.json": False,
        "train.py": False,
        "tokenizer.model": False,
        "image.png": False,
        "empty": False,
        "docs.zip": False,
        "link_out": True,  # followed where it leads, as torch.load follows it
        ".git/objects/blob": False,
    }


def test_a_plain_directory_is_walked_by_content(tmp_path: Path) -> None:
    root = tmp_path / "tree"
    want = _plain_tree(root, tmp_path / "outside.pt")
    left_out: list[tuple[str, str]] = []
    found = {Path(p).relative_to(root).as_posix() for p in expand([str(root)], left_out=left_out)}
    assert len(found & {"link_in", "weights"}) == 1  # one file, reached twice, scanned once
    # nothing is passed over silently: every file not scanned is listed with why
    assert {Path(p).relative_to(root).as_posix() for p, _ in left_out} == {
        name.split("/")[0] for name, scanned in want.items() if not scanned
    }
    reasons = {Path(p).relative_to(root).as_posix(): why for p, why in left_out}
    assert reasons[".git"] == "a version-control folder"
    assert reasons["docs.zip"].startswith("a zip archive with no pickle")
    assert reasons["empty"] == "an empty file"
    assert reasons["image.png"] == "a PNG image, not a checkpoint"
    assert {"weights" if f == "link_in" else f for f in found} == {name for name, scanned in want.items() if scanned}
    for name, scanned in want.items():
        if (root / name).is_file() and not (root / name).is_symlink() and not name.startswith(".git/"):
            assert is_candidate(root / name) == scanned, name


def test_a_file_named_directly_is_always_read(tmp_path: Path) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("hello\n")
    assert expand([str(path)]) == [str(path)]
    with pytest.raises(CheckpointError, match="not a checkpoint"):
        read_checkpoint(path)


def test_a_directory_without_checkpoints(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("x")
    with pytest.raises(UsageError, match="no checkpoints found"):
        expand([str(tmp_path)])


def test_scan_of_a_walked_directory(tmp_path: Path) -> None:
    root = tmp_path / "tree"
    root.mkdir()
    torch.save({"w": torch.ones(2)}, root / "weights")
    (root / "readme.md").write_text("# model\n")
    code, doc, _ = json_report("scan", str(root), "--preset", "fp16")
    assert code == 1
    assert [Path(c["path"]).name for c in doc["checkpoints"]] == ["weights"]


# -- Hugging Face directories, as from_pretrained loads them ---------------------------------------


try:
    import transformers
except ImportError:  # only the tests below need it: the ones above still run
    transformers = None

needs_transformers = pytest.mark.skipif(transformers is None, reason="pip install transformers")


def _gpt2(path: Path) -> Path:
    cfg = transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16, n_positions=8, eos_token_id=0, bos_token_id=0)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    config.pop("dtype", None)  # dtype="auto" then takes the weights' own dtype, which shows which file was read
    config.pop("torch_dtype", None)
    (path / "config.json").write_text(json.dumps(config))
    return path


def _state(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


def _variant(state: dict[str, torch.Tensor], dtype: torch.dtype, shift: float) -> dict[str, torch.Tensor]:
    return {k: (v.float() + shift).to(dtype).contiguous() for k, v in state.items()}


def _crowded(path: Path) -> tuple[Path, dict[str, dict[str, torch.Tensor]]]:
    """save_pretrained's output plus everything else people leave next to it."""
    _gpt2(path)
    base = _state(path)
    single = _variant(base, torch.float16, 1.0)
    save_file(single, str(path / "model.safetensors"), metadata={"format": "pt"})
    names = sorted(base)
    halves = [names[: len(names) // 2], names[len(names) // 2 :]]
    sharded = _variant(base, torch.float32, 2.0)
    weight_map = {}
    for i, part in enumerate(halves):
        fname = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({k: sharded[k] for k in part}, str(path / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, fname))
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    save_file({k: sharded[k] for k in halves[0]}, str(path / "model-00003-of-00003.safetensors"))  # stale, in no index
    binary = _variant(base, torch.bfloat16, 3.0)
    torch.save(binary, path / "pytorch_model.bin")
    save_file(_variant(base, torch.float16, 4.0), str(path / "model.fp16.safetensors"))
    torch.save(_variant(base, torch.float32, 5.0), path / "weights")
    (path / "sub").mkdir()
    save_file(_variant(base, torch.float32, 6.0), str(path / "sub" / "model.safetensors"))
    torch.save({"learning_rate": 0.1}, path / "training_args.bin")  # no tensors: nothing to say
    (path / "README.md").write_text("# tiny\n")
    return path, {"single": single, "sharded": sharded, "binary": binary}


def _from_pretrained(path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[set[str], dict[str, torch.Tensor]]:
    """The files transformers opens for weights, and the model it builds."""
    mu = transformers.modeling_utils
    opened: set[str] = set()
    real_safe_open, real_load = mu.safe_open, mu.load_state_dict

    def spy_safe_open(file: Any, *a: Any, **k: Any) -> Any:
        opened.add(Path(file).relative_to(path).as_posix())
        return real_safe_open(file, *a, **k)

    def spy_load(file: Any, *a: Any, **k: Any) -> Any:
        opened.add(Path(file).relative_to(path).as_posix())
        return real_load(file, *a, **k)

    monkeypatch.setattr(mu, "safe_open", spy_safe_open)
    monkeypatch.setattr(mu, "load_state_dict", spy_load)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True)
    return opened, model.state_dict()


def _assert_same_as_transformers(path: Path, monkeypatch: pytest.MonkeyPatch, source: dict[str, torch.Tensor]) -> Any:
    inv = read_checkpoint(path)
    opened, loaded = _from_pretrained(path, monkeypatch)
    assert set(inv.metadata["shards"]) == opened  # type: ignore[arg-type]
    ours = {t.name: t for t in inv.tensors}
    assert set(ours) == set(source) and set(ours) <= set(loaded)
    for name, t in ours.items():
        assert str(loaded[name].dtype)[6:] == t.dtype, name
        assert tuple(loaded[name].shape) == t.shape, name
        assert torch.equal(loaded[name], source[name]), name  # the values of the file we audited
    return inv


def _unused(inv: Any) -> dict[str, str]:
    return {f.file: f.message for f in inv.findings if f.rule == "unused-weights"}


@needs_transformers
def test_single_file_wins_over_the_index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path, sources = _crowded(tmp_path / "m")
    inv = _assert_same_as_transformers(path, monkeypatch, sources["single"])
    assert {t.dtype for t in inv.tensors} == {"float16"}
    unused = _unused(inv)
    assert set(unused) == {
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model-00003-of-00003.safetensors",
        "pytorch_model.bin",
        "model.fp16.safetensors",
        "weights",
        "sub/model.safetensors",
    }
    assert unused["weights"] == "weights holds weights that from_pretrained would not load (it loads model.safetensors)"
    assert all(f.severity == "warning" for f in inv.findings if f.rule == "unused-weights")


@needs_transformers
def test_the_index_when_there_is_no_single_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path, sources = _crowded(tmp_path / "m")
    (path / "model.safetensors").unlink()
    inv = _assert_same_as_transformers(path, monkeypatch, sources["sharded"])
    assert inv.metadata["index"] == "model.safetensors.index.json"
    unused = _unused(inv)
    assert "model-00003-of-00003.safetensors" in unused and "pytorch_model.bin" in unused
    assert "model-00001-of-00002.safetensors" not in unused
    assert unused["weights"].endswith("(it loads the shards of model.safetensors.index.json)")


@needs_transformers
def test_pytorch_model_bin_when_there_is_no_safetensors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path, sources = _crowded(tmp_path / "m")
    for name in ("model.safetensors", "model.safetensors.index.json"):
        (path / name).unlink()
    inv = _assert_same_as_transformers(path, monkeypatch, sources["binary"])
    assert {t.dtype for t in inv.tensors} == {"bfloat16"}
    assert "model-00001-of-00002.safetensors" in _unused(inv)


@needs_transformers
def test_config_transformers_weights_names_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path, _ = _crowded(tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    config["transformers_weights"] = "sub/model.safetensors"
    (path / "config.json").write_text(json.dumps(config))
    source = load_file(str(path / "sub" / "model.safetensors"))
    inv = _assert_same_as_transformers(path, monkeypatch, source)
    assert "model.safetensors" in _unused(inv)


@needs_transformers
@pytest.mark.parametrize("name", ["../x.safetensors", "/etc/x.safetensors", "weights.pt"])
def test_config_transformers_weights_that_escape_or_are_not_safetensors(tmp_path: Path, name: str) -> None:
    path = _gpt2(tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    config["transformers_weights"] = name
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="transformers_weights"):
        read_checkpoint(path)


def _layouts(path: Path) -> list[tuple[str, Path]]:
    out = []
    for label, drop, extra in [
        ("everything", (), {}),
        ("no_single", ("model.safetensors",), {}),
        ("bin_only", ("model.safetensors", "model.safetensors.index.json"), {}),
        ("bin_index", ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin"), {"bin_index": True}),
        ("distributed", (), {"distributed": True}),
        ("explicit_index", (), {"explicit": "model.safetensors.index.json"}),
        ("explicit_file", (), {"explicit": "sub/model.safetensors"}),
    ]:
        d = path / label
        shutil.copytree(path / "base", d, symlinks=True)
        for name in drop:
            (d / name).unlink()
        if extra.get("bin_index"):
            torch.save({"x": torch.ones(1)}, d / "pytorch_model-00001-of-00001.bin")
            index = {"metadata": {}, "weight_map": {"x": "pytorch_model-00001-of-00001.bin"}}
            (d / "pytorch_model.bin.index.json").write_text(json.dumps(index))
        if extra.get("distributed"):
            save_file({"y": torch.ones(1)}, str(d / "shard-00001-model-00001-of-00001.safetensors"))
        if "explicit" in extra:
            config = json.loads((d / "config.json").read_text())
            config["transformers_weights"] = extra["explicit"]
            (d / "config.json").write_text(json.dumps(config))
        out.append((label, d))
    return out


@needs_transformers
def test_resolution_matches_transformers_for_each_layout(tmp_path: Path) -> None:
    from transformers.distributed.checkpoint import _get_resolved_distributed_checkpoint_files, get_distributed_checkpoint_dir

    mu = transformers.modeling_utils
    _crowded(tmp_path / "base")
    for label, d in _layouts(tmp_path):
        config = json.loads((d / "config.json").read_text())
        if get_distributed_checkpoint_dir(str(d), "", None, None) is not None:
            files = _get_resolved_distributed_checkpoint_files(str(d))
        else:
            files, _ = mu._get_resolved_checkpoint_files(
                str(d), None, None, None, None, False, transformers_explicit_filename=config.get("transformers_weights")
            )
        theirs = [Path(f).resolve().relative_to(d.resolve()).as_posix() for f in files]
        res = directory.resolve(d)
        assert res is not None and list(res.files) == theirs, label


@needs_transformers
def test_no_loader_file_keeps_reading_the_shards(hf_dir: Path, tmp_path: Path) -> None:
    bare = tmp_path / "bare"
    shutil.copytree(hf_dir, bare)
    (bare / "model.safetensors.index.json").unlink()
    assert directory.resolve(bare) is None  # from_pretrained would find nothing it loads
    inv = read_checkpoint(bare)
    assert inv.metadata["from_pretrained"] == "finds no weights file here"
    assert _unused(inv) == {}


@needs_transformers
def test_symlinked_shards_inside_the_directory_are_fine(tmp_path: Path) -> None:
    path = _gpt2(tmp_path / "m")
    (path / "blobs").mkdir()
    (path / "model.safetensors").rename(path / "blobs" / "abc")
    (path / "model.safetensors").symlink_to(path / "blobs" / "abc")
    inv = read_checkpoint(path)
    assert inv.metadata["shards"] == ["model.safetensors"]
    assert _unused(inv) == {}  # the blob is the file it loads, seen through its link


@needs_transformers
def test_a_model_directory_inside_a_walked_tree(tmp_path: Path) -> None:
    root = tmp_path / "tree"
    root.mkdir()
    _gpt2(root / "model")
    torch.save({"w": torch.ones(2)}, root / "loose.ckpt")
    assert [Path(p).relative_to(root).as_posix() for p in expand([str(root)])] == ["loose.ckpt", "model"]


# -- a sniffer's verdicts come from the input only: a bug of ours propagates (exit 3) -----------------------------


def _mutants(seed: bytes, n: int, rng: Any) -> Any:
    """``n`` copies of ``seed``, each with a few bytes changed, cut out or put in (seeded: the same every run)."""
    for _ in range(n):
        data = bytearray(seed)
        for _ in range(rng.randint(1, 4)):
            at, roll = rng.randrange(len(data)), rng.random()
            if roll < 0.5:
                data[at] = rng.randrange(256)
            elif roll < 0.75:
                del data[at : at + rng.randint(1, 8)]
            else:
                data[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 4)))
        yield bytes(data)


def test_malformed_pickles_and_zips_raise_only_checkpoint_errors(tmp_path: Path) -> None:
    """What the sniffer catches is all a bad input makes the readers raise: PickleVM and ZipArchive say what is
    wrong only as CheckpointError, so anything else they raise is a bug and may propagate."""
    import random

    from dtypeaudit.formats.picklevm import PickleVM
    from dtypeaudit.formats.source import LocalSource
    from dtypeaudit.formats.ziparchive import ZipArchive

    rng = random.Random(18)
    buf = io.BytesIO()
    torch.save({"w": torch.ones(2), "meta": [1, 2.5, "s", (3, None)]}, buf, _use_new_zipfile_serialization=False)
    pickles = [pickle.dumps({"a": [1, 2.5, "s", b"b", (1,), None, True, {1: 2}]}, protocol=p) for p in range(6)] + [buf.getvalue()]
    outcomes: dict[str, int] = {}
    for seed in pickles:
        for data in _mutants(seed, 300, rng):
            try:
                PickleVM(data, source="mutant").load(0)
                outcomes["read"] = outcomes.get("read", 0) + 1
            except CheckpointError:
                outcomes["refused"] = outcomes.get("refused", 0) + 1
    assert outcomes["refused"] > 1000 and outcomes["read"] > 100  # both outcomes, and nothing else raised

    zipped = io.BytesIO()
    torch.save({"w": torch.ones(2), "h": torch.zeros(3, dtype=torch.float16)}, zipped)
    refused = 0
    path = tmp_path / "mutant.pt"
    for data in _mutants(zipped.getvalue(), 300, rng):
        # the central directory is where a zip reader parses most: change bytes there too
        tail = bytearray(data)
        for _ in range(rng.randint(0, 4)):
            tail[len(tail) - rng.randint(1, min(200, len(tail)))] = rng.randrange(256)
        path.write_bytes(bytes(tail))
        try:
            with LocalSource(path) as src, ZipArchive.open(src) as za:
                za.pickle_entries()
        except CheckpointError:
            refused += 1
    assert refused > 100


def scanned_as_our_bug(target: Path, bug: type) -> Any:
    """``scan TARGET`` run as a user runs it, when a bug of ours (``bug("a bug of ours")``) was raised inside:
    exit 3, an internal error naming it. Returns the finished process."""
    proc = run_cli("scan", str(target), "--format", "json")
    assert proc.returncode == 3, proc.stderr
    assert f"internal error: {bug.__name__}: a bug of ours" in proc.stderr
    return proc


@pytest.mark.parametrize("bug", [TypeError, ValueError])
def test_a_bug_in_reading_a_first_pickle_is_not_a_verdict(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bug: type) -> None:
    from dtypeaudit.formats import picklevm
    from dtypeaudit.formats.sniff import HEAD_BYTES

    path = tmp_path / "big.pkl"
    path.write_bytes(pickle.dumps({"x": b"a" * (HEAD_BYTES + 1000)}, protocol=2))
    assert sniff_kind(path) == "pickle"  # its first pickle runs past the head: read over the whole file
    real_load = picklevm.PickleVM.load

    def load(self: Any, start: int = 0) -> Any:
        if not isinstance(self.data, bytes):  # the whole file, mapped: where the sniffer used to catch ValueError
            raise bug("a bug of ours")
        return real_load(self, start)

    monkeypatch.setattr(picklevm.PickleVM, "load", load)
    with pytest.raises(bug, match="a bug of ours"):
        sniff_kind(path)
    assert scanned_as_our_bug(path, bug).stdout == ""


@pytest.mark.parametrize("bug", [TypeError, AttributeError])
def test_a_bug_in_looking_into_a_walked_zip_is_not_a_verdict(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bug: type) -> None:
    from dtypeaudit.formats.sniff import leave_out_reason
    from dtypeaudit.formats.ziparchive import ZipArchive

    folder = tmp_path / "tree"
    folder.mkdir()
    torch.save({"w": torch.ones(2)}, folder / "weights.bin")  # a zip not named like a checkpoint: looked into
    with zipfile.ZipFile(folder / "notes.bin", "w") as z:
        z.writestr("readme.txt", "no pickle here")
    assert leave_out_reason(folder / "weights.bin") is None
    assert leave_out_reason(folder / "notes.bin") == "a zip archive with no pickle in it (torch.load cannot load it)"

    def pickle_entries(self: Any) -> Any:
        raise bug("a bug of ours")

    monkeypatch.setattr(ZipArchive, "pickle_entries", pickle_entries)
    with pytest.raises(bug, match="a bug of ours"):
        leave_out_reason(folder / "weights.bin")
    assert scanned_as_our_bug(folder, bug).stdout == ""


@pytest.mark.parametrize("bug", [TypeError, ValueError])
def test_a_bug_under_tarfile_is_not_a_verdict(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bug: type) -> None:
    from dtypeaudit.formats import source

    path = tmp_path / "old.tar"
    with tarfile.open(path, "w") as tar:
        info = tarfile.TarInfo("sys_info")
        info.size = 4
        tar.addfile(info, io.BytesIO(b"abcd"))
    with pytest.raises(CheckpointError, match="is a tar archive"):
        sniff_kind(path)

    def read(self: Any, n: int | None = -1) -> bytes:  # the file object the sniffer hands tarfile
        raise bug("a bug of ours")

    monkeypatch.setattr(source.SourceFile, "read", read)
    with pytest.raises(bug, match="a bug of ours"):
        sniff_kind(path)
    scanned_as_our_bug(path, bug)
