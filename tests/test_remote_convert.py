"""Remote conversion against moto's S3 server (through s3fs, as a user would use AWS): S3 -> S3 and S3 -> local.

What must hold: the outputs are byte for byte what converting the same local files writes; nothing is left under a
temporary name; a directory's index is published last; a refused (hostile) source writes nothing; no credential
reaches any output; a remote source without -o is refused with one line.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from dtypeaudit.conversion import convert
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
    return root


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
    assert proc3.returncode == 1
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
