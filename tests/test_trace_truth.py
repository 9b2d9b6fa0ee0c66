"""Predictions equal reality: what ``dtypeaudit trace`` predicts on fake tensors is what the model does on real ones.

For each model of the zoo (tests/trace_zoo.py: a CNN with BatchNorm, a transformer with hand-written attention and
one with ``nn.MultiheadAttention``, transformers' GPT-2), in working and broken dtype mixes, with and without CPU
autocast, forward and backward: the real model runs on real CPU tensors under the same recorder (which records
each operation and, where one fails, records PyTorch's message and goes on with its inputs cast as the trace
does), and the trace runs on fake tensors built on the meta device. Every operation must match: the module it ran
in, its input and output dtypes, whether it failed and with which message; so must every module's output dtypes,
the loss and every gradient's dtype. A hypothesis property does the same for random small models with random
layers half-converted.

No expected dtype is written down here: every one is computed by running the model.

``pytest -m slow`` runs every combination; by default each model runs every mix once, with autocast and
forward-only variants spread over the mixes, in about half a minute.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from torch import nn

from dtypeaudit.trace import trace_module
from dtypeaudit.trace.record import Recording, run
from dtypeaudit.trace.result import TraceSummary

from . import trace_zoo as zoo

AUTOCASTS = (None, "bfloat16", "float16")


@dataclass(frozen=True)
class Family:
    name: str
    build: Callable[[str], nn.Module]
    mixes: list[zoo.Mix]
    shape: tuple[int, ...]
    source: str = "factory"

    def real_inputs(self, dtype: str, backward: bool) -> tuple[tuple[Any, ...], dict[str, Any]]:
        torch.manual_seed(1)
        if dtype == "int64":
            ids = torch.randint(0, 16, self.shape)
            if self.source == "transformers":
                return (), ({"input_ids": ids, "labels": ids} if backward else {"input_ids": ids})
            return (ids,), {}
        return (torch.randn(self.shape, dtype=getattr(torch, dtype)),), {}

    def spec(self, dtype: str) -> str:
        name = "input_ids=" if self.source == "transformers" else ""
        return f"{name}{'x'.join(map(str, self.shape))}:{dtype}"


FAMILIES = [
    Family("cnn", zoo.cnn, zoo.CNN_MIXES, (2, 3, 8, 8)),
    Family("transformer", zoo.transformer, zoo.TOKEN_MIXES, (2, 8)),
    Family("mha", lambda mix: zoo.transformer(mix, torch_attention=True), zoo.TOKEN_MIXES, (2, 8)),
    Family("gpt2", zoo.gpt2_mixed, zoo.TOKEN_MIXES, (2, 8), source="transformers"),
]


def _cases() -> list[Any]:
    cases = []
    for fam in FAMILIES:
        for i, (mix, _, dtype) in enumerate(fam.mixes):
            for j, autocast in enumerate(AUTOCASTS):
                for backward in (True, False):
                    # By default: every mix once, autocast modes and forward-only runs rotated over the mixes.
                    chosen = j == i % len(AUTOCASTS) and backward != (i % 4 == 3)
                    cases.append(
                        pytest.param(
                            fam,
                            mix,
                            dtype,
                            autocast,
                            backward,
                            id=f"{fam.name}-{mix}-{autocast or 'noautocast'}-{'fb' if backward else 'f'}",
                            marks=() if chosen else (pytest.mark.slow,),
                        )
                    )
    return cases


def real_run(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], autocast: str | None, backward: bool) -> Recording:
    model.train(backward)
    grad = contextlib.nullcontext() if backward else torch.no_grad()
    with grad:
        return run(model, args, kwargs, autocast=getattr(torch, autocast) if autocast else None, backward=backward)


def fake_run(model: nn.Module, spec: str, autocast: str | None, backward: bool, source: str) -> TraceSummary:
    report = trace_module(model, inputs=[spec], autocast=autocast, backward=backward, source=source)
    summary = report.checkpoints[0].trace  # type: ignore[attr-defined]
    assert summary is not None
    return summary


# Layout bookkeeping: the autograd engine copies a gradient whose strides differ from its parameter's, and fake
# tensors' strides come from meta kernels, so these may come and go; none of them changes a dtype.
LAYOUT = frozenset({"aten.detach", "aten.new_empty_strided", "aten.empty_strided", "aten.clone", "aten.alias", "aten.copy_"})


def _compared(ops: Any) -> list[tuple[object, ...]]:
    return [
        (o.phase, o.module, o.op, o.inputs, o.outputs, o.autocast_cast, o.error)
        for o in ops
        if not (o.name in LAYOUT and len(set(o.inputs)) == 1 and set(o.outputs) <= set(o.inputs) and o.error is None)
    ]


def assert_same(real: Recording, fake: TraceSummary) -> None:
    """Every operation (but layout bookkeeping), module output, loss and gradient dtype, every failure with its message."""
    failures_real = [(o.phase, o.module, o.op, o.inputs, o.error) for o in real.ops if o.error]
    failures_fake = [(o.phase, o.module, o.op, o.inputs, o.error) for o in fake.ops if o.error]
    assert failures_fake == failures_real
    ops_real, ops_fake = _compared(real.ops), _compared(fake.ops)
    for i, (r, f) in enumerate(zip(ops_real, ops_fake, strict=False)):
        assert f == r, f"operation {i} differs: real {r}, fake {f}"
    assert len(ops_fake) == len(ops_real)
    assert [(c.module, c.inputs, c.outputs) for c in fake.calls] == [(c.module, c.inputs, c.outputs) for c in real.calls]
    assert fake.output == real.output
    assert (fake.loss, fake.loss_dtype) == (real.loss, real.loss_dtype)
    assert list(fake.grads) == real.grads
    assert fake.stopped == real.stopped


@pytest.mark.parametrize(("family", "mix", "dtype", "autocast", "backward"), _cases())
def test_zoo_prediction_equals_reality(family: Family, mix: str, dtype: str, autocast: str | None, backward: bool) -> None:
    torch.manual_seed(0)
    model = family.build(mix)
    args, kwargs = family.real_inputs(dtype, backward)
    real = real_run(model, args, kwargs, autocast, backward)
    with torch.device("meta"):
        meta_model = family.build(mix)
    fake = fake_run(meta_model, family.spec(dtype), autocast, backward, family.source)
    assert_same(real, fake)


def test_zoo_covers_failures_and_working_mixes() -> None:
    """The zoo is not vacuous: broken mixes fail for real, and the working ones run clean."""
    outcomes = {}
    for fam in FAMILIES[:2]:
        for mix, _, dtype in fam.mixes:
            torch.manual_seed(0)
            args, kwargs = fam.real_inputs(dtype, True)
            rec = real_run(fam.build(mix), args, kwargs, None, True)
            outcomes[(fam.name, mix)] = bool([o for o in rec.ops if o.error]) or rec.stopped is not None
    assert not outcomes[("cnn", "fp32")] and not outcomes[("cnn", "half")] and not outcomes[("transformer", "fp16-norms-fp32")]
    for broken in ("forgot-half-input", "fp32-bias", "half-bn", "fp64-layer"):
        assert outcomes[("cnn", broken)], broken
    for broken in ("fp32-bias", "head-left-fp32", "bf16-embedding", "fp64-layer"):
        assert outcomes[("transformer", broken)], broken


# -- the property: random small models, random layers half-converted ---------------------------------------------------

LAYER_KINDS = ("linear", "conv", "bn", "ln", "relu", "softmax", "gelu")


def _random_model(draw: Any) -> tuple[nn.Module, tuple[int, ...]]:
    image = draw(st.booleans())
    layers: list[nn.Module] = []
    width = 4
    if image:
        for _ in range(draw(st.integers(1, 3))):
            kind = draw(st.sampled_from(("conv", "bn", "relu")))
            layers.append(nn.Conv2d(width, width, 3, padding=1) if kind == "conv" else nn.BatchNorm2d(width) if kind == "bn" else nn.ReLU())
        layers += [nn.Flatten(), nn.Linear(width * 4 * 4, 3)]
        return nn.Sequential(*layers), (2, width, 4, 4)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(("linear", "ln", "relu", "softmax", "gelu")))
        layers.append(
            nn.Linear(width, width)
            if kind == "linear"
            else nn.LayerNorm(width)
            if kind == "ln"
            else nn.ReLU()
            if kind == "relu"
            else nn.Softmax(-1)
            if kind == "softmax"
            else nn.GELU()
        )
    layers.append(nn.Linear(width, 2))
    return nn.Sequential(*layers), (3, width)


@st.composite
def _scenario(draw: Any) -> tuple[Callable[[], nn.Module], tuple[int, ...], str, str | None, bool]:
    seed = draw(st.integers(0, 2**16))
    model, shape = _random_model(draw)
    n = len(list(model.modules()))
    casts = [draw(st.sampled_from(("keep", "keep", "half", "bf16", "weight-half", "bias-half", "stats-half", "double"))) for _ in range(n)]
    input_dtype = draw(st.sampled_from(("float32", "float16", "bfloat16")))
    autocast = draw(st.sampled_from((None, "bfloat16", "float16")))
    backward = draw(st.booleans())
    structure = model

    def build() -> nn.Module:
        torch.manual_seed(seed)
        m = _clone_structure(structure)
        for how, mod in zip(casts, list(m.modules()), strict=True):
            _cast(mod, how)
        return m

    return build, shape, input_dtype, autocast, backward


def _clone_structure(model: nn.Module) -> nn.Module:
    """A new model of the same layers, made on the current default device (meta for the trace)."""
    layers: list[nn.Module] = []
    for layer in model:
        if isinstance(layer, nn.Linear):
            layers.append(nn.Linear(layer.in_features, layer.out_features))
        elif isinstance(layer, nn.Conv2d):
            layers.append(nn.Conv2d(layer.in_channels, layer.out_channels, 3, padding=1))
        elif isinstance(layer, nn.BatchNorm2d):
            layers.append(nn.BatchNorm2d(layer.num_features))
        elif isinstance(layer, nn.LayerNorm):
            layers.append(nn.LayerNorm(layer.normalized_shape))
        else:
            layers.append(type(layer)(*([-1] if isinstance(layer, nn.Softmax) else [])))
    return nn.Sequential(*layers)


def _cast(mod: nn.Module, how: str) -> None:
    if how == "half":
        mod.half() if not list(mod.children()) else None
    elif how == "bf16":
        mod.bfloat16() if not list(mod.children()) else None
    elif how == "double":
        mod.double() if not list(mod.children()) else None
    elif how in ("weight-half", "bias-half"):
        p = getattr(mod, how.split("-")[0], None)
        if isinstance(p, torch.Tensor):
            p.data = p.data.half()
    elif how == "stats-half":
        for name in ("running_mean", "running_var"):
            b = getattr(mod, name, None)
            if isinstance(b, torch.Tensor):
                b.data = b.data.half()


def _half_conversion_prediction_equals_reality(
    scenario: tuple[Callable[[], nn.Module], tuple[int, ...], str, str | None, bool],
) -> None:
    build, shape, input_dtype, autocast, backward = scenario
    model = build()
    torch.manual_seed(2)
    x = torch.randn(shape).to(getattr(torch, input_dtype))
    real = real_run(model, (x,), {}, autocast, backward)
    with torch.device("meta"):
        meta_model = build()
    fake = fake_run(meta_model, f"{'x'.join(map(str, shape))}:{input_dtype}", autocast, backward, "factory")
    assert_same(real, fake)
    event("fails" if any(o.error for o in real.ops) or real.stopped else "runs")


def _half_conversions_property(examples: int, derandomize: bool):
    return settings(max_examples=examples, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=derandomize)(
        given(_scenario())(_half_conversion_prediction_equals_reality)
    )


test_random_half_conversions_prediction_equals_reality = _half_conversions_property(30, derandomize=True)
test_random_half_conversions_prediction_equals_reality_many = pytest.mark.slow(_half_conversions_property(300, derandomize=False))
