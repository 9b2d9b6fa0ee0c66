"""The JSON Schema of ``dtypeaudit.report/1`` (dtypeaudit/render/schema.py) holds real reports, and only them."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from typer.testing import CliRunner

from dtypeaudit.cli import app
from dtypeaudit.render import json as json_render
from dtypeaudit.render import schema as schema_module
from dtypeaudit.render.schema import fields_table, report_schema

from .helpers import ROOT

SAMPLES = ROOT / "sample_models"


def _report(*args: str) -> tuple[int, dict[str, Any]]:
    result = CliRunner().invoke(app, ["scan", *args, "--format", "json"], env={"COLUMNS": "100"})
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result.exit_code, json.loads(result.stdout)


def _validator() -> jsonschema.Draft202012Validator:
    schema = report_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def test_the_schema_is_a_valid_draft_2020_12_schema_naming_the_contract() -> None:
    schema = report_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    assert schema["title"] == "dtypeaudit.report/1"
    assert schema["properties"]["schema"] == {"const": "dtypeaudit.report/1", "description": schema["properties"]["schema"]["description"]}


def test_the_fixed_fields_of_the_contract_are_required_and_typed() -> None:
    rows = {path: (kind, required) for path, kind, required, _ in fields_table(report_schema())}
    for path in ("checkpoints[].path", "checkpoints[].format", "checkpoints[].error", "checkpoints[].tensors", "checkpoints[].findings"):
        assert rows[path][1], path
    assert rows["checkpoints[].tensors[].name"] == ("string", True)
    assert rows["checkpoints[].tensors[].shape"] == ("array of integer", True)
    assert rows["checkpoints[].tensors[].kind"] == ('"parameter" \\| "buffer" \\| "unknown"', True)
    assert rows["checkpoints[].findings[].severity"] == ('"error" \\| "warning" \\| "info"', True)
    # the builder writes ``file or None``: the schema says null where the dataclass says str
    assert rows["checkpoints[].tensors[].file"] == ("string \\| null", True)
    assert rows["checkpoints[].trace"] == ("object", False)


def test_every_field_is_described_from_the_code() -> None:
    rows = fields_table(report_schema())
    undescribed = [path for path, _, _, description in rows if not description]
    assert undescribed == []
    described = dict((path, description) for path, _, _, description in rows)
    # straight from the attribute docstrings in inventory.py
    assert described["checkpoints[].tensors[].name"] == "Dotted key path from the checkpoint's root object (`model.fc.weight`)."
    assert described["checkpoints[].findings[].message"] == "One sentence, for people."


def test_the_shipped_samples_report_validates(tmp_path: Path) -> None:
    code, doc = _report(str(SAMPLES))
    assert code == 1
    assert [c["format"] for c in doc["checkpoints"]] == ["safetensors", "torch-zip", "torch-zip"]
    assert {f["rule"] for c in doc["checkpoints"] for f in c["findings"]} == {"module-dtype-mix"}
    _validator().validate(doc)


def test_policy_findings_with_expected_and_actual_validate() -> None:
    code, doc = _report(str(SAMPLES / "cnn_half_converted.pt"), "--preset", "fp16-mixed", "--strict")
    assert code == 1
    mismatches = [f for f in doc["checkpoints"][0]["findings"] if f["rule"] == "dtype-mismatch"]
    assert mismatches and all(f["expected"] == ["float32"] and f["actual"] == "float16" for f in mismatches)
    assert doc["policy"] is not None and doc["strict"] is True
    _validator().validate(doc)


def test_shards_ties_optimizer_state_and_an_unreadable_file_validate(
    hf_dir: Path, tied_lm_pt: Path, training_pt: Path, tmp_path: Path
) -> None:
    broken = tmp_path / "broken.pt"
    broken.write_bytes(b"PK\x03\x04 not really a zip")
    code, doc = _report(str(hf_dir), str(tied_lm_pt), str(training_pt), str(broken))
    assert code == 2
    by_path = {Path(c["path"]).name: c for c in doc["checkpoints"]}
    assert {t["file"] for t in by_path[hf_dir.name]["tensors"]} == {f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)}
    assert any(t["shares_with"] for t in by_path[tied_lm_pt.name]["tensors"])
    assert any(t["region"] == "optimizer" for t in by_path[training_pt.name]["tensors"])
    assert by_path["broken.pt"]["error"] and by_path["broken.pt"]["tensors"] == [] and by_path["broken.pt"]["metadata"] == {}
    _validator().validate(doc)


@pytest.mark.parametrize(
    "break_it, where",
    [
        (lambda d: d["checkpoints"][0]["tensors"][0].pop("dtype"), "dtype"),
        (lambda d: d["checkpoints"][2]["findings"][0].__setitem__("severity", "fatal"), "fatal"),
        (lambda d: d["checkpoints"][0]["tensors"][0].__setitem__("shape", "[16]"), "[16]"),
        (lambda d: d.__setitem__("schema", "dtypeaudit.report/2"), "dtypeaudit.report/1"),
        (lambda d: d["checkpoints"][1].pop("findings"), "findings"),
    ],
)
def test_a_report_that_breaks_the_contract_is_refused(break_it: Any, where: str) -> None:
    _, doc = _report(str(SAMPLES))
    broken = copy.deepcopy(doc)
    break_it(broken)
    with pytest.raises(jsonschema.ValidationError, match=rf"{where}"):
        _validator().validate(broken)


def test_a_key_added_to_the_report_without_a_field_or_a_description_fails_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    original = json_render.tensor_dict
    monkeypatch.setattr(schema_module, "tensor_dict", lambda t: {**original(t), "undocumented": 1})
    report_schema.cache_clear()
    try:
        with pytest.raises(LookupError, match="tensor.undocumented"):
            report_schema()
    finally:
        monkeypatch.undo()
        report_schema.cache_clear()


def test_a_trace_report_validates(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    factory = tmp_path / "net.py"
    factory.write_text(
        "import torch\n\ndef build():\n    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.GELU(), torch.nn.Linear(3, 2))\n"
    )
    result = CliRunner().invoke(app, ["trace", f"{factory}:build", "--input", "2x4", "--format", "json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["checkpoints"][0]["format"] == "trace" and doc["checkpoints"][0]["trace"]["ops_total"] > 0
    _validator().validate(doc)
