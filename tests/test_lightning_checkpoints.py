"""A real Lightning ``Trainer.fit`` checkpoint: it converts, and baselines and diffs see through its wrapper."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml

from .helpers import run_cli
from .lightning_fit import write

pytestmark = pytest.mark.slow  # one Trainer.fit in a child process: about 30 s on a loaded machine


@pytest.fixture(scope="module")
def fitted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return write(tmp_path_factory.mktemp("lightning"))


def _kth_value_key(state: dict[str, object]) -> str:
    (key,) = [k for k in state["callbacks"] if k.startswith("ModelCheckpoint")]  # type: ignore[attr-defined]
    return key


def test_an_early_checkpoint_converts_although_the_callback_holds_inf(fitted: tuple[Path, Path], tmp_path: Path) -> None:
    ckpt, _ = fitted
    source = torch.load(ckpt, weights_only=True)
    assert math.isinf(source["callbacks"][_kth_value_key(source)]["kth_value"])  # as Lightning writes it early on
    out = tmp_path / "out.ckpt"
    proc = run_cli("convert", str(ckpt), "--to", "bf16", "-o", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "verified" in proc.stdout
    converted = torch.load(out, weights_only=True)
    for name, tensor in source["state_dict"].items():
        want = tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
        assert converted["state_dict"][name].dtype == want.dtype and torch.equal(converted["state_dict"][name], want), name
    assert math.isinf(converted["callbacks"][_kth_value_key(converted)]["kth_value"])
    assert converted["optimizer_states"][0]["state"][0]["exp_avg"].dtype == source["optimizer_states"][0]["state"][0]["exp_avg"].dtype


def test_scan_values_calls_callback_state_info_and_a_nan_weight_still_refuses(fitted: tuple[Path, Path], tmp_path: Path) -> None:
    ckpt, _ = fitted
    proc = run_cli("scan", str(ckpt), "--values", "-f", "json")
    assert proc.returncode == 0, proc.stdout
    findings = json.loads(proc.stdout)["checkpoints"][0]["findings"]
    (nonfinite,) = [f for f in findings if f["rule"] == "non-finite"]
    assert nonfinite["severity"] == "info" and nonfinite["tensor"].endswith(".kth_value") and "training state" in nonfinite["message"]
    # A NaN in a weight that will be cast still refuses the conversion: only callback state is spared.
    state = torch.load(ckpt, weights_only=True)
    state["state_dict"]["net.bn.weight"][0] = float("nan")
    broken = tmp_path / "broken.ckpt"
    torch.save(state, broken)
    proc = run_cli("convert", str(broken), "--to", "bf16", "-o", str(tmp_path / "never.ckpt"))
    assert proc.returncode == 1 and "state_dict.net.bn.weight" in proc.stdout and "NaN/Inf" in proc.stdout
    assert not (tmp_path / "never.ckpt").exists()


def test_a_baseline_of_the_bare_weights_holds_the_lightning_checkpoint(fitted: tuple[Path, Path], tmp_path: Path) -> None:
    ckpt, bare = fitted
    proc = run_cli("policy", "init", str(bare))
    assert proc.returncode == 0
    policy = tmp_path / "baseline.yaml"
    policy.write_text(proc.stdout)
    rules = {r["name"]: r for r in yaml.safe_load(proc.stdout)["rules"]}
    assert sorted(rules["baseline-bfloat16"]["match"]) == ["conv.bias", "conv.weight", "fc.bias", "fc.weight"]
    for target in (bare, ckpt):
        proc = run_cli("scan", str(target), "--policy", str(policy), "-f", "json")
        assert proc.returncode == 0, (target, proc.stdout)
        assert json.loads(proc.stdout)["checkpoints"][0]["findings"] == []
    # The baseline still catches drift inside the wrapper.
    state = torch.load(ckpt, weights_only=True)
    state["state_dict"]["net.fc.weight"] = state["state_dict"]["net.fc.weight"].float()
    drifted = tmp_path / "drifted.ckpt"
    torch.save(state, drifted)
    proc = run_cli("scan", str(drifted), "--policy", str(policy), "-f", "json")
    assert proc.returncode == 1
    mismatches = {f["tensor"] for f in json.loads(proc.stdout)["checkpoints"][0]["findings"] if f["rule"] == "dtype-mismatch"}
    assert mismatches == {"state_dict.net.fc.weight"}


def test_diff_matches_across_the_lightning_module_prefix(fitted: tuple[Path, Path]) -> None:
    ckpt, bare = fitted
    for a, b, key in ((ckpt, bare, "removed"), (bare, ckpt, "added")):
        proc = run_cli("diff", str(a), str(b), "-f", "json")
        assert proc.returncode == 1  # the training checkpoint holds more than the weights
        doc = json.loads(proc.stdout)
        side = "a" if a == ckpt else "b"
        assert doc[side]["prefix"] == "state_dict.net."
        assert doc["changed"] == [] and doc["added" if key == "removed" else "removed"] == []
        extra = {t["name"] for t in doc[key]}
        assert extra and all(n.startswith(("optimizer_states.", "callbacks.")) for n in extra), extra
        assert doc["compared"] == len(torch.load(bare, weights_only=True))  # every weight and buffer, values equal
    text = run_cli("diff", str(ckpt), str(bare)).stdout
    assert text.splitlines()[-1].startswith("0 added, ") and ", 0 changed" in text.splitlines()[-1]


def test_the_callback_key_is_not_cut_inside_at_100_columns(fitted: tuple[Path, Path]) -> None:
    ckpt, _ = fitted
    (name,) = [f"callbacks.{k}.kth_value" for k in torch.load(ckpt, weights_only=True)["callbacks"] if k.startswith("ModelCheckpoint")]
    lines = run_cli("scan", str(ckpt), "-f", "plain", env={"COLUMNS": "100"}).stdout.splitlines()
    header = next(line for line in lines if line.startswith("name "))
    dtype_at = header.index("dtype")
    start = next(i for i, line in enumerate(lines) if line.startswith("callbacks."))
    pieces = [lines[start][:dtype_at].rstrip()]
    for line in lines[start + 1 :]:
        if line[dtype_at:].strip():
            break
        pieces.append(line.rstrip())
    assert len(pieces) > 1 and all(p.endswith((".", ",", ":")) for p in pieces[:-1]), pieces
    assert "".join(p if p.endswith(".") else p + " " for p in pieces[:-1]) + pieces[-1] == name
