"""The catalogue of hostile and broken inputs. Each is built at test time and must be answered with one
clear line naming the file and the problem, exit 2 (or 1 with an unsafe-global finding), execute nothing,
finish quickly, and leave every file it did not create untouched."""

from __future__ import annotations

import io
import json
import os
import signal
import struct
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch

from dtypeaudit.formats import read_checkpoint

from . import oracle
from .helpers import ROOT, facts, run_cli
from .hostile import call, dict_pickle, global_op, reduce_pickle, rewrite_zip, safetensors_bytes, text, torch_zip_bytes, with_data_pkl


def rejected(path: Path, code: int, *keywords: str, args: tuple[str, ...] = ()) -> str:
    """Scan ``path`` as a user would; assert the exit code, one line naming the file, the keywords, no traceback."""
    before = path.read_bytes() if path.is_file() else None
    # A hostile file that made the reader hang would hit run_cli's timeout; speed itself is measured in benchmarks/.
    proc = run_cli("scan", str(path), *args)
    assert proc.returncode == code, (proc.returncode, proc.stdout[-2000:], proc.stderr)
    assert "Traceback" not in proc.stderr
    if code == 2:
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and str(path) in lines[0], proc.stderr
        assert "internal error" not in lines[0], lines[0]
        for k in keywords:
            assert k in lines[0], (k, lines[0])
    else:
        doc = json.loads(run_cli("scan", str(path), "-f", "json", *args).stdout)
        messages = " | ".join(f"{f['rule']}: {f['message']}" for f in doc["checkpoints"][0]["findings"])
        for k in keywords:
            assert k in messages, (k, messages)
    if before is not None:
        assert path.read_bytes() == before
    return proc.stdout


@pytest.fixture(scope="module")
def valid_zip() -> bytes:
    return torch_zip_bytes({"w": torch.arange(6, dtype=torch.float32), "b": torch.ones(2, dtype=torch.float16)})


def names(zip_bytes: bytes) -> list[str]:
    return zipfile.ZipFile(io.BytesIO(zip_bytes)).namelist()


# -- containers ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("label", "content", "keywords"),
    [
        ("empty_file", b"", ["empty file"]),
        ("random_bytes", bytes(range(7, 256)) * 3, ["not a checkpoint"]),
        ("png_renamed_pt", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + b"\x00" * 64, ["PNG image"]),
        (
            "git_lfs_pointer",
            b"version https://git-lfs.github.com/spec/v1\noid sha256:4d7a\nsize 1234\n",
            ["Git LFS pointer", "git lfs pull"],
        ),
        ("html_error_page", b"<!DOCTYPE html>\n<html><head><title>403 Forbidden</title></head></html>", ["HTML page"]),
        ("gzip_data", b"\x1f\x8b\x08\x00" + b"\x00" * 40, ["gzip"]),
    ],
)
def test_not_a_checkpoint(tmp_path: Path, label: str, content: bytes, keywords: list[str]) -> None:
    path = tmp_path / f"{label}.pt"
    path.write_bytes(content)
    rejected(path, 2, *keywords)


def test_truncated_zip(tmp_path: Path, valid_zip: bytes) -> None:
    path = tmp_path / "truncated.pt"
    path.write_bytes(valid_zip[: len(valid_zip) // 2])
    rejected(path, 2, "truncated")


def test_zip_without_data_pkl(tmp_path: Path, valid_zip: bytes) -> None:
    pkl = next(n for n in names(valid_zip) if n.endswith("data.pkl"))
    rejected(rewrite_zip(valid_zip, tmp_path / "nopkl.pt", drop={pkl}), 2, "no data.pkl")


def test_entries_without_a_common_prefix(tmp_path: Path, valid_zip: bytes) -> None:
    rename = {n: n.split("/", 1)[1] for n in names(valid_zip)}
    rejected(rewrite_zip(valid_zip, tmp_path / "noprefix.pt", rename=rename), 2, "no top-level folder")


def test_entries_with_two_prefixes(tmp_path: Path, valid_zip: bytes) -> None:
    pkl = next(n for n in names(valid_zip) if n.endswith("data.pkl"))
    data = zipfile.ZipFile(io.BytesIO(valid_zip)).read(pkl)
    rejected(rewrite_zip(valid_zip, tmp_path / "two.pt", add=[("other/data.pkl", data)]), 2, "mixes folders", "other/data.pkl")
    rejected(rewrite_zip(valid_zip, tmp_path / "stray.pt", add=[("other/readme", b"x")]), 2, "mixes folders")


def test_duplicate_entry_names(tmp_path: Path, valid_zip: bytes) -> None:
    pkl = next(n for n in names(valid_zip) if n.endswith("data.pkl"))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        path = rewrite_zip(valid_zip, tmp_path / "dup.pt", add=[(pkl, b"\x80\x02N.")])
    rejected(path, 2, "twice")


def test_short_and_missing_storage_records(tmp_path: Path, valid_zip: bytes) -> None:
    record = next(n for n in names(valid_zip) if n.endswith("data/0"))
    rejected(rewrite_zip(valid_zip, tmp_path / "short.pt", replace={record: b"\x00" * 3}), 2, "holds 3 bytes but the pickle needs 24")
    rejected(rewrite_zip(valid_zip, tmp_path / "missing.pt", drop={record}), 2, "storage '0' is missing")


def test_byteorder_big_is_read_and_unknown_refused(tmp_path: Path, valid_zip: bytes) -> None:
    order = next(n for n in names(valid_zip) if n.endswith("byteorder"))
    big = rewrite_zip(valid_zip, tmp_path / "big.pt", replace={order: b"big"})
    proc = run_cli("scan", str(big), "-f", "json")
    assert proc.returncode == 0
    ckpt = json.loads(proc.stdout)["checkpoints"][0]
    assert ckpt["metadata"]["byteorder"] == "big"
    assert {t["name"]: t["dtype"] for t in ckpt["tensors"]} == {"w": "float32", "b": "float16"}
    conv = run_cli("convert", str(big), "--to", "fp16")
    assert conv.returncode == 2 and "big-endian" in conv.stderr
    rejected(rewrite_zip(valid_zip, tmp_path / "odd.pt", replace={order: b"middle"}), 2, "unknown byteorder 'middle'")


def test_deflated_storage_zip_bomb(tmp_path: Path, valid_zip: bytes) -> None:
    record = next(n for n in names(valid_zip) if n.endswith("data/0"))
    bomb = rewrite_zip(valid_zip, tmp_path / "bomb.pt", replace={record: b"\x00" * (200 << 20)}, compress={record})
    assert bomb.stat().st_size < 1 << 20
    rejected(bomb, 2, "is compressed")


def test_torchscript_is_read_not_loaded(torchscript_pt: Path) -> None:
    out = run_cli("scan", str(torchscript_pt), "-f", "json")
    assert out.returncode == 0
    assert {t["name"] for t in json.loads(out.stdout)["checkpoints"][0]["tensors"]} >= {"conv.weight", "bn.running_var"}


def test_legacy_whose_magic_comes_from_a_reduce(tmp_path: Path, canary: Path) -> None:
    magic = b"\x80\x02" + call(global_op("posix", "system"), text(f"touch {canary}")) + b"."
    path = tmp_path / "legacy.pt"
    path.write_bytes(magic + b"\x80\x02M\xe9\x03." + b"\x80\x02}q\x00.")
    rejected(path, 1, "posix.system")
    assert not canary.exists()


def test_legacy_with_wrong_magic_value(tmp_path: Path, legacy_pt: Path) -> None:
    data = bytearray(legacy_pt.read_bytes())
    data[5] ^= 0xFF
    path = tmp_path / "badmagic.pt"
    path.write_bytes(bytes(data))
    rejected(path, 2)


# -- pickles -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("module", "name", "arg"),
    [
        ("os", "system", "touch {canary}"),
        ("posix", "system", "touch {canary}"),
        ("builtins", "eval", "open('{canary}', 'w')"),
        ("builtins", "exec", "open('{canary}', 'w')"),
        ("runpy", "run_path", "{canary}.py"),
        ("subprocess", "call", "touch {canary}"),
    ],
)
def test_code_execution_globals(tmp_path: Path, canary: Path, module: str, name: str, arg: str) -> None:
    (tmp_path / f"{canary.name}.py").write_text(f"open({str(canary)!r}, 'w')\n")
    path = with_data_pkl(tmp_path / "evil.pt", reduce_pickle(module, name, arg.format(canary=canary)))
    rejected(path, 1, f"calls {module}.{name}", "can execute code")
    assert not canary.exists()


def test_getattr_chain(tmp_path: Path, canary: Path) -> None:
    getter = call(global_op("builtins", "getattr"), global_op("os", "path"), text("exists"))
    path = with_data_pkl(tmp_path / "getattr.pt", dict_pickle(x=call(getter, text(str(canary)))))
    rejected(path, 1, "builtins.getattr", "os.path")


def test_partial_of_torch_load(tmp_path: Path) -> None:
    partial = call(global_op("functools", "partial"), global_op("torch", "load"), text("/tmp/elsewhere.pt"))
    path = with_data_pkl(tmp_path / "partial.pt", dict_pickle(x=call(partial)))
    rejected(path, 1, "functools.partial", "torch.load")


def test_stack_global_through_memo(tmp_path: Path, canary: Path) -> None:
    body = (
        b"\x8c\x02os\x94\x8c\x06system\x94h\x00h\x01\x93"
        + b"\x8c"
        + bytes([len(f"touch {canary}")])
        + f"touch {canary}".encode()
        + b"\x85R"
    )
    data = b"\x80\x04}(\x8c\x01x" + body + b"u."
    rejected(with_data_pkl(tmp_path / "stack.pt", data), 1, "os.system")
    assert not canary.exists()


@pytest.mark.parametrize("protocol", [4, 5])
def test_protocol_4_and_5_framing(tmp_path: Path, protocol: int) -> None:
    path = tmp_path / f"p{protocol}.pt"
    torch.save({"a": torch.ones(3), "b": {"c": torch.zeros(2, dtype=torch.bfloat16)}}, path, pickle_protocol=protocol)
    proc = run_cli("scan", str(path), "-f", "json")
    assert proc.returncode == 0
    got = {t["name"]: (t["dtype"], tuple(t["shape"]), t["kind"]) for t in json.loads(proc.stdout)["checkpoints"][0]["tensors"]}
    # torch's weights_only loader does not take protocol 4/5; this file is our own, so a full load is safe.
    assert got == oracle.facts(oracle.walk(torch.load(path, weights_only=False)))


def test_benign_pickle_followed_by_malicious(tmp_path: Path, canary: Path) -> None:
    data = b"\x80\x02}." + reduce_pickle("os", "system", f"touch {canary}")
    path = with_data_pkl(tmp_path / "smuggled.pt", data)
    rejected(path, 1, "bytes follow the pickle", "os.system")
    bare = tmp_path / "smuggled.pkl"
    bare.write_bytes(data)
    rejected(bare, 1, "os.system")
    assert not canary.exists()


def test_billion_laughs_memo(tmp_path: Path) -> None:
    # Ten memoised lists, each holding the previous one ten times: 10**9 paths in a few hundred bytes.
    level = b"]q\x00(" + b"X\x03\x00\x00\x00lol" * 10 + b"e0"
    for i in range(1, 10):
        level += b"]q" + bytes([i]) + b"(" + (b"h" + bytes([i - 1])) * 10 + b"e" + (b"0" if i < 9 else b"")
    data = b"\x80\x02}(X\x01\x00\x00\x00x" + level + b"u."
    rejected(with_data_pkl(tmp_path / "laughs.pt", data), 2, "too many paths")


def test_deep_nesting(tmp_path: Path) -> None:
    rejected(with_data_pkl(tmp_path / "marks.pt", b"\x80\x02" + b"(" * 5000 + b"N."), 2, "nests deeper")
    rejected(with_data_pkl(tmp_path / "tuples.pt", b"\x80\x02N" + b"\x85" * 100_000 + b"."), 2, "nests deeper")


def test_persistent_id_not_a_storage(tmp_path: Path) -> None:
    rejected(with_data_pkl(tmp_path / "pid.pt", b"\x80\x02X\x03\x00\x00\x00abcQ."), 2, "is not a storage record")


def test_setitem_on_a_non_dict(tmp_path: Path) -> None:
    rejected(with_data_pkl(tmp_path / "setitem.pt", b"\x80\x02]K\x01K\x02s."), 2, "SETITEM on a list")


def test_binunicode_past_the_end(tmp_path: Path) -> None:
    rejected(with_data_pkl(tmp_path / "long.pt", b"\x80\x02X\xff\xff\xff\x00abc."), 2, "runs past the end")


# -- safetensors ---------------------------------------------------------------------------------

F32_2 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}


@pytest.mark.parametrize(
    ("label", "content", "keywords"),
    [
        ("length_past_end", safetensors_bytes({"a": F32_2}, b"\x00" * 8, length=10_000), ["header claims 10000 bytes"]),
        ("length_over_cap", safetensors_bytes(b"{" + b" " * 20, length=200_000_000), ["over the 100000000-byte cap"]),
        ("non_utf8", safetensors_bytes(b'{"a\xff": 1}'), ["not UTF-8"]),
        ("non_json", safetensors_bytes(b"{not json}"), ["not JSON"]),
        (
            "overlap",
            safetensors_bytes({"a": F32_2, "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\x00" * 12),
            ["overlaps"],
        ),
        ("gap", safetensors_bytes({"a": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\x00" * 12), ["gap of 4 bytes"]),
        ("trailing", safetensors_bytes({"a": F32_2}, b"\x00" * 12), ["trailing bytes"]),
        (
            "size_mismatch",
            safetensors_bytes({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\x00" * 8),
            ["= 12 bytes but its offsets span 8"],
        ),
        (
            "shape_overflow",
            safetensors_bytes({"a": {"dtype": "F32", "shape": [2**62, 2**62], "data_offsets": [0, 8]}}, b"\x00" * 8),
            ["offsets span 8"],
        ),
        (
            "unknown_dtype",
            safetensors_bytes({"a": {"dtype": "F13", "shape": [2], "data_offsets": [0, 8]}}, b"\x00" * 8),
            ["unknown dtype 'F13'"],
        ),
        ("metadata_not_strings", safetensors_bytes({"__metadata__": {"a": 1}, "t": F32_2}, b"\x00" * 8), ["map strings to strings"]),
        (
            "duplicate_names",
            safetensors_bytes(b'{"a": ' + json.dumps(F32_2).encode() + b', "a": ' + json.dumps(F32_2).encode() + b"}", b"\x00" * 8),
            ["names 'a' twice"],
        ),
    ],
)
def test_safetensors_headers(tmp_path: Path, label: str, content: bytes, keywords: list[str]) -> None:
    path = tmp_path / f"{label}.safetensors"
    path.write_bytes(content)
    rejected(path, 2, *keywords)


def test_safetensors_unsorted_offsets_are_fine(tmp_path: Path) -> None:
    path = tmp_path / "unsorted.safetensors"
    path.write_bytes(safetensors_bytes({"b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}, "a": F32_2}, b"\x00" * 16))
    assert [t.name for t in read_checkpoint(path).tensors] == ["a", "b"]


# 300,000 entries took 82 s against 11 s for 30,000 on a loaded machine: the default run scans a tenth (a quadratic
# step would still show), `pytest -m slow` the whole.
@pytest.mark.parametrize("n", [30_000, pytest.param(300_000, marks=pytest.mark.slow)])
def test_safetensors_many_tiny_entries(tmp_path: Path, n: int) -> None:
    header = {f"t{i}": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]} for i in range(n)}
    path = tmp_path / "many.safetensors"
    path.write_bytes(safetensors_bytes(header))
    proc = run_cli("scan", str(path), "-f", "json")  # benchmarks/ time it; run_cli's timeout catches a hang
    assert proc.returncode == 0
    assert len(json.loads(proc.stdout)["checkpoints"][0]["tensors"]) == n


# -- directories (see also test_formats_safetensors) ----------------------------------------------


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/etc/passwd"])
def test_index_escapes_by_cli(hf_dir: Path, tmp_path: Path, shard: str) -> None:
    import shutil

    d = tmp_path / "escape"
    shutil.copytree(hf_dir, d)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["weight_map"]["evil"] = shard
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    rejected(d, 2, "leaves the directory")


# -- values ---------------------------------------------------------------------------------------


def test_exotic_tensors_are_left_and_plain_ones_converted(tmp_path: Path) -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.qint8)
    base = torch.arange(10, dtype=torch.float32)
    state = {
        "scalar": torch.tensor(2.5), "empty": torch.empty(0, 4), "complex": torch.ones(2, dtype=torch.complex64),
        "q": q, "sparse": torch.eye(2).to_sparse(), "meta": torch.empty(3, device="meta"), "view": base[2:5], "base": base,
    }  # fmt: skip
    src = tmp_path / "exotic.pt"
    torch.save(state, src)
    out = tmp_path / "exotic16.pt"
    proc = run_cli("convert", str(src), "--to", "fp16", "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "sparse_coo tensors are left exactly as they are" in proc.stdout and "meta tensors are left" in proc.stdout
    got = torch.load(out, weights_only=True)
    assert got["scalar"].dtype == torch.float16 and got["empty"].shape == (0, 4) and got["complex"].dtype == torch.complex64
    assert got["q"].dtype == torch.qint8 and got["sparse"].is_sparse and got["meta"].is_meta
    assert torch.equal(got["view"], base[2:5].half()) and got["view"].storage_offset() == 2


@pytest.mark.parametrize(
    ("values", "rule"),
    [
        ([float("nan"), 1.0], "non-finite"),
        ([float("inf"), 1.0], "non-finite"),
        ([1e5, 1.0], "fp16-overflow"),
        ([1e-30, 1.0], "fp16-underflow"),
    ],
)
def test_bad_values_block_conversion(tmp_path: Path, values: list[float], rule: str) -> None:
    src = tmp_path / "v.pt"
    torch.save({"w": torch.tensor(values)}, src)
    rejected(src, 1, rule, args=("--values",))
    assert run_cli("convert", str(src), "--to", "fp16").returncode == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v.pt"]


# -- policies --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text_", "keywords"),
    [
        ("rules:\n  - match: 're:(a+)+$'\n    dtype: fp16\n", ["exponential time"]),
        ("rules:\n  - match: 're:[unclosed'\n    dtype: fp16\n", ["invalid regex"]),
        ("default: fp8\n", ["unknown dtype 'fp8'"]),
        ("rules: 5\n", ["rules must be a list"]),
        ("default: fp16\ndefault: bf16\n", ["duplicate key 'default'"]),
        ("", ["policy is empty"]),
        ("a: &a [x, x]\nb: &b [*a, *a]\nc: [*b, *b]\n", ["aliases are not allowed"]),
        ("default: !!python/object/apply:os.system ['touch /tmp/pwned']\n", ["is not allowed"]),
    ],
)
def test_hostile_policies(tmp_path: Path, text_: str, keywords: list[str]) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(text_)
    proc = run_cli("scan", "sample_models/cnn_fp32.pt", "--policy", str(policy), cwd=ROOT)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    line = proc.stderr.strip()
    assert str(policy) in line and all(k in line for k in keywords), line
    assert not Path("/tmp/pwned").exists()


# -- outputs ---------------------------------------------------------------------------------------


def _mount_tmpfs(where: Path, options: str) -> bool:
    where.mkdir()
    return subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True).returncode == 0


def test_read_only_output_directory(tmp_path: Path, training_pt: Path) -> None:
    ro = tmp_path / "ro"
    if not _mount_tmpfs(ro, "ro,size=1m"):
        pytest.skip("cannot mount a read-only tmpfs here")
    try:
        proc = run_cli("convert", str(training_pt), "--to", "bf16", "-o", str(ro / "x.pt"))
        assert proc.returncode == 2 and "Traceback" not in proc.stderr
        assert "not writable" in proc.stderr or "Read-only file system" in proc.stderr
    finally:
        subprocess.run(["umount", str(ro)], check=False)


def test_small_filesystem(tmp_path: Path) -> None:
    small = tmp_path / "small"
    if not _mount_tmpfs(small, "size=256k"):
        pytest.skip("cannot mount a small tmpfs here")
    try:
        src = tmp_path / "m.pt"
        torch.save({f"w{i}": torch.randn(256, 256) for i in range(8)}, src)
        before = src.read_bytes()
        proc = run_cli("convert", str(src), "--to", "fp16", "-o", str(small / "m16.pt"))
        assert proc.returncode == 2 and "Traceback" not in proc.stderr and "internal error" not in proc.stderr
        assert "m16.pt: could not write the output: No space left on device; nothing was written" in proc.stderr
        assert list(small.iterdir()) == [] and src.read_bytes() == before
    finally:
        subprocess.run(["umount", str(small)], check=False)


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_report_to_a_full_device(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with open("/dev/full", "w") as full:
        proc = subprocess.run(
            [sys.executable, "-m", "dtypeaudit", "scan", str(ROOT / "sample_models"), "--format", "json"],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["dtypeaudit: error: No space left on device"]


def test_sigint_in_the_middle_of_a_write(tmp_path: Path) -> None:
    src = tmp_path / "big.pt"
    torch.save({f"w{i}": torch.randn(1024, 1024) for i in range(48)}, src)  # ~200 MB
    before_size, before_mtime = src.stat().st_size, src.stat().st_mtime_ns
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # Ctrl-C as in a terminal: the child starts with SIGINT at its default even where this run was started with
    # SIGINT ignored (a background job of a script), which a child would inherit unless a test before this one in the
    # same worker happened to install a handler of its own.
    proc = subprocess.Popen(
        [sys.executable, "-m", "dtypeaudit", "convert", str(src), "--to", "fp16"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not any(p.name.endswith(".tmp") for p in tmp_path.iterdir()):
        time.sleep(0.002)
    assert any(p.name.endswith(".tmp") for p in tmp_path.iterdir()), "the write never started"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert b"interrupted" in err and b"Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.pt"]
    assert (src.stat().st_size, src.stat().st_mtime_ns) == (before_size, before_mtime)


def test_inventory_of_hostile_pickle_still_lists_tensors(tmp_path: Path, canary: Path) -> None:
    data = torch_zip_bytes({"w": torch.ones(2)})
    pkl = next(n for n in names(data) if n.endswith("data.pkl"))
    original = zipfile.ZipFile(io.BytesIO(data)).read(pkl)
    # Wrap the real state dict in a call to os.system's result: the tensor inside is still found.
    evil = b"\x80\x02" + call(global_op("os", "system"), text(f"touch {canary}")) + b"0" + original[2:]
    path = rewrite_zip(data, tmp_path / "wrapped.pt", replace={pkl: evil})
    inv = read_checkpoint(path)
    assert facts(inv) == {"w": ("float32", (2,), "unknown")}
    assert not canary.exists()
    assert struct  # keep the import honest for readers of this module


# -- crashes the fuzzer found (fuzz/fuzz_readers.py), kept as tests -------------------------------


def test_fuzz_zip_version_field(tmp_path: Path, valid_zip: bytes) -> None:
    blob = bytearray(valid_zip)
    central = blob.index(b"PK\x01\x02")
    blob[central + 6 : central + 8] = b"\xff\x00"  # "version needed to extract" 25.5
    path = tmp_path / "version.pt"
    path.write_bytes(bytes(blob))
    # Python's zipfile refuses "version needed to extract" 25.5; miniz ignores the field, and so do we.
    assert facts(read_checkpoint(path)) == oracle.facts(oracle.load(path))


def test_fuzz_zip_name_not_utf8(tmp_path: Path, valid_zip: bytes) -> None:
    blob = bytearray(valid_zip)
    first_name = names(valid_zip)[0].encode()
    central = blob.index(b"PK\x01\x02" + blob[blob.index(b"PK\x01\x02") + 4 : blob.index(b"PK\x01\x02") + 6])
    blob[central + 8 : central + 10] = (int.from_bytes(blob[central + 8 : central + 10], "little") | 0x0800).to_bytes(2, "little")
    local = blob.index(b"PK\x03\x04")
    assert blob[local + 30 : local + 30 + len(first_name)] == first_name
    blob[local + 30] = 0xFF  # the local header's copy of the name is no longer UTF-8
    path = tmp_path / "name.pt"
    path.write_bytes(bytes(blob))
    rejected(path, 2, "local header", "loaders disagree")
