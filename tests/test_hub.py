"""Hub ids read from the Hugging Face cache, offline: ``org/name``, ``org/name@rev``, ``hf://org/name[/file]``.

The cache is laid out as huggingface_hub lays it out (``models--org--name/{blobs,refs,snapshots}``, snapshot files
as relative links into ``blobs/``, LFS blobs named by their sha256 and git blobs by their git sha1), and
huggingface_hub's own readers (``scan_cache_dir``, ``snapshot_download(local_files_only=True)``) must agree that
it is a valid cache before dtypeaudit is asked to read it.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from dtypeaudit.pipeline import expand, scan
from dtypeaudit.render.json import report_dict

from .helpers import run_cli, write_sharded
from .models import TinyLM

MAIN = "a" * 8 + "1" * 32
V1 = "b" * 8 + "2" * 32
SHARDED = "c" * 8 + "3" * 32


def _blob_name(data: bytes, lfs: bool) -> str:
    """huggingface_hub names an LFS file's blob by its sha256, a git file's by its git blob sha1 (the etag the hub sends)."""
    if lfs:
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _snapshot(cache: Path, repo: str, commit: str, files: dict[str, bytes], refs: tuple[str, ...] = ()) -> Path:
    """One revision of ``repo`` in the cache: blobs, a snapshot of relative links into them, and its refs."""
    folder = cache / f"models--{repo.replace('/', '--')}"
    snapshot = folder / "snapshots" / commit
    for name, data in files.items():
        blob = folder / "blobs" / _blob_name(data, lfs=not name.endswith(".json"))
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (folder / "refs").mkdir(parents=True, exist_ok=True)
        (folder / "refs" / ref).write_text(commit)  # huggingface_hub writes the bare hash, no newline
    return snapshot


def _safetensors(state: dict[str, torch.Tensor], tmp: Path) -> bytes:
    save_file(state, str(tmp), metadata={"format": "pt"})
    return tmp.read_bytes()


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hf")
    cache = root / "hub"
    torch.manual_seed(0)
    state = {k: v.clone() for k, v in TinyLM().state_dict().items() if k != "lm_head.weight"}
    config = json.dumps({"architectures": ["TinyLM"], "torch_dtype": "bfloat16"}).encode()
    bf16 = _safetensors({k: v.bfloat16() for k, v in state.items()}, root / "bf16.safetensors")
    fp32 = _safetensors(state, root / "fp32.safetensors")
    _snapshot(cache, "org/tiny", MAIN, {"config.json": config, "model.safetensors": bf16}, refs=("main",))
    _snapshot(cache, "org/tiny", V1, {"config.json": config, "model.safetensors": fp32}, refs=("v1",))
    extra = root / "extra.bin"
    torch.save({"stray": torch.zeros(3)}, extra)
    runs = {"runs/epoch1.ckpt": extra.read_bytes(), "README.md": b"# runs\n"}
    _snapshot(cache, "org/runs", MAIN, runs, refs=("main",))  # no model directory: walked
    _snapshot(
        cache,
        "org/extra",
        MAIN,
        {"config.json": config, "model.safetensors": bf16, "pytorch_model.bin": extra.read_bytes()},
        refs=("main",),
    )
    sharded = write_sharded(root / "sharded-src", state, 3)
    _snapshot(cache, "org/sharded", SHARDED, {p.name: p.read_bytes() for p in sorted(sharded.iterdir())}, refs=("main",))
    return cache


@pytest.fixture
def offline(cache: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_the_fixture_is_a_cache_huggingface_hub_reads(offline: Path) -> None:
    huggingface_hub = pytest.importorskip("huggingface_hub")  # the cache is read without it: only this check needs it
    info = huggingface_hub.scan_cache_dir(offline)
    assert not info.warnings
    repos = {r.repo_id: r for r in info.repos}
    assert {rev.commit_hash for rev in repos["org/tiny"].revisions} == {MAIN, V1}
    assert {ref for rev in repos["org/tiny"].revisions for ref in rev.refs} == {"main", "v1"}
    assert huggingface_hub.snapshot_download("org/tiny", local_files_only=True, cache_dir=offline) == str(
        offline / "models--org--tiny" / "snapshots" / MAIN
    )
    found = huggingface_hub.try_to_load_from_cache("org/tiny", "model.safetensors", cache_dir=offline, revision="v1")
    assert found == str(offline / "models--org--tiny" / "snapshots" / V1 / "model.safetensors")


def _checkpoints(targets: list[str]) -> list[dict]:
    return report_dict(scan(targets, jobs=1))["checkpoints"]


def test_a_hub_id_reads_the_cached_snapshot(offline: Path) -> None:
    snapshot = offline / "models--org--tiny" / "snapshots"
    by_id, by_url, pinned, tagged = _checkpoints(["org/tiny", "hf://org/tiny", f"org/tiny@{V1}", "org/tiny@v1"])
    local_main, local_v1 = _checkpoints([str(snapshot / MAIN), str(snapshot / V1)])
    assert [c["path"] for c in (by_id, by_url, pinned, tagged)] == ["org/tiny", "hf://org/tiny", f"org/tiny@{V1}", "org/tiny@v1"]
    for c, local, commit in ((by_id, local_main, MAIN), (by_url, local_main, MAIN), (pinned, local_v1, V1), (tagged, local_v1, V1)):
        assert c["error"] is None and c["format"] == "hf-directory"
        assert c["tensors"] == local["tensors"] and c["findings"] == local["findings"]
        assert c["metadata"]["hub"] == {"read_from": "cache", "revision": commit}
        assert c["bytes_read"] > 0
    assert {t["dtype"] for t in by_id["tensors"]} == {"bfloat16"}
    assert {t["dtype"] for t in pinned["tensors"]} == {"float32"}


def test_a_file_in_a_cached_repo(offline: Path) -> None:
    (c,) = _checkpoints(["hf://org/tiny@v1/model.safetensors"])
    assert c["format"] == "safetensors" and c["path"] == "hf://org/tiny@v1/model.safetensors"
    assert {t["dtype"] for t in c["tensors"]} == {"float32"}


def test_a_sharded_model_reads_its_shards_through_the_blob_links(offline: Path) -> None:
    (c,) = _checkpoints(["org/sharded"])
    assert c["error"] is None and c["metadata"]["index"] == "model.safetensors.index.json"
    assert len(c["metadata"]["shards"]) == 3 and not c["findings"]


def test_offline_and_not_cached_is_one_line_exit_2(offline: Path) -> None:
    proc = run_cli("scan", "org/tiny", "org/absent", "org/tiny@nope", "--format", "json")
    assert proc.returncode == 2
    doc = json.loads(proc.stdout)
    assert [c["error"] is None for c in doc["checkpoints"]] == [True, False, False]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 2
    assert lines[0] == (
        f"dtypeaudit: error: org/absent: no such local path; as a Hugging Face hub id: the Hugging Face cache ({offline}) "
        "holds no snapshot of it, and HF_HUB_OFFLINE=1 forbids asking the hub (download it first: hf download org/absent)"
    )
    assert "org/tiny@nope" in lines[1] and "HF_HUB_OFFLINE=1" in lines[1]


def test_a_local_path_wins_over_a_hub_id(offline: Path, tmp_path: Path) -> None:
    local = tmp_path / "org" / "tiny"
    local.mkdir(parents=True)
    save_file({"only": torch.zeros(2, dtype=torch.float16)}, str(local / "model.safetensors"))
    proc = run_cli("scan", "org/tiny", "--format", "json", cwd=tmp_path)
    (c,) = json.loads(proc.stdout)["checkpoints"]
    assert [t["name"] for t in c["tensors"]] == ["only"] and "hub" not in c["metadata"]


def test_hf_home_layout_and_names_that_are_not_hub_ids(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(cache.parent))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert cache.name == "hub"
    assert _checkpoints(["org/tiny"])[0]["metadata"]["hub"]["revision"] == MAIN
    from dtypeaudit.formats.hub import is_hub_id

    assert is_hub_id("meta-llama/Llama-3.1-8B") and is_hub_id("org/name@v1.0")
    for name in ("ckpts/model.pt", "./org/name", "/abs/path", "a/b/c", "runs/x.safetensors", "a--b/c", "org/name.json"):
        assert not is_hub_id(name), name


def test_expand_keeps_a_hub_id_that_names_a_model(offline: Path) -> None:
    assert expand(["org/tiny", "hf://org/sharded", "org/absent"]) == ["org/tiny", "hf://org/sharded", "org/absent"]


def test_not_cached_and_online_asks_the_hub(cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the cache lacks a repository and offline mode is off, the hub is read through HfFileSystem (here an
    in-memory stand-in: the tests have no network), by range, the same way."""
    huggingface_hub = pytest.importorskip("huggingface_hub")
    from fsspec.implementations.memory import MemoryFileSystem

    class FakeHub(MemoryFileSystem):  # type: ignore[misc]
        protocol = "hf"
        store: dict = {}
        pseudo_dirs = [""]
        cachable = False

    hub_fs = FakeHub()
    weights = _safetensors({"w": torch.zeros(2, 2, dtype=torch.float16)}, tmp_path / "w.safetensors")
    hub_fs.pipe({"/org/remote-only/config.json": b'{"torch_dtype": "float16"}', "/org/remote-only/model.safetensors": weights})
    monkeypatch.setattr(huggingface_hub, "HfFileSystem", lambda: hub_fs)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    (c, f) = _checkpoints(["org/remote-only", "hf://org/remote-only/model.safetensors"])
    assert c["error"] is None and c["format"] == "hf-directory" and c["path"] == "org/remote-only"
    assert c["metadata"]["hub"] == {"read_from": "hub", "revision": None} and c["metadata"]["config_dtype"] == "float16"
    assert [t["dtype"] for t in c["tensors"]] == ["float16"] and c["bytes_read"] > 0
    assert f["format"] == "safetensors" and f["tensors"][0]["name"] == "w"


def test_a_cached_repo_is_audited_as_a_local_copy_of_it_is(offline: Path, tmp_path: Path) -> None:
    """Links into blobs/ are followed as the loader follows them: a weights file from_pretrained would not load is
    an unused-weights finding, and a repository that is no model directory is walked."""
    snapshot = offline / "models--org--extra" / "snapshots" / MAIN
    copy = tmp_path / "copy"
    copy.mkdir()
    for link in snapshot.iterdir():
        copy.joinpath(link.name).write_bytes(link.read_bytes())
    (cached, local) = _checkpoints(["org/extra", str(copy)])
    assert [f["rule"] for f in cached["findings"]] == ["unused-weights"]
    assert cached["findings"] == local["findings"] and cached["tensors"] == local["tensors"]
    runs = offline / "models--org--runs" / "snapshots" / MAIN
    assert expand(["org/runs"]) == [str(runs / "runs" / "epoch1.ckpt")]
