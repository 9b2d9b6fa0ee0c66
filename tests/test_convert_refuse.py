"""convert refuses what scan flags as an error, before anything is written: a rewrite must never launder a payload.

Hostile pickles are written by hand (tests/hostile.py) and never loaded; benign ones by torch.save of our own objects.
"""

from __future__ import annotations

import io
import json
import pickle
import pickletools
import zipfile
from pathlib import Path

import pytest
import torch

import dtypeaudit

from .helpers import run_cli, write_sharded
from .hostile import call, global_op, reduce_pickle, rewrite_zip, text, torch_zip_bytes, with_data_pkl


def payload(canary: Path) -> bytes:
    """Opcodes pushing what a trusting loader would get from posix.system('touch CANARY')."""
    return call(global_op("posix", "system"), text(f"touch {canary}"))


def inject(dict_pickle: bytes, canary: Path) -> bytes:
    """Add a 'payload' item to the dict torch.save pickled (protocol 2: PROTO, EMPTY_DICT, BINPUT 0)."""
    head = b"\x80\x02}q\x00"
    assert dict_pickle.startswith(head), dict_pickle[:16]
    return head + b"(" + text("payload") + payload(canary) + b"u" + dict_pickle[len(head) :]


def inject_zip(src: bytes, dest: Path, canary: Path) -> Path:
    with zipfile.ZipFile(io.BytesIO(src)) as z:
        (name,) = [n for n in z.namelist() if n.endswith("/data.pkl")]
        data_pkl = z.read(name)
    return rewrite_zip(src, dest, replace={name: inject(data_pkl, canary)})


# -- the files -------------------------------------------------------------------------------------


def zip_posix_system(tmp_path: Path, canary: Path) -> Path:
    return with_data_pkl(tmp_path / "model.pt", reduce_pickle("posix", "system", f"touch {canary}"))


def zip_os_system_beside_tensors(tmp_path: Path, canary: Path) -> Path:
    return inject_zip(torch_zip_bytes({"w": torch.ones(4), "b": torch.zeros(2)}), tmp_path / "model.pt", canary)


def legacy_posix_system(tmp_path: Path, canary: Path) -> Path:
    plain = tmp_path / "plain-legacy.pt"
    torch.save({"w": torch.ones(4), "b": torch.zeros(2)}, plain, _use_new_zipfile_serialization=False)
    data = plain.read_bytes()
    plain.unlink()
    # magic number, protocol, sys_info, then the object itself: a pickle's end is just past its STOP.
    ends, pos = [], 0
    for _ in range(4):
        pos += max(at for _, _, at in pickletools.genops(data[pos:])) + 1
        ends.append(pos)
    start, end = ends[2], ends[3]
    path = tmp_path / "legacy.pt"
    path.write_bytes(data[:start] + inject(data[start:end], canary) + data[end:])
    return path


def trailing_benign_pickle(tmp_path: Path, canary: Path) -> Path:
    src = torch_zip_bytes({"w": torch.ones(4)})
    with zipfile.ZipFile(io.BytesIO(src)) as z:
        (name,) = [n for n in z.namelist() if n.endswith("/data.pkl")]
        data_pkl = z.read(name)
    return rewrite_zip(src, tmp_path / "model.pt", replace={name: data_pkl + pickle.dumps({"hidden": 1}, protocol=2)})


def trailing_malicious_pickle(tmp_path: Path, canary: Path) -> Path:
    return with_data_pkl(tmp_path / "model.pt", b"\x80\x02}." + reduce_pickle("posix", "system", f"touch {canary}"))


def bare_pickle(tmp_path: Path, canary: Path) -> Path:
    path = tmp_path / "model.pkl"
    path.write_bytes(reduce_pickle("os", "system", f"touch {canary}"))
    return path


def whole_module(tmp_path: Path, canary: Path) -> Path:
    path = tmp_path / "linear.pt"
    torch.save(torch.nn.Linear(3, 2), path)
    return path


CASES = [
    (zip_posix_system, ["unsafe-global", "posix.system"]),
    (zip_os_system_beside_tensors, ["unsafe-global", "posix.system"]),
    (legacy_posix_system, ["unsafe-global", "posix.system"]),
    (trailing_benign_pickle, ["trailing-data"]),
    (trailing_malicious_pickle, ["trailing-data", "posix.system"]),
    (bare_pickle, ["unsafe-global", "os.system"]),
    (whole_module, ["torch.nn.modules.linear.Linear", "save its state_dict and convert that"]),
]


def listing(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*"))


def assert_refused(path: Path, canary: Path, keywords: list[str], *args: str) -> str:
    directory = path.parent
    before, source = listing(directory), (path.read_bytes() if path.is_file() else None)
    proc = run_cli("convert", str(path), "--to", "fp16", *args)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr and "internal error" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "refusing to convert" in line]
    assert lines, proc.stderr
    assert all(str(path) in line for line in lines), lines
    for k in keywords:
        assert k in proc.stderr, (k, proc.stderr)
    assert "nothing was written" in proc.stdout and "verified" not in proc.stdout
    assert listing(directory) == before, "an output or a temporary file was left behind"
    assert not canary.exists()
    if source is not None:
        assert path.read_bytes() == source
    return proc.stderr


@pytest.mark.parametrize(("make", "keywords"), CASES, ids=[m.__name__ for m, _ in CASES])
def test_refused_and_nothing_written(tmp_path: Path, canary: Path, make, keywords: list[str]) -> None:
    path = make(tmp_path, canary)
    assert_refused(path, canary, keywords)  # the default output name, beside the source
    assert_refused(path, canary, keywords, "-o", str(tmp_path / "out.pt"))
    assert_refused(path, canary, keywords, "-o", str(tmp_path / "out.safetensors"))
    assert_refused(path, canary, keywords, "--dry-run")
    assert not (tmp_path / "out.pt").exists() and not (tmp_path / "out.safetensors").exists()


@pytest.mark.parametrize(("make", "keywords"), CASES, ids=[m.__name__ for m, _ in CASES])
def test_scan_flags_what_convert_refuses(tmp_path: Path, canary: Path, make, keywords: list[str]) -> None:
    doc = json.loads(run_cli("scan", str(make(tmp_path, canary)), "-f", "json").stdout)
    found = {(f["rule"], f["severity"]) for f in doc["checkpoints"][0]["findings"]}
    assert any(severity == "error" for _, severity in found) or ("trailing-data", "warning") in found, found
    assert not canary.exists()


def test_json_report_of_a_refusal(tmp_path: Path, canary: Path) -> None:
    path = zip_posix_system(tmp_path, canary)
    proc = run_cli("convert", str(path), "--to", "bf16", "-f", "json")
    assert proc.returncode == 2
    doc = json.loads(proc.stdout)
    assert doc["refused"] is True and doc["output"] is None and doc["target"] == "bfloat16"
    (finding,) = doc["refusals"]
    assert finding["rule"] == "unsafe-global" and finding["severity"] == "error" and "posix.system" in finding["message"]


def test_hf_directory_with_a_hostile_shard(tmp_path: Path, canary: Path) -> None:
    d = write_sharded(tmp_path / "hf", {f"layer{i}.weight": torch.ones(2, 2) for i in range(4)}, 2, kind="bin")
    shard = d / "pytorch_model-00002-of-00002.bin"
    inject_zip(shard.read_bytes(), shard, canary)
    stderr = assert_refused(d, canary, ["unsafe-global", "posix.system"])
    assert str(shard) in stderr
    assert_refused(d, canary, ["posix.system"], "-o", str(tmp_path / "hf-out"))
    assert not (tmp_path / "hf-fp16").exists() and not (tmp_path / "hf-out").exists()


def test_library_returns_the_refusal(tmp_path: Path, canary: Path) -> None:
    path = whole_module(tmp_path, canary)
    before = listing(tmp_path)
    result = dtypeaudit.convert(path, "fp16")
    assert result.refused and result.blocked and result.output is None and result.plan.tensors == []
    assert any(f.rule in ("pickled-module", "unsafe-global") for f in result.refused)
    assert listing(tmp_path) == before


def test_a_clean_file_still_converts(tmp_path: Path) -> None:
    src = tmp_path / "ok.pt"
    torch.save({"w": torch.ones(4)}, src)
    result = dtypeaudit.convert(src, "fp16")
    assert not result.refused and not result.blocked and result.output == tmp_path / "ok.fp16.pt"
    assert torch.load(result.output, weights_only=True)["w"].dtype == torch.float16


def test_which_refusals_are_a_pickled_module() -> None:
    from dtypeaudit.conversion import pickled_module_files, refusals
    from dtypeaudit.inventory import Finding, Inventory, TensorRecord

    def inv(*findings: Finding, names: tuple[str, ...] = ("_parameters.weight",), file: str = "") -> Inventory:
        return Inventory("m.pt", "torch-zip", tuple(TensorRecord(n, "float32", (2,), 8, file=file) for n in names), findings)

    linear = Finding("unsafe-global", "error", "calls torch.nn.modules.linear.Linear, which is not a tensor-rebuilding global")
    system = Finding("unsafe-global", "error", "calls posix.system, which can execute code when loaded")
    module = Finding("pickled-module", "error", "pickles a whole nn.Module")
    shard = Finding("pickled-module", "error", "pickles a whole nn.Module", file="a.bin")
    assert pickled_module_files([linear, system]) == []  # a module's global alone is the reader's call, not ours
    assert pickled_module_files([linear, module]) == [None]
    assert pickled_module_files([shard, module, shard]) == ["a.bin", None]
    # Errors and trailing data are refused; other warnings and info are not.
    trailing = Finding("trailing-data", "warning", "4 bytes follow the pickle")
    foreign = Finding("foreign-global", "warning", "references argparse.Namespace")
    mismatch = Finding("index-mismatch", "error", "missing from its shard", tensor="w")
    assert refusals(inv(trailing, foreign, mismatch, system)) == (trailing, mismatch, system)
