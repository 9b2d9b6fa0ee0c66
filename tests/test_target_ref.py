"""Issue 18: a target is parsed once into a ``TargetRef`` and read where it was found; inventories name their format
with a ``Format``; one resolver says which policy and hardware target apply."""

from __future__ import annotations

import io
import json
import pickle
from pathlib import Path

import fsspec
import pytest
import torch
from safetensors.torch import save_file

from dtypeaudit import hardware
from dtypeaudit.checks import checks_for, run_checks
from dtypeaudit.conversion import convert
from dtypeaudit.errors import ConversionError, UsageError
from dtypeaudit.formats import Format, format_of, hub, read_checkpoint
from dtypeaudit.formats.locate import TargetKind, TargetRef, parse_target
from dtypeaudit.formats.remote import RemotePath
from dtypeaudit.options import effective
from dtypeaudit.pipeline import expand_targets, read_target, scan
from dtypeaudit.policy import load_policy

COMMIT = "c" * 40


def _save(path: Path, dtype: torch.dtype = torch.float32) -> Path:
    torch.save({"fc.weight": torch.ones(2, 2, dtype=dtype), "fc.bias": torch.ones(2, dtype=dtype)}, path)
    return path


# -- parsing once ---------------------------------------------------------------------------------------------------


def test_each_kind_of_target_is_told_apart_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    ckpt = _save(tmp_path / "model.pt")
    (tmp_path / "folder").mkdir()
    (tmp_path / "org").mkdir()
    kinds = {
        text: parse_target(text).kind
        for text in (str(ckpt), "folder", "missing.pt", "net.py:build", "pkg.models:build", "s3://bucket/x.pt", "hf://org/name")
    }
    assert kinds == {
        str(ckpt): TargetKind.FILE,
        "folder": TargetKind.DIR,
        "missing.pt": TargetKind.FILE,
        "net.py:build": TargetKind.FACTORY,
        "pkg.models:build": TargetKind.FACTORY,
        "s3://bucket/x.pt": TargetKind.URL,
        "hf://org/name": TargetKind.HUB,
    }
    assert parse_target("meta-llama/Llama-3.1-8B").kind is TargetKind.HUB
    # a local folder named like the organisation makes org/x a path (a typo), not a hub id
    assert parse_target("org/x").kind is TargetKind.FILE
    # convert's sources and read() take paths and URLs only: there org/name is a local path, a:b a file name
    assert parse_target("meta-llama/Llama-3.1-8B", models=False).kind is TargetKind.FILE
    assert parse_target("net.py:build", models=False).kind is TargetKind.FILE
    with pytest.raises(UsageError, match="is a factory"):  # a factory is built (scan does that), never read as a file
        read_checkpoint(parse_target("net.py:build"))
    local = parse_target(f"file://{ckpt}")
    assert local.kind is TargetKind.FILE and local.where == ckpt and not local.is_remote


def test_a_target_crosses_to_a_worker_without_its_remote_filesystem(tmp_path: Path) -> None:
    ckpt = _save(tmp_path / "model.pt")
    local = parse_target(str(ckpt))
    assert pickle.loads(pickle.dumps(local)).where == ckpt
    remote = TargetRef("memory:///reg/a.pt", TargetKind.URL, RemotePath.from_url("memory:///reg/a.pt"))
    sent = pickle.loads(pickle.dumps(remote))
    assert sent == remote and sent.where is None  # the worker locates it once, in its own process


def test_a_walked_remote_folder_is_located_once_not_again_per_file(monkeypatch: pytest.MonkeyPatch) -> None:
    fs = fsspec.filesystem("memory")
    for name in ("a", "b", "c"):
        buf = io.BytesIO()
        torch.save({"w": torch.zeros(2, dtype=torch.float16)}, buf)
        fs.pipe(f"/walked/{name}.pt", buf.getvalue())
    located: list[str] = []
    real = RemotePath.from_url.__func__  # type: ignore[attr-defined]

    def counting(cls: type[RemotePath], url: str) -> RemotePath:
        located.append(url)
        return real(cls, url)

    monkeypatch.setattr(RemotePath, "from_url", classmethod(counting))
    report = scan(["memory://walked"])
    assert [(c.path, c.format, c.error) for c in report.checkpoints] == [
        (f"memory:///walked/{n}.pt", "torch-zip", None) for n in ("a", "b", "c")
    ]
    assert located == ["memory://walked"]
    fs.rm("/walked", recursive=True)


def test_a_hub_id_is_looked_up_in_the_cache_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    snapshot = tmp_path / "hub" / "models--org--tiny" / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (tmp_path / "hub" / "models--org--tiny" / "refs").mkdir()
    (tmp_path / "hub" / "models--org--tiny" / "refs" / "main").write_text(COMMIT)
    save_file({"w": torch.zeros(2, 2, dtype=torch.bfloat16)}, str(snapshot / "model.safetensors"))
    (snapshot / "config.json").write_text('{"torch_dtype": "bfloat16"}')
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    asked: list[str] = []
    real = hub.locate
    monkeypatch.setattr(hub, "locate", lambda target: asked.append(target) or real(target))
    (c,) = scan(["org/tiny"]).checkpoints
    assert (c.path, c.format, c.error) == ("org/tiny", "hf-directory", None)
    assert c.inventory is not None and c.inventory.metadata["hub"] == {"read_from": "cache", "revision": COMMIT}
    assert asked == ["hf://org/tiny"]  # expanding it found it; reading it did not ask again
    # read alone (no walk before it), a hub id is located by the read itself
    asked.clear()
    assert read_target("org/tiny").metadata["hub"] == {"read_from": "cache", "revision": COMMIT} and asked == ["hf://org/tiny"]


def test_expand_gives_targets_that_read_as_their_names_do(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    _save(run / "a.pt")
    _save(run / "b.pt", torch.float16)
    found = expand_targets([str(run), str(run / "a.pt")])
    assert [(t.text, t.kind) for t in found] == [(str(run / "a.pt"), TargetKind.FILE), (str(run / "b.pt"), TargetKind.FILE)]
    assert [read_target(t).tensors for t in found] == [read_checkpoint(t.text).tensors for t in found]


# -- Format ---------------------------------------------------------------------------------------------------------


def test_readers_name_formats_the_enum_knows_and_json_keeps_the_strings(tmp_path: Path) -> None:
    zipped = _save(tmp_path / "zip.pt")
    legacy = tmp_path / "legacy.pt"
    torch.save({"w": torch.ones(2)}, legacy, _use_new_zipfile_serialization=False)
    st = tmp_path / "w.safetensors"
    save_file({"w": torch.ones(2)}, str(st))
    scripted = tmp_path / "scripted.pt"
    torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), str(scripted))
    got = {p.name: format_of(read_checkpoint(p).format) for p in (zipped, legacy, st, scripted)}
    assert got == {
        "zip.pt": Format.TORCH_ZIP,
        "legacy.pt": Format.TORCH_LEGACY,
        "w.safetensors": Format.SAFETENSORS,
        "scripted.pt": Format.TORCHSCRIPT,
    }
    assert [f for f in Format if f.casts] == [Format.TORCH_ZIP, Format.TORCH_LEGACY, Format.SAFETENSORS, Format.HF_DIRECTORY]
    assert json.dumps({"format": Format.HF_DIRECTORY}) == '{"format": "hf-directory"}' and f"{Format.DCP}" == "dcp"
    assert format_of("not-a-format") is None
    # the refusal convert gives is the one the enum holds
    with pytest.raises(ConversionError) as refused:
        convert(str(scripted), "fp16", dry_run=True)
    assert refused.value.message == Format.TORCHSCRIPT.convert_refusal


# -- which policy and target apply ------------------------------------------------------------------------------------


def test_target_option_wins_over_the_policy_and_the_policy_target_applies_otherwise(tmp_path: Path) -> None:
    policy_file = tmp_path / "p.yaml"
    policy_file.write_text("version: 1\nextends: fp16\ntarget: t4\n")
    own = effective(str(policy_file))
    assert own.policy is not None and own.policy.target == "t4" and own.target is hardware.resolve("t4")
    chosen = effective(str(policy_file), target="a100")
    assert chosen.target is hardware.resolve("a100") and chosen.policy is not None and chosen.policy.target == "t4"
    assert effective(preset="fp16").target is None and effective().policy is None
    loaded = load_policy("fp16")
    assert effective(loaded).policy is loaded  # a Policy object as given
    with pytest.raises(UsageError, match="not both"):
        effective(str(policy_file), preset="fp16")
    with pytest.raises(UsageError):
        effective(target="no-such-gpu")
    # the checks: the policy's own, with the chosen target's in place of the policy's target
    inv = read_checkpoint(_save(tmp_path / "m.pt", torch.bfloat16))
    rules = lambda checks: sorted({(f.rule, f.severity) for f in run_checks(inv, checks)[1]})  # noqa: E731
    assert rules(own.checks()) == rules(checks_for(own.policy))
    assert ("emulated-dtype", "warning") in rules(own.checks())  # t4 only emulates bfloat16
    assert ("emulated-dtype", "warning") not in rules(chosen.checks())  # an a100 computes it
    assert ("dtype-mismatch", "error") in rules(chosen.checks())  # and the policy's rules still apply


def test_a_remote_source_is_located_once_by_convert(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fs = fsspec.filesystem("memory")
    buf = io.BytesIO()
    torch.save({"fc.weight": torch.ones(2, 2), "fc.bias": torch.ones(2)}, buf)
    fs.pipe("/conv/model.pt", buf.getvalue())
    located: list[str] = []
    real = RemotePath.from_url.__func__  # type: ignore[attr-defined]
    monkeypatch.setattr(RemotePath, "from_url", classmethod(lambda cls, url: located.append(url) or real(cls, url)))
    out = tmp_path / "model.fp16.pt"
    result = convert("memory://conv/model.pt", "fp16", output=str(out))
    assert result.output == str(out) and not result.blocked
    assert {k: v.dtype for k, v in torch.load(out, weights_only=True).items()} == {"fc.weight": torch.float16, "fc.bias": torch.float16}
    assert located == ["memory://conv/model.pt"]  # read and downloaded from where it was found, not located again
    fs.rm("/conv", recursive=True)


# -- a file:// target is its path ----------------------------------------------------------------------------------


def test_a_file_url_and_its_path_are_one_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from .helpers import run_cli

    monkeypatch.chdir(tmp_path)
    ckpt = _save(tmp_path / "model.pt")
    url = f"file://{ckpt}"
    named = parse_target(url)
    assert named.file_url and named.named_by_url and named.identity == parse_target("./model.pt").identity == str(ckpt)
    # the first spelling is kept, the others dropped: scan reads the checkpoint once, under the name given first
    assert [t.text for t in expand_targets([url, str(ckpt), "model.pt"])] == [url]
    assert [t.text for t in expand_targets(["model.pt", url])] == ["model.pt"]
    report = scan([url, "model.pt"])
    assert [c.path for c in report.checkpoints] == [url] and report.checkpoints[0].error is None
    # convert SOURCE...: converted once, written where -o names
    out = tmp_path / "out"
    out.mkdir()
    proc = run_cli("convert", "model.pt", url, "--to", "fp16", "-o", str(out / "model.fp16.pt"), "--format", "json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["source"] == "model.pt"
    got = torch.load(out / "model.fp16.pt", weights_only=True)
    want = {"fc.weight": (torch.float16, (2, 2)), "fc.bias": (torch.float16, (2,))}
    assert {k: (v.dtype, tuple(v.shape)) for k, v in got.items()} == want
    assert sorted(p.name for p in out.iterdir()) == ["model.fp16.pt"]


def test_a_file_url_crosses_to_a_worker_as_a_file_url() -> None:
    named = parse_target("file:///tmp/x/model.pt")
    sent = pickle.loads(pickle.dumps(named))
    assert sent == named and sent.file_url and sent.where == Path("/tmp/x/model.pt")
