"""``dtypeaudit trace`` with a policy (its ``trace:`` section, ``fail_on`` and ``target:``) and with ``--target``.

Real small models, traced through the command: a policy decides whether an implicit promotion fails the run and
which modules may promote; a hardware target turns the dtypes a model computes in into ``emulated-dtype`` and
``unsupported-dtype`` at the modules that compute them, and at its parameters.
"""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from dtypeaudit.cli import app
from dtypeaudit.errors import PolicyError
from dtypeaudit.policy import load_policy
from dtypeaudit.trace import trace, trace_module

# Two fp16 blocks that each multiply by a float32 buffer (an implicit promotion to float32) and cast back:
# `prehead` and `head`, so `head*` shows the dotted-boundary rule (it must not silence `prehead`).
NET = """
import torch
from torch import nn


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4).half()
        self.register_buffer("scale", torch.ones(4))  # left in float32

    def forward(self, x):
        return (self.fc(x) * self.scale).to(x.dtype)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.prehead = Scaled()
        self.head = Scaled()

    def forward(self, x):
        return self.head(self.prehead(x))


def build():
    return Net()


def bf16():
    return nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2)).to(torch.bfloat16)


def fp8():
    return nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)).to(torch.float8_e4m3fn)


def fp32():
    return nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
"""


@pytest.fixture(scope="module")
def net(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("trace_policy") / "net.py"
    path.write_text(NET)
    return path


def write(tmp_path: Path, text: str, name: str = "policy.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text).lstrip())
    return path


def cli(*args: str) -> Any:
    return CliRunner().invoke(app, ["trace", *args], catch_exceptions=False)


def findings(result: Any) -> list[dict[str, Any]]:
    return json.loads(result.stdout)["checkpoints"][0]["findings"]


def where(result: Any, rule: str) -> list[str]:
    return [f["tensor"] for f in findings(result) if f["rule"] == rule]


# -- trace: fail_on and allow_promotion ---------------------------------------------------------------------------------


def test_without_a_policy_promotions_are_warnings(net: Path) -> None:
    r = cli(f"{net}:build", "--input", "2x4:float16", "-f", "json")
    assert r.exit_code == 0, r.output
    assert sorted(where(r, "implicit-promotion")) == ["head", "prehead"]


def test_policy_trace_fail_on_warning_fails_the_run(net: Path, tmp_path: Path) -> None:
    pol = write(tmp_path, "version: 1\ntrace:\n  fail_on: warning\n")
    r = cli(f"{net}:build", "--input", "2x4:float16", "--policy", str(pol), "-f", "json")
    assert r.exit_code == 1
    assert sorted(where(r, "implicit-promotion")) == ["head", "prehead"]
    assert json.loads(r.stdout)["policy"] == str(pol)
    # the flag wins over the policy
    assert cli(f"{net}:build", "--input", "2x4:float16", "--policy", str(pol), "--fail-on", "error").exit_code == 0


def test_allow_promotion_silences_only_the_modules_it_matches(net: Path, tmp_path: Path) -> None:
    pol = write(tmp_path, 'version: 1\ntrace:\n  fail_on: warning\n  allow_promotion: ["head*"]\n')
    r = cli(f"{net}:build", "--input", "2x4:float16", "--policy", str(pol), "-f", "json")
    assert r.exit_code == 1  # `head*` matches `head` (and `head.fc`), not `prehead`: globs match on dotted boundaries
    assert where(r, "implicit-promotion") == ["prehead"]
    # --allow-promotion adds to the policy's patterns
    both = cli(f"{net}:build", "--input", "2x4:float16", "--policy", str(pol), "--allow-promotion", "prehead", "-f", "json")
    assert both.exit_code == 0 and where(both, "implicit-promotion") == []


def test_the_policy_fail_on_applies_and_trace_fail_on_wins_over_it(net: Path, tmp_path: Path) -> None:
    general = write(tmp_path, "version: 1\nfail_on: warning\n", "general.yaml")
    assert cli(f"{net}:build", "--input", "2x4:float16", "--policy", str(general)).exit_code == 1
    lenient = write(tmp_path, "version: 1\nfail_on: warning\ntrace:\n  fail_on: error\n", "lenient.yaml")
    assert cli(f"{net}:build", "--input", "2x4:float16", "--policy", str(lenient)).exit_code == 0


def test_trace_section_merges_through_extends(net: Path, tmp_path: Path) -> None:
    write(tmp_path, 'version: 1\ntrace:\n  fail_on: warning\n  allow_promotion: ["head*"]\n', "base.yaml")
    child = write(tmp_path, 'version: 1\nextends: base.yaml\ntrace:\n  allow_promotion: ["prehead"]\n', "child.yaml")
    pol = load_policy(str(child))
    assert pol.trace.fail_on == "warning"
    assert [m.text for m in pol.trace.allow_promotion] == ["prehead", "head*"]
    report = trace(f"{net}:build", inputs=["2x4:float16"], policy=str(child))
    assert report.fail_on == "warning" and [f for f in report.findings if f.rule == "implicit-promotion"] == []
    override = write(tmp_path, "version: 1\nextends: base.yaml\ntrace:\n  fail_on: info\n", "override.yaml")
    assert load_policy(str(override)).trace.fail_on == "info"


def test_a_preset_without_a_trace_section_traces_as_before(net: Path) -> None:
    r = cli(f"{net}:build", "--input", "2x4:float16", "--preset", "fp16-mixed", "-f", "json")
    assert r.exit_code == 0 and sorted(where(r, "implicit-promotion")) == ["head", "prehead"]
    assert cli(f"{net}:build", "--input", "2x4:float16", "--preset", "fp16", "--policy", "x.yaml").exit_code == 2


# -- hardware targets ----------------------------------------------------------------------------------------------


def test_target_t4_on_a_bf16_model_is_emulated(net: Path) -> None:
    r = cli(f"{net}:bf16", "--input", "2x4:bfloat16", "--target", "t4", "-f", "json")
    assert r.exit_code == 0  # emulated-dtype is a warning
    found = [f for f in findings(r) if f["rule"] == "emulated-dtype"]
    at = {f["tensor"]: f for f in found}
    assert {"0", "1", "2", "0.weight", "0.bias", "2.weight", "2.bias"} <= set(at)
    assert all(f["severity"] == "warning" and f["actual"] == "bfloat16" for f in found)
    assert at["0"]["message"].startswith("aten.addmm computes in bfloat16 here: bfloat16 runs emulated (slowly) on t4")
    assert "aten.gelu" in at["1"]["message"] and "use float16" in at["1"]["message"]
    assert cli(f"{net}:bf16", "--input", "2x4:bfloat16", "--target", "t4", "--fail-on", "warning").exit_code == 1
    # the same model on a GPU with bf16 tensor cores, and an fp32 model on the T4: nothing to say
    assert where(cli(f"{net}:bf16", "--input", "2x4:bfloat16", "--target", "a100", "-f", "json"), "emulated-dtype") == []
    assert findings(cli(f"{net}:fp32", "--input", "2x4", "--target", "t4", "-f", "json")) == []


def test_target_a100_on_fp8_weights_is_unsupported(net: Path) -> None:
    """torch's CPU kernels run an fp8 addmm, so the trace runs the fp8 model and each module computes in fp8."""
    r = cli(f"{net}:fp8", "--input", "2x4:float8_e4m3fn", "--target", "a100", "-f", "json")
    assert r.exit_code == 1
    found = {f["tensor"]: f for f in findings(r) if f["rule"] == "unsupported-dtype"}
    assert set(found) == {"0", "1", "0.weight", "0.bias", "1.weight", "1.bias"}
    assert all(f["severity"] == "error" and f["actual"] == "float8_e4m3fn" for f in found.values())
    assert "compute capability 8.9" in found["0"]["message"] and "aten.addmm" in found["0"]["message"]
    assert findings(cli(f"{net}:fp8", "--input", "2x4:float8_e4m3fn", "--target", "h100", "-f", "json")) == []


def test_target_holds_checkpoint_dtypes(net: Path, tmp_path: Path) -> None:
    """fp8 weights from a checkpoint (read by dtypeaudit's readers) on an fp32 factory: parameters and operations."""
    with torch.device("cpu"):
        model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    ckpt = tmp_path / "fp8.pt"
    torch.save({k: v.to(torch.float8_e4m3fn) for k, v in model.state_dict().items()}, ckpt)
    report = trace(f"{net}:fp32", inputs=["2x4:float8_e4m3fn"], checkpoint=str(ckpt), target="a100")
    unsupported = {f.tensor for f in report.findings if f.rule == "unsupported-dtype"}
    assert {"0.weight", "0.bias", "1.weight", "1.bias", "0", "1"} == unsupported


def test_policy_target_applies_and_the_flag_replaces_it(net: Path, tmp_path: Path) -> None:
    v100 = write(tmp_path, "version: 1\ntarget: v100\n", "v100.yaml")
    r = cli(f"{net}:bf16", "--input", "2x4:bfloat16", "--policy", str(v100), "-f", "json")
    assert r.exit_code == 0 and "0.weight" in where(r, "emulated-dtype")
    assert "on v100" in next(f["message"] for f in findings(r) if f["rule"] == "emulated-dtype")
    replaced = cli(f"{net}:bf16", "--input", "2x4:bfloat16", "--policy", str(v100), "--target", "h100", "-f", "json")
    assert where(replaced, "emulated-dtype") == []


def test_trace_module_takes_a_policy_and_target_too(tmp_path: Path) -> None:
    pol = write(tmp_path, "version: 1\ntarget: t4\ntrace:\n  fail_on: warning\n")
    with torch.device("meta"):
        model = nn.Linear(4, 4).to(torch.bfloat16)
    report = trace_module(model, inputs=["2x4:bfloat16"], policy=str(pol))
    assert report.fail_on == "warning" and report.policy == str(pol)
    assert {f.tensor for f in report.findings if f.rule == "emulated-dtype"} == {"(root)", "weight", "bias"}


def test_unknown_target_is_misuse_before_the_factory_runs(tmp_path: Path) -> None:
    canary = tmp_path / "ran"
    factory = tmp_path / "f.py"
    factory.write_text(f"from torch import nn\ndef build():\n    open({str(canary)!r}, 'w').close()\n    return nn.Linear(2, 2)\n")
    r = CliRunner().invoke(app, ["trace", f"{factory}:build", "--input", "1x2", "--target", "gtx9000"])
    assert r.exit_code == 2 and "gtx9000" in r.stderr and not canary.exists()


# -- validation: file and line -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "line", "words"),
    [
        ("version: 1\ntrace:\n  fail_on: fatal\n", 3, ["unknown severity 'fatal'", "error, warning, info"]),
        ("version: 1\ntrace:\n  fail_on: warning\n  allow: ['head*']\n", 4, ["unknown key 'allow' in trace", "allow_promotion"]),
        ("version: 1\ntrace: warning\n", 2, ["trace must be a mapping", "fail_on, allow_promotion"]),
        ("version: 1\ntrace:\n  allow_promotion:\n    - head\n    - 're:(a+)+'\n", 5, ["nests repetitions"]),
        ("version: 1\ntrace:\n  allow_promotion: [3]\n", 3, ["pattern must be a string"]),
    ],
)
def test_bad_trace_sections_name_file_and_line(tmp_path: Path, text: str, line: int, words: list[str]) -> None:
    path = write(tmp_path, text)
    with pytest.raises(PolicyError) as info:
        load_policy(str(path))
    message = info.value.one_line()
    assert message.startswith(f"{path}:{line}: "), message
    for word in words:
        assert word in message
    r = CliRunner().invoke(app, ["trace", "nowhere.py:build", "--policy", str(path)])
    assert r.exit_code == 2 and f"{path}:{line}:" in r.stderr


# -- the README's example, as written ---------------------------------------------------------------------------------


def test_readme_trace_policy(net: Path, tmp_path: Path) -> None:
    section = (Path(__file__).resolve().parent.parent / "docs" / "tracing.md").read_text(encoding="utf-8")
    (block,) = re.findall(r"```yaml\n(.*?)```", section, flags=re.S)
    assert block.startswith("# release.yaml:")
    pol = tmp_path / "release.yaml"
    pol.write_text(block)
    fp16 = cli(f"{net}:build", "--input", "2x4:float16", "--policy", str(pol), "-f", "json")
    assert fp16.exit_code == 1 and where(fp16, "implicit-promotion") == ["prehead"]  # the head's promotion is allowed
    assert cli(f"{net}:build", "--input", "2x4:float16", "--policy", str(pol), "--allow-promotion", "prehead").exit_code == 0
    bf16 = cli(f"{net}:bf16", "--input", "2x4:bfloat16", "--policy", str(pol), "-f", "json")
    assert bf16.exit_code == 1 and {f["rule"] for f in findings(bf16)} == {"emulated-dtype"}
