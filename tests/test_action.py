"""The composite GitHub Action, run as GitHub runs it: each step's bash with its inputs and env filled in, in a venv."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import venv
from pathlib import Path
from typing import Any

import pytest
import yaml

from .helpers import ROOT

pytestmark = pytest.mark.slow  # pip builds and installs the checkout: about a minute


def _fill(text: str, inputs: dict[str, str], action_path: Path) -> str:
    """``${{ inputs.X }}`` and ``${{ github.action_path }}`` as the runner substitutes them before the step runs."""

    def value(m: re.Match[str]) -> str:
        expr = m.group(1).strip()
        if expr == "github.action_path":
            return str(action_path)
        assert expr.startswith("inputs."), expr
        return inputs[expr.removeprefix("inputs.")]

    return re.sub(r"\$\{\{(.*?)\}\}", value, text)


def _run_steps(action: dict[str, Any], given: dict[str, str], work: Path, python_bin: Path) -> list[subprocess.CompletedProcess[str]]:
    """Run the steps in ``work``, the workflow's workspace: the user's repository, with its checkpoints."""
    shutil.copytree(ROOT / "sample_models", work / "sample_models")
    inputs = {name: spec.get("default", "") for name, spec in action["inputs"].items()} | given
    summary = work / "summary.md"
    results = []
    for step in action["runs"]["steps"]:
        assert step["shell"] == "bash"
        env = {
            "PATH": f"{python_bin}{os.pathsep}{os.environ['PATH']}",
            "HOME": os.environ.get("HOME", str(work)),
            "GITHUB_STEP_SUMMARY": str(summary),
            "GITHUB_ACTION_PATH": str(ROOT),
            "PIP_DISABLE_PIP_VERSION_CHECK": "1",
            "NO_COLOR": "1",
            **{k: _fill(str(v), inputs, ROOT) for k, v in step.get("env", {}).items()},
        }
        # GitHub runs a bash step as: bash --noprofile --norc -eo pipefail {0}
        script = work / "step.sh"
        script.write_text(_fill(step["run"], inputs, ROOT))
        proc = subprocess.run(
            ["bash", "--noprofile", "--norc", "-eo", "pipefail", str(script)],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        results.append(proc)
        if proc.returncode:
            break
    return results


@pytest.fixture(scope="module")
def runner_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv, as a runner's Python: no dtypeaudit, no dependencies (the install step fetches them)."""
    root = tmp_path_factory.mktemp("runner") / "venv"
    venv.EnvBuilder(with_pip=True).create(root)
    bin_dir = root / ("Scripts" if os.name == "nt" else "bin")
    check = subprocess.run(
        [bin_dir / "python", "-c", "import dtypeaudit"], capture_output=True, text=True, env={"PATH": os.environ["PATH"]}, cwd=root
    )
    assert check.returncode != 0  # not installed yet: the action's install step must do it
    return bin_dir


def test_the_action_installs_its_own_checkout_and_scans(runner_python: Path, tmp_path: Path) -> None:
    action = yaml.safe_load((ROOT / "action.yml").read_text())
    sarif = tmp_path / "out.sarif"
    install, scan = _run_steps(
        action, {"paths": "sample_models/cnn_fp32.pt sample_models/block_bf16.safetensors", "sarif": str(sarif)}, tmp_path, runner_python
    )
    assert install.returncode == 0, install.stderr
    shown = subprocess.run([runner_python / "python", "-m", "pip", "show", "-f", "dtypeaudit"], capture_output=True, text=True)
    assert shown.returncode == 0 and "Name: dtypeaudit" in shown.stdout
    light = subprocess.run([runner_python / "python", "-c", "import torch"], capture_output=True, cwd=tmp_path)
    assert light.returncode != 0  # the light install: no torch
    assert scan.returncode == 0, scan.stdout + scan.stderr
    assert scan.stdout.strip().splitlines()[-1] == "dtypeaudit: 2 checkpoint(s), 2 readable, 0 finding(s)"
    assert '"version": "2.1.0"' in sarif.read_text()
    assert "**✅ passed**: 2 checkpoint(s), 0 finding(s)" in (tmp_path / "summary.md").read_text()


def test_the_action_fails_the_step_on_findings(runner_python: Path, tmp_path: Path) -> None:
    action = yaml.safe_load((ROOT / "action.yml").read_text())
    steps = _run_steps(action, {"paths": "sample_models/cnn_fp32.pt", "preset": "fp16", "sarif": ""}, tmp_path, runner_python)
    install, scan = steps
    assert install.returncode == 0
    assert scan.returncode == 1
    assert any(
        line.startswith("::error file=sample_models/cnn_fp32.pt,title=dtypeaudit dtype-mismatch (") for line in scan.stdout.splitlines()
    )
    assert "**❌ failed**" in (tmp_path / "summary.md").read_text()


# A stand-in for ``python -m pip``: prints what the step would install, one word a line, installs nothing.
PIP_ECHO = 'python() { shift 2; printf "%s\\n" "$@"; }\n'


def test_a_version_input_installs_that_instead() -> None:
    action = yaml.safe_load((ROOT / "action.yml").read_text())
    install = action["runs"]["steps"][0]
    for version, wanted in (("dtypeaudit==9.9.9", "dtypeaudit==9.9.9"), ("", str(ROOT))):
        env = {k: _fill(str(v), {"version": version}, ROOT) for k, v in install["env"].items()}
        script = PIP_ECHO + _fill(install["run"], {"version": version}, ROOT)
        proc = subprocess.run(
            ["bash", "-eo", "pipefail", "-c", script], env={**env, "PATH": os.environ["PATH"]}, capture_output=True, text=True
        )
        assert proc.stdout.splitlines() == ["install", "--quiet", wanted], proc.stderr
