"""Remote checkpoints, against real servers started here: moto's S3 server (through s3fs, with AWS_ENDPOINT_URL as
a user sets it) and a small HTTP server that honours ``Range``.

What must hold: a remote scan's inventory is the local scan's of the same bytes; a 10 GB file costs under 1 MB
of reads; a missing object, a server error, a timeout are one line each, exit 2 for that object, the others
still reported; and no credential (an AWS secret key, a token or password in a URL) reaches any output.
"""

from __future__ import annotations

import collections
import io
import json
import pickle
import re
import shutil
import struct
import traceback
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from dtypeaudit.errors import CheckpointError
from dtypeaudit.formats import read_checkpoint
from dtypeaudit.pipeline import expand, scan
from dtypeaudit.render.json import report_dict

from .helpers import RangeHandler, run_cli, serve_folder, write_sharded
from .models import TinyCNN, TinyLM
from .s3server import ACCESS_KEY, SECRET_KEY, moto_s3

URL_TOKEN = "tok-3a9f1c77e2b54d0c"
URL_PASSWORD = "pw-never-shown-8d1e"
TEN_GB = 10 << 30


# -- checkpoints, written by the real writers ------------------------------------------------------


def _sparse_zip(path: Path, members: list[tuple[str, bytes | int]]) -> None:
    """A stored zip64 archive as torch.save lays one out; an int member is that many bytes left as a hole in a
    sparse file, with CRC 0 (what torch.save writes with compute_crc32=False)."""
    with path.open("wb") as f:
        central = []
        for name, data in members:
            offset, raw = f.tell(), name.encode()
            size = data if isinstance(data, int) else len(data)
            crc = 0 if isinstance(data, int) else zlib.crc32(data)
            extra = struct.pack("<HHQQ", 1, 16, size, size)
            f.write(
                struct.pack("<IHHHHHIIIHH", 0x04034B50, 45, 0, 0, 0, 0, crc, 0xFFFFFFFF, 0xFFFFFFFF, len(raw), len(extra)) + raw + extra
            )
            if isinstance(data, int):
                f.seek(size, 1)
            else:
                f.write(data)
            central.append((raw, crc, size, offset))
        start = f.tell()
        for raw, crc, size, offset in central:
            extra = struct.pack("<HHQQQ", 1, 24, size, size, offset)
            header = (0x02014B50, 45, 45, 0, 0, 0, 0, crc, 0xFFFFFFFF, 0xFFFFFFFF, len(raw), len(extra), 0, 0, 0, 0, 0xFFFFFFFF)
            f.write(struct.pack("<IHHHHHHIIIHHHHHII", *header) + raw + extra)
        end, n = f.tell(), len(central)
        f.write(struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, n, n, end - start, start))
        f.write(struct.pack("<IIQI", 0x07064B50, 0, end, 1))
        f.write(struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, n, n, 0xFFFFFFFF, 0xFFFFFFFF, 0))


class _Ref:
    def __init__(self, key: str, numel: int) -> None:
        self.key, self.numel = key, numel


class _Tensor:
    def __init__(self, ref: _Ref) -> None:
        self.ref = ref

    def __reduce__(self) -> Any:
        return torch._utils._rebuild_tensor_v2, (self.ref, 0, (self.ref.numel,), (1,), False, collections.OrderedDict())


class _TorchPickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:  # torch.save's persistent ids for storages
        return ("storage", torch.FloatStorage, obj.key, "cpu", obj.numel) if isinstance(obj, _Ref) else None


def _ten_gb_zip(path: Path) -> Path:
    """A torch.save archive holding one float32 tensor of 10 GiB (a hole on disk) and a small one."""
    big = TEN_GB // 4
    buf = io.BytesIO()
    _TorchPickler(buf, protocol=2).dump({"big.weight": _Tensor(_Ref("0", big)), "small": _Tensor(_Ref("1", 3))})
    records: list[tuple[str, bytes | int]] = [
        ("archive/data.pkl", buf.getvalue()),
        ("archive/.format_version", b"1"),
        ("archive/.storage_alignment", b"64"),
        ("archive/byteorder", b"little"),
        ("archive/data/0", big * 4),
        ("archive/data/1", struct.pack("<3f", 1, 2, 3)),
        ("archive/version", b"3\n"),
    ]
    _sparse_zip(path, records)
    return path


def _ten_gb_safetensors(path: Path) -> Path:
    header = json.dumps({"big.weight": {"dtype": "BF16", "shape": [TEN_GB // 2], "data_offsets": [0, TEN_GB]}}).encode()
    header += b" " * (-len(header) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.truncate(8 + len(header) + TEN_GB)
    return path


ZOO = ("all_dtypes_pt", "lightning_ckpt", "torchscript_pt", "training_pt", "tied_lm_pt", "hf_bin_dir", "dcp_dir")
"""The session's checkpoints (tests/conftest.py), copied under their fixture's name."""


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Path:
    root = tmp_path_factory.mktemp("remote")
    for name in ZOO:
        made = Path(request.getfixturevalue(name))
        if made.is_dir():
            shutil.copytree(made, root / name)
        else:
            shutil.copy(made, root / name)
    torch.manual_seed(0)
    cnn = TinyCNN().state_dict()
    torch.save({"model": cnn, "step": 3}, root / "cnn.pt")
    torch.save({k: v.half() for k, v in cnn.items()}, root / "legacy.pt", _use_new_zipfile_serialization=False)
    save_file({k: v.contiguous() for k, v in cnn.items()}, str(root / "cnn.safetensors"), metadata={"format": "pt"})
    lm = {k: v.clone() for k, v in TinyLM().state_dict().items() if k != "lm_head.weight"}
    write_sharded(root / "hf-model", lm, 3)
    shutil.copy(root / "cnn.pt", root / "hf-model" / "extra.pt")  # weights from_pretrained would not load
    registry = root / "registry"
    (registry / "run1").mkdir(parents=True)
    shutil.copy(root / "cnn.pt", registry / "run1" / "last.ckpt")
    shutil.copy(root / "legacy.pt", registry / "run1" / "weights")  # no suffix: found by content
    (registry / "run1" / "notes.txt").write_text("not a checkpoint\n")
    shutil.copytree(root / "hf-model", registry / "models" / "tiny-lm")
    shutil.copy(root / "cnn.safetensors", registry / "models" / "loose.safetensors")
    _ten_gb_safetensors(root / "big.safetensors")
    _ten_gb_zip(root / "big.pt")
    return root


# -- a Range-honouring HTTP server (tests/helpers.py) ----------------------------------------------


@pytest.fixture(scope="module")
def web(files: Path) -> Iterator[tuple[str, type[RangeHandler]]]:
    pytest.importorskip("fsspec")  # http(s):// targets go through fsspec's HTTP filesystem, on aiohttp
    pytest.importorskip("aiohttp")
    with serve_folder(files) as served:
        yield served


# -- moto's S3 server ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def s3(files: Path) -> Iterator[dict[str, str]]:
    """A bucket ``models`` on moto's S3 server holding the checkpoints; the environment a user would set for it."""
    with moto_s3("models", files, keep=lambda p: not p.name.startswith("big.")) as (env, _):
        yield env


# -- helpers -------------------------------------------------------------------------------------


def _doc(targets: list[str]) -> dict[str, Any]:
    return report_dict(scan(targets, jobs=1))


def _same(remote: dict[str, Any], local: dict[str, Any]) -> None:
    """Equal inventories, findings and metadata: everything but where the bytes came from."""
    drop = ("path", "bytes_read")
    assert {k: v for k, v in remote.items() if k not in drop} == {k: v for k, v in local.items() if k not in drop}


# -- S3 ------------------------------------------------------------------------------------------


def test_s3_inventories_equal_the_local_scan(s3: dict[str, str], files: Path) -> None:
    names = ["cnn.pt", "legacy.pt", "cnn.safetensors", "hf-model"]
    remote = _doc([f"s3://models/{n}" for n in names])["checkpoints"]
    local = _doc([str(files / n) for n in names])["checkpoints"]
    assert [c["format"] for c in remote] == ["torch-zip", "torch-legacy", "safetensors", "hf-directory"]
    for r, loc in zip(remote, local, strict=True):
        assert r["error"] is None
        _same(r, loc)
    assert [c["path"] for c in remote] == [f"s3://models/{n}" for n in names]
    # small files come whole in their first block; the directory's JSON files are read again when the
    # directory is looked over for weights from_pretrained would not load
    for c, name in zip(remote[:3], names, strict=False):
        assert c["bytes_read"] == (files / name).stat().st_size
    assert 0 < remote[3]["bytes_read"] < 2 * sum(p.stat().st_size for p in (files / "hf-model").iterdir())
    assert [f["rule"] for f in remote[3]["findings"]] == ["unused-weights"]


def test_s3_every_format_of_the_zoo(s3: dict[str, str], files: Path) -> None:
    remote = _doc([f"s3://models/{n}" for n in ZOO])["checkpoints"]
    local = _doc([str(files / n) for n in ZOO])["checkpoints"]
    assert [c["format"] for c in remote] == ["torch-zip", "torch-zip", "torchscript", "torch-zip", "torch-zip", "hf-directory", "dcp"]
    for r, loc in zip(remote, local, strict=True):
        assert r["error"] is None, r["error"]
        _same(r, loc)


def test_s3_prefix_is_walked_by_content(s3: dict[str, str], files: Path) -> None:
    remote = expand(["s3://models/registry"])
    local = expand([str(files / "registry")])
    assert [r.removeprefix("s3://models/registry/") for r in remote] == [Path(p).relative_to(files / "registry").as_posix() for p in local]
    assert remote == [
        "s3://models/registry/models/loose.safetensors",
        "s3://models/registry/models/tiny-lm",
        "s3://models/registry/run1/last.ckpt",
        "s3://models/registry/run1/weights",
    ]
    for r, loc in zip(_doc(remote)["checkpoints"], _doc(local)["checkpoints"], strict=True):
        _same(r, loc)


def test_s3_missing_object_is_one_line_and_the_rest_is_reported(s3: dict[str, str]) -> None:
    proc = run_cli("scan", "s3://models/cnn.pt", "s3://models/nope.pt", "s3://models/hf-model", "--format", "json", env=s3)
    assert proc.returncode == 2, proc.stderr
    doc = json.loads(proc.stdout)
    errors = {c["path"]: c["error"] for c in doc["checkpoints"]}
    assert errors["s3://models/cnn.pt"] is None and errors["s3://models/hf-model"] is None
    assert errors["s3://models/nope.pt"] == "s3://models/nope.pt: no such file or directory"
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == ["dtypeaudit: error: s3://models/nope.pt: no such file or directory"]
    assert SECRET_KEY not in proc.stdout + proc.stderr and ACCESS_KEY not in proc.stdout + proc.stderr


def test_s3_prefix_named_with_a_slash(s3: dict[str, str], files: Path) -> None:
    assert expand(["s3://models/hf-model/"]) == ["s3://models/hf-model"]  # as pathlib names a local "dir/"
    (remote,) = _doc(["s3://models/hf-model/"])["checkpoints"]
    _same(remote, _doc([str(files / "hf-model")])["checkpoints"][0])


def test_s3_glob(s3: dict[str, str]) -> None:
    assert expand(["s3://models/*.pt", "s3://models/hf-*"]) == ["s3://models/cnn.pt", "s3://models/legacy.pt", "s3://models/hf-model"]


# -- HTTP ----------------------------------------------------------------------------------------


def test_http_inventories_equal_the_local_scan(web: tuple[str, type[RangeHandler]], files: Path) -> None:
    base, _ = web
    names = ["cnn.pt", "legacy.pt", "cnn.safetensors"]
    remote = _doc([f"{base}/files/{n}" for n in names])["checkpoints"]
    local = _doc([str(files / n) for n in names])["checkpoints"]
    for r, loc in zip(remote, local, strict=True):
        assert r["error"] is None
        _same(r, loc)


@pytest.mark.parametrize("name", ["big.safetensors", "big.pt"])
def test_a_10_gb_remote_file_reads_under_a_megabyte(web: tuple[str, type[RangeHandler]], files: Path, name: str) -> None:
    base, handler = web
    assert (files / name).stat().st_size > TEN_GB
    handler.served.clear()
    inv = read_checkpoint(f"{base}/files/{name}")
    local = read_checkpoint(files / name)
    assert inv.tensors == local.tensors and inv.findings == local.findings
    assert sum(t.nbytes for t in inv.tensors) >= TEN_GB
    assert inv.bytes_read is not None and inv.bytes_read < 1 << 20
    assert handler.served[name] == inv.bytes_read  # what the server sent is what was counted
    assert local.bytes_read is not None and local.bytes_read < 1 << 20


def test_http_failures_are_one_line_each(web: tuple[str, type[RangeHandler]], monkeypatch: pytest.MonkeyPatch) -> None:
    base, _ = web
    monkeypatch.setenv("DTYPEAUDIT_REMOTE_RETRIES", "2")
    doc = _doc([f"{base}/files/cnn.pt", f"{base}/files/missing.pt", f"{base}/error500/cnn.pt", f"{base}/files/cnn.safetensors"])
    errors = [c["error"] for c in doc["checkpoints"]]
    assert errors[0] is None and errors[3] is None
    assert errors[1] == f"{base}/files/missing.pt: no such file or directory"
    assert errors[2] == f"{base}/error500/cnn.pt: server error (HTTP 500) after 2 tries"


def test_http_transient_errors_are_retried(web: tuple[str, type[RangeHandler]]) -> None:
    base, handler = web
    inv = read_checkpoint(f"{base}/flaky/cnn.safetensors")
    assert inv.format == "safetensors" and handler.requests["/flaky/cnn.safetensors"] >= 2


def test_http_timeout(web: tuple[str, type[RangeHandler]], monkeypatch: pytest.MonkeyPatch) -> None:
    base, _ = web
    monkeypatch.setenv("DTYPEAUDIT_REMOTE_TIMEOUT", "0.3")
    monkeypatch.setenv("DTYPEAUDIT_REMOTE_RETRIES", "1")
    with pytest.raises(CheckpointError) as err:
        read_checkpoint(f"{base}/slow/cnn.pt?attempt=timeout")
    assert err.value.one_line() == f"{base}/slow/cnn.pt?attempt=REDACTED: timed out (no answer within 0.3 s)"


def test_a_server_that_ignores_ranges_is_refused_not_downloaded(web: tuple[str, type[RangeHandler]]) -> None:
    base, handler = web
    handler.served.clear()
    # reads from the start take what they asked for from the full answer and stop
    assert read_checkpoint(f"{base}/norange/big.safetensors").bytes_read == 64 << 10
    # a zip is read from its end: refused rather than downloaded
    with pytest.raises(CheckpointError) as err:
        read_checkpoint(f"{base}/norange/big.pt")
    assert err.value.one_line() == f"{base}/norange/big.pt: the server does not honour range requests; not downloading the whole file"
    assert handler.served["big.safetensors"] + handler.served["big.pt"] < 64 << 20


def test_no_credential_reaches_any_output(web: tuple[str, type[RangeHandler]], s3: dict[str, str]) -> None:
    base, _ = web
    host = base.removeprefix("http://")
    targets = [
        f"{base}/files/cnn.pt?X-Amz-Credential={ACCESS_KEY}&X-Amz-Signature={URL_TOKEN}",
        f"http://user:{URL_PASSWORD}@{host}/files/cnn.safetensors",
        f"{base}/files/missing.pt?token={URL_TOKEN}",
        f"{base}/error500/cnn.pt?token={URL_TOKEN}",
        f"http://user:{URL_PASSWORD}@{host}/files/nope.pt",
        "s3://models/cnn.pt",
        "s3://models/absent.pt",
    ]
    env = {**s3, "DTYPEAUDIT_REMOTE_RETRIES": "1"}
    outputs = []
    for fmt in ("json", "plain", "sarif", "github", "junit", "markdown"):
        proc = run_cli("scan", *targets, "--format", fmt, "--verbose", env=env)
        assert proc.returncode == 2, proc.stderr
        outputs.append((proc.stdout, proc.stderr))
    doc = json.loads(outputs[0][0])
    assert [c["error"] is None for c in doc["checkpoints"]] == [True, True, False, False, False, True, False]
    assert doc["checkpoints"][1]["path"] == f"http://REDACTED@{host}/files/cnn.safetensors"
    for out, err in outputs:
        assert len([line for line in err.splitlines() if line.startswith("dtypeaudit: error:")]) == 4
        for secret in (SECRET_KEY, ACCESS_KEY, URL_TOKEN, URL_PASSWORD):
            assert secret not in out and secret not in err


def test_worker_processes_read_remote_targets(web: tuple[str, type[RangeHandler]], files: Path) -> None:
    base, _ = web
    targets = [f"{base}/files/cnn.safetensors?copy={i}" for i in range(17)]  # past fleet.SERIAL_BELOW: worker processes
    proc = run_cli("scan", *targets, "--jobs", "2", "--format", "json")
    assert proc.returncode in (0, 1), proc.stderr
    local = _doc([str(files / "cnn.safetensors")])["checkpoints"][0]
    checkpoints = json.loads(proc.stdout)["checkpoints"]
    assert [c["path"] for c in checkpoints] == [f"{base}/files/cnn.safetensors?copy=REDACTED"] * 17
    for c in checkpoints:
        _same(c, local)


def test_bytes_read_is_shown_with_verbose_only(web: tuple[str, type[RangeHandler]]) -> None:
    base, _ = web
    quiet = run_cli("scan", f"{base}/files/cnn.safetensors", "--format", "plain")
    loud = run_cli("scan", f"{base}/files/cnn.safetensors", "--format", "plain", "--verbose")
    assert " read)" not in quiet.stdout.splitlines()[0]
    assert re.search(r"\(\d[\d.]* (B|KiB) read\)", loud.stdout.splitlines()[0])


def test_local_scans_report_bytes_read_too(files: Path) -> None:
    doc = _doc([str(files / "cnn.safetensors"), str(files / "hf-model")])
    for c in doc["checkpoints"]:
        assert c["bytes_read"] > 0


def test_unknown_protocols_and_missing_backends_are_one_line() -> None:
    proc = run_cli("scan", "nosuchproto://bucket/x.pt")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("dtypeaudit: error:")
    assert "nosuchproto" in proc.stderr


def test_module_imports_stay_light() -> None:
    """A local scan imports neither fsspec nor a backend: remote support costs local users nothing."""
    proc = run_cli(
        "scan",
        "sample_models/cnn_fp32.pt",
        env={"PYTHONPROFILEIMPORTTIME": "1"},
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert proc.returncode in (0, 1)
    imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert not {"fsspec", "s3fs", "aiohttp", "huggingface_hub"} & imported


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("s3://bucket/key.pt", "s3://bucket/key.pt"),
        ("https://u:p@host/m.pt", "https://REDACTED@host/m.pt"),
        (
            "https://b.s3.amazonaws.com/m.pt?X-Amz-Credential=AKIA/x&X-Amz-Signature=abc&versionId=7",
            "https://b.s3.amazonaws.com/m.pt?X-Amz-Credential=REDACTED&X-Amz-Signature=REDACTED&versionId=7",
        ),
        ("https://h/m.pt?sig=1#access_token=2", "https://h/m.pt?sig=REDACTED#REDACTED"),
        ("hf://org/name@main/model.safetensors", "hf://org/name@main/model.safetensors"),
        ("https://h/m.pt?token=abc: not found (HTTP 404)", "https://h/m.pt?token=REDACTED: not found (HTTP 404)"),
        ("fetching https://h/a?k=v, then http://h/b", "fetching https://h/a?k=REDACTED, then http://h/b"),
    ],
)
def test_redact(text: str, shown: str) -> None:
    from dtypeaudit.redact import redact

    assert redact(text) == shown


def test_credential_values_of_the_environment_are_masked(monkeypatch: pytest.MonkeyPatch) -> None:
    from dtypeaudit.redact import redact

    monkeypatch.setenv("HF_TOKEN", "hf_abcdefghijklmnop")
    assert redact("bad token hf_abcdefghijklmnop given") == "bad token REDACTED given"
    assert CheckpointError("rejected hf_abcdefghijklmnop", path="x").one_line() == "x: rejected REDACTED"


# -- remote_call: a backend's failure is one line and exit 2; a bug of ours propagates, exit 3 -----------------------


def test_a_bug_of_ours_in_a_remote_read_exits_3_not_2(web: tuple[str, type[RangeHandler]], monkeypatch: pytest.MonkeyPatch) -> None:
    HTTPFile = pytest.importorskip("fsspec.implementations.http").HTTPFile

    base, _ = web
    url = f"{base}/files/cnn.safetensors"
    assert read_checkpoint(url).format == "safetensors"

    # RemoteSource calls fsspec's private _fetch_range: were its signature to change, our call is the bug.
    def _fetch_range(self: Any, start: int, end: int, session: Any) -> bytes:
        raise AssertionError("never reached: the call itself fails")

    monkeypatch.setattr(HTTPFile, "_fetch_range", _fetch_range)
    with pytest.raises(TypeError, match="session"):
        read_checkpoint(url)
    proc = run_cli("scan", url, "--format", "json")
    assert proc.returncode == 3, proc.stderr
    assert "internal error: TypeError" in proc.stderr and "bug in dtypeaudit" in proc.stderr and proc.stdout == ""


def test_network_failures_are_still_remote_errors_exit_2_with_their_cause(
    web: tuple[str, type[RangeHandler]], monkeypatch: pytest.MonkeyPatch
) -> None:
    import socket

    from dtypeaudit.formats.remote import RemoteError

    aiohttp = pytest.importorskip("aiohttp")

    base, _ = web
    monkeypatch.setenv("DTYPEAUDIT_REMOTE_RETRIES", "1")
    with pytest.raises(RemoteError) as err:  # an HTTP error: aiohttp's ClientResponseError
        read_checkpoint(f"{base}/error500/cnn.pt?token={URL_TOKEN}")
    assert err.value.one_line() == f"{base}/error500/cnn.pt?token=REDACTED: server error (HTTP 500)"
    # fsspec's HTTP info raises FileNotFoundError from aiohttp's ClientResponseError: both kept for --debug, as the
    # context, out of tracebacks (the backend's messages quote the URL with its token)
    assert err.value.__cause__ is None and err.value.__suppress_context__
    assert URL_TOKEN not in "".join(traceback.format_exception(err.value))
    cause = err.value.__context__
    assert isinstance(cause, FileNotFoundError) and isinstance(cause.__cause__, aiohttp.ClientResponseError)
    assert cause.__cause__.status == 500

    with socket.socket() as s:  # a port nothing listens on: an OSError (connection refused)
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    with pytest.raises(RemoteError) as err:
        read_checkpoint(f"http://127.0.0.1:{closed}/files/cnn.pt")
    assert err.value.one_line() == f"http://127.0.0.1:{closed}/files/cnn.pt: cannot connect (Connection refused)"
    assert isinstance(err.value.__context__, OSError)

    with pytest.raises(RemoteError) as err:  # fsspec's HTTP file refuses a server that ignores Range with a ValueError
        read_checkpoint(f"{base}/norange/big.pt")
    assert "does not honour range requests" in err.value.one_line()
    assert isinstance(err.value.__context__, ValueError) and "range requests" in str(err.value.__context__)

    proc = run_cli("scan", f"{base}/error500/cnn.pt", f"http://127.0.0.1:{closed}/files/cnn.pt", "--format", "json")
    assert proc.returncode == 2 and "internal error" not in proc.stderr
    assert [c["error"] for c in json.loads(proc.stdout)["checkpoints"]] == [
        f"{base}/error500/cnn.pt: server error (HTTP 500)",
        f"http://127.0.0.1:{closed}/files/cnn.pt: cannot connect (Connection refused)",
    ]


def test_remote_call_takes_only_a_backends_errors_for_the_networks() -> None:
    botocore = pytest.importorskip("botocore.exceptions")
    from dtypeaudit.formats.remote import RemoteError, remote_call

    calls: list[str] = []

    def fails(exc: Exception) -> Any:
        calls.append(type(exc).__name__)
        raise exc

    denied = botocore.ClientError({"Error": {"Code": "AccessDenied"}, "ResponseMetadata": {"HTTPStatusCode": 403}}, "GetObject")
    with pytest.raises(RemoteError) as err:
        remote_call(lambda: fails(denied), "s3://models/x.pt")
    assert err.value.one_line() == "s3://models/x.pt: access denied (HTTP 403 AccessDenied): check the credentials"
    assert err.value.__context__ is denied
    with pytest.raises(RemoteError) as err:
        remote_call(lambda: fails(FileNotFoundError(2, "No such file or directory")), "s3://models/y.pt")
    assert err.value.one_line() == "s3://models/y.pt: not found"

    # ours: passed through unchanged, the first time, not retried and not renamed
    for bug in (TypeError("unsupported operand"), AttributeError("no attribute 'size'"), KeyError("k"), ValueError("ours")):
        calls.clear()
        with pytest.raises(type(bug)) as raised:
            remote_call(lambda: fails(bug), "s3://models/z.pt")  # noqa: B023 (called at once)
        assert raised.value is bug and calls == [type(bug).__name__]


def test_debug_tracebacks_show_no_credential(web: tuple[str, type[RangeHandler]]) -> None:
    """--debug prints the whole traceback, causes included (a backend's own messages quote the URL): redacted too."""
    base, _ = web
    proc = run_cli("scan", f"{base}/error500/cnn.pt?token={URL_TOKEN}", "--debug", env={"DTYPEAUDIT_REMOTE_RETRIES": "1"})
    assert proc.returncode == 2 and "Traceback" in proc.stderr and "HTTP 500" in proc.stderr
    assert URL_TOKEN not in proc.stderr and URL_TOKEN not in proc.stdout


def test_a_dead_s3_endpoint_is_tried_only_by_our_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    """botocore and s3fs each retry a failed connection themselves (5 attempts each, with backoff up to 20 s), under
    remote_call's own tries: a server that closed every connection took 150 connections and 114 s to report. Now
    only remote_call retries: the connections grow with DTYPEAUDIT_REMOTE_RETRIES alone."""
    import socket
    import threading

    from s3fs import S3FileSystem

    from dtypeaudit.formats.remote import RemoteError, forget

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    accepted = [0]

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            accepted[0] += 1
            conn.close()  # a server that dies on every request

    threading.Thread(target=serve, daemon=True).start()
    port = server.getsockname()[1]
    for name, value in {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    counts = []
    try:
        for tries in (1, 2):
            monkeypatch.setenv("DTYPEAUDIT_REMOTE_RETRIES", str(tries))
            forget()
            S3FileSystem.clear_instance_cache()  # fsspec keeps one per set of arguments: an earlier test's, on moto
            accepted[0] = 0
            with pytest.raises(RemoteError) as err:
                read_checkpoint(f"s3://bucket-{tries}/model.safetensors")
            assert "cannot connect" in err.value.one_line() and SECRET_KEY not in err.value.one_line()
            counts.append(accepted[0])
    finally:
        server.close()
        forget()
        S3FileSystem.clear_instance_cache()
    assert 1 <= counts[0] <= 4  # the few requests one look-up of a missing object makes, each once
    assert counts[1] == 2 * counts[0]


def test_debug_output_masks_the_credentials_of_a_url_wherever_a_backend_quotes_them() -> None:
    """botocore's error names the bucket of ``s3://KEY:SECRET@bucket`` as ``KEY:SECRET@bucket``, outside any URL:
    --debug printed the secret in the traceback."""
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    key, secret = "AKIAEXAMPLEKEY01", "wJalrXUtnFEMI-never-printed"
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{closed}", "AWS_DEFAULT_REGION": "us-east-1", "DTYPEAUDIT_REMOTE_RETRIES": "1"}
    proc = run_cli("scan", f"s3://{key}:{secret}@bucket/model.safetensors", "--debug", env=env, process=True)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" in proc.stderr and "REDACTED" in proc.stderr
    assert secret not in proc.stdout + proc.stderr and key not in proc.stdout + proc.stderr
