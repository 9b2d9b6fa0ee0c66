"""PyTorch is the truth: the module-consistency rules, checked against real forward passes on CPU.

1. The kernel table: BatchNorm, Linear, Conv, LayerNorm, GroupNorm, RMSNorm, InstanceNorm and Embedding, and
   transformers' weight-only norms (LlamaRMSNorm, T5LayerNorm, GemmaRMSNorm), with every combination of input,
   weight, bias and running-statistic dtype over float32/float16/bfloat16, run for real; what
   ``check.forward_dtype`` and ``module-dtype-mix`` predict must be what happened, and what the factory measures
   of a norm's forward on the meta device must be what the CPU returns.
2. A corpus of small real models (a torchvision-style ResNet with BatchNorm in Sequentials, an MLP, a tiny
   transformer, transformers' GPT-2 and Llama) broken the ways users break them, and fine ones: each is saved,
   run, and scanned with and without ``--model``. A forward pass that fails on a dtype is flagged; one that
   runs is not.
3. A property: random casts of random layers of small MLPs and CNNs, the verdict against the real forward.

No expected forward result is written down here: every one is computed by running the model.
"""

from __future__ import annotations

import copy
import importlib.util
import itertools
import json
import tempfile
import warnings
from collections.abc import Callable
from functools import cache
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st
from torch import nn

from dtypeaudit import check, kernels, read
from dtypeaudit.checks import certain, forward_dtype, module_dtype_mix, semantics, table_verdict
from dtypeaudit.formats import factory
from dtypeaudit.inventory import Finding, Inventory
from dtypeaudit.structure import infer_modules

from . import kernel_cases, models
from .helpers import inventory_of
from .kernel_cases import TORCH_DTYPES, Kernel, run_forward, set_dtype
from .models import MODELS

CONSISTENCY = ("module-dtype-mix", "dtype-outlier")
BACKENDS, OUTCOMES = kernels.table().backends, kernels.table().outcomes


def consistency(findings: list[Finding], severities: tuple[str, ...] = ("error", "warning")) -> list[Finding]:
    return [f for f in findings if f.rule in CONSISTENCY and f.severity in severities]


# 1. The kernel table ------------------------------------------------------------------------------------


KERNELS: dict[str, Kernel] = dict(kernel_cases.KERNELS)


def _transformers_norm(module: str, cls: str) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        mod = pytest.importorskip(f"transformers.models.{module}")
        return getattr(mod, cls)(4)  # type: ignore[no-any-return]

    return make


# transformers' weight-only norms: LlamaRMSNorm returns weight * x.to(input_dtype) (the RMSNorms of Mistral, Qwen2,
# Phi-3 ... are copies of it), T5LayerNorm casts x to a half weight only, GemmaRMSNorm casts back to x's dtype.
HF_NORMS: dict[str, tuple[str, str]] = {
    "LlamaRMSNorm": ("llama.modeling_llama", "LlamaRMSNorm"),
    "T5LayerNorm": ("t5.modeling_t5", "T5LayerNorm"),
    "GemmaRMSNorm": ("gemma.modeling_gemma", "GemmaRMSNorm"),
    "CohereLayerNorm": ("cohere.modeling_cohere", "CohereLayerNorm"),
}
for _name, (_module, _cls) in HF_NORMS.items():
    KERNELS[_name] = Kernel(_transformers_norm(_module, _cls), lambda d: torch.randn(2, 4, dtype=d), ("weight",))


# Without --model, an InstanceNorm with running statistics looks like a BatchNorm and a ConvTranspose2d whose in
# and out channels agree like a Conv2d: the guess applies the stricter kernel's rule.
STRICTER_GUESSES = frozenset({"InstanceNorm2d", "ConvTranspose1d", "ConvTranspose2d"})


TABLE_KERNELS = tuple(kernel_cases.KERNELS)
BACKEND = kernel_cases.backend_id()


def _cases(name: str) -> list[tuple[str, str, tuple[str, ...]]]:
    k = KERNELS[name]
    return [(name, x, combo) for x in kernel_cases.inputs_of(name) for combo in itertools.product(TORCH_DTYPES, repeat=len(k.leaves))]


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")
@pytest.mark.parametrize("name", list(KERNELS))
def test_kernel_table_matches_a_real_forward(name: str) -> None:
    """Every combination of one module's dtypes and its input's, run here: the table's row for this machine's
    backend is what PyTorch did, and the verdict is the strictest outcome over every backend the table knows.

    On a backend the table has not measured, the real forward must still be no laxer than the verdict (a crash
    here is a crash in the table), and the test warns that the backend is unmeasured.
    """
    measured = []
    kernel = KERNELS[name]
    rows = OUTCOMES.get(BACKEND)
    for _, x, combo in _cases(name):
        m = kernel_cases.build_kernel(name, combo) if name in TABLE_KERNELS else _build_hf_norm(name, combo)
        example = kernel.example(TORCH_DTYPES.get(x, torch.int64))
        outcome = run_forward(lambda m=m, example=example: m(example))  # type: ignore[misc]
        if outcome.limitation:
            pytest.skip(f"{name} on CPU: environment limitation, not a dtype rule: {outcome.limitation}")
        measured.append((x, combo, outcome))
        context = f"{name} input={x} {dict(zip(kernel.leaves, combo, strict=True))} on {BACKEND}: {outcome}"
        strictest: str | None = None
        if name in TABLE_KERNELS:
            key = kernel_cases.row_key(name, x, combo)
            if rows is not None:
                assert rows.get(key) == outcome.entry, f"{context}; the table says {rows.get(key)} for {BACKEND}"
            assert rows is None or key in rows, context
            # Every backend's row, for every kernel of this type's family (ConvTranspose1d runs ConvTranspose2d's).
            family = [kernel_cases.row_key(k, x, combo) for k in kernels.measured_kernels(name)]
            entries = [o[k] for o in OUTCOMES.values() for k in family if k in o]
            strictest = "crash" if "raise" in entries or outcome.raised else outcome.output
            if strictest != "crash":
                assert set(entries) <= {outcome.output}, f"{context}; backends return different dtypes: {entries}"
        crashes = strictest == "crash" if strictest is not None else outcome.raised
        for facts in (True, False):
            inv = inventory_of(m, facts=facts, prefix="m.")
            (module,) = infer_modules(inv)
            predicted = forward_dtype(module, x)
            where = f"{context} facts={facts}, strictest over the table: {strictest}"
            if facts and strictest is not None:
                assert predicted == strictest, where
            elif facts or name not in STRICTER_GUESSES:
                assert (predicted == "crash") == crashes, where
            else:
                assert predicted == "crash" or not crashes, where  # a guess may be stricter, never laxer
            if (facts or name not in STRICTER_GUESSES) and [f for f in module_dtype_mix(inv) if f.severity == "error"]:
                assert crashes and module.confidence in ("fact", "high"), where  # whatever the input
            # Guessed weight-only norms are assumed to promote (Hugging Face's RMSNorm): only what is certain (a
            # known kernel, or a forward measured where the meta device settles it) gives the exact answer.
            if not outcome.raised and predicted != "crash" and (certain(module, x) or (not facts and semantics(module) != "promote")):
                assert predicted == outcome.output, where
            if facts and name in HF_NORMS:
                assert semantics(module) == "measured" and module.confidence == "fact", where
    if name in TABLE_KERNELS and rows is None:
        warnings.warn(f"backend {BACKEND} is not in dtypeaudit/data/kernels.json: run `python scripts/measure_kernels.py`", stacklevel=1)
    # The table is not empty on either side: some combinations run, some fail.
    assert any(o.raised for *_, o in measured) or name in ("RMSNorm", "Embedding", *HF_NORMS)
    assert any(not o.raised for *_, o in measured)


def _build_hf_norm(name: str, combo: tuple[str, ...]) -> nn.Module:
    m = KERNELS[name].make().eval()
    set_dtype(m, "weight", TORCH_DTYPES[combo[0]])
    return m


def test_kernel_table_records_where_each_backend_was_measured() -> None:
    """Every backend says on which machine and torch it was measured and how; every row is a real case."""
    keys = {kernel_cases.row_key(*c) for c in kernel_cases.kernel_cases()}
    assert {"cpu-avx2", "cpu-default", "cpu-avx2-no-onednn"} <= set(BACKENDS)
    for backend, rows in OUTCOMES.items():
        assert set(BACKENDS[backend]) == {"measured_on", "torch", "how"} and all(BACKENDS[backend].values()), backend
        assert rows and set(rows) <= keys, backend
        assert set(rows.values()) <= {"raise", *TORCH_DTYPES}, backend


def test_the_shipped_table_is_what_the_script_writes() -> None:
    """The file is the script's compact form of its own expansion: no row was edited by hand into a shape the
    script would not write, and expanding it loses nothing."""
    spec = importlib.util.spec_from_file_location("measure_kernels", Path(__file__).parents[1] / "scripts" / "measure_kernels.py")
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    shipped = json.loads(kernels.TABLE.read_text(encoding="utf-8"))
    assert script.compact(BACKENDS, OUTCOMES) == shipped
    # the base holds what most backends measured: the backends that agree with it carry their record alone
    assert sum(set(entry) == {"how", "measured_on", "torch"} for entry in shipped["backends"].values()) >= 4


def test_a_scan_without_module_types_reads_no_kernel_table() -> None:
    """The table is read on the first verdict asked for, which only a module type (``--model``) asks: a plain
    scan of a state dict never reads the file."""
    kernels.table.cache_clear()
    model = kernel_cases.build_kernel("ConvTranspose2d", ("bfloat16", "float32"))  # raises where oneDNN runs it
    assert consistency(check(inventory_of(model, facts=False))) and kernels.table.cache_info().currsize == 0
    assert consistency(check(inventory_of(model, facts=True))) and kernels.table.cache_info().currsize == 1


def test_strictest_backend_decides_and_the_finding_names_it() -> None:
    """ConvTranspose2d, half weight and input, float32 bias: AVX2's kernels run it, oneDNN's refuse it (issue 19's
    AVX-512 FP16 machine for float16, AVX-512 for bfloat16). The verdict is an error naming the stricter backend."""
    for half in ("float16", "bfloat16"):
        m = kernel_cases.build_kernel("ConvTranspose2d", (half, "float32"))
        inv = inventory_of(m, facts=True, prefix="m.")
        (module,) = infer_modules(inv)
        verdict = table_verdict(module, half)
        assert verdict is not None and verdict.result == "raise" and verdict.running, verdict
        assert forward_dtype(module, half) == "crash"
        (finding,) = module_dtype_mix(inv)
        assert finding.severity == "error", finding
        assert f"it raises on {verdict.raising[0]} (" in finding.message and "the strictest backend decides" in finding.message
        assert BACKENDS[verdict.raising[0]]["measured_on"] in finding.message
    # A float32 ConvTranspose2d with a half bias runs on every backend measured: no finding.
    m = kernel_cases.build_kernel("ConvTranspose2d", ("float32", "float16"))
    assert forward_dtype(infer_modules(inventory_of(m, facts=True, prefix="m."))[0], "float32") == "float32"


TORCH_WEIGHT_ONLY: dict[str, Callable[[], nn.Module]] = {
    "LayerNorm(bias=False)": lambda: nn.LayerNorm(4, bias=False),
    "RMSNorm": lambda: nn.RMSNorm(4),
}


@pytest.mark.parametrize("name", [*TORCH_WEIGHT_ONLY, *HF_NORMS])
def test_factory_measures_a_norms_forward_as_the_cpu_runs_it(name: str) -> None:
    """What the factory measures of a norm's forward on the meta device is what the CPU returns, wherever the CPU
    runs it; where the CPU refuses (a kernel's dtype check the meta device does not make), ``check`` does not trust
    the measurement (``_settled``). PyTorch's own norms, whose rules are known, are not probed by ``--model``."""
    norm = (TORCH_WEIGHT_ONLY.get(name) or KERNELS[name].make)()
    probed = factory.probe_norms(nn.Sequential(norm))
    if name in HF_NORMS:
        assert set(probed) == {name}
        measured = probed[name]
    else:
        assert probed == {}
        measured = factory._probe(norm, 4) or {}
    assert len(measured) == len(TORCH_DTYPES) ** 2
    for p, x in itertools.product(TORCH_DTYPES, repeat=2):
        m = copy.deepcopy(norm).to(TORCH_DTYPES[p]).eval()
        example = torch.randn(2, 4, dtype=TORCH_DTYPES[x])
        outcome = run_forward(lambda m=m, example=example: m(example))  # type: ignore[misc]
        if outcome.raised:
            assert p not in (x, "float32"), (name, p, x, outcome)
        else:
            assert measured[f"{p}/{x}"] == outcome.output, (name, p, x, outcome)


# 2. The corpus (its models, MODELS, live in tests/models.py: tests/test_structure.py builds them too) ---------


TOKEN_MODELS = frozenset({"transformer", "gpt2", "llama"})


def _is_norm(m: nn.Module) -> bool:
    return isinstance(m, nn.modules.batchnorm._NormBase | nn.LayerNorm | nn.GroupNorm | nn.RMSNorm) or "Norm" in type(m).__name__


def norms_to(model: nn.Module, dtype: torch.dtype) -> None:
    for m in model.modules():
        if _is_norm(m):
            m.to(dtype)


def _linears(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"]


def _middle_linear(model: nn.Module) -> nn.Module:
    found = _linears(model)
    return found[len(found) // 2]


def _block(model: nn.Module, name: str) -> nn.Module:
    """The second residual block: ``layer1.1``, ``transformer.h.1``, ``model.layers.1``."""
    path = {"resnet": "layer1.1", "gpt2": "transformer.h.1", "llama": "model.layers.1"}[name]
    return model.get_submodule(path)


def _embedding(model: nn.Module) -> nn.Module:
    return next(m for m in model.modules() if isinstance(m, nn.Embedding))


def _half_batchnorm(model: nn.Module) -> None:
    """What a name-based fp16-mixed conversion did to BatchNorms inside Sequentials: fp16 weights, fp32 statistics."""
    model.half()
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            set_dtype(m, "running_mean", torch.float32)
            set_dtype(m, "running_var", torch.float32)


def _all(dtype: torch.dtype) -> Callable[[nn.Module, str], None]:
    def mutate(model: nn.Module, name: str) -> None:
        model.to(dtype)

    return mutate


def _with_fp32_norms(dtype: torch.dtype) -> Callable[[nn.Module, str], None]:
    def mutate(model: nn.Module, name: str) -> None:
        model.to(dtype)
        norms_to(model, torch.float32)

    return mutate


def _half_then(change: Callable[[nn.Module, str], object]) -> Callable[[nn.Module, str], None]:
    def mutate(model: nn.Module, name: str) -> None:
        model.half()
        change(model, name)

    return mutate


# Each way of breaking (or keeping) a model, and the rule that must catch it when its forward fails.
MUTATIONS: dict[str, tuple[Callable[[nn.Module, str], None], str | None]] = {
    "all-fp32": (_all(torch.float32), None),
    "all-fp16": (_all(torch.float16), None),
    "all-bf16": (_all(torch.bfloat16), None),
    "fp16-fp32-norms": (_with_fp32_norms(torch.float16), None),
    "bf16-fp32-norms": (_with_fp32_norms(torch.bfloat16), None),
    "forgotten-half": (_half_then(lambda m, n: _middle_linear(m).float()), "dtype-outlier"),
    "first-layer-fp32": (_half_then(lambda m, n: _linears(m)[0].float()), "dtype-outlier"),
    "bias-left-fp32": (_half_then(lambda m, n: set_dtype(_middle_linear(m), "bias", torch.float32)), "module-dtype-mix"),
    "batchnorm-half-converted": (lambda m, n: _half_batchnorm(m), "module-dtype-mix"),
    "embedding-fp32": (_half_then(lambda m, n: _embedding(m).float()), "dtype-outlier"),
    "embedding-bf16": (_half_then(lambda m, n: _embedding(m).bfloat16()), "dtype-outlier"),
    "block-bf16": (_half_then(lambda m, n: _block(m, n).bfloat16()), "dtype-outlier"),
}
FINE = frozenset({"all-fp32", "all-fp16", "all-bf16", "fp16-fp32-norms", "bf16-fp32-norms"})
APPLIES: dict[str, frozenset[str]] = {
    "resnet": FINE | {"forgotten-half", "bias-left-fp32", "batchnorm-half-converted", "block-bf16"},
    "mlp": frozenset({"all-fp32", "all-fp16", "all-bf16", "forgotten-half", "first-layer-fp32", "bias-left-fp32"}),
    "transformer": FINE | {"forgotten-half", "bias-left-fp32", "embedding-fp32", "embedding-bf16"},
    "gpt2": FINE | {"forgotten-half", "bias-left-fp32", "embedding-fp32", "block-bf16"},
    "llama": FINE | {"forgotten-half", "embedding-fp32", "block-bf16"},
}
# With --model every failure is certain, LlamaRMSNorm's included: the factory measures its forward (weight *
# x.to(input_dtype) is float32 for an fp32 weight), so an fp32 LlamaRMSNorm in a half model is an error.
UNMEASURED: frozenset[tuple[str, str]] = frozenset()
CASES = [(model, mutation) for model in MODELS for mutation in MUTATIONS if mutation in APPLIES[model]]


def _input(name: str, model: nn.Module) -> torch.Tensor:
    """An input of the dtype the model's first layer holds (token ids for language models)."""
    if name in TOKEN_MODELS:
        return torch.tensor([[1, 2, 3, 4, 5]])
    first = next(p for p in model.parameters() if p.is_floating_point())
    shape = (2, 3, 8, 8) if name == "resnet" else (2, 16)
    return torch.randn(*shape, dtype=first.dtype)


@cache
def model_inventory(name: str) -> Inventory:
    """What ``--model tests.models:make_NAME`` gives."""
    return factory.inventory(f"{models.__name__}:{MODELS[name].__name__}")


def _save(name: str, model: nn.Module, directory: Path) -> list[Path]:
    from safetensors.torch import save_model

    pt = directory / f"{name}.pt"
    torch.save(model.state_dict(), pt)
    st_path = directory / f"{name}.safetensors"
    save_model(model, str(st_path))  # ties written once, as safetensors requires
    return [pt, st_path]


@pytest.mark.parametrize(("model_name", "mutation"), CASES, ids=[f"{m}-{x}" for m, x in CASES])
def test_runtime_truth(model_name: str, mutation: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = MODELS[model_name]().eval()
    mutate, rule = MUTATIONS[mutation]
    mutate(model, model_name)
    outcome = run_forward(lambda: model(_input(model_name, model)))
    if outcome.limitation:
        pytest.skip(f"environment limitation, not a dtype failure: {outcome.limitation}")
    for path in _save(model_name, model, tmp_path):
        inv = read(path)
        for with_model in (False, True):
            scanned = factory.attach(inv, model_inventory(model_name)) if with_model else inv
            found = consistency(check(scanned))
            where = f"{path.name} {'with' if with_model else 'without'} --model, forward: {outcome}; findings: {found}"
            if not outcome.raised:
                # A model that runs gets neither an error nor a warning from the consistency rules.
                assert found == [], where
                continue
            # A model that fails is flagged: by the rule its breakage calls for, at the severity the issue asks.
            assert found, where
            if rule is not None:
                severity = "warning" if rule == "dtype-outlier" and not with_model else "error"
                assert any(f.rule == rule and f.severity == severity for f in found), where
            if with_model and (model_name, mutation) not in UNMEASURED:
                assert any(f.severity == "error" for f in found), where


# 3. The property ------------------------------------------------------------------------------------------


def make_prop_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 4))


def make_prop_deep_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))


def make_prop_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 4, 3),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Conv2d(4, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4, 2),
    )


PROP_MODELS: dict[str, Callable[[], nn.Module]] = {"mlp": make_prop_mlp, "deep_mlp": make_prop_deep_mlp, "cnn": make_prop_cnn}


@cache
def prop_model_inventory(name: str) -> Inventory:
    return factory.inventory(f"{__name__}:{PROP_MODELS[name].__name__}")


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_verdict_agrees_with_a_real_forward(data: st.DataObject) -> None:
    """Whatever layers or tensors are cast: a crash is always flagged; with --model, an error exactly when it crashes."""
    name = data.draw(st.sampled_from(sorted(PROP_MODELS)), label="model")
    model = PROP_MODELS[name]().eval()
    model.to(TORCH_DTYPES[data.draw(st.sampled_from(sorted(TORCH_DTYPES)), label="base")])
    layers = [(n, m) for n, m in model.named_modules() if any(True for _ in m.parameters(recurse=False))]
    for _ in range(data.draw(st.integers(0, 3), label="casts")):
        layer_name, layer = data.draw(st.sampled_from(layers), label="layer")
        dtype = TORCH_DTYPES[data.draw(st.sampled_from(sorted(TORCH_DTYPES)), label="dtype")]
        leaves = [n for n, t in layer.state_dict().items() if t.is_floating_point()]
        leaf = data.draw(st.sampled_from([None, *leaves]), label=f"tensor of {layer_name}")
        if leaf is None:
            layer.to(dtype)
        else:
            set_dtype(layer, leaf, dtype)
    first = next(p for p in model.parameters())
    x = torch.randn(2, 3, 6, 6) if name == "cnn" else torch.randn(2, 8)
    outcome = run_forward(lambda: model(x.to(first.dtype)))
    assume(outcome.limitation is None)
    event("forward fails" if outcome.raised else "forward runs")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "m.pt"
        torch.save(model.state_dict(), path)
        inv = read(path)
    guessed = consistency(check(inv))
    known = consistency(check(factory.attach(inv, prop_model_inventory(name))), ("error",))
    summary = f"{name}: {[(k, str(v.dtype)) for k, v in model.state_dict().items()]} forward: {outcome}"
    if outcome.raised:
        assert guessed, summary
    if not guessed:
        assert not outcome.raised, summary
    assert bool(known) == outcome.raised, f"{summary}; with --model: {known}"


UPSAMPLER = """
from torch import nn

def build():
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ConvTranspose2d(4, 3, 3))
"""


def test_scan_model_fails_a_checkpoint_that_one_backend_refuses(tmp_path: Path) -> None:
    """Issue 19: `scan --model` passed a half ConvTranspose2d with a float32 bias (exit 0) that AVX-512 FP16 CPUs
    refuse. Now it exits 1 on every machine, and the finding names the stricter backend."""
    from .helpers import run_cli

    (tmp_path / "net.py").write_text(UPSAMPLER)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ConvTranspose2d(4, 3, 3)).half()
    set_dtype(model[1], "bias", torch.float32)
    torch.save(model.state_dict(), tmp_path / "up.pt")
    proc = run_cli("scan", str(tmp_path / "up.pt"), "--model", f"{tmp_path / 'net.py'}:build", "-f", "json")
    assert proc.returncode == 1, proc.stderr
    (finding,) = [f for f in json.loads(proc.stdout)["checkpoints"][0]["findings"] if f["rule"] == "module-dtype-mix"]
    assert finding["severity"] == "error" and finding["tensor"] == "1"
    fp16_cpu = "cpu-avx512-onednn-bf16-onednn-fp16"
    assert f"{fp16_cpu} ({BACKENDS[fp16_cpu]['measured_on']})" in finding["message"].partition("though")[0]
    assert "it raises on " in finding["message"]
    assert "though it runs on cpu-avx2" in finding["message"]
