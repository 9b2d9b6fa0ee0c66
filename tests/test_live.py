"""Auditing live objects: modules, optimizers after a real step, a real GradScaler, batches, drift, 7B on meta."""

from __future__ import annotations

import dataclasses
import time
import tracemalloc
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import dtypeaudit
from dtypeaudit import live
from dtypeaudit.checks import check
from dtypeaudit.formats import factory

from .models import BasicBlock, TinyCNN, TinyLM


class ResNetish(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.layer1 = nn.Sequential(BasicBlock(8, 8), BasicBlock(8, 16, stride=2))
        self.fc = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.layer1(torch.relu(self.bn1(self.conv1(x)))).mean((2, 3)))


def _stepped(model: nn.Module, batch: torch.Tensor, opt_cls: type = torch.optim.AdamW) -> torch.optim.Optimizer:
    opt = opt_cls(model.parameters(), lr=1e-3)
    model(batch).float().sum().backward()
    opt.step()
    return opt


def test_module_records_true_kinds_module_types_and_names() -> None:
    model = ResNetish()
    inv = live.inventory(model)
    assert inv.format == "live"
    by = inv.by_name()
    assert list(by) == list(dict(model.named_parameters())) + list(dict(model.named_buffers()))
    assert set(by) == set(model.state_dict())
    assert by["layer1.1.downsample.1.running_var"].kind == "buffer"
    assert by["layer1.1.downsample.1.running_var"].module == "BatchNorm2d"
    assert by["layer1.0.conv1.weight"].kind == "parameter" and by["layer1.0.conv1.weight"].module == "Conv2d"
    for name, t in model.state_dict().items():
        r = by[name]
        assert (r.dtype, r.shape, r.nbytes, r.stride) == (str(t.dtype).removeprefix("torch."), tuple(t.shape), t.nbytes, t.stride())
    assert inv.metadata["default_dtype"] == "float32"
    assert inv.metadata["first_layer"] == {"name": "conv1", "type_name": "Conv2d", "dtype": "float32"}


def test_same_records_as_the_factory_reader(tmp_path: Path) -> None:
    """A live module and --model's factory describe one model alike: names, dtypes, shapes, sizes, kinds, module
    types and ties."""
    script = tmp_path / "net.py"
    script.write_text(
        "from torch import nn\n"
        "def build():\n"
        "    m = nn.Sequential(nn.Embedding(8, 4), nn.LayerNorm(4), nn.Linear(4, 8, bias=False), nn.BatchNorm1d(8))\n"
        "    m[2].weight = m[0].weight\n"
        "    return m\n"
    )

    def facts(inv: dtypeaudit.Inventory) -> list[tuple[object, ...]]:
        return [(t.name, t.dtype, t.shape, t.nbytes, t.kind, t.module, t.shares_with) for t in inv.tensors]

    built = factory.build(f"{script}:build")
    assert facts(live.inventory(built)) == facts(factory.inventory(f"{script}:build"))
    assert live.inventory(built).by_name()["2.weight"].shares_with == ("0.weight",)


def test_findings_match_check_on_the_saved_checkpoint(tmp_path: Path) -> None:
    """audit(model) finds what scan finds in torch.save(model.state_dict()), with kinds known rather than guessed."""
    model = TinyCNN()
    model.fc.weight.data = model.fc.weight.data.half()  # a half-applied cast: fp16 weight, fp32 bias
    path = tmp_path / "cnn.pt"
    torch.save(model.state_dict(), path)
    policy = dtypeaudit.load_policy("fp32")
    from_file = {(f.rule, f.tensor) for f in check(dtypeaudit.read(path), policy)}
    from_live = {(f.rule, f.tensor) for f in dtypeaudit.audit(model, policy)}
    assert from_file == from_live == {("module-dtype-mix", "fc"), ("dtype-mismatch", "fc.weight")}
    mix = next(f for f in dtypeaudit.audit(model) if f.rule == "module-dtype-mix")
    assert mix.severity == "error" and mix.message.startswith("Linear (")


def test_clean_model_has_no_findings() -> None:
    assert dtypeaudit.audit(ResNetish(), "fp32") == []
    assert dtypeaudit.audit(ResNetish().half(), "fp16") == []


def test_optimizer_state_after_a_real_step_named_after_the_module() -> None:
    model = ResNetish()
    opt = _stepped(model, torch.randn(2, 3, 8, 8))
    inv = live.inventory({"model": model, "opt": opt})
    by = inv.by_name()
    assert by["opt.state.model.fc.weight.exp_avg"].region == "optimizer"
    assert by["opt.state.model.fc.weight.exp_avg_sq"].shape == (4, 16)
    assert by["opt.state.model.fc.weight.step"].dtype == "float32"
    alone = live.inventory(opt).by_name()
    assert "state.0.exp_avg" in alone and all(t.region == "optimizer" for t in alone.values())
    # param_groups tensors (capturable optimizers keep lr as a tensor) are recorded too
    opt2 = torch.optim.Adam(nn.Linear(2, 2).parameters(), lr=torch.tensor(0.01))
    assert live.inventory(opt2).by_name()["param_groups.0.lr"].region == "optimizer"


def test_optimizer_on_a_bf16_model_keeps_bf16_moments() -> None:
    """Adam keeps its moments in the parameters' dtype: a pure-bf16 model has bf16 exp_avg_sq, which a policy
    that wants fp32 optimizer state catches (amp-training)."""
    model = ResNetish().to(torch.bfloat16)
    opt = _stepped(model, torch.randn(2, 3, 8, 8, dtype=torch.bfloat16), torch.optim.Adam)
    found = dtypeaudit.audit({"model": model, "optimizer": opt}, "amp-training")
    moments = {f.tensor for f in found if f.rule == "dtype-mismatch" and ".exp_avg" in (f.tensor or "")}
    assert "optimizer.state.model.fc.weight.exp_avg_sq" in moments


def test_a_real_grad_scaler() -> None:
    scaler = torch.amp.GradScaler("cpu")
    assert live.inventory(scaler).tensors == ()  # nothing until it has scaled a loss
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale(model(torch.randn(2, 4)).sum()).backward()
    scaler.step(opt)
    scaler.update()
    by = live.inventory({"model": model, "opt": opt, "scaler": scaler}).by_name()
    assert by["scaler.scale"].dtype == "float32" and by["scaler.scale"].region == "optimizer"
    assert by["scaler.growth_tracker"].dtype == "int32"
    assert dtypeaudit.audit({"model": model, "opt": opt, "scaler": scaler}, "fp32") == []


Pair = namedtuple("Pair", ["image", "label"])


@dataclasses.dataclass
class Sample:
    pixels: torch.Tensor
    meta: dict[str, torch.Tensor]


def test_batch_in_any_nesting() -> None:
    batch = {
        "pair": Pair(torch.zeros(2, 3), torch.tensor([1, 0])),
        "list": [torch.zeros(1)],
        "sample": Sample(torch.zeros(1), {"w": torch.ones(1)}),
    }
    names = {t.name for t in live.inventory(batch).tensors}
    assert names == {"pair.image", "pair.label", "list.0", "sample.pixels", "sample.meta.w"}
    assert live.collect(batch).batch == frozenset(names)
    assert {t.name for t in live.inventory(torch.zeros(2)).tensors} == {"batch"}


def test_float64_batch_against_the_first_layer() -> None:
    model = ResNetish()
    batch = (torch.randn(2, 3, 8, 8, dtype=torch.float64), torch.tensor([0, 1]))
    found = dtypeaudit.audit({"model": model, "batch": batch})
    assert [(f.rule, f.tensor, f.severity) for f in found] == [("batch-dtype", "batch.0", "warning")]
    assert "first layer model.conv1 (Conv2d) is float32" in found[0].message
    with pytest.raises(RuntimeError, match="expected scalar type Double but found Float"):  # what the finding predicts
        model(batch[0])
    assert dtypeaudit.audit({"model": model, "batch": (batch[0].float(), batch[1])}) == []
    # the policy holds the batch too; the module-structure checks do not (its names are not a module's)
    policy_found = dtypeaudit.audit({"model": model, "batch": batch}, "fp32")
    assert ("dtype-mismatch", "batch.0") in {(f.rule, f.tensor) for f in policy_found}


def test_embedding_first_layer_skips_the_batch_comparison() -> None:
    model = TinyLM().half()
    assert dtypeaudit.audit({"model": model, "batch": {"ids": torch.tensor([[1, 2]]), "mask": torch.ones(1, 2)}}) == []


def test_targets_apply_to_live_objects() -> None:
    model = ResNetish().to(torch.bfloat16)
    found = dtypeaudit.audit(model, target="v100")
    assert found and {f.rule for f in found} == {"emulated-dtype"}
    assert dtypeaudit.audit(model, target="a100") == []
    assert {f.rule for f in dtypeaudit.audit(ResNetish().double(), target="mps")} == {"unsupported-dtype"}


class Spy(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_audit_runs_no_tensor_operation() -> None:
    """Metadata only: not one aten op (no copy, no .item(), no cast) runs during an audit."""
    model = ResNetish()
    opt = _stepped(model, torch.randn(2, 3, 8, 8))
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(torch.tensor(1.0))
    batch = {"x": torch.randn(2, 3, 8, 8, dtype=torch.float64)}
    with Spy() as spy:
        found = dtypeaudit.audit({"model": model, "opt": opt, "scaler": scaler, "batch": batch}, "fp32", target="t4")
    assert spy.ops == []
    assert {f.rule for f in found} == {"batch-dtype", "dtype-mismatch"}


def test_meta_tensors() -> None:
    with torch.device("meta"):
        model = ResNetish()
    inv = live.inventory(model)
    assert inv.metadata["devices"] == {"meta": len(inv.tensors)}
    assert inv.by_name()["fc.weight"].nbytes == 16 * 4 * 4
    assert dtypeaudit.audit(model, "fp32") == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_are_read_without_a_copy() -> None:
    model = ResNetish().cuda().half()
    with Spy() as spy:
        found = dtypeaudit.audit(model, "fp16", target="t4")
    assert spy.ops == [] and found == []
    assert live.inventory(model).metadata["devices"] == {"cuda": len(live.inventory(model).tensors)}


def _llama_7b_on_meta() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32, vocab_size=32000
    )
    with torch.device("meta"):
        return LlamaForCausalLM(config)


def test_a_7b_model_on_meta_costs_nothing_proportional_to_it() -> None:
    """6.7 billion parameters (25 GiB in float32): the audit allocates well under a MiB for its 293 records, whatever the
    model's size; benchmarks/bench_audit.py times it (9 ms)."""
    model = _llama_7b_on_meta()
    params = sum(p.numel() for p in model.parameters())
    assert params > 6.7e9
    tracemalloc.start()
    start = time.perf_counter()
    found = dtypeaudit.audit(model, "fp32", target="h100")
    elapsed = time.perf_counter() - start
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert found == []
    assert peak < 32 * 2**20, f"{peak / 2**20:.1f} MiB for a {params * 4 / 2**30:.0f} GiB model"
    print(f"audit of a 7B model on meta: {elapsed:.3f} s, peak {peak / 2**20:.1f} MiB traced")
    inv = live.inventory(model)
    assert len(inv.tensors) == 291 + 2 and sum(t.nbytes for t in inv.tensors if t.kind == "parameter") == params * 4


def test_transformers_model_in_bf16_with_fp32_norms() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    assert dtypeaudit.audit(model, "bf16") == []
    by = live.inventory(model).by_name()
    assert by["model.norm.weight"].module == "LlamaRMSNorm" and by["model.layers.0.self_attn.q_proj.weight"].module == "Linear"
    model.model.norm.float()  # LlamaRMSNorm returns weight * x: float32 output into the bf16 lm_head
    found = dtypeaudit.audit(model)
    assert [(f.rule, f.tensor) for f in found] == [("dtype-outlier", "model.norm")]
    assert found[0].message.startswith("LlamaRMSNorm, RMSNorm-like")


# -- drift and the default dtype ------------------------------------------------------------------------------------


def test_auditor_reports_drift_since_the_last_audit() -> None:
    model = ResNetish()
    auditor = dtypeaudit.Auditor("fp32")
    assert auditor.audit(model, label="epoch 0") == []
    model.layer1[1].conv1.half()  # a half-applied cast
    found = auditor.audit(model, label="epoch 1")
    drift = [f for f in found if f.rule == "dtype-drift"]
    assert [(f.tensor, f.expected, f.actual, f.severity) for f in drift] == [("layer1.1.conv1.weight", ("float32",), "float16", "warning")]
    assert "since epoch 0" in drift[0].message
    assert [f for f in auditor.audit(model, label="epoch 2") if f.rule == "dtype-drift"] == []  # compared with epoch 1 now
    strict = dtypeaudit.Auditor(drift_severity="error")
    strict.audit(model)
    model.fc.double()
    assert {f.severity for f in strict.audit(model) if f.rule == "dtype-drift"} == {"error"}


def test_default_dtype_is_recorded_and_its_change_is_drift() -> None:
    auditor = dtypeaudit.Auditor()
    auditor.audit(nn.Linear(2, 2))
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        inv = live.inventory(nn.Linear(2, 2))
        found = auditor.audit(nn.Linear(2, 2))
    finally:
        torch.set_default_dtype(old)
    assert inv.metadata["default_dtype"] == "float64"
    assert any(
        f.rule == "dtype-drift" and f.tensor is None and "get_default_dtype() changed from float32 to float64" in f.message for f in found
    )


def test_failures_render_as_the_findings_table() -> None:
    model = TinyCNN().half()
    err = live.AuditFailed(dtypeaudit.audit(model, "fp32"), title="my model")
    text = str(err)
    assert text.splitlines()[0] == "my model"
    assert "severity" in text and "dtype-mismatch" in text and "conv.weight" in text
    assert text.rstrip().splitlines()[-1].startswith("✗ 8 errors")
    assert live.render_findings([], title="clean").rstrip().endswith("✓ no findings, none at or above error")


def test_parse_when() -> None:
    assert live.parse_when("fit") is None and live.parse_when("epoch") == 0 and live.parse_when("step:50") == 50
    for bad in ("step", "step:0", "steps:3", "daily"):
        with pytest.raises(dtypeaudit.DtypeAuditError):
            live.parse_when(bad)


def test_policy_requires_the_default_dtype(tmp_path: Path) -> None:
    policy = tmp_path / "train.yaml"
    policy.write_text("version: 1\ndefault: fp32\ndefault_dtype: fp32\n")
    assert dtypeaudit.load_policy(str(policy)).default_dtype == "float32"
    model = nn.Linear(2, 2)
    assert dtypeaudit.audit(model, str(policy)) == []
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        found = dtypeaudit.audit(model, str(policy))
    finally:
        torch.set_default_dtype(old)
    assert [(f.rule, f.severity, f.expected, f.actual) for f in found] == [("default-dtype", "error", ("float32",), "float64")]
    policy.write_text("version: 1\ndefault_dtype: int64\n")
    with pytest.raises(dtypeaudit.PolicyError, match="train.yaml:2: default_dtype must be a floating dtype"):
        dtypeaudit.load_policy(str(policy))


def test_auditor_and_pytest_plugin_fail_at_the_resolved_fail_on(tmp_path: Path) -> None:
    """Auditor.fail_on and the pytest fixture's assert_clean take --fail-on's rule from options.effective: the
    argument, else the policy's fail_on, else error; bfloat16 on a t4 is an emulated-dtype warning."""
    from dtypeaudit.errors import UsageError
    from dtypeaudit.pytest_plugin import DtypeAudit

    warns = tmp_path / "warns.yaml"
    warns.write_text("version: 1\nfail_on: warning\n")
    model = nn.Linear(4, 4).to(torch.bfloat16)
    assert dtypeaudit.Auditor().fail_on == "error"
    assert dtypeaudit.Auditor(str(warns)).fail_on == "warning"
    assert dtypeaudit.Auditor(str(warns), fail_on="info").fail_on == "info"
    auditor = dtypeaudit.Auditor(str(warns), target="t4")
    found = auditor.audit(model)
    assert {f.severity for f in found} == {"warning"} and auditor.failing(found) == found
    with pytest.raises(UsageError, match="--fail-on must be error, warning or info"):
        dtypeaudit.Auditor(fail_on="fatal")  # type: ignore[arg-type]
    fixture = DtypeAudit(target="t4")
    assert [f.rule for f in fixture.assert_clean(model)] == ["emulated-dtype", "emulated-dtype"]  # warnings pass at error
    with pytest.raises(pytest.fail.Exception, match="failing at warning"):
        fixture.assert_clean(model, str(warns))
    assert len(fixture.assert_clean(model, str(warns), fail_on="error")) == 2
