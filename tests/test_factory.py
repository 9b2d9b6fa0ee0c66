"""module:factory targets build the model on the meta device; --model gives checkpoint tensors their kinds."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from dtypeaudit.errors import FactoryError
from dtypeaudit.formats import factory, read_checkpoint
from dtypeaudit.inventory import Inventory, TensorRecord

SCRIPT = """
import torch
from torch import nn

BUILT_ON = []

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Linear(4, 2).half()

def build_model():
    model = Net()
    BUILT_ON.append(model.conv.weight.device.type)
    return model

def broken():
    raise RuntimeError("no GPU here")

def not_a_module():
    return 42
"""


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "net.py"
    path.write_text(SCRIPT)
    return path


def test_script_factory_inventory(script: Path) -> None:
    inv = factory.inventory(f"{script}:build_model")
    model_facts = {t.name: (t.kind, t.dtype, t.module) for t in inv.tensors}
    assert model_facts == {
        "conv.weight": ("parameter", "float32", "Conv2d"),
        "conv.bias": ("parameter", "float32", "Conv2d"),
        "bn.weight": ("parameter", "float32", "BatchNorm2d"),
        "bn.bias": ("parameter", "float32", "BatchNorm2d"),
        "head.weight": ("parameter", "float16", "Linear"),
        "head.bias": ("parameter", "float16", "Linear"),
        "bn.running_mean": ("buffer", "float32", "BatchNorm2d"),
        "bn.running_var": ("buffer", "float32", "BatchNorm2d"),
        "bn.num_batches_tracked": ("buffer", "int64", "BatchNorm2d"),
    }


def test_factory_builds_on_meta(script: Path) -> None:
    factory.build(f"{script}:build_model")
    import sys

    mod = next(m for n, m in sys.modules.items() if n.startswith("_dtypeaudit_user_") and hasattr(m, "BUILT_ON"))
    assert mod.BUILT_ON[-1] == "meta"


def test_package_module_factory() -> None:
    inv = factory.inventory("tests.models:TinyLM")
    by = inv.by_name()
    assert by["lm_head.weight"].shares_with == ("embed.weight",)
    assert by["norm.weight"].module == "LayerNorm"


@pytest.mark.parametrize(
    ("attr", "message"),
    [
        ("broken", "calling 'broken()' failed: RuntimeError: no GPU here"),
        ("not_a_module", "returned a int"),
        ("missing", "has no callable"),
    ],
)
def test_factory_errors_are_one_line(script: Path, attr: str, message: str) -> None:
    with pytest.raises(FactoryError, match=re.escape(message)):
        factory.build(f"{script}:{attr}")


def test_attach_kinds_through_wrapper_prefix(lightning_ckpt: Path) -> None:
    ckpt = read_checkpoint(lightning_ckpt)
    model = factory.inventory("tests.models:LitModule")
    by = factory.attach(ckpt, model).by_name()
    assert (by["state_dict.net.bn.running_var"].kind, by["state_dict.net.bn.running_var"].module) == ("buffer", "BatchNorm2d")
    assert (by["state_dict.net.fc.weight"].kind, by["state_dict.net.fc.weight"].module) == ("parameter", "Linear")
    # Optimizer moments keep their unknown kind: they belong to no module.
    assert by["optimizer_states.0.state.0.exp_avg"].kind == "unknown"


def test_plain_state_dict_attach(tmp_path: Path, script: Path) -> None:
    net = factory.build(f"{script}:build_model").to_empty(device="cpu")
    path = tmp_path / "sd.pt"
    torch.save({"model": net.state_dict()}, path)
    by = factory.attach(read_checkpoint(path), factory.inventory(f"{script}:build_model")).by_name()
    assert by["model.bn.num_batches_tracked"].kind == "buffer"


def _inv(names: dict[str, tuple[int, ...]], path: str = "x") -> Inventory:
    return Inventory(path, "test", tuple(TensorRecord(n, "float32", s, 4 * math.prod(s)) for n, s in names.items()))


MODEL = {"conv.weight": (4, 3, 3, 3), "conv.bias": (4,), "bn.weight": (4,), "bn.bias": (4,), "fc.weight": (2, 4)}


@pytest.mark.parametrize(
    "prefix",
    ["", "model_state_dict.", "state_dict.", "model.", "module.", "_orig_mod.", "model.module._orig_mod.", "state_dict.model.module."],
)
def test_wrapper_prefixes_are_stripped_in_any_nesting(prefix: str) -> None:
    got = factory.match_names(_inv({prefix + k: v for k, v in MODEL.items()}), _inv(MODEL, "m"))
    assert got.matched == {prefix + k: k for k in MODEL}


def test_a_lone_tensor_under_a_foreign_prefix_is_not_attached() -> None:
    """Wrapper segments are trusted alone; any other prefix must explain half the model (a stray 'head.fc.weight' does not)."""
    names = {**MODEL, "head.fc.weight": (2, 4)}
    got = factory.match_names(_inv(names), _inv(MODEL, "m"))
    assert "head.fc.weight" not in got.matched and len(got.matched) == len(MODEL)


def test_same_name_other_shape_is_no_match() -> None:
    got = factory.match_names(_inv({**MODEL, "fc.weight": (3, 4)}), _inv(MODEL, "m"))
    assert "fc.weight" not in got.matched
    assert got.prefixes[0][:2] == ("", "") and got.prefixes[0][2:] == (5, 4)  # names, of which same shape


# One model resolver for every command (issue 19 item 7) ---------------------------------------------------


LLAMA = Path(__file__).with_name("consistency_models.py")


@pytest.fixture(scope="module")
def llama_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny Llama's float32 state dict written by torch.save, and a folder with only its config.json."""
    pytest.importorskip("transformers")
    from tests import consistency_models

    root = tmp_path_factory.mktemp("llama")
    torch.manual_seed(0)
    model = consistency_models.llama()
    ckpt = root / "llama.pt"
    torch.save(model.state_dict(), ckpt)
    config_dir = root / "config"
    model.config.save_pretrained(config_dir)
    return ckpt, config_dir


def _forms(config_dir: Path) -> dict[str, str]:
    return {
        "script-returning-module": f"{LLAMA}:llama",
        "module-returning-config": "tests.consistency_models:llama_config",
        "config-folder": str(config_dir),
        "transformers-path": f"transformers:{config_dir}",
        "config-json": str(config_dir / "config.json"),
    }


FORMS = ["script-returning-module", "module-returning-config", "config-folder", "transformers-path", "config-json"]
COMMANDS = ["scan", "convert", "explain", "trace"]


def _invoke(command: str, ref: str, ckpt: Path) -> Any:
    from typer.testing import CliRunner

    from dtypeaudit.cli import app

    args = {
        "scan": ["scan", str(ckpt), "--model", ref, "-f", "json"],
        "convert": ["convert", str(ckpt), "--to", "bf16", "--dry-run", "--model", ref, "-f", "json"],
        "explain": ["scan", str(ckpt), "--preset", "fp32", "--explain", "model.norm.weight", "--model", ref],
        "trace": ["trace", ref, "--checkpoint", str(ckpt), "--input", "input_ids=1x4", "-f", "json"],
    }[command]
    return CliRunner().invoke(app, args, catch_exceptions=False)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_takes_every_model_form(command: str, form: str, llama_files: tuple[Path, Path]) -> None:
    """A factory returning a module or a config, a config folder, transformers:PATH and a config.json: each command
    resolves each form to the same LlamaForCausalLM, whose module types reach the report."""
    ckpt, config_dir = llama_files
    result = _invoke(command, _forms(config_dir)[form], ckpt)
    assert result.exit_code == 0, (result.stdout, result.stderr)
    if command == "scan":
        by = {t["name"]: t for t in json.loads(result.stdout)["checkpoints"][0]["tensors"]}
        assert by["model.norm.weight"]["module"] == "LlamaRMSNorm"
        assert by["model.layers.0.self_attn.q_proj.weight"]["module"] == "Linear"
    elif command == "explain":
        assert result.stdout.startswith(f"{ckpt}\nmodel.norm.weight: float32") and "LlamaRMSNorm" in result.stdout
    elif command == "trace":
        assert json.loads(result.stdout)["checkpoints"][0]["trace"]["model"] == "LlamaForCausalLM"
    else:
        doc = json.loads(result.stdout)
        assert doc["refused"] is False and doc["dry_run"] is True, doc
        assert {t["name"] for t in doc["tensors"]} == set(torch.load(ckpt, weights_only=True)), doc


def test_transformers_model_type_is_a_model_for_scan(llama_files: tuple[Path, Path]) -> None:
    """transformers:llama (the model type's default config, 4096 wide) is resolved, and scan says that its names
    match but its shapes do not, rather than refusing the reference."""
    ckpt, _ = llama_files
    result = _invoke("scan", "transformers:llama", ckpt)
    doc = json.loads(result.stdout)
    (mismatch,) = [f for f in doc["checkpoints"][0]["findings"] if f["rule"] == "model-mismatch"]
    assert result.exit_code == 1 and "--model transformers:llama: its names match 0 of the" in mismatch["message"]
    assert "with the model's shape" in mismatch["message"]


BAD_REFERENCES = {
    "hf/llama": "hf/llama: no such file or directory",
    "transformers:hf/llama": "transformers:hf/llama: no such file or directory",
    "nomodel": "nomodel: is not a model: give a factory",
    "missing.py:build": "missing.py:build: no such script 'missing.py'",
}


@pytest.mark.parametrize("ref", list(BAD_REFERENCES))
@pytest.mark.parametrize("command", COMMANDS)
def test_a_bad_model_reference_is_one_line_and_exit_2(command: str, ref: str, llama_files: tuple[Path, Path]) -> None:
    """A local path that does not exist says so first, on every command, in one line; never an import error."""
    ckpt, _ = llama_files
    result = _invoke(command, ref, ckpt)
    assert result.exit_code == 2, (result.stdout, result.stderr)
    (line,) = result.stderr.strip().splitlines()
    assert BAD_REFERENCES[ref] in line and "Empty module name" not in line, line
    assert result.stdout == ""


def test_a_folder_or_file_that_is_no_model(tmp_path: Path) -> None:
    (tmp_path / "weights.pt").write_bytes(b"x")
    with pytest.raises(FactoryError, match="a directory without config.json is not a model"):
        factory.resolve(str(tmp_path))
    with pytest.raises(FactoryError, match="a file is not a model"):
        factory.resolve(str(tmp_path / "weights.pt"))
