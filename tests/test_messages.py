"""Messages a user reads: API wording in the Python API and pytest plugin, local typos, policy typos."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import dtypeaudit
from dtypeaudit.pytest_plugin import DtypeAudit

from .helpers import run_cli


def _mixed() -> nn.Module:
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    model[0].weight.data = model[0].weight.data.half()  # weight float16, bias float32: the forward fails
    return model


def test_the_api_and_the_pytest_plugin_speak_of_the_model_not_of_cli_options() -> None:
    (mix,) = [f for f in dtypeaudit.audit(_mixed()) if f.rule == "module-dtype-mix"]
    assert mix.message.startswith("Linear (module type from the model) mixes floating dtypes") and "--" not in mix.message
    with pytest.raises(pytest.fail.Exception) as failed:
        DtypeAudit().assert_clean(_mixed())
    text = str(failed.value)
    assert "module-dtype-mix" in text and "module type from the model" in text and "--model" not in text


@pytest.fixture
def workspace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    from safetensors.torch import save_file

    (tmp_path / "hf" / "gpt2").mkdir(parents=True)
    save_file({"wte.weight": torch.zeros(4, 2)}, str(tmp_path / "hf" / "gpt2" / "model.safetensors"))
    return tmp_path


def test_a_local_typo_is_said_to_be_a_missing_path_with_the_close_name(workspace: Path) -> None:
    for target in ("hf/gtp2", "./hf/gtp2", "hf/gpt2/model.safetenosrs"):
        proc = run_cli("scan", target, "-f", "json", cwd=workspace, env={"HF_HUB_OFFLINE": "1"})
        assert proc.returncode == 2
        (line,) = proc.stderr.splitlines()
        assert "no such file or directory (did you mean " in line, line
        assert "hub" not in line and "hf download" not in line
    assert "'hf/gpt2'" in run_cli("scan", "hf/gtp2", cwd=workspace).stderr
    assert run_cli("scan", "hf/gpt2", "-f", "json", cwd=workspace).returncode == 0  # the control: the right name reads
    # With no local folder of that name, an org/name is still a hub id.
    other = run_cli("scan", "someorg/somemodel", cwd=workspace, env={"HF_HUB_OFFLINE": "1"})
    assert other.returncode == 2 and "as a Hugging Face hub id" in other.stderr


@pytest.mark.parametrize(
    ("text", "suggestion"),
    [
        ("version: 1\ndefualt: float16\n", "did you mean 'default'?"),
        ('version: 1\nrules:\n  - mtach: "*norm*"\n    dtype: float32\n', "did you mean 'match'?"),
        ("version: 1\ndefault: flaot16\n", "did you mean 'float16'?"),
        ('version: 1\nrules:\n  - match: "*"\n    dtype: float32\n    region: optimzer\n', "did you mean 'optimizer'?"),
        ('version: 1\nrules:\n  - match: "*"\n    dtype: float32\n    severity: eror\n', "did you mean 'error'?"),
        ('version: 1\nrules:\n  - match: "*"\n    dtype: float32\n    kind: paramter\n', "did you mean 'parameter'?"),
        ("version: 1\nextends: fp16-mixd\n", "did you mean 'fp16-mixed'?"),
        ("version: 1\ntrace:\n  fail_no: warning\n", "did you mean 'fail_on'?"),
    ],
)
def test_policy_typos_get_did_you_mean(tmp_path: Path, text: str, suggestion: str) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(text)
    proc = run_cli("policy", "validate", str(policy))
    assert proc.returncode == 2 and suggestion in proc.stderr, proc.stderr


def test_a_preset_typo_and_a_far_miss(tmp_path: Path) -> None:
    proc = run_cli("policy", "validate", "bf16-weigths-fp32-norms")
    assert proc.returncode == 2 and "did you mean 'bf16-weights-fp32-norms'?" in proc.stderr
    proc = run_cli("policy", "validate", "nothing-like-any")
    assert proc.returncode == 2 and "did you mean" not in proc.stderr and "presets: " in proc.stderr
