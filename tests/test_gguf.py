"""GGUF scan: our header reader against the ``gguf`` package's GGUFReader, on files its GGUFWriter writes with tensors
quantized by ``gguf.quants.quantize``; malformed files refused in one line (exit 2)."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import pytest

from dtypeaudit.formats import read_checkpoint
from dtypeaudit.formats.gguf import GGML_TYPES, PLAIN_DTYPES
from dtypeaudit.quant.group import view
from tests.helpers import json_report, run_cli


def _gguf() -> Any:
    """The gguf package (and numpy, which it needs): only the tests that write or read GGUF with it skip without it;
    the malformed-file tests build their bytes by hand."""
    pytest.importorskip("numpy")
    return pytest.importorskip("gguf")


# name -> (ggml type name, numpy shape: rows x row length, as GGUFWriter takes it)
TENSORS = {
    "token_embd.weight": ("Q4_K", (64, 256)),
    "blk.0.attn_q.weight": ("Q8_0", (32, 256)),
    "blk.0.attn_k.weight": ("Q4_0", (32, 256)),
    "blk.0.ffn_up.weight": ("Q6_K", (48, 512)),
    "blk.0.ffn_down.weight": ("Q5_K", (256, 256)),
    "blk.0.attn_norm.weight": ("F32", (256,)),
    "blk.0.attn_v.weight": ("F16", (32, 256)),
    "output.weight": ("BF16", (64, 256)),
}
PLAIN = ("F32", "F16", "BF16")


# Where each K-quant block keeps its float16 super-block scales (d, dmin), by byte offset in the block.
F16_SCALES = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def quantized(data: object, qtype: object, rng: object, *, finite: bool = True) -> object:
    """``gguf.quants.quantize``; for the types whose quantizer the gguf package leaves to llama.cpp (the K-quants),
    random blocks of the type's size, which its dequantizer reads like any others: their float16 scales kept
    finite (an exponent bit cleared) unless ``finite`` is False, when some are NaN or Inf, as random bytes make them."""
    gguf = _gguf()
    import numpy as np

    try:
        return gguf.quants.quantize(data, qtype)
    except NotImplementedError:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        rows, cols = data.shape  # type: ignore[attr-defined]
        raw = rng.integers(0, 256, (rows, cols // block * size), dtype=np.uint8)  # type: ignore[attr-defined]
        if finite:
            blocks = raw.reshape(-1, size)
            for offset in F16_SCALES[qtype.name]:  # type: ignore[attr-defined]
                blocks[:, offset + 1] &= 0xBF  # the high byte (little-endian): exponent at most 23 of 31
        return raw


def write_gguf(path: Path, tensors: dict[str, tuple[str, tuple[int, ...]]] = TENSORS, *, finite: bool = True) -> Path:
    gguf = _gguf()
    import numpy as np

    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny")
    writer.add_file_type(15)
    writer.add_token_list([f"tok{i}" for i in range(300)])  # an array of strings to walk past
    writer.add_token_scores([float(i) for i in range(300)])
    for name, (type_name, shape) in tensors.items():
        qtype = gguf.GGMLQuantizationType[type_name]
        data = rng.standard_normal(shape).astype(np.float32)
        if type_name == "F32":
            writer.add_tensor(name, data)
        elif type_name == "F16":
            writer.add_tensor(name, data.astype(np.float16))
        else:
            writer.add_tensor(name, quantized(data, qtype, rng, finite=finite), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_ggml_type_table_matches_the_gguf_package() -> None:
    gguf = _gguf()
    theirs = {int(t): (t.name, *gguf.GGML_QUANT_SIZES[t]) for t in gguf.GGMLQuantizationType}
    assert GGML_TYPES == theirs


def test_reader_matches_ggufreader(tmp_path: Path) -> None:
    gguf = _gguf()
    path = write_gguf(tmp_path / "tiny.gguf")
    inv = read_checkpoint(str(path))
    reader = gguf.GGUFReader(str(path))
    assert inv.format == "gguf"
    want = {}
    for t in reader.tensors:
        name = t.tensor_type.name
        # GGUFReader's shape is ggml's (innermost first); its data array is in PyTorch's order
        torch_shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        dtype = PLAIN_DTYPES.get(name, "uint8")
        stored_shape = torch_shape if name in PLAIN_DTYPES else (int(t.n_bytes),)
        want[t.name] = (dtype, stored_shape, int(t.n_bytes), int(t.data_offset))
    assert {t.name: (t.dtype, t.shape, t.nbytes, t.offset) for t in inv.tensors} == want
    assert inv.layout is not None and inv.layout.storages == {t.name: (int(t.data_offset), int(t.n_bytes)) for t in reader.tensors}
    assert inv.metadata["gguf"] == {
        "version": 3,
        "alignment": 32,
        "data_offset": int(reader.data_offset),
        "architecture": "llama",
        "name": "tiny",
        "file_type": 15,
    }


def test_each_quantized_tensor_is_a_logical_weight(tmp_path: Path) -> None:
    gguf = _gguf()
    import numpy as np

    Q = gguf.GGMLQuantizationType
    path = write_gguf(tmp_path / "tiny.gguf")
    inv = read_checkpoint(str(path))
    quant = view(inv)
    got = {w.name: (w.scheme.name, w.shape, w.dequantizes_to, w.scheme.params["ggml_type"], dict(w.storage)) for w in quant.weights}
    quantized = {n: (q, s) for n, (q, s) in TENSORS.items() if q not in PLAIN}
    assert got == {n: (q, s, "float32", int(Q[q]), {"weight": n}) for n, (q, s) in quantized.items()}
    q8 = next(w for w in quant.weights if w.scheme.name == "Q8_0")
    assert q8.bits_per_weight == 8.5  # 34 bytes per 32 values
    q4k = next(w for w in quant.weights if w.scheme.name == "Q4_K")
    assert q4k.bits_per_weight == 4.5  # 144 bytes per 256 values
    # the bytes the reader points at are the bytes gguf.quants.dequantize reads back
    reader = gguf.GGUFReader(str(path))
    t = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight")
    raw = path.read_bytes()
    offset, nbytes = inv.layout.storages["blk.0.attn_q.weight"]  # type: ignore[union-attr]
    mine = np.frombuffer(raw[offset : offset + nbytes], dtype=np.uint8).reshape(32, -1)
    np.testing.assert_array_equal(gguf.quants.dequantize(mine, Q.Q8_0), gguf.quants.dequantize(t.data, Q.Q8_0))


def test_scan_report_and_exit_code(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "tiny.gguf")
    proc = run_cli("scan", str(path), env={"COLUMNS": "200"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    row = next(line for line in proc.stdout.splitlines() if line.startswith("blk.0.ffn_up.weight "))
    assert row.split()[:6] == ["blk.0.ffn_up.weight", "Q6_K", "→", "float32", "[48,", "512]"]
    code, report, _ = json_report("scan", str(path))
    (c,) = report["checkpoints"]
    assert code == 0 and c["format"] == "gguf" and c["findings"] == []
    assert sorted(w["scheme"] for w in c["quantized"]) == ["Q4_0", "Q4_K", "Q5_K", "Q6_K", "Q8_0"]


def _header(version: int = 3, n_tensors: int = 0, n_kv: int = 0) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv)


def _string(s: str) -> bytes:
    raw = s.encode()
    return struct.pack("<Q", len(raw)) + raw


@pytest.mark.parametrize(
    ("content", "words"),
    [
        (_header(version=1), "version 1 is not supported"),
        (_header(n_tensors=1 << 40), "over the caps"),
        (_header(n_kv=1) + _string("general.name"), "runs past the end"),
        (_header(n_kv=1) + struct.pack("<Q", 1 << 40), "over the 16777216-byte cap"),
        (_header(n_kv=1) + _string("k") + struct.pack("<I", 99), "unknown value type 99"),
        (_header(n_tensors=1) + _string("w") + struct.pack("<I", 9), "9 dims"),
        (_header(n_tensors=1) + _string("w") + struct.pack("<IQIQ", 1, 32, 77, 0), "unknown ggml type 77"),
        (_header(n_tensors=1) + _string("w") + struct.pack("<IQIQ", 1, 32, 8, 0), "outside the"),
        (_header(n_tensors=1) + _string("w") + struct.pack("<IQIQ", 1, 33, 8, 0) + bytes(64), "not a whole number of Q8_0 blocks"),
        (_header(n_kv=2) + (_string("a") + struct.pack("<IB", 0, 1)) * 2, "listed twice"),
    ],
)
def test_malformed_files_are_refused_in_one_line(tmp_path: Path, content: bytes, words: str) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    proc = run_cli("scan", str(path))
    assert proc.returncode == 2
    assert words in proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr


_NO_TORCH = """
import sys
class Block:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name.partition(".")[0] in ("torch", "numpy", "safetensors", "gguf"):
            raise ImportError("blocked: " + name)
        return None
sys.meta_path.insert(0, Block)
from dtypeaudit.cli import main
sys.argv = ["dtypeaudit", "scan", *ARGS, "--format", "json"]
main()
"""


def test_quantized_scans_need_neither_torch_nor_numpy(tmp_path: Path) -> None:
    """The light install (no torch, numpy, safetensors or gguf) groups logical weights and reads GGUF the same."""
    import json
    import os
    import subprocess
    import sys

    import torch
    from safetensors.torch import save_file

    gguf_path = write_gguf(tmp_path / "tiny.gguf")
    fp8 = tmp_path / "fp8"
    fp8.mkdir()
    save_file(
        {"l.weight": torch.ones(128, 128).to(torch.float8_e4m3fn), "l.weight_scale_inv": torch.ones(1, 1)}, str(fp8 / "model.safetensors")
    )
    (fp8 / "config.json").write_text(
        json.dumps({"torch_dtype": "bfloat16", "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}})
    )
    args = [str(gguf_path), str(fp8)]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent), "NO_COLOR": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", _NO_TORCH.replace("ARGS", repr(args))], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    code, full, _ = json_report("scan", *args)
    assert code == 0
    light = json.loads(proc.stdout)
    for c in (*light["checkpoints"], *full["checkpoints"]):
        c.pop("bytes_read")
    assert light == full
    assert [len(c["quantized"]) for c in light["checkpoints"]] == [5, 1]


# An all-float GGUF (F32, F16 and BF16 tensors, nothing quantized): no writer of ours writes GGUF, so convert takes
# the dequantizing path, whose plan and output agree, for --dry-run and the real run alike.
FLOAT_TENSORS = {
    "blk.0.attn_norm.weight": ("F32", (256,)),
    "blk.0.attn_q.weight": ("F32", (32, 256)),
    "blk.0.attn_v.weight": ("F16", (32, 256)),
}


def test_an_unquantized_gguf_converts_by_the_dequantizing_writer(tmp_path: Path) -> None:
    from safetensors.numpy import load_file

    gguf = _gguf()
    import numpy as np

    from dtypeaudit.inventory import Format

    path = write_gguf(tmp_path / "float.gguf", FLOAT_TENSORS)
    assert not view(read_checkpoint(str(path)))  # nothing quantized
    assert Format.GGUF.dequantizes and not Format.GGUF.casts and Format.GGUF.convert_refusal is None
    planned = run_cli("convert", str(path), "--to", "fp16", "--dry-run")
    assert planned.returncode == 0, planned.stdout + planned.stderr
    assert "tensors: 2 cast, 1 left as they are" in planned.stdout
    assert "note: no quantized weights: a gguf file is converted by the dequantizing writer, to safetensors" in planned.stdout
    assert "dequantized to" not in planned.stdout  # no "0 quantized weights" note
    done = run_cli("convert", str(path), "--to", "fp16")
    assert done.returncode == 0, done.stdout + done.stderr
    out = tmp_path / "float.fp16.safetensors"
    assert f"-> {out}" in done.stdout
    got = load_file(str(out))
    # the values are the gguf package's own reading of the file, cast to float16
    theirs = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(str(path)).tensors}
    assert sorted(got) == sorted(FLOAT_TENSORS)
    for name, value in got.items():
        assert value.dtype == np.float16 and value.shape == FLOAT_TENSORS[name][1]
        np.testing.assert_array_equal(value, theirs[name].astype(np.float16).reshape(value.shape))


def test_a_gguf_kept_as_it_is_is_refused_alike_by_the_plan_and_the_run(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "float.gguf", FLOAT_TENSORS)
    why = "gguf files are converted by dequantizing them to safetensors; their tensors cannot be kept as they are (--keep-quantized)"
    for extra in (("--dry-run",), ("-o", str(tmp_path / "out.pt"))):
        proc = run_cli("convert", str(path), "--to", "fp16", "--keep-quantized", *extra)
        assert proc.returncode == 2 and why in proc.stderr and "pickle" not in proc.stderr, proc.stderr
    assert not (tmp_path / "out.pt").exists()


def _tiny(path: Path, **writer_args: Any) -> tuple[Any, Path]:
    gguf = _gguf()
    writer = gguf.GGUFWriter(str(path), "llama", **writer_args)
    return writer, path


def _finish(writer: Any, data: Any) -> None:
    writer.add_tensor("w", data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("vtype", ["UINT64", "INT32", "UINT8"])
def test_an_alignment_not_stored_as_uint32_is_refused_as_the_loaders_do(tmp_path: Path, vtype: str) -> None:
    gguf = _gguf()
    import numpy as np

    writer, path = _tiny(tmp_path / "a.gguf")
    writer.add_key_value("general.alignment", 32, getattr(gguf.GGUFValueType, vtype))  # type: ignore[attr-defined]
    _finish(writer, np.ones((4, 8), dtype=np.float32))
    with pytest.raises(ValueError, match="alignment"):
        gguf.GGUFReader(str(path))  # the reference refuses it
    r = run_cli("scan", str(path), "-q")
    assert r.returncode == 2
    assert f"GGUF general.alignment is stored as type {int(getattr(gguf.GGUFValueType, vtype))}, not uint32" in r.stderr


def test_a_big_endian_gguf_is_named_as_such(tmp_path: Path) -> None:
    gguf = _gguf()
    import numpy as np

    writer, path = _tiny(tmp_path / "be.gguf", endianess=gguf.GGUFEndian.BIG)
    _finish(writer, np.ones((4, 8), dtype=np.float32))  # the writer swaps the bytes itself
    assert gguf.GGUFReader(str(path)).endianess == gguf.GGUFEndian.BIG  # the reference sees its byte order
    r = run_cli("scan", str(path), "-q")
    assert r.returncode == 2
    assert "is a big-endian GGUF file (version 3)" in r.stderr and "50331648" not in r.stderr
