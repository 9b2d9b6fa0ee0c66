"""convert agrees with scan and with PyTorch: every preset and option on real checkpoints (issue 10).

For each conversion in the matrix: what convert writes passes ``scan`` with the same policy (exit 0), and
the model loads it (``load_state_dict(assign=True)``, so the file's dtypes are what runs) and runs a forward
pass on CPU with an input of the dtype its first layer holds. Where convert refuses, nothing is written and
the reason is given. No cell may write an output whose forward pass fails: convert refuses to make what scan
would only warn of (``dtype-outlier`` without ``--model``), so a ``warned`` verdict fails the matrix.
The full cross product runs with ``pytest -m slow``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from dtypeaudit import exitcodes
from dtypeaudit.checks import checks_for
from dtypeaudit.conversion import Result, convert
from dtypeaudit.inventory import severity_rank
from dtypeaudit.pipeline import scan
from dtypeaudit.policy import Policy, load_policy, preset_names

from . import consistency_models as cm
from .helpers import run_cli

MODELS_PY = Path(cm.__file__).resolve()
# What PyTorch says when two dtypes meet in one op on CPU (torch 2.13).
DTYPE_ERROR = re.compile(r"same dtype|expected scalar type|mixed dtype|should be the same|Input type .* and (weight|bias) type")


# -- the checkpoints ----------------------------------------------------------------------------------


@dataclass
class Subject:
    """A checkpoint as users have them, and how its model runs what convert wrote."""

    name: str
    source: Path
    load: Callable[[Path], nn.Module]
    """The model with the converted file's tensors assigned as they are (their dtypes, not the model's)."""
    run: Callable[[nn.Module], torch.Tensor]
    """A forward pass with an input of the dtype the first layer holds."""
    factory: str
    norm: str
    """A --keep pattern that holds a normalisation layer."""
    head: str
    """A --keep pattern that holds one compute layer's weight."""
    taint: str
    """A tensor whose values --keep-unsafe / --clamp act on in the tainted copies."""
    training: bool = False
    tainted: dict[str, Path] = field(default_factory=dict)


def _resnet_input(model: nn.Module) -> torch.Tensor:
    first = model.conv1.weight
    return torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1)).to(first.dtype)


def _run_resnet(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(_resnet_input(model))  # type: ignore[no-any-return]


def _run_lm(model: nn.Module) -> torch.Tensor:
    ids = torch.tensor([[1, 2, 3, 4, 5]])  # an embedding's input is its indices, int64 whatever its dtype
    with torch.no_grad():
        return model(ids).logits  # type: ignore[no-any-return]


def _unwrap(state: dict[str, Any], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}


def _assign(model: nn.Module, state: dict[str, torch.Tensor], *, tied: tuple[str, ...] = ()) -> nn.Module:
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    assert set(missing) <= set(tied) and not unexpected, (missing, unexpected)
    if tied:
        model.tie_weights()  # type: ignore[operator]
    return model.eval()


def _load_dir(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        state |= load_file(str(f))
    return state


def _trained_resnet() -> tuple[cm.ResNet, torch.optim.Adam]:
    """A ResNet after one real Adam step: running statistics and moments that are not their initial values."""
    torch.manual_seed(0)
    model = cm.resnet()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss = model(torch.randn(4, 3, 32, 32)).logsumexp(1).mean()
    loss.backward()
    opt.step()
    return model.eval(), opt


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("consistency")


def _taint_pt(src: Path, dest: Path, name: str, value: float) -> Path:
    def put(holder: dict[str, Any], key: str) -> None:
        if key in holder:
            holder[key] = torch.full_like(holder[key], value)
        else:
            head, _, rest = key.partition(".")
            put(holder[head], rest)

    state = torch.load(src, weights_only=False)  # our own fixture
    put(state, name)
    torch.save(state, dest)
    return dest


def _taint_dir(src: Path, dest: Path, name: str, value: float) -> Path:
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dest)
    for f in dest.glob("*.safetensors"):
        state = load_file(str(f))
        if name in state:
            state[name] = torch.full_like(state[name], value)
            save_file(state, str(f), metadata={"format": "pt"})
    return dest


def _tainted(subject: Subject, work: Path) -> Subject:
    """Copies whose ``taint`` tensor underflows float16 (1e-9: --keep-unsafe) or overflows it (1e5: --clamp)."""
    taint = _taint_dir if subject.source.is_dir() else _taint_pt
    for kind, value in (("underflow", 1e-9), ("overflow", 1e5)):
        dest = work / f"{subject.name}-{kind}{subject.source.suffix}"
        if not dest.exists():
            taint(subject.source, dest, subject.taint, value)
        subject.tainted[kind] = dest
    return subject


def _resnet_subject(work: Path) -> Subject:
    model, _ = _trained_resnet()
    path = work / "resnet.pt"
    torch.save(model.state_dict(), path)
    return _tainted(
        Subject(
            "resnet",
            path,
            lambda out: _assign(cm.resnet(), torch.load(out, weights_only=True)),
            _run_resnet,
            f"{MODELS_PY}:resnet",
            norm="*bn1.*",
            head="fc.weight",
            taint="layer1.0.bn1.running_var",
        ),
        work,
    )


def _gpt2_pt_subject(work: Path) -> Subject:
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = cm.gpt2().eval()
    path = work / "gpt2.bin"
    torch.save(model.state_dict(), path)  # lm_head.weight and transformer.wte.weight: one storage
    return _tainted(
        Subject(
            "gpt2-tied-pt",
            path,
            lambda out: _assign(cm.gpt2(), torch.load(out, weights_only=True)),
            _run_lm,
            f"{MODELS_PY}:gpt2",
            norm="*ln_f.*",
            head="*.0.mlp.c_proj.weight",
            taint="transformer.h.0.ln_1.bias",
        ),
        work,
    )


def _gpt2_dir_subject(work: Path) -> Subject:
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    path = work / "gpt2-dir"
    cm.gpt2().eval().save_pretrained(path, max_shard_size="40KB")  # sharded, with an index and a config
    return _tainted(
        Subject(
            "gpt2-dir",
            path,
            lambda out: _assign(cm.gpt2(), _load_dir(out), tied=("lm_head.weight",)),
            _run_lm,
            f"{MODELS_PY}:gpt2",
            norm="*ln_f.*",
            head="*.0.mlp.c_proj.weight",
            taint="transformer.h.0.ln_1.bias",
        ),
        work,
    )


def _llama_subject(work: Path) -> Subject:
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    path = work / "llama-dir"
    cm.llama().eval().save_pretrained(path)
    return _tainted(
        Subject(
            "llama-dir",
            path,
            lambda out: _assign(cm.llama(), _load_dir(out)),
            _run_lm,
            f"{MODELS_PY}:llama",
            norm="*norm*",
            head="*.0.mlp.down_proj.weight",
            taint="model.layers.0.mlp.down_proj.weight",
        ),
        work,
    )


def _tutorial_subject(work: Path) -> Subject:
    """The PyTorch tutorial's "saving and loading a general checkpoint", after a real Adam step."""
    model, opt = _trained_resnet()
    path = work / "tutorial.tar"
    torch.save({"epoch": 5, "model_state_dict": model.state_dict(), "optimizer_state_dict": opt.state_dict(), "loss": 0.4}, path)
    return _tainted(
        Subject(
            "tutorial",
            path,
            lambda out: _assign(cm.resnet(), torch.load(out, weights_only=True)["model_state_dict"]),
            _run_resnet,
            f"{MODELS_PY}:resnet",
            norm="*bn1.*",
            head="*.fc.weight",
            taint="model_state_dict.layer1.0.bn1.running_var",
            training=True,
        ),
        work,
    )


def real_lightning() -> Any:
    """lightning itself: tests/conftest.py stands in empty modules for it when it pickles an AttributeDict first."""
    mod = sys.modules.get("lightning")
    if mod is not None and not hasattr(mod, "Trainer"):
        for name in [n for n in sys.modules if n == "lightning" or n.startswith("lightning.")]:
            if getattr(sys.modules[name], "__file__", None) is None:
                del sys.modules[name]
    return pytest.importorskip("lightning", reason="pip install lightning to test real Lightning checkpoints")


def lit_module_class() -> type:
    L = real_lightning()

    class LitResNet(L.LightningModule):  # type: ignore[misc,name-defined]
        def __init__(self, lr: float = 1e-3) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.net = cm.resnet()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)  # type: ignore[no-any-return]

        def training_step(self, batch: Any, _: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.cross_entropy(self(x), y)

        def validation_step(self, batch: Any, _: int) -> None:
            x, y = batch
            self.log("val_loss", nn.functional.cross_entropy(self(x), y))

        def configure_optimizers(self) -> Any:
            opt = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1)}

    LitResNet.__module__ = __name__
    LitResNet.__qualname__ = "LitResNet"
    globals()["LitResNet"] = LitResNet  # load_from_checkpoint and pickling find it here
    return LitResNet


def lit_data() -> torch.utils.data.DataLoader[Any]:
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 10, (8,), generator=g))
    return torch.utils.data.DataLoader(data, batch_size=4)


def lit_trainer(root: Path, **kw: Any) -> Any:
    import logging
    import warnings

    L = real_lightning()
    warnings.filterwarnings("ignore", module="lightning")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    return L.Trainer(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(root),
        **kw,
    )


def _lightning_subject(work: Path) -> Subject:
    lit = lit_module_class()
    torch.manual_seed(0)
    trainer = lit_trainer(work / "lit-root", max_epochs=1)
    trainer.fit(lit(), lit_data())
    path = work / "epoch=0-step=2.ckpt"
    trainer.save_checkpoint(path)
    trainer.save_checkpoint(work / "weights-only.ckpt", weights_only=True)
    return _tainted(
        Subject(
            "lightning",
            path,
            lambda out: _assign(cm.resnet(), _unwrap(torch.load(out, weights_only=False)["state_dict"], "net.")),
            _run_resnet,
            f"{MODELS_PY}:resnet",
            norm="*bn1.*",
            head="*.fc.weight",
            taint="state_dict.net.layer1.0.bn1.running_var",
            training=True,
        ),
        work,
    )


BUILDERS: dict[str, Callable[[Path], Subject]] = {
    "resnet": _resnet_subject,
    "gpt2-tied-pt": _gpt2_pt_subject,
    "gpt2-dir": _gpt2_dir_subject,
    "llama-dir": _llama_subject,
    "tutorial": _tutorial_subject,
    "lightning": _lightning_subject,
}
_SUBJECTS: dict[str, Subject] = {}


@pytest.fixture
def subject(request: pytest.FixtureRequest, work: Path) -> Subject:
    name = request.param
    if name not in _SUBJECTS:
        _SUBJECTS[name] = BUILDERS[name](work)
    return _SUBJECTS[name]


# -- the verdict of one conversion ---------------------------------------------------------------------

CUSTOM_FIXABLE = """\
version: 1
default: {target}
rules:
  - region: optimizer
    dtype: any
  - match: ["*.running_mean", "*.running_var"]
    dtype: float32
  - ndim: "<=1"
    dtype: [{target}, float32]
"""
"""A policy the plan has to work for: statistics fp32 and 1-D tensors either way, so each BatchNorm goes fp32 whole."""

CUSTOM_HEAD_FP32 = """\
version: 1
default: {target}
rules:
  - region: optimizer
    dtype: any
  - match: ["lm_head.*", "fc.*", "*.fc.*"]
    dtype: float32
    reason: the output projection in fp32
"""
"""The README's head-in-fp32 rule: where the head is tied to the embedding, the policy demands both ways."""


def policy_for(spec: str | None, target: str, work: Path) -> Policy | None:
    if spec is None:
        return None
    if spec.startswith("custom-"):
        text = {"custom-fixable": CUSTOM_FIXABLE, "custom-head-fp32": CUSTOM_HEAD_FP32}[spec]
        path = work / f"{spec}-{target}.yaml"
        path.write_text(text.format(target=target))
        return load_policy(str(path))
    return load_policy(spec)


def target_of(policy: Policy | None, default: str = "float16") -> str:
    if policy is not None and policy.default is not None and len(policy.default) == 1:
        (only,) = policy.default
        if only in ("float16", "bfloat16", "float32"):
            return only
    return default


@dataclass(frozen=True)
class Outcome:
    verdict: str
    """``runs`` (written, scan passes, the forward pass runs), ``refused`` (nothing written), or ``warned``
    (written, scan passes with a dtype-outlier warning, and the forward pass fails as warned): what convert
    must no longer do, so no cell expects it."""
    result: Result
    detail: str = ""


def outcome(subject: Subject, spec: str | None, variant: str, work: Path, *, target: str | None = None) -> Outcome:
    if spec is None or spec.startswith("custom-"):
        to = target or "float16"
        policy = policy_for(spec, to, work)
    else:
        policy = policy_for(spec, "", work)
        to = target or target_of(policy)
    source = (
        subject.tainted["underflow"] if variant == "keep-unsafe" else subject.tainted["overflow"] if variant == "clamp" else subject.source
    )
    options: dict[str, Any] = {
        "keep": (subject.norm,) if variant == "keep-norm" else (subject.head,) if variant == "keep-head" else (),
        "keep_unsafe": variant == "keep-unsafe",
        "clamp": variant == "clamp",
        "include_optimizer": variant == "include-optimizer",
        "strip_optimizer": variant == "strip-optimizer",
        "model": subject.factory if variant == "model" else None,
    }
    out = work / f"out-{subject.name}-{spec}-{variant}-{to}{'' if source.is_dir() else source.suffix}"
    if out.is_dir():
        shutil.rmtree(out)
    out.unlink(missing_ok=True)
    result = convert(source, to, output=out, policy=policy, **options)
    if result.output is None:
        assert result.blocked and not out.exists(), "a refusal writes nothing"
        reasons = [f"{f.rule}: {f.tensor}" for f in (*result.refused, *result.failed)] + [s.name for s in result.unsafe]
        assert reasons, "a refusal says why"
        return Outcome("refused", result, "; ".join(reasons[:3]))
    # What scan says of the output, with the same policy (and the same --model).
    report = scan([str(out)], checks=checks_for(policy), model=options["model"], fail_on=(policy.fail_on if policy else None) or "error")
    failing = [f for f in report.findings if severity_rank(f.severity) >= severity_rank(report.fail_on)]
    assert exitcodes.for_report(report) == exitcodes.CLEAN, f"convert wrote what scan fails: {failing[:3]}"
    assert not any(f.rule in ("tied-dtype-conflict", "config-dtype-mismatch", "module-dtype-mix") for f in report.findings), report.findings
    warned = [f for f in report.findings if f.rule == "dtype-outlier"]
    model = subject.load(out)
    try:
        y = subject.run(model)
    except RuntimeError as exc:
        assert DTYPE_ERROR.search(str(exc)), f"the forward pass failed for another reason: {exc}"
        assert warned, f"the forward pass fails ({exc}) but scan of the output warned of nothing"
        return Outcome("warned", result, str(exc))
    if variant != "clamp":  # a saturated value may overflow on its way through the model; it must still run
        assert torch.isfinite(y.float()).all(), "the converted model computes NaN/Inf"
    return Outcome("runs", result)


# -- the matrix ------------------------------------------------------------------------------------------

ALL_SUBJECTS = list(BUILDERS)
VARIANTS = ["plain", "keep-norm", "keep-head", "keep-unsafe", "clamp", "model", "include-optimizer", "strip-optimizer"]
TRAINING_ONLY = {"include-optimizer", "strip-optimizer"}
FP32_NORM_PRESETS = {"fp16-mixed", "bf16-mixed", "fp16-weights-fp32-norms", "bf16-weights-fp32-norms"}


def expected(subject: str, spec: str | None, variant: str, target: str) -> str:
    """What each cell comes to, and why where it is not ``runs``. Never ``warned``: convert refuses an output whose
    forward pass would fail (a float32 Linear, or a float32 LlamaRMSNorm, in a half model) rather than write it."""
    if spec == "fp8-serving":
        return "refused"  # convert does not quantize: every subject is unquantized (no-quantized-weights)
    if target == "float32":
        return "runs"  # amp-training and fp32: nothing narrows, nothing mixes
    if subject == "gpt2-dir" and spec in FP32_NORM_PRESETS:
        # from_pretrained casts every weight to config.json's dtype (GPT-2 keeps no module in float32), so the
        # LayerNorms written float32 would load half and fail the preset as loaded: convert refuses to write it.
        return "refused"
    everything_in_target = spec in ("fp16", "bf16", "custom-head-fp32")  # the default holds norms to the target too
    if variant == "include-optimizer" and target == "float16" and spec not in FP32_NORM_PRESETS:
        # Adam's exp_avg_sq underflows float16: the value check refuses (bfloat16 keeps them; the mixed presets
        # keep optimizer state float32, so nothing of it is cast)
        return "refused"
    if variant == "keep-norm":
        if everything_in_target:
            return "refused"  # the policy wants the kept norm in the target
        if subject == "llama-dir":
            # LlamaRMSNorm returns weight * x.to(input_dtype): a kept float32 norm would make the stream float32 and
            # the next half Linear fail, so convert refuses (dtype-outlier); the fp32-norm presets also want it half.
            return "refused"
        return "runs"  # an all-float32 BatchNorm or LayerNorm takes a half input and returns it
    if variant == "keep-head":
        # A float32 Linear in a half model refuses the half input ('mat1 and mat2 must have the same dtype'): the
        # policy wants that weight in the target, or convert refuses to write it (dtype-outlier, held by --keep).
        return "refused"
    if variant == "keep-unsafe" and target == "float16":
        if everything_in_target:
            return "refused"  # the unsafe tensor's module is kept float32 whole, which the policy forbids
        if subject == "llama-dir":
            return "refused"  # down_proj kept float32: a Linear that would refuse the half stream (or against the policy)
    if spec == "custom-head-fp32":
        if subject == "gpt2-dir":
            return "runs"  # save_pretrained drops the tied lm_head: the rule matches nothing
        # The .bin ties lm_head to wte: one storage the policy wants both ways (tied-dtype-conflict). Elsewhere the
        # float32 head (fc, lm_head) is a Linear that would refuse the half stream: convert refuses (dtype-outlier).
        return "refused"
    # Everything else runs, the Llama-style model under the fp32-norm presets included: its weight-only RMSNorms
    # take the weights' dtype (rms-norms-*), only BatchNorm/LayerNorm/GroupNorm/InstanceNorm stay float32.
    return "runs"


def cells() -> list[Any]:
    presets: list[str | None] = [None, *preset_names(), "custom-fixable", "custom-head-fp32"]
    out = []
    for s in ALL_SUBJECTS:
        for spec in presets:
            for variant in VARIANTS:
                if variant in TRAINING_ONLY and s not in ("tutorial", "lightning"):
                    continue
                core = variant == "plain" or (spec in (None, "fp16-weights-fp32-norms", "custom-fixable") and variant != "clamp")
                marks = [] if core else [pytest.mark.slow]
                out.append(pytest.param(s, spec, variant, id=f"{s}-{spec or 'no-policy'}-{variant}", marks=marks))
    return out


@pytest.mark.parametrize(("subject", "spec", "variant"), cells(), indirect=["subject"])
def test_matrix(subject: Subject, spec: str | None, variant: str, work: Path) -> None:
    got = outcome(subject, spec, variant, work)
    target = got.result.plan.target
    assert got.verdict == expected(subject.name, spec, variant, target), got.detail


@pytest.mark.parametrize("subject", ["resnet", "gpt2-tied-pt", "llama-dir"], indirect=True)
@pytest.mark.parametrize("to", ["float16", "bfloat16"])
def test_no_policy_targets(subject: Subject, to: str, work: Path) -> None:
    assert outcome(subject, None, "plain", work, target=to).verdict == "runs"


# -- what the plan says and does ---------------------------------------------------------------------------


def _resnet(work: Path) -> Subject:
    if "resnet" not in _SUBJECTS:
        _SUBJECTS["resnet"] = _resnet_subject(work)
    return _SUBJECTS["resnet"]


def _gpt2_pt(work: Path) -> Subject:
    if "gpt2-tied-pt" not in _SUBJECTS:
        _SUBJECTS["gpt2-tied-pt"] = _gpt2_pt_subject(work)
    return _SUBJECTS["gpt2-tied-pt"]


def test_keep_keeps_the_module_whole_and_says_so(work: Path, tmp_path: Path) -> None:
    src = _resnet(work).source
    out = tmp_path / "kept.pt"
    proc = run_cli("convert", str(src), "--to", "fp16", "--keep", "layer1.0.bn1.weight", "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    assert (
        "note: kept layer1.0.bn1.bias, layer1.0.bn1.running_mean, layer1.0.bn1.running_var with layer1.0.bn1.weight: "
        "a BatchNorm's weight, bias and running statistics must share a dtype" in proc.stdout
    )
    got = torch.load(out, weights_only=True)
    assert {got[f"layer1.0.bn1.{leaf}"].dtype for leaf in ("weight", "bias", "running_mean", "running_var")} == {torch.float32}
    assert got["conv1.weight"].dtype == torch.float16
    assert run_cli("scan", str(out)).returncode == 0
    assert torch.isfinite(_run_resnet(_assign(cm.resnet(), got)).float()).all()  # an all-fp32 BatchNorm takes fp16 input


def test_keep_that_would_break_the_forward_pass_is_refused(work: Path, tmp_path: Path) -> None:
    """--keep fc.weight keeps the Linear whole, in float32; PyTorch's Linear refuses the float16 input, so convert
    writes nothing, guess or fact, and says which module, why, and what holds it."""
    src = _resnet(work).source
    for model in ((), ("--model", f"{MODELS_PY}:resnet")):
        out = tmp_path / f"kept{len(model)}.pt"
        proc = run_cli("convert", str(src), "--to", "fp16", "--keep", "fc.weight", *model, "-o", str(out))
        assert proc.returncode == 1 and not out.exists(), proc.stdout + proc.stderr
        assert len(proc.stderr.splitlines()) == 1 and "(1 finding, 1 cause); the report on stdout says why" in proc.stderr
        assert "error: dtype-outlier: fc:" in proc.stdout  # the report says why
        assert "is float32 in a float16 model" in proc.stdout and "mat1 and mat2 must have the same dtype" in proc.stdout
        if not model:  # scan would only warn of this guess; convert, which would be making it, refuses
            assert "convert does not write an output whose forward pass would fail (held by fc.weight: --keep fc.weight" in proc.stdout
            assert "the planned output would not run (1 finding); nothing was written" in proc.stdout
    # What it refuses to write is what PyTorch refuses to run.
    state = {k: v.half() if v.is_floating_point() and not k.startswith("fc.") else v for k, v in torch.load(src, weights_only=True).items()}
    with pytest.raises(RuntimeError, match="same dtype"):
        _run_resnet(_assign(cm.resnet(), state))


def test_llama_under_the_fp32_norm_presets_runs_and_scans_clean(tmp_path: Path) -> None:
    """A transformers Llama (weight-only LlamaRMSNorm) converted with fp16-mixed / bf16-mixed: its RMSNorms take the
    weights' dtype, so from_pretrained loads it, it runs on CPU, and scan with the preset passes it, with or without
    --model. A GPT-2 folder under the same presets is refused: from_pretrained would load its LayerNorms half."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    llama_src, gpt2_src = tmp_path / "llama", tmp_path / "gpt2"
    cm.llama().eval().save_pretrained(llama_src)
    cm.gpt2().eval().save_pretrained(gpt2_src)
    for preset, to, dtype in (("fp16-mixed", "fp16", torch.float16), ("bf16-mixed", "bf16", torch.bfloat16)):
        policy = load_policy(preset)
        for model in (None, f"{MODELS_PY}:llama"):
            out = tmp_path / f"llama-{preset}-{bool(model)}"
            result = convert(llama_src, to, output=out, policy=policy, model=model)
            assert result.output == out, [f.message for f in result.failed]
            report = scan([str(out)], checks=checks_for(policy), model=model, policy=policy)
            found = [f for f in report.findings if f.rule != "left-out"]  # generation_config.json: no weights in it
            assert found == [], [(f.rule, f.tensor, f.message) for f in found]
            loaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype="auto").eval()
            norms = [m for m in loaded.modules() if type(m).__name__ == "LlamaRMSNorm"]
            assert len(norms) == 5 and {n.weight.dtype for n in norms} == {dtype}
            assert {p.dtype for p in loaded.parameters()} == {dtype}
            logits = _run_lm(loaded)
            assert logits.dtype == dtype and torch.isfinite(logits.float()).all()
            assert torch.isfinite(_run_lm(_assign(cm.llama(), _load_dir(out))).float()).all()  # the file's own dtypes
        # What the preset asks of the RMSNorms, and why, as --explain shows it.
        explained = run_cli("scan", str(llama_src), "--preset", preset, "--explain", "model.layers.0.input_layernorm.weight")
        assert "module type guessed from names and shapes: RMSNorm" in explained.stdout
        assert (
            f"✓ rms-norms-{to}: matches (module type guessed from names and shapes: RMSNorm), expects {dtype}".replace("torch.", "")
            in explained.stdout
        )
        # A GPT-2 folder under the same presets: from_pretrained would cast its float32 LayerNorms to config.json's
        # half dtype (GPT-2 keeps no module in float32), so the model it builds fails the preset: refused, nothing written.
        out = tmp_path / f"gpt2-{preset}"
        refused = convert(gpt2_src, to, output=out, policy=policy)
        assert refused.output is None and not out.exists()
        assert {f.rule for f in refused.failed} == {"dtype-mismatch"}
        assert all("as from_pretrained loads it; stored as float32" in f.message for f in refused.failed)


def test_an_fp32_llama_rmsnorm_in_a_half_model_is_an_error_with_model(tmp_path: Path) -> None:
    """The old fp16-mixed output: LlamaRMSNorm kept float32 in a float16 Llama. PyTorch fails its forward; scan warns
    without --model (a guess) and, with --model, knows it (the factory measures LlamaRMSNorm's forward): an error."""
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = cm.llama().eval().half()
    for m in model.modules():
        if type(m).__name__ == "LlamaRMSNorm":
            m.float()
    with pytest.raises(RuntimeError, match="same dtype"):
        _run_lm(model)
    path = tmp_path / "llama.pt"
    torch.save(model.state_dict(), path)
    guessed = [f for f in scan([str(path)], checks=checks_for(None)).findings if f.rule == "dtype-outlier"]
    assert guessed and {f.severity for f in guessed} == {"warning"}
    known = [f for f in scan([str(path)], checks=checks_for(None), model=f"{MODELS_PY}:llama").findings if f.rule == "dtype-outlier"]
    assert {f.tensor for f in known} == {f.tensor for f in guessed} and {f.severity for f in known} == {"error"}
    assert "LlamaRMSNorm (module type from the model, its forward measured on the meta device) is float32 in a float16 model" in (
        known[0].message
    )
    assert "returns float32 for float16 input" in known[0].message


def test_batchnorm_in_a_sequential_goes_whole(work: Path) -> None:
    bn = "layer2.0.downsample.1"
    leaves = ("weight", "bias", "running_mean", "running_var")
    got = outcome(_resnet(work), "fp16-weights-fp32-norms", "plain", work)
    assert got.verdict == "runs"
    by = {p.tensor.name: p for p in got.result.plan.tensors}
    # downsample.1 is a BatchNorm no name rule finds; the structure guesses its type from its running statistics,
    # and the preset's module rule keeps it fp32 whole.
    assert {by[f"{bn}.{leaf}"].target for leaf in leaves} == {"float32"}
    assert by[f"{bn}.weight"].reason == "policy: norm-modules-fp32 expects float32"
    assert by["layer2.0.downsample.0.weight"].target == "float16"
    # A policy that holds only the statistics to fp32 (and allows 1-D tensors either way): the plan keeps the
    # BatchNorm whole, and says so.
    got = outcome(_resnet(work), "custom-fixable", "plain", work)
    assert got.verdict == "runs"
    by = {p.tensor.name: p for p in got.result.plan.tensors}
    assert {by[f"{bn}.{leaf}"].target for leaf in leaves} == {"float32"}
    assert any(
        f"{bn}.weight" in n and "a BatchNorm's weight, bias and running statistics must share a dtype" in n for n in got.result.plan.notes
    )


def test_keep_unsafe_keeps_the_whole_module(work: Path) -> None:
    got = outcome(_resnet(work), None, "keep-unsafe", work)
    assert got.verdict == "runs"
    by = {p.tensor.name: p for p in got.result.plan.tensors}
    bn = "layer1.0.bn1"
    assert by[f"{bn}.running_var"].reason == "unsafe values kept at full precision (--keep-unsafe)"
    assert {by[f"{bn}.{leaf}"].target for leaf in ("weight", "bias", "running_mean", "running_var")} == {"float32"}
    assert by["layer1.0.bn2.weight"].target == "float16"


def _policy_file(tmp_path: Path, text: str) -> Policy:
    path = tmp_path / "policy.yaml"
    path.write_text(text)
    return load_policy(str(path))


def test_tied_tensors_are_decided_together(work: Path, tmp_path: Path) -> None:
    src = _gpt2_pt(work).source
    # The policy allows the embedding either way: the head's float32 wins for both names of the one storage.
    policy = _policy_file(
        tmp_path,
        'version: 1\ndefault: float16\nrules:\n  - match: "lm_head.*"\n    dtype: float32\n'
        '  - match: "*.wte.*"\n    dtype: [float16, float32]\n',
    )
    out = tmp_path / "tied.bin"
    result = convert(src, "fp16", output=out, policy=policy, dry_run=True)
    assert "kept transformer.wte.weight with lm_head.weight: tied tensors are one storage and take one dtype" in result.plan.notes
    by = {p.tensor.name: p.target for p in result.plan.tensors}
    assert by["lm_head.weight"] == by["transformer.wte.weight"] == "float32" and by["transformer.h.0.attn.c_attn.weight"] == "float16"
    assert not any(f.rule == "tied-dtype-conflict" for f in result.failed)
    # But a float32 embedding feeds float32 activations to the float16 blocks: PyTorch refuses that forward pass,
    # so convert writes nothing and names the embedding.
    planned = {k: v.to(getattr(torch, by[k])) for k, v in torch.load(src, weights_only=True).items()}
    with pytest.raises(RuntimeError, match=DTYPE_ERROR):
        _run_lm(_assign(cm.gpt2(), planned))
    assert result.failed and {f.rule for f in result.failed} == {"dtype-outlier"}
    assert any(f.tensor == "transformer.wte" and "float32 in a float16 model" in f.message for f in result.failed)
    assert convert(src, "fp16", output=out, policy=policy).output is None and not out.exists()
    # A policy that wants float32 for one name and float16 for the other cannot be met: refused, nothing written.
    strict = _policy_file(tmp_path, 'version: 1\ndefault: float16\nrules:\n  - match: "lm_head.*"\n    dtype: float32\n')
    refused = convert(src, "fp16", output=tmp_path / "no.bin", policy=strict)
    assert refused.output is None and not (tmp_path / "no.bin").exists()
    assert {f.rule for f in refused.failed} >= {"tied-dtype-conflict"}


def test_config_dtype_follows_the_weights(work: Path, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    if "gpt2-dir" not in _SUBJECTS:
        _SUBJECTS["gpt2-dir"] = _gpt2_dir_subject(work)
    src = _SUBJECTS["gpt2-dir"].source
    for preset, to, want in (("fp16", "fp16", "float16"), ("bf16", "bf16", "bfloat16"), ("fp32", "fp32", "float32")):
        out = tmp_path / f"gpt2-{preset}"
        result = convert(src, to, output=out, policy=load_policy(preset))
        assert result.output == out and result.plan.config_dtype == want
        assert json.loads((out / "config.json").read_text())["dtype"] == want
        findings = scan([str(out)], checks=checks_for(load_policy(preset))).findings
        assert not [f for f in findings if f.rule == "config-dtype-mismatch"], findings
        # The dtype from_pretrained picks by itself ("auto" reads config.json) runs the model.
        model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype="auto").eval()
        assert model.transformer.wte.weight.dtype == getattr(torch, want)
        assert torch.isfinite(_run_lm(model).float()).all()


def test_plan_failure_is_reported_in_json_and_exit_1(work: Path, tmp_path: Path) -> None:
    src = _resnet(work).source
    out = tmp_path / "x.pt"
    proc = run_cli("convert", str(src), "--to", "fp16", "--preset", "fp16", "--keep", "fc.weight", "-o", str(out), "-f", "json")
    assert proc.returncode == 1 and not out.exists()
    doc = json.loads(proc.stdout)
    assert doc["refused"] and {(f["rule"], f["tensor"]) for f in doc["plan_failures"]} == {
        ("dtype-mismatch", "fc.weight"),
        ("dtype-mismatch", "fc.bias"),
        ("dtype-outlier", "fc"),  # and a float32 Linear in a float16 model would not run
    }
    dry = run_cli("convert", str(src), "--to", "fp16", "--preset", "fp16", "--keep", "fc.weight", "--dry-run")
    assert dry.returncode == 1 and "the planned output fails scan or would not run (3 findings)" in dry.stdout
    # A refusal only the policy makes: kept whole, an fp32 BatchNorm runs, but the fp16 preset wants it fp16.
    dry = run_cli("convert", str(src), "--to", "fp16", "--preset", "fp16", "--keep", "*.bn1.*", "--dry-run")
    assert dry.returncode == 1 and "the planned output fails scan with the same policy (" in dry.stdout


def test_convert_model_option_uses_module_types(work: Path, tmp_path: Path) -> None:
    src = _resnet(work).source
    out = tmp_path / "typed.pt"
    proc = run_cli(
        "convert", str(src), "--to", "bf16", "--preset", "bf16-weights-fp32-norms", "--model", f"{MODELS_PY}:resnet", "-o", str(out)
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert run_cli("scan", str(out), "--preset", "bf16-weights-fp32-norms", "--model", f"{MODELS_PY}:resnet").returncode == 0
    model = _assign(cm.resnet(), torch.load(out, weights_only=True))
    assert model.layer2[0].downsample[1].weight.dtype == torch.float32  # a norm module by type, not by name
    assert torch.isfinite(_run_resnet(model).float()).all()


# -- everyday gaps -----------------------------------------------------------------------------------------


def hf_cache(root: Path, repo_id: str, files: dict[str, bytes], revision: str = "0123456789abcdef0123456789abcdef01234567") -> Path:
    """A Hugging Face cache laid out by huggingface_hub's own helpers, as hf_hub_download leaves it: content in
    ``blobs/<sha256>``, ``snapshots/<revision>/<file>`` relative links to them, ``refs/main`` naming the revision."""
    import hashlib

    from huggingface_hub.file_download import _create_symlink, repo_folder_name

    repo = root / repo_folder_name(repo_id=repo_id, repo_type="model")
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    snapshot = repo / "snapshots" / revision
    for name, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        os.chmod(blob, 0o644)
        (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
        _create_symlink(str(blob), str(snapshot / name), new_blob=False)
    return snapshot


def test_convert_from_a_hugging_face_cache_snapshot(work: Path, tmp_path: Path) -> None:
    huggingface_hub = pytest.importorskip("huggingface_hub")
    pytest.importorskip("transformers")
    if "gpt2-dir" not in _SUBJECTS:
        _SUBJECTS["gpt2-dir"] = _gpt2_dir_subject(work)
    src = _SUBJECTS["gpt2-dir"].source
    files = {p.name: p.read_bytes() for p in sorted(src.iterdir()) if p.is_file()}
    files["onnx/README.md"] = b"exported elsewhere\n"
    cache = tmp_path / "hub"
    snapshot = hf_cache(cache, "org/tiny-gpt2", files)
    # huggingface_hub itself reads this cache as a complete snapshot, offline.
    assert Path(huggingface_hub.snapshot_download("org/tiny-gpt2", cache_dir=cache, local_files_only=True)) == snapshot
    assert all((snapshot / name).is_symlink() for name in files)
    out = tmp_path / "gpt2-fp16"
    proc = run_cli("convert", str(snapshot), "--to", "fp16", "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    for p in out.rglob("*"):
        assert not p.is_symlink(), p  # the output holds the files, not links into someone's cache
    assert (out / "onnx" / "README.md").read_bytes() == b"exported elsewhere\n"
    assert run_cli("scan", str(out)).returncode == 0
    assert torch.isfinite(_run_lm(_assign(cm.gpt2(), _load_dir(out), tied=("lm_head.weight",))).float()).all()
    # A link that leads anywhere but the cache's blobs is still refused, whatever file it is.
    secret = tmp_path / "secret.txt"
    secret.write_text("not yours")
    (snapshot / "notes.txt").symlink_to(secret)
    proc = run_cli("convert", str(snapshot), "--to", "fp16", "-o", str(tmp_path / "leak"))
    assert proc.returncode == 2 and "leads outside the directory" in proc.stderr and not (tmp_path / "leak").exists()
    (snapshot / "notes.txt").unlink()
    shard = next(n for n in files if n.endswith(".safetensors"))
    (snapshot / shard).unlink()
    (snapshot / shard).symlink_to(tmp_path / "elsewhere.safetensors")
    shutil.copy(src / shard, tmp_path / "elsewhere.safetensors")
    proc = run_cli("convert", str(snapshot), "--to", "fp16", "-o", str(tmp_path / "leak2"))
    assert proc.returncode == 2 and "leads outside the directory" in proc.stderr


def test_directory_keeps_file_modes(work: Path, tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    if "gpt2-dir" not in _SUBJECTS:
        _SUBJECTS["gpt2-dir"] = _gpt2_dir_subject(work)
    src = tmp_path / "modes"
    shutil.copytree(_SUBJECTS["gpt2-dir"].source, src)
    (src / "tokenizer.json").write_text("{}")
    (src / "scripts").mkdir()
    (src / "scripts" / "run.sh").write_text("#!/bin/sh\n")
    modes = {"config.json": 0o600, "tokenizer.json": 0o640, "scripts/run.sh": 0o750, "model.safetensors.index.json": 0o604}
    shard_modes = {p.name: 0o640 if i % 2 else 0o600 for i, p in enumerate(sorted(src.glob("*.safetensors")))}
    for name, mode in {**modes, **shard_modes}.items():
        os.chmod(src / name, mode)
    os.chmod(src, 0o750)
    out = tmp_path / "modes-fp16"
    assert convert(src, "fp16", output=out).output == out
    for name, mode in {**modes, **shard_modes}.items():
        assert stat.S_IMODE((out / name).stat().st_mode) == mode, name
    assert stat.S_IMODE(out.stat().st_mode) == 0o750


def test_strip_optimizer_on_a_real_lightning_checkpoint(work: Path, tmp_path: Path) -> None:
    lit = lit_module_class()
    if "lightning" not in _SUBJECTS:
        _SUBJECTS["lightning"] = _lightning_subject(work)
    src = _SUBJECTS["lightning"].source
    out = tmp_path / "release.ckpt"
    result = convert(src, "fp16", output=out, strip_optimizer=True, policy=load_policy("fp16-weights-fp32-norms"))
    assert result.output == out
    assert any("Trainer.fit(ckpt_path=...) cannot resume from it" in n for n in result.plan.notes)
    got = torch.load(out, weights_only=False)
    own = torch.load(work / "weights-only.ckpt", weights_only=False)  # what Lightning writes with save_weights_only=True
    assert set(got) == set(own), set(got) ^ set(own)
    assert got["loops"] == torch.load(src, weights_only=False)["loops"]
    # What Lightning does with it: load_from_checkpoint and validate(ckpt_path=...) work, ...
    assert lit.load_from_checkpoint(out).net.fc.weight.shape == (10, 16)
    lit_trainer(tmp_path / "v").validate(lit(), lit_data(), ckpt_path=str(out))
    # ... and fit(ckpt_path=...) refuses it exactly as it refuses its own weights-only checkpoint.
    for path in (out, work / "weights-only.ckpt"):
        with pytest.raises(KeyError, match="save_weights_only"):
            lit_trainer(tmp_path / "f", max_epochs=2).fit(lit(), lit_data(), ckpt_path=str(path))
    assert torch.isfinite(_run_resnet(_SUBJECTS["lightning"].load(out)).float()).all()


def test_strip_optimizer_finds_training_state_under_any_key(tmp_path: Path) -> None:
    model, opt = _trained_resnet()
    scaler = torch.amp.GradScaler("cpu")
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    src = tmp_path / "amp.pt"
    torch.save(
        {
            "model": model.state_dict(),
            "train": {"optim": opt.state_dict(), "scaler": scaler.state_dict(), "sched": sched.state_dict(), "step": 7},
        },
        src,
    )
    out = tmp_path / "release.pt"
    result = convert(src, "fp16", output=out, strip_optimizer=True)
    assert result.output == out
    got = torch.load(out, weights_only=True)
    assert got["train"] == {"step": 7} and set(got) == {"model", "train"}
    assert "stripped 'train.optim', 'train.scaler', 'train.sched' (--strip-optimizer)" in result.plan.notes
    assert torch.isfinite(_run_resnet(_assign(cm.resnet(), got["model"])).float()).all()
