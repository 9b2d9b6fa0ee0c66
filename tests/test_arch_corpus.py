"""Runtime verdicts beyond the zoo (issue 19 item 2): architectures from tests/arch_corpus.py x the dtype mixes users
leave them in, each run for real on CPU and compared with ``scan --model``, plain ``scan`` and ``trace``.

- A forward that raises on dtypes: ``scan --model`` and ``trace`` report an error; plain ``scan`` at least a warning.
- A forward that runs: no ``scan`` error (plain scan may warn where names cannot tell), and ``trace`` no error.

No outcome is written down: every one is computed by running the model. A representative subset runs by default,
the full matrix under ``-m slow``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from functools import cache
from pathlib import Path

import pytest
import torch
from torch import nn

from dtypeaudit import check, read
from dtypeaudit.formats import factory
from dtypeaudit.inventory import Finding, Inventory

from . import arch_corpus
from .arch_corpus import ARCHS
from .kernel_cases import Outcome, run_forward

CONSISTENCY = ("module-dtype-mix", "dtype-outlier")
NORMS = (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.modules.batchnorm._NormBase)


def _is_norm(m: nn.Module) -> bool:
    """A norm layer (torch's, transformers', a user's own): not a model that merely has "Norm" in its name."""
    return isinstance(m, NORMS) or ("norm" in type(m).__name__.lower() and next(m.children(), None) is None)


def _all(dtype: torch.dtype) -> Callable[[nn.Module], None]:
    return lambda model: model.to(dtype)  # type: ignore[return-value]


def _fp32_norms(dtype: torch.dtype) -> Callable[[nn.Module], None]:
    def mutate(model: nn.Module) -> None:
        model.to(dtype)
        for m in model.modules():
            if _is_norm(m):
                m.float()

    return mutate


def _compute(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, nn.Linear | nn.Conv1d | nn.Conv2d)]


def _forgotten_half(model: nn.Module) -> None:
    """One layer in the middle left float32 by a partial ``.half()``."""
    model.half()
    found = _compute(model)
    found[len(found) // 2].float()


def _t5_wo_fp32(model: nn.Module) -> None:
    """What ``_keep_in_fp32_modules = ["wo"]`` leaves: T5's feed-forward output projection float32 in a half model;
    T5DenseActDense casts its input to ``wo``'s dtype."""
    model.half()
    for name, m in model.named_modules():
        if name.endswith(".wo"):
            m.float()


def _embedding_bf16(model: nn.Module) -> None:
    """A float32 model whose token embedding was left bfloat16: its output meets float32 weights next."""
    model.float()
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    embeddings[0].bfloat16()


def _rnn_fp32(model: nn.Module) -> None:
    model.half()
    for m in model.modules():
        if isinstance(m, nn.RNNBase):
            m.float()


MIXES: dict[str, Callable[[nn.Module], None]] = {
    "fp32": _all(torch.float32),
    "fp16": _all(torch.float16),
    "bf16": _all(torch.bfloat16),
    "fp16-fp32-norms": _fp32_norms(torch.float16),
    "bf16-fp32-norms": _fp32_norms(torch.bfloat16),
    "forgotten-half": _forgotten_half,
    "t5-wo-fp32": _t5_wo_fp32,
    "embedding-bf16": _embedding_bf16,
    "rnn-fp32": _rnn_fp32,
}
EMBEDDED = frozenset({"bert", "t5", "llama", "mistral", "gpt_neox", "whisper", "clip", "lstm", "gru", "multihead_attention"})
EMBEDDED |= {"encoder_layer", "custom_rmsnorm"}
APPLIES: dict[str, Callable[[str], bool]] = {
    "t5-wo-fp32": lambda arch: arch == "t5",
    "embedding-bf16": lambda arch: arch in EMBEDDED,
    "rnn-fp32": lambda arch: arch in ("lstm", "gru"),
}
CASES = [(a, mix) for a in ARCHS for mix in MIXES if APPLIES.get(mix, lambda _: True)(a)]
# The default run: each of the four classes of issue 19 item 2, and one working and one failing mix of each kind.
DEFAULT = {
    ("t5", "t5-wo-fp32"),
    ("llama", "embedding-bf16"),
    ("bert", "embedding-bf16"),
    ("lstm", "rnn-fp32"),
    ("custom_rmsnorm", "fp16-fp32-norms"),
    ("custom_rmsnorm", "fp16"),
    ("llama", "fp16-fp32-norms"),
    ("mobilenet", "forgotten-half"),
    ("mobilenet", "fp16-fp32-norms"),
    ("conv_groupnorm", "bf16-fp32-norms"),
    ("embedding_bag", "forgotten-half"),
    ("multihead_attention", "forgotten-half"),
    ("encoder_layer", "fp16"),
}


def _first_float_dtype(model: nn.Module) -> torch.dtype:
    return next(p.dtype for p in model.parameters() if p.is_floating_point())


def build(arch: str, mix: str) -> nn.Module:
    if ARCHS[arch].source == "transformers":
        pytest.importorskip("transformers")  # the plain-torch architectures run without it
    torch.manual_seed(0)
    model = ARCHS[arch].make().eval()
    MIXES[mix](model)
    return model


def real_outcome(arch: str, model: nn.Module) -> Outcome:
    args, kwargs = ARCHS[arch].real_inputs(_input_dtype(arch, model))
    return run_forward(lambda: model(*args, **kwargs))


def _input_dtype(arch: str, model: nn.Module) -> torch.dtype:
    """Float inputs in the dtype of the layer that reads them (the first parameter)."""
    return _first_float_dtype(model)


@cache
def model_inventory(arch: str) -> Inventory:
    """What ``--model tests.arch_corpus:ARCH`` gives."""
    return factory.inventory(f"{arch_corpus.__name__}:{ARCHS[arch].make.__name__}")


def scan_findings(model: nn.Module, arch: str, path: Path, *, with_model: bool) -> list[Finding]:
    torch.save(model.state_dict(), path)
    inv = read(path)
    if with_model:
        inv = factory.attach(inv, model_inventory(arch))
    return [f for f in check(inv) if f.rule in CONSISTENCY or f.rule == "model-mismatch"]


def trace_errors(arch: str, model: nn.Module) -> list[Finding]:
    from dtypeaudit.trace import trace_module

    report = trace_module(copy.deepcopy(model), inputs=ARCHS[arch].specs(_input_dtype(arch, model)), source=ARCHS[arch].source)
    (cp,) = report.checkpoints
    return [f for f in cp.findings if f.severity == "error"]


def _verdicts(arch: str, mix: str, tmp_path: Path) -> None:
    model = build(arch, mix)
    outcome = real_outcome(arch, model)
    if outcome.limitation:
        pytest.skip(f"environment limitation, not a dtype failure: {outcome.limitation}")
    known = scan_findings(model, arch, tmp_path / "m.pt", with_model=True)
    guessed = scan_findings(model, arch, tmp_path / "m.pt", with_model=False)
    traced = trace_errors(arch, model)
    where = f"{arch} {mix}: forward {outcome}\n--model: {known}\nplain: {guessed}\ntrace: {traced}"
    assert not [f for f in known if f.rule == "model-mismatch"], where
    errors = [f for f in known if f.severity == "error"]
    assert bool(errors) == outcome.raised, where
    assert bool(traced) == outcome.raised, where
    if outcome.raised:
        assert guessed, where
    else:
        assert not [f for f in guessed if f.severity == "error"], where


@pytest.mark.parametrize(("arch", "mix"), sorted(DEFAULT), ids=[f"{a}-{m}" for a, m in sorted(DEFAULT)])
def test_verdicts_agree_with_a_real_forward(arch: str, mix: str, tmp_path: Path) -> None:
    _verdicts(arch, mix, tmp_path)


FULL = [c for c in CASES if c not in DEFAULT]


@pytest.mark.slow
@pytest.mark.parametrize(("arch", "mix"), FULL, ids=[f"{a}-{m}" for a, m in FULL])
def test_full_matrix_agrees_with_a_real_forward(arch: str, mix: str, tmp_path: Path) -> None:
    _verdicts(arch, mix, tmp_path)


def test_the_corpus_covers_failures_and_working_mixes() -> None:
    """The default subset holds mixes that fail and mixes that run, and every class the issue names."""
    raised = {(a, m): real_outcome(a, build(a, m)).raised for a, m in DEFAULT}
    assert any(raised.values()) and not all(raised.values()), raised
    assert raised[("lstm", "rnn-fp32")] and raised[("custom_rmsnorm", "fp16-fp32-norms")]
    assert not raised[("t5", "t5-wo-fp32")] and not raised[("llama", "embedding-bf16")]
