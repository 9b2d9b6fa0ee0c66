"""Remote conversion against moto's S3 server (through s3fs, as a user would use AWS): S3 -> S3 and S3 -> local.

What must hold: the outputs are byte for byte what converting the same local files writes; nothing is left under a
temporary name; a directory's index is published last; a refused (hostile) source writes nothing; no credential
reaches any output; a remote source without -o is refused with one line.
"""

from __future__ import annotations

import importlib.util
import json
import pickle
import shutil
import subprocess
import sys
import warnings
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from dtypeaudit.conversion import convert
from dtypeaudit.conversion import remote_sources as remote
from dtypeaudit.errors import ConversionError, UsageError

from .helpers import run_cli, write_sharded
from .hostile import reduce_pickle, with_data_pkl
from .models import TinyLM
from .s3server import ACCESS_KEY, SECRET_KEY, moto_s3


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("remote-convert")
    torch.manual_seed(0)
    lm = {k: v.clone() for k, v in TinyLM().state_dict().items() if k != "lm_head.weight"}
    torch.save({"model": lm, "step": 7}, root / "x.pt")
    write_sharded(root / "ft-001", lm, 3)
    (root / "ft-001" / "tokenizer.json").write_text('{"version": "1.0"}\n')
    loud = dict(lm)
    loud["layers.1.mlp.weight"] = torch.full((8, 8), 1e6)
    write_sharded(root / "ft-loud", loud, 2)
    canary = root / "canary"
    with_data_pkl(root / "evil.pt", reduce_pickle("posix", "system", f"touch {canary}"))
    # formats convert refuses outright, each with 4 MiB of weights a refusal must not download
    big = torch.nn.Linear(1024, 1024)
    torch.jit.save(torch.jit.script(big), str(root / "scripted.pt"))
    (root / "bare.pkl").write_bytes(pickle.dumps({"w": [0.5] * 1000}, protocol=4))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": big.state_dict()}, checkpoint_id=str(root / "dcp"))
    if importlib.util.find_spec("transformers") is not None:  # an FP8 folder, its layer 0's scales in another shard
        from .test_quant_convert import make_fp8_dir

        shutil.copytree(make_fp8_dir(tmp_path_factory.mktemp("fp8-build")), root / "fp8")
    return root


@pytest.fixture(scope="module")
def two_index(s3: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model folder as transformers 5 saves it (safetensors shards and their index), beside the .bin shards and
    index huggingface_hub writes for the same weights (as transformers 4 did with safe_serialization=False); also
    in the bucket, under two-index/."""
    import transformers
    from huggingface_hub import save_torch_state_dict

    path = tmp_path_factory.mktemp("two") / "two-index"
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=16, eos_token_id=0, bos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    model.save_pretrained(path, max_shard_size="40KB")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        save_torch_state_dict(model.state_dict(), path, safe_serialization=False, max_shard_size="40KB")
    for p in sorted(path.iterdir()):
        s3["client"].upload_file(str(p), "convert-test", f"two-index/{p.name}")
    return path


@pytest.fixture(scope="module")
def s3(local: Path) -> Iterator[dict[str, Any]]:
    with moto_s3("convert-test", local, keep=lambda p: p.name != "canary") as (env, client):
        yield {"env": env, "client": client}


def _objects(client: Any, prefix: str = "") -> dict[str, Any]:
    pages = client.get_paginator("list_objects_v2").paginate(Bucket="convert-test", Prefix=prefix)
    return {o["Key"]: o for page in pages for o in page.get("Contents", [])}


def _body(client: Any, key: str) -> bytes:
    return bytes(client.get_object(Bucket="convert-test", Key=key)["Body"].read())


def _no_temporaries(client: Any) -> None:
    left = [k for k in _objects(client) if "dtypeaudit" in k or k.endswith(".tmp")]
    assert not left, left


def test_single_file_s3_to_s3_and_local(s3: dict[str, Any], local: Path, tmp_path: Path) -> None:
    client = s3["client"]
    want = tmp_path / "want.fp16.pt"
    convert(local / "x.pt", "fp16", output=want)
    r = convert("s3://convert-test/x.pt", "fp16", output="s3://convert-test/x.fp16.pt")
    assert r.output == "s3://convert-test/x.fp16.pt" and r.plan.source.path == "s3://convert-test/x.pt"
    assert _body(client, "x.fp16.pt") == want.read_bytes()
    _no_temporaries(client)
    got = tmp_path / "got.fp16.pt"
    r = convert("s3://convert-test/x.pt", "fp16", output=str(got))
    assert got.read_bytes() == want.read_bytes()
    loaded = torch.load(got, weights_only=True)
    original = torch.load(local / "x.pt", weights_only=True)
    for k, v in original["model"].items():
        assert torch.equal(loaded["model"][k], v.to(torch.float16) if v.is_floating_point() else v)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["got.fp16.pt", "want.fp16.pt"]  # no temporaries beside it
    # the destination exists now: refused unless --force, as locally
    with pytest.raises(ConversionError, match="already exists"):
        convert("s3://convert-test/x.pt", "fp16", output="s3://convert-test/x.fp16.pt")
    convert("s3://convert-test/x.pt", "bf16", output="s3://convert-test/x.fp16.pt", force=True)
    assert load_file is not None and _body(client, "x.fp16.pt") != want.read_bytes()
    _no_temporaries(client)


def test_directory_s3_to_s3(s3: dict[str, Any], local: Path, tmp_path: Path) -> None:
    client = s3["client"]
    want = tmp_path / "want"
    convert(local / "ft-001", "bf16", output=want)
    r = convert("s3://convert-test/ft-001/", "bf16", output="s3://convert-test/ft-001-bf16/")
    assert r.output is not None and not r.blocked
    objects = _objects(client, "ft-001-bf16/")
    names = {k.removeprefix("ft-001-bf16/") for k in objects}
    assert names == {p.name for p in want.iterdir()}
    for name in names:
        assert _body(client, f"ft-001-bf16/{name}") == (want / name).read_bytes(), name
    _no_temporaries(client)
    # published last: the index after every shard, config.json after every shard too
    index = objects["ft-001-bf16/model.safetensors.index.json"]["LastModified"]
    for key, o in objects.items():
        if key.endswith(".safetensors"):
            assert o["LastModified"] <= index
    original = {}
    for shard in sorted((local / "ft-001").glob("*.safetensors")):
        original.update(load_file(shard))
    converted = {}
    for shard in sorted(want.glob("*.safetensors")):
        converted.update(load_file(shard))
    assert original.keys() == converted.keys()
    for k, v in original.items():
        assert torch.equal(converted[k], v.to(torch.bfloat16) if v.is_floating_point() else v)


def test_directory_s3_to_local(s3: dict[str, Any], local: Path, tmp_path: Path) -> None:
    want, got = tmp_path / "want", tmp_path / "got"
    convert(local / "ft-001", "fp16", output=want)
    convert("s3://convert-test/ft-001", "fp16", output=str(got))
    assert sorted(p.name for p in got.iterdir()) == sorted(p.name for p in want.iterdir())
    for p in want.iterdir():
        assert (got / p.name).read_bytes() == p.read_bytes(), p.name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["got", "want"]


def test_refused_source_writes_nothing(s3: dict[str, Any], local: Path, tmp_path: Path) -> None:
    client = s3["client"]
    before = set(_objects(client))
    r = convert("s3://convert-test/evil.pt", "fp16", output="s3://convert-test/evil.fp16.pt")
    assert r.refused and r.output is None
    assert set(_objects(client)) == before
    r = convert("s3://convert-test/evil.pt", "fp16", output=str(tmp_path / "evil.fp16.pt"))
    assert r.refused and not list(tmp_path.iterdir())
    assert not (local / "canary").exists()


def test_remote_source_needs_output(s3: dict[str, Any]) -> None:
    with pytest.raises(UsageError, match="needs -o"):
        convert("s3://convert-test/x.pt", "fp16")


def test_cli_s3_to_s3_prints_no_credential(s3: dict[str, Any], tmp_path: Path) -> None:
    env = s3["env"]
    proc = run_cli("convert", "s3://convert-test/ft-001/", "--to", "bf16", "-o", "s3://convert-test/cli-bf16/", env=env)
    assert proc.returncode == 0, proc.stderr
    assert "s3://convert-test/cli-bf16" in proc.stdout
    proc2 = run_cli("convert", "s3://convert-test/x.pt", "--to", "fp16", env=env)
    assert proc2.returncode == 2 and "-o" in proc2.stderr and len(proc2.stderr.strip().splitlines()) == 1
    proc3 = run_cli("convert", "s3://convert-test/evil.pt", "--to", "fp16", "-o", "s3://convert-test/evil2.pt", env=env)
    assert proc3.returncode == 2  # refused for what it holds, before a download
    for p in (proc, proc2, proc3):
        assert SECRET_KEY not in p.stdout + p.stderr and ACCESS_KEY not in p.stdout + p.stderr
    _no_temporaries(s3["client"])
    assert "evil2.pt" not in _objects(s3["client"])


def test_unsafe_values_publish_nothing_and_keep_unsafe_matches_local(s3: dict[str, Any], local: Path, tmp_path: Path) -> None:
    client = s3["client"]
    r = convert("s3://convert-test/ft-loud/", "fp16", output="s3://convert-test/ft-loud-fp16/")
    assert r.unsafe and r.output is None
    assert not _objects(client, "ft-loud-fp16/")
    want = tmp_path / "want"
    mine = convert(local / "ft-loud", "fp16", output=want, keep_unsafe=True)
    r = convert("s3://convert-test/ft-loud/", "fp16", output="s3://convert-test/ft-loud-fp16/", keep_unsafe=True)
    assert [f.rule for f in r.failed] == [f.rule for f in mine.failed]  # held in float32, as locally: the same verdict
    if mine.output is None:
        assert r.output is None and not _objects(client, "ft-loud-fp16/")
    else:
        for p in want.iterdir():
            assert _body(client, f"ft-loud-fp16/{p.name}") == p.read_bytes(), p.name
    _no_temporaries(client)


@pytest.mark.parametrize("name", ["scripted.pt", "bare.pkl", "dcp"])
def test_a_format_convert_refuses_is_refused_before_a_download_as_locally(
    name: str, s3: dict[str, Any], local: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TorchScript, a bare pickle and DCP: the local refusal (ConversionError, its reason word for word), from the
    remote headers, with nothing downloaded and nothing written."""
    with pytest.raises(ConversionError) as mine:
        convert(local / name, "fp16", output=tmp_path / "local-out")
    downloads: list[str] = []
    real = remote._download
    monkeypatch.setattr(remote, "_download", lambda src, dest: (downloads.append(str(src)), real(src, dest))[1])
    before = set(_objects(s3["client"]))
    for output in ("s3://convert-test/refused-out", str(tmp_path / "out")):
        with pytest.raises(ConversionError) as theirs:
            convert(f"s3://convert-test/{name}", "fp16", output=output)
        assert theirs.value.message == mine.value.message
        assert theirs.value.path == f"s3://convert-test/{name}"
    assert downloads == []
    assert set(_objects(s3["client"])) == before and not list(tmp_path.iterdir())


def test_cli_remote_format_refusal_exits_2_with_the_local_line(s3: dict[str, Any], local: Path) -> None:
    mine = run_cli("convert", str(local / "scripted.pt"), "--to", "fp16")
    theirs = run_cli("convert", "s3://convert-test/scripted.pt", "--to", "fp16", "-o", "s3://convert-test/s.pt", env=s3["env"])
    assert mine.returncode == theirs.returncode == 2
    assert theirs.stderr.strip() == mine.stderr.strip().replace(str(local / "scripted.pt"), "s3://convert-test/scripted.pt")
    assert len(theirs.stderr.strip().splitlines()) == 1 and "TorchScript" in theirs.stderr


def test_local_and_remote_outputs_get_the_same_index_files(s3: dict[str, Any], two_index: Path, tmp_path: Path) -> None:
    """One decision (modeldir.output_index): the index from_pretrained reads (model.safetensors.index.json, as it
    resolves the source) is rewritten with the output's sizes; the .bin index, which names the .bin shards the
    conversion copies untouched, is copied untouched, locally and remotely alike."""
    import transformers

    src = two_index
    want, got = tmp_path / "want", tmp_path / "got"
    convert(src, "fp16", output=want)
    convert("s3://convert-test/two-index/", "fp16", output="s3://convert-test/two-index-fp16/")
    convert("s3://convert-test/two-index", "fp16", output=str(got))
    uploaded = {k.removeprefix("two-index-fp16/"): _body(s3["client"], k) for k in _objects(s3["client"], "two-index-fp16/")}
    indexes = {"model.safetensors.index.json", "pytorch_model.bin.index.json"}
    assert {p.name for p in want.iterdir()} == {p.name for p in src.iterdir()} == {p.name for p in got.iterdir()} == set(uploaded)
    for name in sorted(indexes):
        assert (got / name).read_bytes() == (want / name).read_bytes() == uploaded[name], name
    assert (want / "pytorch_model.bin.index.json").read_bytes() == (src / "pytorch_model.bin.index.json").read_bytes()
    index = json.loads((want / "model.safetensors.index.json").read_text())
    shards = sorted(want.glob("*.safetensors"))
    converted = {k: v for shard in shards for k, v in load_file(shard).items()}
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in converted.values())
    assert index["weight_map"] == json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    # what from_pretrained loads from the output is what the rewritten index names, converted
    back = transformers.GPT2LMHeadModel.from_pretrained(want).eval()
    state = back.state_dict()
    assert converted and all(torch.equal(state[k], v) and v.dtype == torch.float16 for k, v in converted.items())
    _no_temporaries(s3["client"])


def test_remote_directory_to_local_goes_through_the_one_atomic_swap(s3: dict[str, Any], local: Path, tmp_path: Path) -> None:
    """S3 -> a local directory is made in atomic_output's temporary: what a dead run left beside the output is removed
    first, an existing output is replaced only with --force, and a conversion blocked by its values leaves nothing."""
    from dtypeaudit import temporaries

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    got = tmp_path / "got"
    stale = tmp_path / f".got.{temporaries.MARKER}-{temporaries.this_host()}-{int(dead.stdout)}.tmp"
    stale.mkdir()
    (stale / "model-00001-of-00003.safetensors").write_bytes(b"half")
    r = convert("s3://convert-test/ft-001", "fp16", output=str(got))
    assert r.output == str(got) and sorted(p.name for p in tmp_path.iterdir()) == ["got"]
    before = {p.name: p.read_bytes() for p in got.iterdir()}
    with pytest.raises(ConversionError, match="already exists"):
        convert("s3://convert-test/ft-001", "bf16", output=str(got))
    convert("s3://convert-test/ft-001", "bf16", output=str(got), force=True)
    after = {p.name: p.read_bytes() for p in got.iterdir()}
    assert after.keys() == before.keys() and after["model-00001-of-00003.safetensors"] != before["model-00001-of-00003.safetensors"]
    loud = tmp_path / "loud"
    r = convert("s3://convert-test/ft-loud", "fp16", output=str(loud))
    assert r.unsafe and r.output is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["got"]


def test_written_records_are_what_the_files_hold(s3: dict[str, Any], local: Path, tmp_path: Path) -> None:
    """Result.written: one verify.Written per weight file (the directory writer's return), whose names, dtypes, shapes
    and CRCs are what safetensors loads from each file; the same records, locally and from a remote source."""
    want = convert(local / "ft-001", "bf16", output=tmp_path / "want")
    got = convert("s3://convert-test/ft-001/", "bf16", output="s3://convert-test/ft-001-written/")
    shards = sorted(p.name for p in (tmp_path / "want").glob("*.safetensors"))
    assert sorted(want.written) == sorted(got.written) == shards
    for name in shards:
        loaded = load_file(tmp_path / "want" / name)
        record = want.written[name]
        assert record.tensors == {k: (str(v.dtype).removeprefix("torch."), tuple(v.shape)) for k, v in loaded.items()}
        assert record.crcs == {k: zlib.crc32(v.contiguous().view(torch.uint8).numpy().tobytes()) for k, v in loaded.items()}
        assert got.written[name].tensors == record.tensors and got.written[name].crcs == record.crcs
    single = convert(local / "x.pt", "fp16", output=tmp_path / "x.fp16.pt")
    assert list(single.written) == ["x.fp16.pt"] and single.written["x.fp16.pt"].crcs
    # a Result crosses processes (fleet): its records hold what the files hold, not maps of the closed sources
    assert pickle.loads(pickle.dumps(single)).written["x.fp16.pt"].tensors == single.written["x.fp16.pt"].tensors


def _bad_upload(damage: Any, suffixes: tuple[str, ...] = (".pt", ".safetensors")) -> Any:
    """``_Dest.put`` uploading a damaged copy of the verified file (those with ``suffixes``): what a broken transfer
    would leave."""
    real = remote._Dest.put

    def put(self: Any, local_file: Path, path: str) -> None:
        damaged = local_file.with_name(local_file.name + ".damaged")
        damaged.write_bytes(damage(local_file.read_bytes()) if local_file.suffix in suffixes else local_file.read_bytes())
        try:
            real(self, damaged, path)
        finally:
            damaged.unlink()

    return put


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda data: data[:-100], id="short"),
        pytest.param(lambda data: data.replace(b'"dtype":"BF16"', b'"dtype":"I16" ', 1), id="header"),
    ],
)
def test_an_upload_that_differs_from_the_verified_file_publishes_nothing(
    damage: Any, s3: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    client = s3["client"]
    monkeypatch.setattr(remote._Dest, "put", _bad_upload(damage))
    with pytest.raises(ConversionError, match="verification failed"):
        convert("s3://convert-test/ft-001/", "bf16", output="s3://convert-test/ft-001-damaged/")
    assert not _objects(client, "ft-001-damaged/")
    _no_temporaries(client)


def test_an_upload_of_config_json_with_a_changed_byte_publishes_nothing(s3: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """The size alone would pass it: a small file beside the weights is read back whole after its upload."""
    client = s3["client"]
    same_size = lambda data: data.replace(b"bfloat16", b"bfloat61", 1)  # noqa: E731
    monkeypatch.setattr(remote._Dest, "put", _bad_upload(same_size, (".json",)))
    with pytest.raises(ConversionError, match="verification failed: the upload's bytes differ"):
        convert("s3://convert-test/ft-001/", "bf16", output="s3://convert-test/ft-001-damaged/")
    assert not _objects(client, "ft-001-damaged/")
    _no_temporaries(client)


def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_fp8_folder_from_s3_plans_and_converts_as_locally(s3: dict[str, Any], local: Path, tmp_path: Path) -> None:
    """A small FP8 folder converts from S3 as it converts locally (held equal to transformers' dequantization by
    test_quant_convert): the dry run plans the same dequantizes (the scales dropped, not cast), and the outputs,
    local and on S3, are byte for byte the local conversion's, with nothing left under a temporary name."""
    pytest.importorskip("transformers")
    client = s3["client"]
    want = tmp_path / "want"
    here = convert(local / "fp8", "bf16", output=want)
    assert not here.blocked and here.plan.counts()["dequantize"] > 0

    def planned(r: Any) -> list[tuple[str, str, str]]:
        return [(p.tensor.name, p.action, p.target) for p in r.plan.tensors]

    dry = convert("s3://convert-test/fp8/", "bf16", dry_run=True, read_values=False)
    assert not dry.blocked and not dry.values_read and planned(dry) == planned(here)
    assert all(p.action == "drop" for p in dry.plan.tensors if p.tensor.name.endswith("_scale_inv"))
    lines = []
    for source in ("s3://convert-test/fp8/", str(local / "fp8")):
        proc = run_cli("convert", source, "--to", "bf16", "--dry-run", env=s3["env"])
        assert proc.returncode == 0, proc.stdout + proc.stderr
        lines.append(next(line for line in proc.stdout.splitlines() if line.startswith("tensors:")))
    assert lines[0] == lines[1] and " dequantized, " in lines[0], lines

    got = tmp_path / "got"
    r = convert("s3://convert-test/fp8/", "bf16", output=str(got))
    assert not r.blocked and r.output == str(got) and planned(r) == planned(here)
    assert _tree(got) == _tree(want)
    r = convert("s3://convert-test/fp8/", "bf16", output="s3://convert-test/fp8-bf16/")
    assert not r.blocked and r.output is not None
    names = {k.removeprefix("fp8-bf16/") for k in _objects(client, "fp8-bf16/")}
    assert names == set(_tree(want))
    for name in names:
        assert _body(client, f"fp8-bf16/{name}") == (want / name).read_bytes(), name
    _no_temporaries(client)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["got", "want"]
