"""Messages that say what is so (issue 29, item 8): each one checked against the files it speaks of.

Inputs come from the real writers: ``gguf.GGUFWriter`` (tests/test_gguf.py), a GPTQ folder as AutoGPTQ lays it out
(tests/test_quant_convert.py), ``torch.save`` of a pickle that calls ``os.system`` (never run: the reader only reads it).
"""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import types
from pathlib import Path

import pytest

from .helpers import ROOT, run_cli

CONFIG_NOTE = "quantization_config is removed from config.json"


# -- a dequantizing conversion speaks of config.json only where there is one -------------------------------------------


def test_gguf_conversion_says_nothing_of_a_config_json(tmp_path: Path) -> None:
    from .test_gguf import write_gguf

    src = write_gguf(tmp_path / "tiny.gguf", {"blk.0.attn_q.weight": ("Q8_0", (32, 256)), "blk.0.attn_norm.weight": ("F32", (256,))})
    out = tmp_path / "tiny.safetensors"
    plan = run_cli("convert", str(src), "--to", "fp16", "-o", str(out), "--dry-run")
    assert plan.returncode == 0, plan.stderr
    assert "note: 1 quantized weight (Q8_0) is dequantized to float16\n" in plan.stdout
    assert "config.json" not in plan.stdout + plan.stderr
    done = run_cli("convert", str(src), "--to", "fp16", "-o", str(out))
    assert done.returncode == 0, done.stderr
    assert "config.json" not in done.stdout + done.stderr
    assert out.is_file() and sorted(p.name for p in tmp_path.iterdir()) == ["tiny.gguf", "tiny.safetensors"]  # no config.json made


def test_a_folder_conversion_says_its_quantization_config_is_removed_and_removes_it(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from .test_quant_convert import _gptq_dir

    _gptq_dir(tmp_path / "gptq")
    out = tmp_path / "bf16"
    plan = run_cli("convert", str(tmp_path / "gptq"), "--to", "bf16", "-o", str(out), "--dry-run")
    assert plan.returncode == 0, plan.stderr
    assert f"are dequantized to bfloat16; {CONFIG_NOTE}\n" in plan.stdout
    assert run_cli("convert", str(tmp_path / "gptq"), "--to", "bf16", "-o", str(out)).returncode == 0
    assert "quantization_config" in json.loads((tmp_path / "gptq" / "config.json").read_text())
    assert "quantization_config" not in json.loads((out / "config.json").read_text())


# -- a folder whose pytorch_model.bin is an unsafe pickle --------------------------------------------------------------


class _Calls:
    """Unpickles as a call of posix.system: torch.save writes it as any other object (nothing here runs it)."""

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, ("true",))


def _evil(folder: Path, *, config: bool, bare: bool = False) -> Path:
    """``pytorch_model.bin`` as torch.save writes it (a zip), or ``bare``: a pickle alone (``pickle.dumps``)."""
    torch = pytest.importorskip("torch")
    folder.mkdir()
    state = {"model.embed_tokens.weight": torch.ones(2), "x": _Calls()}
    if bare:
        (folder / "pytorch_model.bin").write_bytes(pickle.dumps({"x": _Calls()}, protocol=2))
    else:
        torch.save(state, folder / "pytorch_model.bin")
    if config:
        (folder / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    return folder


@pytest.mark.parametrize("bare", [False, True], ids=["torch.save", "bare-pickle"])
def test_convert_of_a_folder_with_an_unsafe_pytorch_model_bin_names_it(tmp_path: Path, bare: bool) -> None:
    evil = _evil(tmp_path / "evil_dir", config=True, bare=bare)
    proc = run_cli("convert", str(evil), "--to", "fp16")
    assert proc.returncode == 2
    said = proc.stdout + proc.stderr
    assert "holds no" not in said
    assert f"{evil / 'pytorch_model.bin'}: refusing to convert: unsafe-global: calls posix.system" in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["evil_dir"]  # nothing written


def test_a_bare_folder_with_a_pytorch_model_bin_is_not_said_to_hold_none(tmp_path: Path) -> None:
    """No config.json, no index, no numbered shards: from_pretrained would not take it for a model; the message says
    what is missing, not that there is no pytorch_model*.bin."""
    evil = _evil(tmp_path / "evil_dir", config=False)
    proc = run_cli("convert", str(evil), "--to", "fp16")
    assert proc.returncode == 2
    assert "holds no" not in proc.stderr and "no pytorch_model" not in proc.stderr
    assert "no config.json or numbered shards beside its weight files" in proc.stderr


# -- the pages docs/hooks.py generates say so where they stand in the repository ----------------------------------------


def _hooks() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("docs_hooks_messages", ROOT / "docs" / "hooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("page", "name", "how", "generated"),
    [
        ("cli.md", "cli-reference", "dtypeaudit --help", "### `dtypeaudit scan`"),
        ("reports.md", "report-schema", "dtypeaudit.render.schema.report_schema()", "| `checkpoints[].tensors[].dtype` |"),
        ("python-api.md", "python-api", "dtypeaudit.__all__", "### `scan`"),
    ],
)
def test_generated_sections_say_so_in_the_repository(page: str, name: str, how: str, generated: str) -> None:
    """Read on GitHub, each generated section is a note saying it is generated at build time and how to see it;
    in the built site the hook puts the generated text in its place, note and all."""
    hooks = _hooks()
    text = (ROOT / "docs" / page).read_text()
    start, end = f"<!-- {name} -->", f"<!-- /{name} -->"
    assert text.count(start) == 1 and text.count(end) == 1
    note = text[text.index(start) + len(start) : text.index(end)]
    assert "Generated at build time" in note and "mkdocs serve" in note and how in note
    built = hooks.on_page_markdown(text)
    assert start not in built and end not in built and note.strip() not in built
    assert generated in built
    assert built.startswith(text[: text.index(start)])  # what stands before the section is kept
