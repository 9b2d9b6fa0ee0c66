"""Policies on real checkpoints: presets that follow the reader, the AMP preset, no silent no-ops, the README's examples.

Every checkpoint is written by torch.save from a real model (a ResNet-style CNN with BatchNorm inside
Sequentials, a transformers GPT-2), after a real optimizer step where it is a training checkpoint, and a
layout the tests call good is also run forward on CPU.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from dtypeaudit.checks import check, checks_for
from dtypeaudit.formats import factory, read_checkpoint
from dtypeaudit.inventory import Finding, Report, TensorRecord
from dtypeaudit.pipeline import scan
from dtypeaudit.policy import Policy, compile_matcher, decide, load_policy, presets
from dtypeaudit.render import explain as explain_render

from .helpers import ROOT, run_cli
from .models import BasicBlock

HERE = "tests.test_policy_truth"


# -- real models ---------------------------------------------------------------------------------


class ResNetish(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 1, 1), nn.BatchNorm2d(8), nn.ReLU())
        self.layer1 = nn.Sequential(BasicBlock(8, 8, relu_module=False), BasicBlock(8, 16, stride=2, relu_module=False))
        self.fc = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.layer1(self.stem(x)).mean((2, 3)))


def resnet() -> nn.Module:
    torch.manual_seed(0)
    return ResNetish()


class LitWrapper(nn.Module):
    """A LightningModule's shape: the network under an attribute, so the factory's names gain ``net.``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = ResNetish()


def lit() -> nn.Module:
    return LitWrapper()


class Backbone(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = ResNetish()


def backbone() -> nn.Module:
    return Backbone()


def unrelated() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))


def gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config).eval()


def half_with_fp32_batchnorms(model: nn.Module, dtype: torch.dtype = torch.float16) -> nn.Module:
    model.to(dtype)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.float()
    return model


def runs(model: nn.Module, example: torch.Tensor) -> bool:
    """A real forward pass on CPU, in eval mode, with an input of the dtype the first layer holds."""
    model.eval()
    with torch.no_grad():
        model(example)
    return True


def image(dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(2, 3, 8, 8).to(dtype)


def train_step(model: nn.Module, *, amp: bool = False) -> tuple[torch.optim.Optimizer, torch.amp.GradScaler | None]:
    """Real Adam steps; with ``amp``, under torch.autocast(float16) with a CPU GradScaler, as AMP training runs."""
    torch.manual_seed(1)
    opt = torch.optim.Adam(model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0) if amp else None
    model.train()
    for _ in range(2):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16, enabled=amp):
            loss = model(image(torch.float32)).float().pow(2).mean()
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
    assert opt.state_dict()["state"], "the optimizer stepped"
    return opt, scaler


def save(path: Path, obj: object) -> Path:
    torch.save(obj, path)
    return path


def run_scan(path: Path, policy: Policy, *, model: str | None = None, more: tuple[Path, ...] = ()) -> Report:
    return scan([str(path), *map(str, more)], checks=checks_for(policy), model=model, policy=policy, jobs=1, raise_errors=True)


def rules_of(findings: list[Finding] | tuple[Finding, ...]) -> set[str]:
    return {f.rule for f in findings}


# -- checkpoints ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("truth")


@pytest.fixture(scope="module")
def tutorial(ckpts: Path) -> Path:
    """PyTorch's "saving a general checkpoint" tutorial, after real Adam steps."""
    model = resnet()
    opt, _ = train_step(model)
    return save(
        ckpts / "tutorial.pt",
        {"epoch": 3, "model_state_dict": model.state_dict(), "optimizer_state_dict": opt.state_dict(), "loss": 0.25},
    )


def lightning_layout(model: nn.Module, opt: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None) -> dict[str, Any]:
    """What Lightning's trainer.save_checkpoint writes (2.x); the scaler under its precision plugin's name."""
    ckpt: dict[str, Any] = {
        "epoch": 3,
        "global_step": 120,
        "pytorch-lightning_version": "2.4.0",
        "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
        "loops": {"fit_loop": {"state_dict": {}, "epoch_progress": {"total": {"ready": 4}}}},
        "callbacks": {},
        "optimizer_states": [opt.state_dict()],
        "lr_schedulers": [],
    }
    if scaler is not None:
        ckpt["MixedPrecision"] = scaler.state_dict()
    return ckpt


@pytest.fixture(scope="module")
def amp_run() -> tuple[nn.Module, torch.optim.Optimizer, torch.amp.GradScaler]:
    model = resnet()
    opt, scaler = train_step(model, amp=True)
    assert scaler is not None
    return model, opt, scaler


@pytest.fixture(scope="module")
def amp_lightning(ckpts: Path, amp_run: tuple[nn.Module, torch.optim.Optimizer, torch.amp.GradScaler]) -> Path:
    return save(ckpts / "amp.ckpt", lightning_layout(*amp_run))


@pytest.fixture(scope="module")
def amp_plain(ckpts: Path, amp_run: tuple[nn.Module, torch.optim.Optimizer, torch.amp.GradScaler]) -> Path:
    model, opt, scaler = amp_run
    return save(
        ckpts / "amp_plain.pt",
        {"model_state_dict": model.state_dict(), "optimizer_state_dict": opt.state_dict(), "scaler": scaler.state_dict(), "epoch": 3},
    )


# -- globs on dotted-name boundaries -------------------------------------------------------------


@pytest.mark.parametrize(
    ("pattern", "name", "hit"),
    [
        ("lm_head.*", "lm_head.weight", True),
        ("lm_head.*", "model.lm_head.weight", True),
        ("lm_head.*", "state_dict.model.lm_head.weight", True),
        ("lm_head.*", "my_lm_head.weight", False),
        ("^lm_head.*", "lm_head.weight", True),
        ("^lm_head.*", "model.lm_head.weight", False),
        ("num_batches_tracked", "layer1.0.bn1.num_batches_tracked", True),
        ("num_batches_tracked", "not_num_batches_tracked", False),
        ("bias", "fc.bias", True),
        ("bias", "fcbias", False),
        ("layers.*.attn", "model.layers.3.attn", True),
        ("layers.*.attn", "model.layers.3.attn.q", False),
        ("*.running_var", "a.b.running_var", True),
        ("ln_?.weight", "transformer.h.0.ln_1.weight", True),
        ("[!x]y.w", "a.zy.w", True),
        ("[!x]y.w", "a.xy.w", False),
        ("a[*]b", "x.a*b", True),
        ("re:lm_head", "model.my_lm_head.weight", True),  # regexes are searched, unchanged
        ("re:^lm_head", "model.lm_head.weight", False),
    ],
)
def test_glob_matches_on_dotted_boundaries(pattern: str, name: str, hit: bool) -> None:
    assert compile_matcher(pattern)(name) is hit


GLOB_CHARS = st.text(alphabet="ab.*?[]!", min_size=1, max_size=7)
NAMES = st.text(alphabet="ab.", max_size=10)


@settings(max_examples=400, deadline=None)
@given(pattern=GLOB_CHARS, name=NAMES, anchored=st.booleans())
def test_glob_is_fnmatch_on_any_dotted_tail(pattern: str, name: str, anchored: bool) -> None:
    """The law: an unanchored glob matches iff fnmatch matches the name or a tail after one of its dots."""
    text = "^" + pattern if anchored else pattern
    starts = [0] if anchored else [0] + [i + 1 for i, c in enumerate(name) if c == "."]
    assert compile_matcher(text)(name) is any(fnmatch.fnmatchcase(name[s:], pattern) for s in starts)


class _CountedPattern:
    """A compiled pattern that counts the matches tried with it (re.Pattern's methods cannot be patched)."""

    def __init__(self, pattern: re.Pattern[str]) -> None:
        self.pattern, self.tries = pattern, 0

    def fullmatch(self, *args: Any) -> re.Match[str] | None:
        self.tries += 1
        return self.pattern.fullmatch(*args)

    def search(self, *args: Any) -> re.Match[str] | None:
        self.tries += 1
        return self.pattern.search(*args)


@pytest.mark.parametrize(
    ("pattern", "hit"),
    [("layers.*.weight", False), ("layers.*.bias", True), ("layers.0.weight", False), ("l?yers.*.bias", True), ("*.bias", True)],
)
def test_glob_cost_does_not_grow_with_the_dots_of_a_hostile_name(pattern: str, hit: bool) -> None:
    """One start position is tried per glob, so a name of 200k segments costs one fnmatch, not 200k."""
    name = "layers." * 200_000 + "bias"
    matcher = compile_matcher(pattern)
    counted = _CountedPattern(matcher.regex)
    assert dataclasses.replace(matcher, regex=counted)(name) is hit  # type: ignore[arg-type]
    assert counted.tries <= 1


def test_explain_shows_the_tail_a_glob_matched_and_the_rule_when_none_did(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(
        "default: any\nrules:\n  - name: head\n    match: lm_head.*\n    dtype: float32\n  - match: ^lm_head.*\n    dtype: fp16\n"
    )
    pol = load_policy(str(path))
    t = TensorRecord("state_dict.model.lm_head.weight", "float32", (4, 4), 64)
    text = explain_render.render(pol, t)
    assert "✓ head: matches (lm_head.* matches 'lm_head.weight' after the 'state_dict.model.' prefix), expects float32" in text
    miss = explain_render.render(pol, TensorRecord("model.my_lm_head.weight", "float32", (4, 4), 64))
    assert "name does not match lm_head.*" in miss and "a leading ^ anchors it at the start" in miss
    assert miss.splitlines()[-1] == "verdict: float32 passes"


# -- integer tensors never meet a floating-only rule ----------------------------------------------


def test_a_floating_rule_never_holds_an_integer_tensor(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(
        "check_integers: true\nrules:\n"
        "  - module: '*Norm*'\n    dtype: float32\n"
        "  - match: num_batches_tracked\n    dtype: int64\n"
        "  - match: mask\n    dtype: any\n"
    )
    pol = load_policy(str(path))
    counter = TensorRecord("bn.num_batches_tracked", "int64", (), 8, module="BatchNorm2d")
    d = decide(pol, counter)
    assert d.rule is not None and d.rule.index == 1 and d.ok
    assert "name no integer type" in (pol.rules[0].why_not(counter) or "")
    assert decide(pol, TensorRecord("mask", "bool", (3,), 3)).rule is pol.rules[2]  # "any" covers every dtype
    wrong = TensorRecord("bn.num_batches_tracked", "int32", (), 4, module="BatchNorm2d")
    assert not decide(pol, wrong).ok  # a rule that names an integer dtype still checks integers


@pytest.mark.parametrize(("preset", "dtype"), [("fp16-mixed", torch.float16), ("bf16-mixed", torch.bfloat16)])
def test_mixed_presets_pass_a_batchnorm_model_with_model(tmp_path: Path, preset: str, dtype: torch.dtype) -> None:
    """With --model, the norm-module rule used to catch the int64 num_batches_tracked of every BatchNorm."""
    model = half_with_fp32_batchnorms(resnet(), dtype)
    assert runs(model, image(dtype))
    path = save(tmp_path / "m.pt", {"state_dict": model.state_dict()})
    report = run_scan(path, load_policy(preset), model=f"{HERE}:resnet")
    inv = report.checkpoints[0].inventory
    assert inv is not None and inv.by_name()["state_dict.stem.1.num_batches_tracked"].module == "BatchNorm2d"
    assert report.findings == []


# -- optimizer state by region, under any key ----------------------------------------------------


OPTIMIZER_KEYS: list[Callable[[dict[str, Any]], dict[str, Any]]] = [
    lambda o: {"optimizer_state_dict": o},  # the PyTorch tutorial
    lambda o: {"optimizer": o},
    lambda o: {"optim": o},
    lambda o: {"optimizer_states": [o]},  # Lightning
    lambda o: {"trainer": {"opt": o}},
]


@pytest.mark.parametrize("where", range(len(OPTIMIZER_KEYS)))
@pytest.mark.parametrize(("preset", "dtype"), [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_release_presets_leave_optimizer_state_wherever_it_is(tmp_path: Path, preset: str, dtype: torch.dtype, where: int) -> None:
    model = resnet()
    opt, _ = train_step(model)
    model.to(dtype)
    assert runs(model, image(dtype))
    path = save(tmp_path / "t.pt", {"epoch": 1, "model_state_dict": model.state_dict(), **OPTIMIZER_KEYS[where](opt.state_dict())})
    inv = read_checkpoint(path)
    assert {t.region for t in inv.tensors if "exp_avg" in t.name} == {"optimizer"}
    assert check(inv, load_policy(preset)) == []


def test_tutorial_checkpoint_scans_clean_where_it_should(tutorial: Path) -> None:
    """An fp32 training checkpoint: fp32 and amp-training pass it; the half-weight presets fail its weights only."""
    for preset in ("fp32", "amp-training"):
        assert run_scan(tutorial, load_policy(preset)).findings == [], preset
    for preset in ("fp16", "fp16-mixed", "bf16", "bf16-mixed"):
        findings = run_scan(tutorial, load_policy(preset)).findings
        assert findings and all(f.tensor and f.tensor.startswith("model_state_dict.") for f in findings), preset


@pytest.mark.parametrize(("preset", "to"), [("fp16", "fp16"), ("bf16", "bf16"), ("fp16-mixed", "fp16"), ("bf16-mixed", "bf16")])
def test_a_converted_tutorial_checkpoint_passes_its_own_preset(tutorial: Path, tmp_path: Path, preset: str, to: str) -> None:
    """The issue's "33 errors": the presets looked for optimizer state by key name, and optimizer_state_dict. is no such name."""
    from dtypeaudit.conversion import convert

    out = tmp_path / f"tutorial.{preset}.pt"
    convert(str(tutorial), to, output=out, policy=load_policy(preset))
    assert run_scan(out, load_policy(preset)).findings == []
    loaded = torch.load(out, weights_only=True)
    model = ResNetish()
    model.load_state_dict(loaded["model_state_dict"], assign=True)
    assert runs(model, image(model.stem[0].weight.dtype))


# -- the AMP preset ------------------------------------------------------------------------------


def test_gradscaler_state_is_what_amp_training_describes() -> None:
    """The preset's header names the real GradScaler's state_dict keys; those are numbers, not tensors."""
    state = torch.amp.GradScaler("cpu").state_dict()
    header = (ROOT / "configs" / "amp-training.yaml").read_text()
    assert set(state) == {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"}
    assert all(key in header for key in state)
    assert not any(isinstance(v, torch.Tensor) for v in state.values())


@pytest.mark.parametrize("fixture", ["amp_lightning", "amp_plain"])
def test_an_amp_checkpoint_passes_amp_training_and_fails_the_half_presets_pointing_to_it(
    fixture: str, request: pytest.FixtureRequest
) -> None:
    path: Path = request.getfixturevalue(fixture)
    inv = read_checkpoint(path)
    assert {t.dtype for t in inv.tensors if t.region == "model"} == {"float32", "int64"}  # AMP saves fp32 weights
    assert run_scan(path, load_policy("amp-training")).findings == []
    for preset in ("fp16-mixed", "bf16-mixed", "fp16-weights-fp32-norms", "bf16-weights-fp32-norms"):
        failing = [f for f in run_scan(path, load_policy(preset)).findings if f.severity == "error"]
        assert failing, preset
        assert all("amp-training" in f.message for f in failing), [f.message for f in failing if "amp-training" not in f.message]
        assert not any("exp_avg" in (f.tensor or "") for f in failing)  # its fp32 optimizer state is what these presets want


def test_half_weights_fail_amp_training_pointing_to_the_half_presets(tmp_path: Path) -> None:
    model = half_with_fp32_batchnorms(resnet())
    opt, _ = train_step(resnet())
    path = save(tmp_path / "half.ckpt", {"state_dict": model.state_dict(), "optimizer_states": [opt.state_dict()]})
    failing = run_scan(path, load_policy("amp-training")).findings
    assert failing and all("fp16-weights-fp32-norms" in f.message for f in failing)
    assert all(f.tensor and f.tensor.startswith("state_dict.") for f in failing)


def test_preset_listing_tells_the_half_presets_from_lightnings_mixed_precision() -> None:
    listed = {p.name: p for p in presets()}
    assert {"fp32", "fp16", "bf16", "amp-training", "fp16-weights-fp32-norms", "bf16-weights-fp32-norms"} <= set(listed)
    for alias, target in (("fp16-mixed", "fp16-weights-fp32-norms"), ("bf16-mixed", "bf16-weights-fp32-norms")):
        assert listed[alias].alias_of == target
        assert load_policy(alias).rules == load_policy(target).rules
    for name in ("fp16-mixed", "bf16-mixed", "fp16-weights-fp32-norms", "bf16-weights-fp32-norms"):
        text = listed[name].description
        assert "not Lightning's" in text and "keeps fp32 weights" in text and "use amp-training" in text, text
    assert "fp32 master weights" in listed["amp-training"].description
    out = run_cli("policy", "presets").stdout.splitlines()
    assert [line.split()[0] for line in out][-2:] == ["bf16-mixed", "fp16-mixed"]  # aliases last
    assert any(line.startswith("fp16-mixed") and "not Lightning's" in line for line in out)


# -- no silent no-ops: unused rules --------------------------------------------------------------


def write_policy(tmp_path: Path, text: str, name: str = "policy.yaml") -> Policy:
    path = tmp_path / name
    path.write_text(text)
    return load_policy(str(path))


@pytest.fixture(scope="module")
def gpt2_wrapped(ckpts: Path) -> Path:
    return save(ckpts / "gpt2.ckpt", {"state_dict": {f"model.{k}": v for k, v in gpt2().state_dict().items()}})


def unused(report: Report) -> list[Finding]:
    return [f for f in report.findings if f.rule == "unused-rule"]


def test_the_readme_head_rule_now_finds_a_wrapped_head(gpt2_wrapped: Path, tmp_path: Path) -> None:
    pol = write_policy(tmp_path, "default: any\nrules:\n  - name: head-fp32\n    match: 'lm_head.*'\n    dtype: float32\n")
    inv = read_checkpoint(gpt2_wrapped)
    d = decide(pol, inv.by_name()["state_dict.model.lm_head.weight"])
    assert d.rule is not None and d.rule.name == "head-fp32"
    assert unused(run_scan(gpt2_wrapped, pol)) == []


def test_unused_rules_name_the_rule_and_why(gpt2_wrapped: Path, tmp_path: Path) -> None:
    pol = write_policy(
        tmp_path,
        "default: any\nrules:\n"
        "  - name: anchored-head\n    match: '^lm_head.*'\n    dtype: float32\n"  # the checkpoint wraps it in state_dict.model.
        "  - match: '*.weight'\n    dtype: any\n"
        "  - name: shadowed\n    match: 'wte.weight'\n    dtype: float32\n"
        "  - name: norms\n    module: '*LayerNorm*'\n    dtype: float32\n"
        "  - name: mlps\n    module: 'GPT2MLP'\n    dtype: float32\n"  # no tensor sits directly under a GPT2MLP
        "  - name: maybe\n    match: lora_*\n    dtype: float32\n    optional: true\n"
        "ignore: ['ema.*']\n",
    )
    messages = [f.message for f in unused(run_scan(gpt2_wrapped, pol))]
    assert len(messages) == 4, messages
    assert messages[0].startswith("rule anchored-head (match: ^lm_head.*) matches no tensor in ") and "^ anchors" in messages[0]
    assert messages[1].startswith("rule shadowed (match: wte.weight) matches 1 tensor(s), but rule 2 (policy.yaml:6) comes first")
    # Without --model the norms rule still applies: the LayerNorms' type is guessed from their weight and bias.
    assert messages[2].startswith("rule mlps (module: GPT2MLP) matches no tensor in ")
    assert "without --model, module types are guessed from names and shapes (BatchNorm, LayerNorm, RMSNorm" in messages[2]
    assert messages[3] == f"ignore pattern 'ema.*' matches no tensor in {gpt2_wrapped}; it ignores nothing"
    # With --model, the module types are the model's own (and the rules before are still reported).
    with_model = unused(run_scan(gpt2_wrapped, pol, model=f"{HERE}:gpt2"))
    assert [m.message.split(" (")[0].split(" matches")[0] for m in with_model] == [
        "rule anchored-head",
        "rule shadowed",
        "rule mlps",
        "ignore pattern 'ema.*'",
    ]
    assert "guessed" not in with_model[2].message


def test_a_module_rule_with_no_type_known_or_guessed_is_unused(tmp_path: Path) -> None:
    path = save(tmp_path / "loose.pt", {"scale": torch.ones(3), "offsets": torch.zeros(2, 5, 5, 5, 5, 5)})
    pol = write_policy(tmp_path, "default: any\nrules:\n  - name: norms\n    module: '*Norm*'\n    dtype: float32\n")
    (finding,) = unused(run_scan(path, pol))
    assert "selects by module type, but no tensor's module type is known or can be guessed from names and shapes" in finding.message


def test_module_rules_see_guessed_types_everywhere_without_model(tutorial: Path, tmp_path: Path) -> None:
    """Without --model, a module: rule sees the type the structure guesses, in scan, check(), --explain and
    unused-rule alike, and the guess is shown as one; with --model the model's own type decides."""
    pol = write_policy(
        tmp_path,
        "default: float32\nrules:\n  - name: bn-half\n    module: 'BatchNorm*'\n    dtype: float16\n"
        "  - name: linear-half\n    module: Linear\n    dtype: float16\n",
    )
    bn = "model_state_dict.layer1.1.downsample.1.running_var"  # a BatchNorm inside a Sequential: no name says so
    report = run_scan(tutorial, pol)
    failing = {f.tensor for f in report.findings if f.rule == "dtype-mismatch"}
    assert bn in failing and "model_state_dict.fc.weight" in failing and unused(report) == []
    assert {f.tensor for f in check(read_checkpoint(tutorial), pol) if f.rule == "dtype-mismatch"} == failing
    inv = report.checkpoints[0].inventory
    assert inv is not None and (inv.by_name()[bn].module, inv.by_name()[bn].module_guess) == (None, "BatchNorm")
    text = explain_render.render(pol, inv.by_name()[bn])
    assert "module type guessed from names and shapes: BatchNorm" in text.splitlines()[0]
    assert "✓ bn-half: matches (module type guessed from names and shapes: BatchNorm), expects float16" in text
    proc = run_cli("scan", str(tutorial), "--policy", str(tmp_path / "policy.yaml"), "-f", "json")
    tensors = {t["name"]: t for t in json.loads(proc.stdout)["checkpoints"][0]["tensors"]}
    assert (tensors[bn]["module"], tensors[bn]["module_guess"]) == (None, "BatchNorm")
    assert tensors["optimizer_state_dict.state.0.exp_avg"]["module_guess"] is None
    # With --model the type is the model's own; a guess is given only for types that are not PyTorch's.
    with_model = run_scan(tutorial, pol, model=f"{HERE}:resnet").checkpoints[0].inventory
    assert with_model is not None and (with_model.by_name()[bn].module, with_model.by_name()[bn].module_guess) == ("BatchNorm2d", None)


def test_integer_only_rules_without_check_integers_are_unused(tutorial: Path, tmp_path: Path) -> None:
    pol = write_policy(tmp_path, "default: any\nrules:\n  - name: counters\n    match: num_batches_tracked\n    dtype: int64\n")
    assert sum(isinstance(m, nn.BatchNorm2d) for m in resnet().modules()) == 6
    (finding,) = unused(run_scan(tutorial, pol))
    assert "matches only 6 integer/bool tensor(s), which are not checked without check_integers: true" in finding.message


def test_unused_is_decided_across_the_run_and_reported_once(gpt2_wrapped: Path, tutorial: Path, tmp_path: Path) -> None:
    pol = write_policy(
        tmp_path,
        "default: any\nrules:\n  - name: head\n    match: lm_head.*\n    dtype: float32\n"
        "  - name: stats\n    match: running_var\n    dtype: float32\n  - name: nowhere\n    match: nothing.here\n    dtype: any\n",
    )
    report = run_scan(gpt2_wrapped, pol, more=(tutorial,))  # head is only in the first, stats only in the second
    assert [f.message.split(" (")[0] for f in report.findings] == ["rule nowhere"]
    assert "any of the 2 checkpoints scanned" in report.findings[0].message
    assert report.checkpoints[0].findings and not report.checkpoints[1].findings
    broken = tmp_path / "broken.pt"
    broken.write_bytes(b"not a checkpoint")
    report = scan([str(broken), str(tutorial)], checks=checks_for(pol), policy=pol, jobs=1)
    assert report.checkpoints[0].error and [f.rule for f in report.checkpoints[1].findings] == ["unused-rule"] * 2


def test_presets_never_report_their_own_rules(tutorial: Path, gpt2_wrapped: Path) -> None:
    for name in (p.name for p in presets()):
        assert unused(run_scan(tutorial, load_policy(name), more=(gpt2_wrapped,))) == [], name


def test_an_extending_policy_reports_only_its_own_rules(tutorial: Path, tmp_path: Path) -> None:
    pol = write_policy(tmp_path, "extends: fp16-mixed\nrules:\n  - name: head\n    match: lm_head.*\n    dtype: float32\n")
    assert [f.message.split(" (")[0] for f in unused(run_scan(tutorial, pol))] == ["rule head"]


def test_unused_rule_in_json_and_exit_codes(tutorial: Path, tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text("default: any\nrules:\n  - name: head\n    match: lm_head.*\n    dtype: float32\n")
    proc = run_cli("scan", str(tutorial), "--policy", str(path), "-f", "json")
    assert proc.returncode == 0, proc.stderr
    (finding,) = json.loads(proc.stdout)["checkpoints"][0]["findings"]
    assert (finding["rule"], finding["severity"], finding["tensor"]) == ("unused-rule", "warning", None)
    assert finding["message"].startswith("rule head (match: lm_head.*) matches no tensor in ")
    assert run_cli("scan", str(tutorial), "--policy", str(path), "--fail-on", "warning").returncode == 1


# -- --model: wrapper prefixes, and a mismatch is an error ---------------------------------------


def sd(prefix: str = "") -> dict[str, torch.Tensor]:
    return {prefix + k: v for k, v in resnet().state_dict().items()}


@pytest.mark.parametrize(
    ("name", "obj"),
    [
        ("tutorial", lambda: {"model_state_dict": sd(), "epoch": 1}),
        ("lightning", lambda: {"state_dict": sd("model.")}),
        ("ddp", lambda: sd("module.")),
        ("compiled-ddp", lambda: {"model": sd("module._orig_mod.")}),
        ("nested-dicts", lambda: {"model": {"module": {"_orig_mod": sd()}}}),
        ("ema-copy", lambda: {"model": sd(), "ema": sd()}),
        ("under-a-prefix", lambda: {"encoder": sd()}),
    ],
)
def test_model_attaches_through_wrappers(tmp_path: Path, name: str, obj: Callable[[], object]) -> None:
    inv = factory.attach(read_checkpoint(save(tmp_path / f"{name}.pt", obj())), factory.inventory(f"{HERE}:resnet"))
    assert all(t.module for t in inv.tensors), [t.name for t in inv.tensors if not t.module]
    assert "model-mismatch" not in rules_of(inv.findings)
    bn = next(t for t in inv.tensors if t.name.endswith("layer1.1.downsample.1.running_var"))
    assert (bn.kind, bn.module) == ("buffer", "BatchNorm2d")


@pytest.mark.parametrize(("factory_name", "prefix"), [("lit", "net."), ("backbone", "backbone.")])
def test_model_attaches_when_the_factory_adds_a_prefix(tmp_path: Path, factory_name: str, prefix: str) -> None:
    """A LightningModule factory (self.net) against a bare state_dict, and a rewrite: encoder. read as backbone."""
    for obj in (sd(), {"state_dict": sd()}, {"encoder": sd()}):
        inv = factory.attach(read_checkpoint(save(tmp_path / "x.pt", obj)), factory.inventory(f"{HERE}:{factory_name}"))
        assert all(t.module for t in inv.tensors) and not inv.findings, (obj.keys(), prefix)


def test_a_model_whose_names_do_not_match_is_an_error_with_the_closest_prefix(tutorial: Path) -> None:
    assert len(resnet().state_dict()) == 39
    inv = factory.attach(read_checkpoint(tutorial), factory.inventory(f"{HERE}:unrelated"))
    (finding,) = inv.findings
    assert (finding.rule, finding.severity) == ("model-mismatch", "error")
    assert finding.message == (
        f"--model {HERE}:unrelated: its names match 0 of the 39 model tensors in this checkpoint (0%); kinds and module rules "
        "apply to those only. Closest prefix: stripping 'model_state_dict.stem.' matches 4 name(s), none with the model's shape. "
        "Checkpoint names look like 'model_state_dict.stem.0.weight', the model's like '0.weight'; "
        "is it the model this checkpoint was saved from?"
    )
    assert not any(t.module for t in inv.tensors)  # a name that matches with another shape attaches nothing


def test_model_mismatch_through_the_cli(tutorial: Path) -> None:
    proc = run_cli("scan", str(tutorial), "--model", f"{HERE}:gpt2", "-f", "json", cwd=ROOT, env={"PYTHONPATH": str(ROOT)})
    assert proc.returncode == 1
    findings = json.loads(proc.stdout)["checkpoints"][0]["findings"]
    assert [f["rule"] for f in findings] == ["model-mismatch"]
    assert "match 0 of the 39 model tensors" in findings[0]["message"]


def test_a_partial_match_under_half_is_a_mismatch(tmp_path: Path) -> None:
    state = sd()
    state.update({f"head{i}.weight": torch.zeros(3) for i in range(len(state) + 1)})  # more tensors the model lacks than it has
    inv = factory.attach(read_checkpoint(save(tmp_path / "p.pt", state)), factory.inventory(f"{HERE}:resnet"))
    assert rules_of(inv.findings) == {"model-mismatch"} and "match 39 of the 79" in inv.findings[0].message


# -- the README's policy examples, as written ----------------------------------------------------


def readme_policies() -> dict[str, str]:
    """Every ```yaml block of the Policies page (docs/policies.md), by the file name its first comment gives."""
    section = (ROOT / "docs" / "policies.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```yaml\n(.*?)```", section, flags=re.S)
    out = {}
    for block in blocks:
        first = re.match(r"# (\S+\.yaml)\b", block)
        assert first, f"a README policy example must start with '# NAME.yaml ...': {block[:80]!r}"
        out[first.group(1)] = block
    return out


def header(block: str) -> str:
    return " ".join(line.lstrip("# ") for line in block.splitlines() if line.startswith("#") and ":" not in line[:2]).replace("  ", " ")


def policy_from_readme(tmp_path: Path, name: str) -> Policy:
    path = tmp_path / name
    path.write_text(readme_policies()[name])
    return load_policy(str(path))


WRAPPERS = ("state_dict", "model_state_dict")


def wrapped(tmp_path: Path, key: str, state: dict[str, torch.Tensor], **more: object) -> Path:
    return save(tmp_path / f"{key}.pt", {key: state, **more})


def assert_clean(report: Report) -> None:
    assert report.findings == [], [(f.rule, f.tensor, f.message) for f in report.findings]


def test_readme_has_exactly_the_examples_this_file_runs() -> None:
    assert set(readme_policies()) == {"policy.yaml", "gpt2-release.yaml", "amp-resume.yaml"}


@pytest.mark.parametrize("key", WRAPPERS)
def test_readme_reference_policy(tmp_path: Path, key: str) -> None:
    block = readme_policies()["policy.yaml"]
    assert "passes a ResNet-style CNN whose convolutions and classifier are float16 and whose BatchNorm layers are float32" in header(block)
    assert "fails the same CNN after model.half()" in header(block)
    pol = policy_from_readme(tmp_path, "policy.yaml")
    good = half_with_fp32_batchnorms(resnet())
    assert runs(good, image(torch.float16))
    assert_clean(run_scan(wrapped(tmp_path, key, good.state_dict()), pol, model=f"{HERE}:resnet"))
    naive = resnet().half()
    report = run_scan(wrapped(tmp_path, key, naive.state_dict()), pol, model=f"{HERE}:resnet")
    failing = {f.tensor for f in report.findings if f.rule == "dtype-mismatch"}
    assert failing and all(re.search(r"\.(bn\d|1|downsample\.1)\.(weight|bias|running_mean|running_var)$", t or "") for t in failing)
    assert unused(report) == []


@pytest.mark.parametrize("key", WRAPPERS)
def test_readme_gpt2_release_policy(tmp_path: Path, key: str) -> None:
    block = readme_policies()["gpt2-release.yaml"]
    assert "passes a GPT-2 in bfloat16 whose LayerNorms are float32" in header(block)
    assert "fails the same model saved entirely in bfloat16" in header(block)
    pol = policy_from_readme(tmp_path, "gpt2-release.yaml")
    good = gpt2().to(torch.bfloat16)
    for m in good.modules():
        if isinstance(m, nn.LayerNorm):
            m.float()
    assert runs(good, torch.tensor([[1, 2, 3]]))
    assert_clean(run_scan(wrapped(tmp_path, key, good.state_dict()), pol))
    report = run_scan(wrapped(tmp_path, key, gpt2().to(torch.bfloat16).state_dict()), pol)
    failing = {f.tensor for f in report.findings}
    assert failing and all(re.search(r"\.ln_(\d|f)\.(weight|bias)$", t or "") for t in failing)
    assert rules_of(report.findings) == {"dtype-mismatch"}


@pytest.mark.parametrize("layout", ["lightning", "tutorial"])
def test_readme_amp_resume_policy(
    tmp_path: Path, layout: str, amp_run: tuple[nn.Module, torch.optim.Optimizer, torch.amp.GradScaler]
) -> None:
    block = readme_policies()["amp-resume.yaml"]
    text = header(block)
    assert "passes a checkpoint of an AMP training run" in text and "fails one whose weights were cast to float16" in text
    assert "warns (unused-rule) when the optimizer state is missing" in text
    pol = policy_from_readme(tmp_path, "amp-resume.yaml")
    model, opt, scaler = amp_run
    key = "state_dict" if layout == "lightning" else "model_state_dict"
    optimizer = {"optimizer_states": [opt.state_dict()]} if layout == "lightning" else {"optimizer_state_dict": opt.state_dict()}
    assert_clean(run_scan(wrapped(tmp_path, key, model.state_dict(), **optimizer, scaler=scaler.state_dict()), pol))
    half = {k: v.half() if v.is_floating_point() else v for k, v in model.state_dict().items()}
    failing = run_scan(wrapped(tmp_path, key, half, **optimizer), pol).findings
    assert failing and all(f.rule == "dtype-mismatch" and "master-weights-fp32" in f.message for f in failing)
    report = run_scan(wrapped(tmp_path, key, model.state_dict()), pol)
    assert [f.rule for f in report.findings] == ["unused-rule"] and "adam-moments" in report.findings[0].message
    assert report.findings[0].severity == "warning"


def test_readme_examples_validate_through_the_cli(tmp_path: Path) -> None:
    for name, block in readme_policies().items():
        (tmp_path / name).write_text(block)
        proc = run_cli("policy", "validate", str(tmp_path / name))
        assert proc.returncode == 0, proc.stderr
