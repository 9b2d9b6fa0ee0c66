"""Policies: precedence, every selector, every validation error with its line, presets on real checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest

from dtypeaudit.checks import check, policy_findings
from dtypeaudit.errors import PolicyError
from dtypeaudit.formats import factory, read_checkpoint
from dtypeaudit.inventory import Inventory, TensorRecord
from dtypeaudit.policy import decide, load_policy, preset_names


def write(tmp_path: Path, text: str, name: str = "policy.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def rec(name: str, dtype: str = "float32", shape: tuple[int, ...] = (4, 4), **kw: object) -> TensorRecord:
    import math

    from dtypeaudit import dtypes

    return TensorRecord(name=name, dtype=dtype, shape=shape, nbytes=math.prod(shape) * dtypes.get(dtype).itemsize, **kw)  # type: ignore[arg-type]


def test_first_match_wins_then_default(tmp_path: Path) -> None:
    pol = load_policy(
        str(
            write(
                tmp_path,
                """
version: 1
default: fp16
rules:
  - name: head
    match: lm_head.*
    dtype: fp32
  - match: "*.weight"
    dtype: bf16
""",
            )
        )
    )
    assert decide(pol, rec("lm_head.weight")).rule.name == "head"  # type: ignore[union-attr]
    assert decide(pol, rec("x.weight")).expected == frozenset({"bfloat16"})
    d = decide(pol, rec("x.bias"))
    assert d.rule is None and d.expected == frozenset({"float16"}) and not d.ok


@pytest.mark.parametrize(
    ("selector", "hit", "miss"),
    [
        ("match: 're:^layers\\.\\d+\\.attn'", rec("layers.3.attn.q"), rec("xlayers.3.attn.q")),
        ("match: ['*.bias', '*.scale']", rec("a.scale"), rec("a.weight")),
        ("ndim: '<=1'", rec("a", shape=(4,)), rec("a", shape=(4, 4))),
        ("ndim: 2", rec("a", shape=(4, 4)), rec("a", shape=(4,))),
        ("kind: buffer", rec("a", kind="buffer"), rec("a", kind="parameter")),
        ("module: '*Norm*'", rec("a", module="LayerNorm"), rec("a", module="Linear")),
        ("region: optimizer", rec("a", region="optimizer"), rec("a", region="model")),
    ],
)
def test_every_selector(tmp_path: Path, selector: str, hit: TensorRecord, miss: TensorRecord) -> None:
    pol = load_policy(str(write(tmp_path, f"version: 1\ndefault: any\nrules:\n  - {selector}\n    dtype: float16\n")))
    assert decide(pol, hit).rule is not None
    assert decide(pol, miss).rule is None
    # one matcher decides and explains: the rule names the selector that failed, and only that one
    (rule,) = pol.rules
    key = selector.split(":")[0]
    assert rule.miss(hit) is None and rule.why_not(hit) is None
    assert rule.miss(miss) == key
    assert (rule.why_not(miss) or "").startswith("name does not match" if key == "match" else key), rule.why_not(miss)


def test_combined_selectors_all_must_hold(tmp_path: Path) -> None:
    pol = load_policy(str(write(tmp_path, "rules:\n  - match: '*norm*'\n    ndim: 1\n    dtype: float32\n")))
    assert decide(pol, rec("ln.norm.weight", shape=(4,))).rule is not None
    assert decide(pol, rec("ln.norm.weight", shape=(4, 4))).rule is None


def test_integers_only_when_asked(tmp_path: Path) -> None:
    text = "default: fp16\n{}rules:\n  - match: '*.num_batches_tracked'\n    dtype: int32\n"
    off = load_policy(str(write(tmp_path, text.format(""), "off.yaml")))
    on = load_policy(str(write(tmp_path, text.format("check_integers: true\n"), "on.yaml")))
    t = rec("bn.num_batches_tracked", dtype="int64", shape=())
    assert decide(off, t).skipped and decide(off, t).ok
    assert not decide(on, t).ok


def test_ignore_and_severity(tmp_path: Path) -> None:
    pol = load_policy(
        str(
            write(
                tmp_path,
                "default: {dtype: fp16, severity: warning}\nignore: ['optimizer.*']\n"
                "rules:\n  - match: 'x'\n    dtype: fp16\n    severity: info\n",
            )
        )
    )
    assert decide(pol, rec("optimizer.state.0.exp_avg")).skipped
    assert decide(pol, rec("y")).severity == "warning"
    assert decide(pol, rec("x")).severity == "info"


def test_extends_a_preset_and_a_file(tmp_path: Path) -> None:
    write(tmp_path, "version: 1\ndefault: bf16\nrules:\n  - match: base.*\n    dtype: fp32\n", "base.yaml")
    child = write(tmp_path, "extends: base.yaml\nrules:\n  - match: base.special\n    dtype: fp16\n", "child.yaml")
    pol = load_policy(str(child))
    assert decide(pol, rec("base.special")).expected == frozenset({"float16"})  # own rules first
    assert decide(pol, rec("base.other")).expected == frozenset({"float32"})  # then the parent's
    assert pol.default == frozenset({"bfloat16"})
    preset_child = load_policy(str(write(tmp_path, "extends: fp16-mixed\ndefault: bf16\n", "p.yaml")))
    assert preset_child.default == frozenset({"bfloat16"}) and len(preset_child.rules) == len(load_policy("fp16-mixed").rules)


@pytest.mark.parametrize(
    ("text", "line", "keywords"),
    [
        ("version: 1\ndefualt: fp16\n", 2, ["unknown key 'defualt'", "valid keys: version"]),
        ("version: 2\n", 1, ["unsupported version 2"]),
        ("default: fp17\n", 1, ["unknown dtype 'fp17'", "float16"]),
        ("rules:\n  - match: x\n    dtype: float33\n", 3, ["unknown dtype 'float33'"]),
        ("rules:\n  - match: x\n", 2, ["rule has no 'dtype'"]),
        ("rules:\n  - dtype: fp16\n", 2, ["rule selects nothing"]),
        ("rules:\n  - match: x\n    dtype: fp16\n    sevrity: error\n", 4, ["unknown key 'sevrity' in rule", "valid keys"]),
        ("rules:\n  - match: x\n    dtype: fp16\n    severity: fatal\n", 4, ["unknown severity 'fatal'"]),
        ("rules:\n  - match: 're:(unclosed'\n    dtype: fp16\n", 2, ["invalid regex"]),
        ("rules:\n  - match: 're:(a+)+$'\n    dtype: fp16\n", 2, ["exponential time"]),
        ("rules:\n  - match: 're:(x|xx)*y'\n    dtype: fp16\n", 2, ["exponential time"]),
        ("rules:\n  - ndim: '~2'\n    dtype: fp16\n", 2, ["bad ndim"]),
        ("rules:\n  - kind: weights\n    dtype: fp16\n", 2, ["unknown kind 'weights'", "parameter"]),
        ("rules:\n  - region: head\n    dtype: fp16\n", 2, ["unknown region"]),
        ("rules: {a: 1}\n", 1, ["rules must be a list"]),
        ("rules:\n  - match: 42\n    dtype: fp16\n", 2, ["pattern must be a string"]),
        ("check_integers: maybe\n", 1, ["check_integers must be true or false"]),
        ("default: fp16\ndefault: bf16\n", 2, ["duplicate key 'default'"]),
        ("default: [fp16\n", 2, ["not valid YAML"]),
        ("- a\n- b\n", 1, ["must be a mapping"]),
        ("a: &x [1]\nb: *x\n", 1, ["anchors and aliases are not allowed"]),
        ("default: !!python/object:os.system fp16\n", 1, ["tag 'tag:yaml.org,2002:python/object:os.system' is not allowed"]),
        ("extends: no-such-preset\n", 1, ["unknown preset 'no-such-preset'", "fp16-mixed"]),
        ("rules:\n  - match: x\n    dtype: fp16\n    optional: maybe\n", 4, ["optional must be true or false"]),
        ("rules:\n  - match: '^'\n    dtype: fp16\n", 2, ["empty pattern"]),
        ("rules:\n  - match: x\n    dtype: fp16\n    name: 5\n", 4, ["name must be a string"]),
        ("rules:\n  - match: x\n    dtype: fp16\n    reason: [a]\n", 4, ["reason must be a string"]),
        ("rules:\n  - 3\n", 2, ["each rule must be a mapping with at least 'dtype'"]),
        ("rules:\n  - match: x\n    dtype: fp12\n", 3, ["unknown dtype 'fp12'", "fp16"]),
        ("default:\n  dtype: fp16\n  sevrity: info\n", 3, ["unknown key 'sevrity' in default", "valid keys: dtype, severity"]),
        ("default:\n  dtype: fp16\n  severity: loud\n", 3, ["unknown severity 'loud'"]),
        ("version: 2\n", 1, ["unsupported version 2", "version: 1"]),
        ("extends: [a]\n", 1, ["extends must be a preset name or a file path"]),
        ("default_dtype: int8\n", 1, ["default_dtype must be a floating dtype, not 'int8'"]),
        ("trace: 3\n", 1, ["trace must be a mapping", "valid keys: fail_on, allow_promotion"]),
        ("fail_on: often\n", 1, ["unknown severity 'often'"]),
        ("ignore: [1]\n", 1, ["pattern must be a string, not 1"]),
        ("defualt: fp16\n", 1, ["unknown key 'defualt'", "did you mean 'default'?", "valid keys: version, extends"]),
    ],
)
def test_validation_errors_name_file_and_line(tmp_path: Path, text: str, line: int, keywords: list[str]) -> None:
    path = write(tmp_path, text)
    with pytest.raises(PolicyError) as info:
        load_policy(str(path))
    message = info.value.one_line()
    assert message.startswith(f"{path}:{line}: "), message
    for k in keywords:
        assert k in message, message


def test_empty_and_huge_and_billion_laughs(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match="policy is empty"):
        load_policy(str(write(tmp_path, "", "empty.yaml")))
    with pytest.raises(PolicyError, match="over the"):
        load_policy(str(write(tmp_path, "# pad\n" * 300_000, "huge.yaml")))
    laughs = (
        'a: &a ["lol","lol"]\nb: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]\nc: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]\nd: [*c,*c,*c,*c,*c,*c,*c,*c,*c]\n'
    )
    # Refused at the first alias, before anything is expanded: no timing needed to know it cannot blow up.
    with pytest.raises(PolicyError, match="aliases are not allowed"):
        load_policy(str(write(tmp_path, laughs, "laughs.yaml")))


def test_cyclic_extends(tmp_path: Path) -> None:
    write(tmp_path, "extends: b.yaml\n", "a.yaml")
    write(tmp_path, "extends: a.yaml\n", "b.yaml")
    with pytest.raises(PolicyError, match="cycle"):
        load_policy(str(tmp_path / "a.yaml"))


def test_presets_all_load() -> None:
    assert set(preset_names()) >= {"fp32", "fp16", "fp16-mixed", "bf16", "bf16-mixed"}
    for name in preset_names():
        assert load_policy(name).default is not None
        # configs/ holds copies of the packaged presets for users to start from: they must not drift apart
        assert load_policy(f"configs/{name}.yaml").rules == load_policy(name).rules


def _rules(findings: list) -> set[tuple[str, str | None]]:  # type: ignore[type-arg]
    return {(f.rule, f.tensor) for f in findings}


def test_fp16_mixed_on_a_cnn_with_batchnorm(tmp_path: Path) -> None:
    import torch

    from .models import TinyCNN

    pol = load_policy("fp16-mixed")
    good = TinyCNN().half()
    good.bn.float()
    path = tmp_path / "good.pt"
    torch.save(good.state_dict(), path)
    assert check(read_checkpoint(path), pol) == []

    path = tmp_path / "naive.pt"
    torch.save(TinyCNN().half().state_dict(), path)
    assert _rules(check(read_checkpoint(path), pol)) == {
        ("dtype-mismatch", "bn.weight"),
        ("dtype-mismatch", "bn.bias"),
        ("dtype-mismatch", "bn.running_mean"),
        ("dtype-mismatch", "bn.running_var"),
    }


def test_fp16_mixed_on_a_transformer_with_model_types(tmp_path: Path) -> None:
    import torch

    from .models import TinyLM

    model = TinyLM().half()
    for layer in model.layers:
        layer["norm"].float()
    path = tmp_path / "lm.pt"
    torch.save(model.state_dict(), path)
    inv = factory.attach(read_checkpoint(path), factory.inventory("tests.models:TinyLM"))
    # The final norm was left in fp16: found by module type, name aside.
    assert _rules(policy_findings(inv, load_policy("fp16-mixed"))) == {("dtype-mismatch", "norm.weight"), ("dtype-mismatch", "norm.bias")}
    assert policy_findings(inv, load_policy("fp16")) != []


def test_bf16_preset_on_bf16_model(tmp_path: Path) -> None:
    import torch

    from .models import TinyLM

    path = tmp_path / "lm.pt"
    torch.save(TinyLM().to(torch.bfloat16).state_dict(), path)
    inv = read_checkpoint(path)
    assert check(inv, load_policy("bf16")) == []
    # bf16-mixed (bf16-weights-fp32-norms) keeps norms in fp32; a model saved entirely in bf16 is told to use bf16.
    norms = check(inv, load_policy("bf16-mixed"))
    assert {f.tensor for f in norms} == {"layers.0.norm.weight", "layers.0.norm.bias", "layers.1.norm.weight", "layers.1.norm.bias"} | {
        "norm.weight",
        "norm.bias",
    }
    assert all("passes --preset bf16" in f.message for f in norms)
    assert {f.actual for f in check(inv, load_policy("fp32"))} == {"bfloat16"}


def test_fp16_mixed_on_training_checkpoint(training_pt: Path) -> None:
    # An fp32 training checkpoint: optimizer state passes (fp32), the model's weights do not.
    findings = policy_findings(read_checkpoint(training_pt), load_policy("fp16-mixed"))
    assert all(f.tensor.startswith("model.") for f in findings)  # type: ignore[union-attr]
    assert ("dtype-mismatch", "model.conv.weight") in _rules(findings)


def test_inventory_without_policy_uses_no_default() -> None:
    inv = Inventory("x", "test", (rec("a"),))
    assert check(inv) == []


def test_which_fail_on_applies_is_resolved_once(tmp_path: Path) -> None:
    """--fail-on, else the policy's fail_on, else error (a trace: its trace: fail_on before the policy's): one
    resolver, options.effective, that scan, trace, live audits, the pytest plugin and convert's plan ask."""
    from dtypeaudit.errors import UsageError
    from dtypeaudit.options import effective, fail_on_for

    plain = tmp_path / "plain.yaml"
    plain.write_text("version: 1\nextends: fp32\n")
    warns = tmp_path / "warns.yaml"
    warns.write_text("version: 1\nextends: fp32\nfail_on: warning\ntrace:\n  fail_on: info\n")
    assert (effective().fail_on, effective().trace_fail_on) == ("error", "error")
    assert (effective(str(plain)).fail_on, effective(str(plain)).trace_fail_on) == ("error", "error")
    assert (effective(str(warns)).fail_on, effective(str(warns)).trace_fail_on) == ("warning", "info")
    assert (effective(str(warns), fail_on="error").fail_on, effective(str(warns), fail_on="error").trace_fail_on) == ("error", "error")
    assert fail_on_for(load_policy(str(warns))) == "warning" and fail_on_for(None, "info") == "info"
    with pytest.raises(UsageError, match="--fail-on must be error, warning or info, not 'fatal'"):
        effective(str(plain), fail_on="fatal")


def test_scan_fails_at_the_resolved_fail_on(tmp_path: Path) -> None:
    """A checkpoint with only warnings (bfloat16 on a v100, emulated): the policy's fail_on: warning fails it,
    --fail-on error wins over the policy."""
    import json

    import torch

    from tests.helpers import run_cli

    path = tmp_path / "m.pt"
    torch.save({"fc.weight": torch.ones(4, 4, dtype=torch.bfloat16), "fc.bias": torch.ones(4, dtype=torch.bfloat16)}, path)
    plain = tmp_path / "plain.yaml"
    plain.write_text("version: 1\ntarget: v100\n")
    base = run_cli("scan", str(path), "--policy", str(plain), "--format", "json")
    severities = {f["severity"] for c in json.loads(base.stdout)["checkpoints"] for f in c["findings"]}
    assert base.returncode == 0 and severities == {"warning"}, base.stdout
    warns = tmp_path / "warns.yaml"
    warns.write_text("version: 1\ntarget: v100\nfail_on: warning\n")
    assert run_cli("scan", str(path), "--policy", str(warns)).returncode == 1
    assert run_cli("scan", str(path), "--policy", str(warns), "--fail-on", "error").returncode == 0
    bad = run_cli("scan", str(path), "--fail-on", "fatal")
    assert bad.returncode == 2 and "--fail-on must be error, warning or info, not 'fatal'" in bad.stderr
