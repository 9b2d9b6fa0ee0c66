"""dtypeaudit.tune and dtypeaudit.apply on models with failures planted in known places, checked against real runs.

Each planted model is run for real by references written here (their own hooks, their own way of keeping a
module in fp32: a replaced forward, not the hooks under test), and tune's answers are held to them.
"""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from torch import nn

from .helpers import run_cli

D, H = 16, 32


class FeedForward(nn.Module):
    """T5's shape: an inner activation that may overflow, a normalised output that fits."""

    def __init__(self, d: int = D, h: int = H, scale: float = 1.0) -> None:
        super().__init__()
        self.wi = nn.Linear(d, h)
        self.wo = nn.Linear(h, d)
        self.norm = nn.LayerNorm(d)
        with torch.no_grad():
            self.wi.weight.mul_(scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.wo(torch.relu(self.wi(x))))


class FeedForwardModel(nn.Module):
    def __init__(self, scale: float = 1.0) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.ff = FeedForward(scale=scale)
        self.head = nn.Linear(D, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ff(self.inp(x)))


class Attention(nn.Module):
    """Scores without the 1/sqrt(d) scaling: large queries and keys overflow fp16 in the matmul, inside this module."""

    def __init__(self, d: int = D, scale: float = 1.0) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        with torch.no_grad():
            self.q.weight.mul_(scale)
            self.k.weight.mul_(scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ self.k(x).transpose(-1, -2)
        return self.o(torch.softmax(scores, dim=-1) @ self.v(x))


class AttentionModel(nn.Module):
    def __init__(self, scale: float = 1.0) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.attn = Attention(scale=scale)
        self.head = nn.Linear(D, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(self.inp(x)))


class Offset(nn.Module):
    """Adds and removes a large offset: bf16's 8 bits of mantissa lose what sits next to it."""

    def __init__(self, offset: float = 4096.0) -> None:
        super().__init__()
        self.register_buffer("offset", torch.tensor(offset))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x + self.offset) - self.offset


class OffsetModel(nn.Module):
    def __init__(self, offset: float = 4096.0) -> None:
        super().__init__()
        self.pre = nn.Linear(D, D)
        self.shift = Offset(offset)
        self.head = nn.Linear(D, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.shift(self.pre(x)))


class Block(nn.Module):
    def __init__(self, scale: float = 1.0) -> None:
        super().__init__()
        self.ff = FeedForward(scale=scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ff(x)


class DeepStack(nn.Module):
    def __init__(self, depth: int = 24, planted: tuple[int, ...] = (5, 17), scale: float = 2e4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(scale if i in planted else 1.0) for i in range(depth))
        self.unused = nn.ModuleList([nn.Linear(D, D)])  # never called: never kept
        self.head = nn.Linear(D, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def clean() -> nn.Module:
    return nn.Sequential(nn.Linear(D, H), nn.GELU(), nn.Linear(H, D), nn.LayerNorm(D), nn.Linear(D, 4))


def batch(seed: int = 0, rows: int = 8) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, D, generator=g)


def seeded(cls: type, *args: object) -> nn.Module:
    torch.manual_seed(0)
    return cls(*args).eval()


# -- references, written here: not the code under test ------------------------------------------------------------


def floats(value: object) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value] if value.is_floating_point() else []
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in floats(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in floats(v)]
    return []


def real_first_overflow(model: nn.Module, inputs: object, dtype: torch.dtype) -> str | None:
    """The whole model in ``dtype``: the first module to finish with finite inputs and a non-finite output."""
    low = copy.deepcopy(model).to(dtype)
    found: list[str] = []

    def watch(name: str):  # noqa: ANN202
        def hook(_m: nn.Module, args: tuple, kwargs: dict, out: object) -> None:
            finite_in = all(bool(torch.isfinite(a).all()) for a in floats((args, kwargs)))
            if not found and finite_in and not all(bool(torch.isfinite(o).all()) for o in floats(out)):
                found.append(name)

        return hook

    for name, m in low.named_modules():
        m.register_forward_hook(watch(name), with_kwargs=True)
    with torch.no_grad():
        call(low, inputs, dtype)
    return found[0] if found else None


def call(model: nn.Module, inputs: object, dtype: torch.dtype) -> object:
    """``model`` on ``inputs`` (a tensor or a dict of keywords), floating inputs cast to ``dtype``."""
    if isinstance(inputs, dict):
        return model(**{k: to_dtype(v, dtype) for k, v in inputs.items()})
    return model(inputs.to(dtype))


def to_dtype(value: object, dtype: torch.dtype) -> object:
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, tuple):
        return tuple(to_dtype(v, dtype) for v in value)
    return value


def run_kept(model: nn.Module, keep: tuple[str, ...], dtype: torch.dtype, inputs: object) -> object:
    """The model in ``dtype`` with ``keep`` in fp32: tensors under a kept module fp32, its forward replaced by one that
    casts its input to fp32 and its output back."""
    run = copy.deepcopy(model)
    for name, t in [*run.named_parameters(), *run.named_buffers()]:
        if t.is_floating_point() and not any(name.startswith(k + ".") for k in keep):
            t.data = t.data.to(dtype)
    for k in keep:
        module = run.get_submodule(k)
        inner = module.forward

        def forward(*args: object, _inner=inner, **kwargs: object) -> object:  # noqa: ANN001
            out = _inner(*to_dtype(args, torch.float32), **{n: to_dtype(v, torch.float32) for n, v in kwargs.items()})
            return to_dtype(out, dtype)

        module.forward = forward
    with torch.no_grad():
        return call(run, inputs, dtype)


def error(out: object, ref: object) -> float:
    outs, refs = floats(out), floats(ref)
    if not all(bool(torch.isfinite(o).all()) for o in outs):
        return math.inf
    return max(float((o.float() - r.float()).abs().max()) for o, r in zip(outs, refs, strict=True)) / max(
        float(r.abs().max()) for r in refs
    )


def reference_error(model: nn.Module, keep: tuple[str, ...], dtype: torch.dtype, inputs: object) -> float:
    with torch.no_grad():
        ref = call(model, inputs, torch.float32)
    return error(run_kept(model, keep, dtype, inputs), ref)


# -- planted failures ---------------------------------------------------------------------------------------------

PLANTED = [
    # model, target, first overflow of the all-low run, the keep set the planted failure needs
    (lambda: seeded(FeedForwardModel, 1e5), torch.float16, "ff.wi", ("ff",)),
    (lambda: seeded(AttentionModel, 400.0), torch.float16, "attn", ("attn",)),
    (lambda: seeded(OffsetModel), torch.bfloat16, None, ("shift",)),
]


@pytest.mark.parametrize("make, dtype, overflow, needed", PLANTED, ids=["feed-forward", "attention", "bf16-offset"])
def test_a_planted_failure_is_found_and_its_keep_set_runs_within_tolerance(make, dtype, overflow, needed):
    import dtypeaudit

    model, x = make(), batch()
    to = "fp16" if dtype == torch.float16 else "bf16"
    result = dtypeaudit.tune(model, x, to=to, tolerance=1e-2)
    assert real_first_overflow(model, x, dtype) == overflow
    assert result.first_overflow == overflow
    assert reference_error(model, (), dtype, x) > 1e-2  # the planted failure is real
    assert result.keep == needed
    assert result.passed and reference_error(model, result.keep, dtype, x) <= 1e-2
    assert result.output_error == pytest.approx(reference_error(model, result.keep, dtype, x), rel=1e-3, abs=1e-6)
    assert result.schema == "dtypeaudit.tune/1" and result.to == str(dtype).removeprefix("torch.")


def test_the_overflowing_inner_layer_is_kept_through_its_smallest_enclosing_module_that_fits():
    import dtypeaudit

    model, x = seeded(FeedForwardModel, 1e5), batch()
    result = dtypeaudit.tune(model, x, to="fp16")
    wi, ff = result.module("ff.wi"), result.module("ff")
    assert wi.output_abs_max > 65504 and not wi.fits and math.isinf(wi.shadow_error)
    assert ff.fits and ff.output_abs_max < 65504
    assert result.keep == ("ff",)
    assert reference_error(model, ("ff.wi",), torch.float16, x) == math.inf  # keeping the inner layer alone overflows on exit


@pytest.fixture(scope="module")
def deep_stack() -> tuple[nn.Module, torch.Tensor, object]:
    """24 blocks, two with an inner overflow planted, and their tune (shared: it is the slowest)."""
    import dtypeaudit

    model, x = seeded(DeepStack, 24, (5, 17), 1e5), batch()
    return model, x, dtypeaudit.tune(model, x, to="fp16", tolerance=1e-2)


def test_a_deep_stack_keeps_only_its_two_planted_blocks_in_few_passes(deep_stack):
    model, x, result = deep_stack
    assert result.first_overflow == real_first_overflow(model, x, torch.float16) == "blocks.5.ff.wi"
    assert len(result.keep) <= 2
    assert all(k.startswith(("blocks.5.", "blocks.17.")) or k in ("blocks.5", "blocks.17") for k in result.keep)
    assert {k.split(".")[1] for k in result.keep} == {"5", "17"}
    assert reference_error(model, (), torch.float16, x) == math.inf
    assert reference_error(model, result.keep, torch.float16, x) <= 1e-2
    called = [m for m in result.modules if m.calls]
    assert result.forward_passes < len(called) / 4  # not one pass per module
    assert result.module("unused.0").calls == 0 and not any(k.startswith("unused") for k in result.keep)


@pytest.mark.parametrize("to", ["fp16", "bf16"])
def test_a_clean_model_keeps_nothing(to):
    import dtypeaudit

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, H), nn.GELU(), nn.Linear(H, D), nn.LayerNorm(D), nn.Linear(D, 4)).eval()
    result = dtypeaudit.tune(model, batch(), to=to, tolerance=5e-2)
    assert result.keep == () and result.first_overflow is None and result.passed
    assert result.forward_passes == 2  # the fp32 reference and the all-low run
    dtype = torch.float16 if to == "fp16" else torch.bfloat16
    assert result.all_low_error == pytest.approx(reference_error(model, (), dtype, batch()), rel=1e-3)


def test_tune_leaves_the_model_as_it_was():
    import dtypeaudit

    model = seeded(FeedForwardModel, 1e5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    dtypeaudit.tune(model, batch(), to="fp16")
    after = model.state_dict()
    assert all(after[k].dtype == torch.float32 and torch.equal(after[k], v) for k, v in before.items())
    assert not model._forward_hooks and not model.ff._forward_pre_hooks


def test_no_keep_set_passes_an_impossible_tolerance_and_says_which_modules_fail():
    import dtypeaudit
    from dtypeaudit.tuning.report import to_text

    model = seeded(OffsetModel)
    result = dtypeaudit.tune(model, batch(), to="bf16", tolerance=0.0)
    assert not result.passed
    assert "shift" in result.failing
    assert "no keep set passes" in to_text(result)


def test_bad_arguments_are_usage_errors():
    import dtypeaudit
    from dtypeaudit.errors import UsageError

    with pytest.raises(UsageError, match="fp16 or bf16"):
        dtypeaudit.tune(seeded(OffsetModel), batch(), to="int8")
    with pytest.raises(UsageError, match="--metric"):
        dtypeaudit.tune(seeded(OffsetModel), batch(), to="bf16", metric="nope")


@pytest.mark.parametrize("metric", ["cosine", "sqnr"])
def test_other_metrics_find_the_same_keep_set(metric):
    import dtypeaudit

    model = seeded(OffsetModel)
    result = dtypeaudit.tune(model, batch(), to="bf16", tolerance=1e-4, metric=metric)
    assert result.metric == metric and result.keep == ("shift",) and result.passed


def test_a_user_metric_from_a_file(tmp_path):
    import dtypeaudit

    (tmp_path / "m.py").write_text("def worst(out, ref):\n    return float((out.float() - ref).abs().max())\n")
    model = seeded(OffsetModel)
    result = dtypeaudit.tune(model, batch(), to="bf16", tolerance=0.05, metric=f"{tmp_path / 'm.py'}:worst")
    assert result.keep == ("shift",) and result.output_error <= 0.05


# -- reports -------------------------------------------------------------------------------------------------------


def test_the_json_report_has_the_schema_fields_and_no_infinities():
    import dtypeaudit
    from dtypeaudit.tuning.report import to_html, to_json, to_text

    result = dtypeaudit.tune(seeded(FeedForwardModel, 1e5), batch(), to="fp16")
    doc = json.loads(to_json(result))
    assert doc["schema"] == "dtypeaudit.tune/1"
    assert {
        "to",
        "tolerance",
        "metric",
        "modules",
        "first_overflow",
        "keep",
        "output_error",
        "all_low_error",
        "forward_passes",
        "passed",
    } <= set(doc)
    assert doc["all_low_error"] is None and doc["keep"] == ["ff"] and doc["first_overflow"] == "ff.wi"
    wi = next(m for m in doc["modules"] if m["name"] == "ff.wi")
    assert wi["shadow_error"] is None and wi["headroom"] < 1 and wi["type"] == "Linear"
    text = to_text(result)
    assert "first overflow: ff.wi" in text and "keep in fp32: ff" in text and "✓ passes" in text
    page = to_html(result)
    assert page.startswith("<!DOCTYPE html>") and "ff <b>keep in fp32</b>" in page and "ff.wi" in page and "<script" not in page


# -- the policy: written, converted, scanned, applied ----------------------------------------------------------------


def test_the_policy_round_trip_through_convert_scan_and_apply(tmp_path, deep_stack):
    import dtypeaudit

    model, x, result = deep_stack
    policy = tmp_path / "tuned.yaml"
    policy.write_text(dtypeaudit.tuning.policy_text(result))
    assert all(f'"{k}"  # ' in policy.read_text() for k in result.keep)
    torch.save(model.state_dict(), tmp_path / "model.pt")

    convert = run_cli(
        "convert", str(tmp_path / "model.pt"), "--to", "fp16", "--policy", str(policy), "-o", str(tmp_path / "out.pt"), process=True
    )
    assert convert.returncode == 0, convert.stdout + convert.stderr
    scan = run_cli("scan", str(tmp_path / "out.pt"), "--policy", str(policy), process=True)
    assert scan.returncode == 0, scan.stdout + scan.stderr

    written = torch.load(tmp_path / "out.pt", weights_only=True)
    fp32 = {k for k, v in written.items() if v.dtype == torch.float32}
    assert fp32 == {k for k in written if any(k.startswith(m + ".") for m in result.keep)} and fp32
    assert all(v.dtype == torch.float16 for k, v in written.items() if k not in fp32)

    with torch.device("meta"):
        fresh = DeepStack(24, (5, 17), 1e5)
    fresh.load_state_dict(written, assign=True)
    fresh = dtypeaudit.apply(fresh.eval(), str(policy), to="fp16")
    with torch.no_grad():
        out, ref = fresh(x.half()), model(x)
    assert out.dtype == torch.float16
    assert error(out, ref) <= 1e-2


def test_apply_casts_parameters_and_hooks_the_kept_modules(tmp_path):
    import dtypeaudit

    policy = tmp_path / "p.yaml"
    policy.write_text('version: 1\ndefault: float16\nkeep_in_fp32:\n  - "ff"  # why\n')
    model, x = seeded(FeedForwardModel, 1e5), batch()
    with torch.no_grad():
        ref = model(x)
    applied = dtypeaudit.apply(copy.deepcopy(model), str(policy))
    dtypes = {n: p.dtype for n, p in applied.named_parameters()}
    assert {n for n, d in dtypes.items() if d == torch.float32} == {n for n in dtypes if n.startswith("ff.")}
    seen: list[torch.dtype] = []
    applied.ff.wo.register_forward_pre_hook(lambda _m, a: seen.append(a[0].dtype))
    with torch.no_grad():
        out = applied(x.half())
    assert seen == [torch.float32] and out.dtype == torch.float16
    assert error(out, ref) == pytest.approx(error(run_kept(model, ("ff",), torch.float16, x), ref), rel=1e-3)


def test_a_keep_in_fp32_entry_must_be_a_module_path(tmp_path):
    from dtypeaudit.errors import PolicyError
    from dtypeaudit.policy import load_policy

    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\nkeep_in_fp32: ['blocks.*']\n")
    with pytest.raises(PolicyError, match="dotted module paths"):
        load_policy(str(bad))


# -- a Hugging Face model, and a factory with a checkpoint ---------------------------------------------------------


def test_a_tiny_hugging_face_model_keeps_the_mlp_whose_inner_activation_overflows(tmp_path):
    import dtypeaudit
    from dtypeaudit.tuning.load import load_inputs, load_model

    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2
    )
    torch.manual_seed(0)
    planted = transformers.LlamaForCausalLM(config).eval()
    mlp = planted.model.layers[1].mlp
    with torch.no_grad():  # T5's pattern: an inner product over fp16's range, an output that fits
        mlp.up_proj.weight.mul_(1e6)
        mlp.down_proj.weight.div_(1e6)
    planted.save_pretrained(tmp_path / "tiny")

    model = load_model(str(tmp_path / "tiny"))
    assert type(model).__name__ == "LlamaForCausalLM" and torch.equal(model.model.layers[1].mlp.up_proj.weight, mlp.up_proj.weight)
    (args, kwargs), notes = load_inputs(model, specs=["input_ids=2x12"])
    assert notes and "random" in notes[0] and int(kwargs["input_ids"].max()) < 64
    result = dtypeaudit.tune(model, (args, kwargs), to="fp16", tolerance=2e-2, notes=notes)
    inputs = {"input_ids": kwargs["input_ids"], "use_cache": False}
    assert result.first_overflow == real_first_overflow(model, inputs, torch.float16) == "model.layers.1.mlp.up_proj"
    assert result.keep == ("model.layers.1.mlp",)
    assert reference_error(model, (), torch.float16, inputs) == math.inf
    assert reference_error(model, result.keep, torch.float16, inputs) <= 2e-2
    assert result.notes == notes


FACTORY = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.ff = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16), nn.LayerNorm(16))
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.ff(x))


def build():
    torch.manual_seed(0)
    return Net()


def batch():
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
"""


@pytest.mark.parametrize("writer", ["torch", "safetensors"])
def test_a_factory_with_a_checkpoint_tunes_the_checkpoints_values(tmp_path, writer):
    import dtypeaudit
    from dtypeaudit.tuning.load import load_inputs, load_model

    (tmp_path / "net.py").write_text(FACTORY)
    factory = f"{tmp_path / 'net.py'}:build"
    initial = load_model(factory)
    (args, kwargs), notes = load_inputs(initial, input_factory=f"{tmp_path / 'net.py'}:batch")
    assert notes == () and args[0].shape == (8, 16)
    assert dtypeaudit.tune(initial, (args, kwargs), to="fp16").keep == ()  # the factory's own values are clean

    trained = load_model(factory)
    with torch.no_grad():
        trained.ff[0].weight.mul_(1e5)
    if writer == "torch":
        checkpoint = tmp_path / "trained.pt"
        torch.save({"model_state_dict": trained.state_dict(), "epoch": 3}, checkpoint)
    else:
        from safetensors.torch import save_file

        checkpoint = tmp_path / "trained.safetensors"
        save_file(trained.state_dict(), str(checkpoint))
    model = load_model(factory, str(checkpoint))
    assert torch.equal(model.ff[0].weight, trained.ff[0].weight)
    result = dtypeaudit.tuning.tune_from(factory, to="fp16", checkpoint=str(checkpoint), input_factory=f"{tmp_path / 'net.py'}:batch")
    assert result.first_overflow == real_first_overflow(model, args[0], torch.float16) == "ff.0"
    assert result.keep == ("ff",)
    assert reference_error(model, result.keep, torch.float16, args[0]) <= result.tolerance


def test_inputs_from_a_file_of_tensors(tmp_path):
    from safetensors.torch import save_file

    from dtypeaudit.tuning.load import load_inputs

    x = batch()
    torch.save((x,), tmp_path / "batch.pt")
    save_file({"x": x}, str(tmp_path / "batch.safetensors"))
    model = nn.Linear(D, 4)
    (args, kwargs), _ = load_inputs(model, inputs_file=str(tmp_path / "batch.pt"))
    assert torch.equal(args[0], x) and kwargs == {}
    (args, kwargs), _ = load_inputs(model, inputs_file=str(tmp_path / "batch.safetensors"))
    assert args == () and torch.equal(kwargs["x"], x)


def test_a_checkpoint_that_does_not_fit_the_model_is_refused(tmp_path):
    from dtypeaudit.errors import UsageError
    from dtypeaudit.tuning.load import load_model

    (tmp_path / "net.py").write_text(FACTORY)
    torch.save({"other.weight": torch.zeros(3, 3)}, tmp_path / "other.pt")
    with pytest.raises(UsageError, match="does not fit the model"):
        load_model(f"{tmp_path / 'net.py'}:build", str(tmp_path / "other.pt"))


def test_keep_in_fp32_is_what_the_checks_and_extends_see(tmp_path):
    import dtypeaudit
    from dtypeaudit.policy import load_policy

    model = seeded(FeedForwardModel, 1.0).half()
    model.ff.float()
    torch.save(model.state_dict(), tmp_path / "mixed.pt")
    inventory = dtypeaudit.read(str(tmp_path / "mixed.pt"))
    (tmp_path / "plain.yaml").write_text("version: 1\ndefault: float16\nrules:\n  - match: '^ff.*'\n    dtype: float32\n")
    (tmp_path / "tuned.yaml").write_text('version: 1\ndefault: float16\nkeep_in_fp32:\n  - "ff"\n')
    (tmp_path / "child.yaml").write_text("version: 1\nextends: tuned.yaml\n")
    plain = dtypeaudit.check(inventory, load_policy(str(tmp_path / "plain.yaml")))
    assert any(f.rule == "dtype-outlier" for f in plain)  # fp32 Linears beside fp16 ones: one side is an outlier
    for name in ("tuned.yaml", "child.yaml"):
        policy = load_policy(str(tmp_path / name))
        assert policy.kept_in_fp32("ff") and policy.kept_in_fp32("ff.wi") and not policy.kept_in_fp32("ffx")
        assert dtypeaudit.check(inventory, policy) == []  # it casts its input: no outlier, and its tensors are fp32
    model.ff.half()
    torch.save(model.state_dict(), tmp_path / "half.pt")
    found = dtypeaudit.check(dtypeaudit.read(str(tmp_path / "half.pt")), load_policy(str(tmp_path / "tuned.yaml")))
    assert {f.tensor for f in found if f.rule == "dtype-mismatch"} == {n for n in model.state_dict() if n.startswith("ff.")}


def test_the_tune_command_reports_writes_the_policy_and_convert_and_scan_honour_it(tmp_path):
    """The command as a user runs it: the report on stdout, the policy with -o, exit 0; convert --policy keeps the
    kept module's tensors in fp32 and scan --policy passes the output."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from .helpers import run_cli

    (tmp_path / "net.py").write_text(FACTORY)
    factory, batch_fn = f"{tmp_path / 'net.py'}:build", f"{tmp_path / 'net.py'}:batch"
    from dtypeaudit.tuning.load import load_model

    trained = load_model(factory)
    with torch.no_grad():
        trained.ff[0].weight.mul_(1e5)
    checkpoint = tmp_path / "trained.safetensors"
    save_file(trained.state_dict(), str(checkpoint))
    policy = tmp_path / "keep.yaml"
    args = ("tune", factory, "--checkpoint", str(checkpoint), "--input-factory", batch_fn, "--to", "fp16")
    r = run_cli(*args, "-o", str(policy), "--format", "json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["schema"] == "dtypeaudit.tune/1" and doc["keep"] == ["ff"] and doc["first_overflow"] == "ff.0" and doc["passed"]
    assert r.stderr.strip() == f"dtypeaudit: policy written to {policy}"
    assert "ff" in policy.read_text()

    text = run_cli(*args, "--format", "plain")
    assert text.returncode == 0 and "ff" in text.stdout

    out = tmp_path / "trained.fp16.safetensors"
    conv = run_cli("convert", str(checkpoint), "--to", "fp16", "--policy", str(policy), "-o", str(out))
    assert conv.returncode == 0, conv.stderr
    with safe_open(str(out), "pt") as f:
        dtypes = {k: str(f.get_slice(k).get_dtype()) for k in f.keys()}
    assert dtypes == {k: ("F32" if k.startswith("ff.") else "F16") for k in trained.state_dict()}
    assert run_cli("scan", str(out), "--policy", str(policy), "-q").returncode == 0

    impossible = run_cli(*args, "--tolerance", "1e-12", "--format", "json")
    assert impossible.returncode == 1 and not json.loads(impossible.stdout)["passed"]
    assert run_cli("tune", factory, "--to", "fp32", "--input", "8x16").returncode == 2
    bad = run_cli("tune", factory, "--to", "fp16", "--input", "8x16", "--format", "sarif")
    assert bad.returncode == 2 and "table, plain, json or html" in bad.stderr
