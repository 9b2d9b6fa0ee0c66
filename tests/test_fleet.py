"""Fleet jobs: the same per-checkpoint work in local worker processes (--jobs) and as tasks on a Dask
cluster (--cluster), one report in input order, equal to a serial run's; failures stay with their inputs.

The cluster is a real ``dask.distributed.LocalCluster`` of two worker processes started by the tests;
the CLI runs as a separate process and connects to its scheduler as it would to a remote one.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from dtypeaudit import fleet
from dtypeaudit.checks import checks_for
from dtypeaudit.errors import UsageError
from dtypeaudit.pipeline import Work, audit_one, read_target, scan
from dtypeaudit.policy import load_policy

from .helpers import run_cli

TIMING = ("elapsed", "seconds", "duration", "time_s")


def _stable(doc: Any) -> Any:
    """The report without timing fields (none today; a field a scan may add later must not break the comparison)."""
    if isinstance(doc, dict):
        return {k: _stable(v) for k, v in doc.items() if not any(t in k for t in TIMING)}
    if isinstance(doc, list):
        return [_stable(v) for v in doc]
    return doc


class Net(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, 4)
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 2)


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of checkpoints in every local format, some with findings, one unreadable, in nested folders."""
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("fleet")
    torch.manual_seed(0)
    for i in range(24):
        folder = root / f"run_{i // 6}"
        folder.mkdir(exist_ok=True)
        state = Net(3 + i % 5).state_dict()
        if i % 4 == 1:
            state = {k: v.half() for k, v in state.items()}
        if i % 4 == 2:
            state["fc.bias"] = state["fc.bias"].half()  # module-dtype-mix: an error finding
        if i % 3 == 0:
            save_file({k: v.contiguous() for k, v in state.items()}, folder / f"ckpt_{i:02d}.safetensors")
        elif i % 3 == 1:
            torch.save({"state_dict": state, "epoch": i}, folder / f"ckpt_{i:02d}.pt")
        else:
            torch.save(state, folder / f"ckpt_{i:02d}.bin", _use_new_zipfile_serialization=False)
    (root / "run_1" / "broken.pt").write_bytes(b"PK\x03\x04 not really a zip archive")
    hf = root / "run_2" / "hf_model"
    hf.mkdir()
    save_file({k: v.contiguous() for k, v in Net(6).state_dict().items()}, hf / "model.safetensors")
    (hf / "config.json").write_text(json.dumps({"model_type": "toy", "torch_dtype": "float32"}))
    return root


@pytest.fixture(scope="module")
def dask_installed() -> None:
    """Skips only the tests that need Dask (the dask extra); the rest of this file runs without it."""
    pytest.importorskip("distributed")


@pytest.fixture(scope="module")
def cluster(dask_installed: None):
    """A LocalCluster of two worker processes; a worker that dies is not retried, so a lost input shows at once."""
    import dask
    import distributed

    with dask.config.set({"distributed.scheduler.allowed-failures": 0}):
        with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as c:
            yield c


def _scan(*args: str, cwd: Path) -> tuple[int, dict[str, Any], str]:
    proc = run_cli("scan", *args, "--format", "json", cwd=cwd)
    return proc.returncode, _stable(json.loads(proc.stdout)), proc.stderr


def test_cluster_scan_equals_local_scan(tree: Path, cluster) -> None:
    # relative names, from the folder above: the report keeps them as named, though the workers get them whole
    args = ("run_0", "run_1", "run_2", "run_3", "--preset", "fp16-mixed")
    code, local, err = _scan(*args, "--jobs", "1", cwd=tree)
    assert code == 2  # broken.pt
    assert len(local["checkpoints"]) == 26
    assert [c["path"] for c in local["checkpoints"]][:3] == ["run_0/ckpt_00.safetensors", "run_0/ckpt_01.pt", "run_0/ckpt_02.bin"]
    on_cluster = _scan(*args, "--cluster", cluster.scheduler_address, cwd=tree)
    assert on_cluster == (code, local, err)
    in_processes = _scan(*args, "--jobs", "2", cwd=tree)
    assert in_processes == (code, local, err)
    broken = [c for c in local["checkpoints"] if c["error"]]
    assert [c["path"] for c in broken] == ["run_1/broken.pt"]
    assert err.splitlines() == [f"dtypeaudit: error: {broken[0]['error']}"]
    assert broken[0]["error"].startswith("run_1/broken.pt: ")
    assert sum(1 for c in local["checkpoints"] if any(f["severity"] == "error" for f in c["findings"])) > 6


def test_local_cluster_option(tree: Path, dask_installed: None) -> None:
    """--cluster local starts a LocalCluster of --jobs worker processes for the run."""
    code, local, err = _scan(str(tree / "run_0"), "--jobs", "1", cwd=tree)
    assert code == 1 and err == ""
    assert _scan(str(tree / "run_0"), "--cluster", "local", "--jobs", "2", cwd=tree) == (code, local, "")  # no Dask chatter


def test_library_scan_on_cluster_keeps_order_and_policy(tree: Path, cluster) -> None:
    """The library API: checks (policy partials) travel to the workers; unused-rule stays a whole-run finding."""
    pol = load_policy("bf16-mixed")
    kwargs = dict(checks=checks_for(pol), policy=pol, strict=True)
    here = scan([str(tree)], jobs=1, **kwargs)
    there = scan([str(tree)], cluster=cluster.scheduler_address, **kwargs)
    assert [c.path for c in there.checkpoints] == [c.path for c in here.checkpoints]
    assert there == here
    assert any(f.rule == "dtype-mismatch" for f in here.findings)


def test_lost_worker_is_a_failure_of_its_input_only(tree: Path, tmp_path: Path, cluster) -> None:
    """A factory that kills its worker: that input is reported lost (exit 2), the rest of its batch is re-run and reported."""
    killer = tmp_path / "killer.py"
    killer.write_text("import os\n\ndef build():\n    os._exit(3)\n")
    targets = (
        [str(p) for p in sorted((tree / "run_0").iterdir())] + [f"{killer}:build"] + [str(p) for p in sorted((tree / "run_3").iterdir())]
    )
    proc = run_cli("scan", *targets, "--cluster", cluster.scheduler_address, "--format", "json", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    report = json.loads(proc.stdout)
    assert [c["path"] for c in report["checkpoints"]] == targets
    errors = [c for c in report["checkpoints"] if c["error"]]
    assert [c["path"] for c in errors] == [f"{killer}:build"]
    assert "Dask worker reading it was lost (KilledWorker)" in errors[0]["error"]
    assert proc.stderr.splitlines() == [f"dtypeaudit: error: {errors[0]['error']}"]


def test_unreachable_scheduler_is_one_line(tree: Path, dask_installed: None) -> None:
    import dask

    # dask's own setting says how long to keep trying (30 s by default). run_cli runs in this process, where dask
    # read its environment when it was first imported, so the setting goes in through dask.config as well.
    with dask.config.set({"distributed.comm.timeouts.connect": "1s"}):
        proc = run_cli(
            "scan",
            str(tree / "run_0"),
            "--cluster",
            "tcp://127.0.0.1:9",
            "--format",
            "json",
            env={"DASK_DISTRIBUTED__COMM__TIMEOUTS__CONNECT": "1s"},
        )
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert len(proc.stderr.splitlines()) == 1
    assert proc.stderr.startswith("dtypeaudit: error: cannot reach the Dask scheduler at tcp://127.0.0.1:9")
    bad = run_cli("scan", str(tree / "run_0"), "--cluster", "scheduler:8786")
    assert bad.returncode == 2 and "scheduler address" in bad.stderr


def _sources(tree: Path, dest: Path) -> list[str]:
    """Four convertible checkpoints (zip, legacy, safetensors, a Hugging Face directory) and one unreadable file."""
    dest.mkdir()
    return [
        str(tree / "run_0" / "ckpt_01.pt"),
        str(tree / "run_0" / "ckpt_02.bin"),
        str(tree / "run_0" / "ckpt_03.safetensors"),
        str(tree / "run_2" / "hf_model"),
        str(tree / "run_1" / "broken.pt"),
    ]


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_cluster_conversion_equals_local_conversion_byte_for_byte(tree: Path, tmp_path: Path, cluster) -> None:
    sources = _sources(tree, tmp_path / "local")
    (tmp_path / "fleet").mkdir()
    local = run_cli("convert", *sources, "--to", "bf16", "-o", str(tmp_path / "local"), "--format", "json")
    there = run_cli(
        "convert", *sources, "--to", "bf16", "-o", str(tmp_path / "fleet"), "--cluster", cluster.scheduler_address, "--format", "json"
    )
    assert local.returncode == there.returncode == 2, local.stderr + there.stderr
    assert local.stderr.splitlines() == there.stderr.splitlines()
    assert len(local.stderr.splitlines()) == 1 and "broken.pt" in local.stderr
    docs = json.loads(there.stdout)
    assert [d["source"] for d in docs] == sources
    assert [d.get("error") is None for d in docs] == [True, True, True, True, False]
    expected = {
        "ckpt_01.bf16.pt",
        "ckpt_02.bf16.bin",
        "ckpt_03.bf16.safetensors",
        "hf_model-bf16/model.safetensors",
        "hf_model-bf16/config.json",
    }
    written = _files(tmp_path / "fleet")
    assert set(written) == expected
    assert written == _files(tmp_path / "local")
    # and equal to what a single-source conversion writes
    single = tmp_path / "single.pt"
    assert run_cli("convert", sources[0], "--to", "bf16", "-o", str(single)).returncode == 0
    assert single.read_bytes() == written["ckpt_01.bf16.pt"]
    converted = read_target(str(tmp_path / "fleet" / "ckpt_01.bf16.pt"))
    assert {t.dtype for t in converted.tensors} == {"bfloat16"}  # Net's weights; the epoch is a plain int


def test_convert_many_in_processes(tree: Path, tmp_path: Path) -> None:
    sources = _sources(tree, tmp_path / "out")[:3]
    proc = run_cli("convert", *sources, "--to", "fp16", "-o", str(tmp_path / "out"), "--jobs", "2")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("converted: ") == 3
    again = run_cli("convert", *sources, "--to", "fp16", "-o", str(tmp_path / "out"), "--jobs", "2")
    assert again.returncode == 2  # outputs exist: one line per source, nothing replaced without --force
    assert len(again.stderr.splitlines()) == 3 and all("already exists" in line for line in again.stderr.splitlines())


def test_convert_many_usage(tree: Path, tmp_path: Path) -> None:
    a, b = str(tree / "run_0" / "ckpt_01.pt"), str(tree / "run_1" / "ckpt_07.pt")
    not_dir = run_cli("convert", a, b, "--to", "fp16", "-o", str(tmp_path / "x.pt"))
    assert not_dir.returncode == 2 and "existing directory" in not_dir.stderr
    twin = tmp_path / "twin"
    twin.mkdir()
    (twin / "ckpt_01.pt").write_bytes(Path(a).read_bytes())
    clash = run_cli("convert", a, str(twin / "ckpt_01.pt"), "--to", "fp16", "-o", str(tmp_path))
    assert clash.returncode == 2 and "two sources would be written" in clash.stderr


def test_batches_cover_every_input_once() -> None:
    for n in (0, 1, 5, 16, 17, 1000, 10_000):
        for workers in (1, 2, 16):
            ranges = fleet.batches(n, workers)
            assert [i for a, b in ranges for i in range(a, b)] == list(range(n))
            assert all(0 < b - a <= fleet.MAX_BATCH for a, b in ranges)


def test_run_keeps_input_order_and_reports_progress(tree: Path) -> None:
    paths = [str(p) for p in sorted(tree.rglob("*.pt"))] * 3
    seen: list[tuple[int, int]] = []
    work = Work(read=read_target, checks=tuple(checks_for(None)))
    serial = fleet.run(audit_one, paths, work, jobs=1)
    parallel = fleet.run(audit_one, paths, work, jobs=2, progress=lambda done, total, _: seen.append((done, total)))
    assert parallel == serial
    assert [c.path for c in parallel] == paths
    assert seen[-1] == (len(paths), len(paths)) and [d for d, _ in seen] == sorted(d for d, _ in seen)
    with pytest.raises(UsageError):
        fleet.run(audit_one, paths, work, jobs=0)


def test_no_dask_at_import() -> None:
    import subprocess
    import sys

    code = "import sys, dtypeaudit.cli, dtypeaudit.fleet, dtypeaudit.pipeline\nprint(sorted({'dask', 'distributed'} & set(sys.modules)))"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env).stdout.strip() == "[]"


def test_one_source_with_jobs_writes_what_a_plain_convert_writes(tree: Path, tmp_path: Path) -> None:
    source = str(tree / "run_0" / "ckpt_01.pt")
    plain = run_cli("convert", source, "--to", "fp16", "-o", str(tmp_path / "a.pt"), "--format", "json")
    pooled = run_cli("convert", source, "--to", "fp16", "-o", str(tmp_path / "b.pt"), "--format", "json", "--jobs", "2")
    assert plain.returncode == pooled.returncode == 0, plain.stderr + pooled.stderr
    assert json.loads(pooled.stdout) == {**json.loads(plain.stdout), "output": str(tmp_path / "b.pt")}
    assert (tmp_path / "a.pt").read_bytes() == (tmp_path / "b.pt").read_bytes()
    broken = run_cli("convert", str(tree / "run_1" / "broken.pt"), "--to", "fp16", "--jobs", "2")
    assert broken.returncode == 2 and broken.stdout == "" and len(broken.stderr.splitlines()) == 1


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A folder served over HTTP with ranges (the remote tests' server): its URL and the folder."""
    from .helpers import serve_folder

    root = tmp_path / "served"
    root.mkdir()
    with serve_folder(root) as (base, _):
        yield f"{base}/files", root


def test_convert_many_takes_a_url_source(tree: Path, tmp_path: Path, served: tuple[str, Path]) -> None:
    """A URL among several sources: converted as it is alone, its output named after the URL's last part."""
    import shutil

    base, root = served
    local = tree / "run_0" / "ckpt_04.pt"
    shutil.copy(tree / "run_0" / "ckpt_00.safetensors", root / "remote.safetensors")
    url = f"{base}/remote.safetensors"
    out = tmp_path / "out"
    out.mkdir()
    proc = run_cli("convert", str(local), url, "--to", "fp16", "-o", str(out), "--format", "json")
    assert proc.returncode == 0, proc.stderr
    assert [d["source"] for d in json.loads(proc.stdout)] == [str(local), url]
    assert sorted(p.name for p in out.iterdir()) == ["ckpt_04.fp16.pt", "remote.fp16.safetensors"]
    # what each source alone writes, byte for byte: the URL's from the same bytes on disk
    for source, written in ((local, "ckpt_04.fp16.pt"), (root / "remote.safetensors", "remote.fp16.safetensors")):
        alone = tmp_path / f"alone-{written}"
        assert run_cli("convert", str(source), "--to", "fp16", "-o", str(alone)).returncode == 0
        assert (out / written).read_bytes() == alone.read_bytes()


def test_an_output_named_for_a_relative_source_is_found_where_a_remote_worker_looks(tmp_path, monkeypatch):
    """-o's outputs are keyed by the source's identity and absolute: a worker elsewhere gets the source made absolute
    (fleet._absolute) and has its own working directory, and must still find the output the user named."""
    from dtypeaudit.formats.locate import parse_target

    monkeypatch.chdir(tmp_path)
    torch.save({"w": torch.ones(2)}, tmp_path / "a.pt")
    ref = parse_target("a.pt", models=False)
    outputs = {ref.identity: os.path.abspath("out/a.fp16.pt")}
    sent = fleet._absolute(ref)
    assert sent.text == str(tmp_path / "a.pt") and sent != ref
    assert outputs.get(sent.identity) == str(tmp_path / "out" / "a.fp16.pt")
    assert fleet._absolute("a.pt") == str(tmp_path / "a.pt") and fleet._absolute("missing.pt") == "missing.pt"
