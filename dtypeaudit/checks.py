"""Inventory x Policy -> findings. Pure functions; no I/O.

Some checks need no policy: modules whose dtypes PyTorch's kernels refuse (within a module, or against the
model's dominant dtype; see ``structure`` for how modules are found), and a Hugging Face config.json whose
dtype disagrees with the weights.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING, Literal

from . import dtypes, kernels, structure
from .formats.training import is_training_state
from .inventory import Finding, Format, Inventory, TensorRecord
from .quant.hints import might_be_quantized
from .structure import Module

if TYPE_CHECKING:  # the policy module (and YAML) load only when a policy is in use
    from .policy import Decision, Policy

Check = Callable[[Inventory], list[Finding]]

# What a loader might read differently from dtypeaudit: harmless for ordinary files, fatal for a security gate.
STRICT_RULES = frozenset({"loader-divergence", "foreign-global", "trailing-data", "unused-weights"})
STRICT_MARKER = " (strict)"


def _expected_text(expected: frozenset[str] | None) -> str:
    return "any dtype" if expected is None else " or ".join(sorted(expected))


def decision_message(d: Decision) -> str:
    origin = f"rule {d.rule.label}" if d.rule else "the policy's default"
    what = f"{d.tensor.dtype} (quantized {d.tensor.scheme})" if d.tensor.scheme else d.tensor.dtype
    expected = "no tensor here" if d.expected is not None and not d.expected else _expected_text(d.expected)
    text = f"is {what}, expected {expected} ({origin})"
    if d.rule and d.rule.reason:
        text += f": {d.rule.reason}"
    return text


def logical(inv: Inventory) -> Inventory:
    """``inv`` as the loaded model holds it: each quantized logical weight one tensor in the dtype it dequantizes
    to (``quant.group.policy_records``), its scales and zeros folded into it; ``inv`` itself when nothing is quantized."""
    if not might_be_quantized(inv):  # the usual case: quant/ is not even imported
        return inv
    from .quant.group import policy_records

    records = policy_records(inv)
    return inv if records is inv.tensors else replace(inv, tensors=records)


def as_policies_see_it(inv: Inventory) -> tuple[TensorRecord, ...]:
    """The tensors a policy is checked against: each quantized weight as its logical weight (``logical``), and in a
    Hugging Face folder each tensor under the name and in the dtype ``from_pretrained`` gives it. Scans and
    ``policy init`` alike; in the order of ``logical(inv).tensors``, one for one."""
    if inv.format != Format.HF_DIRECTORY:  # only a folder loads under other names or dtypes: a file's scan skips hfload
        return logical(inv).tensors
    from .formats.hfload import loaded_names

    loaded = loaded_dtype(inv)
    names = loaded_names(inv)
    return tuple(
        t.with_(name=names.get(t.name, t.name), dtype=loaded.get(t.name, t.dtype)) if t.name in loaded or t.name in names else t
        for t in logical(inv).tensors
    )


def policy_findings(inv: Inventory, policy: Policy) -> list[Finding]:
    from .policy import decide

    out = []
    for s, t in zip(logical(inv).tensors, as_policies_see_it(inv), strict=True):
        d = decide(policy, t)
        if not d.ok and not (d.rule is None and is_training_state(s)):  # the default speaks for weights, not a callback's state
            # The stored name is in the load-renamed note and the metadata, not here: findings that share a cause
            # keep one message, so the report folds them into one line.
            cast = f" (as from_pretrained loads it; stored as {s.dtype})" if s.dtype != t.dtype else ""
            out.append(
                Finding(
                    "dtype-mismatch",
                    d.severity,
                    decision_message(d) + cast,
                    tensor=t.name,
                    file=t.file or None,
                    expected=tuple(sorted(d.expected or ())),
                    actual=t.dtype,
                )
            )
    return out


def training_state_findings(inv: Inventory, policy: Policy) -> list[Finding]:
    """A Trainer folder's optimizer state (``optimizer.pt`` beside the weights, kept by its reader), judged by the
    policy's rules that select it (amp-training's ``region: optimizer``): a half Adam moment is a finding. The
    default speaks for weights, as for a callback's state (``policy_findings``)."""
    if inv.format != Format.HF_DIRECTORY:
        return []
    from .formats.training import optimizer_parts
    from .policy import decide

    out = []
    for label, part in optimizer_parts(inv):
        for t in part.tensors:
            d = decide(policy, t.with_(file=label))
            if d.rule is not None and not d.ok:
                expected = tuple(sorted(d.expected or ()))
                out.append(
                    Finding("dtype-mismatch", d.severity, decision_message(d), tensor=t.name, file=label, expected=expected, actual=t.dtype)
                )
    return out


def tied_conflicts(inv: Inventory, policy: Policy) -> list[Finding]:
    """Names that share one storage but whose rules allow no common dtype."""
    from .policy import decide

    out = []
    seen: set[frozenset[str]] = set()
    by = inv.by_name()
    for t in inv.tensors:
        if not t.shares_with:
            continue
        group = frozenset((t.name, *t.shares_with))
        if group in seen:
            continue
        seen.add(group)
        members = [by[n] for n in sorted(group) if n in by]
        if any(m.dtype != members[0].dtype or m.shape != members[0].shape for m in members):
            continue  # a view of a different shape is not a tie
        allowed: frozenset[str] | None = None
        for m in members:
            d = decide(policy, m)
            if d.skipped is None and d.expected is not None:
                allowed = d.expected if allowed is None else allowed & d.expected
        if allowed is not None and not allowed:
            wants = "; ".join(f"{m.name} -> {_expected_text(decide(policy, m).expected)}" for m in members)
            out.append(
                Finding(
                    "tied-dtype-conflict",
                    "error",
                    f"tied tensors share one storage but the policy wants different dtypes: {wants}",
                    tensor=members[0].name,
                )
            )
    return out


# What PyTorch's CPU kernels accept, measured by scripts/measure_kernels.py into dtypeaudit/data/kernels.json per backend
# (torch 2.13). For a module type the table measured, its strictest outcome over every backend decides
# (``kernels.verdict``); these rules are what the table shows, and what guesses from names and shapes follow:
# - Linear, Conv (and transformers' Conv1D): input, weight and bias all in one dtype, else
#   "mat1 and mat2 must have the same dtype" / "Input type ... and bias type ... should be the same";
#   ConvTranspose also takes a bias of another dtype, on AVX2 CPUs for any input dtype, but oneDNN's kernels
#   (AVX-512 for bfloat16 input, AVX-512 FP16 / AMX for float16) refuse it: only float32 input is safe;
# - BatchNorm, LayerNorm, GroupNorm: weight, bias and running statistics in one dtype P; the input must be P,
#   except that an all-float32 norm takes float16 or bfloat16 input and returns the input's dtype. Any other
#   combination fails ("expected scalar type Half but found Float", "mixed dtype (CPU): expect parameter to
#   have scalar type of Float"). InstanceNorm: the same for weight and bias; its statistics may be any dtype;
# - torch.nn.RMSNorm takes any input and returns its dtype; Embedding returns its weight's dtype;
# - transformers' LlamaRMSNorm (and the RMSNorms copied from it, T5LayerNorm ...) returns weight * x.to(input_dtype):
#   a float32 weight makes its output float32 for half input, and the next half Linear fails ("mat1 and mat2 must
#   have the same dtype"); Gemma's and Cohere's cast back and return the input's dtype. With --model, the factory
#   measures each such weight-only norm class's forward on the meta device (``Module.forward``), which settles the
#   output dtype; without it, a weight-only norm is assumed to multiply in its weight's dtype.
# Activations flow in the model's dominant dtype, so a module that does not take it, or hands on another dtype,
# breaks the next layer.
Semantics = Literal["strict", "transpose", "norm", "any", "promote", "embedding", "measured"]
_CRASH = "crash"
_MEASURED = structure.MEASURED_DTYPES

_MIX_REASONS: dict[str, str] = {
    "linear": "weight and bias must share one dtype, so the forward pass fails ('self and mat2 must have the same dtype')",
    "conv": "weight and bias must share one dtype, so the forward pass fails ('Input type ... and bias type ... should be the same')",
    "batchnorm": "weight, bias and running statistics must share one dtype (only an all-float32 BatchNorm takes half input), "
    "so the forward pass fails with 'expected scalar type ... but found ...'",
    "norm": "weight and bias must share one dtype, so the forward pass fails with 'expected scalar type ... but found ...'",
    "rnn": "its weights and biases must share one dtype, so the forward pass fails ('RNN input dtype ... does not match weight "
    "dtype' or 'self and mat2 must have the same dtype')",
}


def _promote(a: str, b: str) -> str:
    if a == b:
        return a
    if {a, b} <= structure.HALF_DTYPES:
        return "float32"
    return max((a, b), key=lambda d: dtypes.get(d).itemsize)


def semantics(m: Module) -> Semantics | None:
    """Which of the measured dtype rules ``m``'s forward follows; None for a module of unknown kind."""
    if m.kind == "rnn":
        return "strict"
    if m.kind in ("linear", "conv"):
        return "transpose" if m.confidence == "fact" and m.type_name in ("ConvTranspose1d", "ConvTranspose2d") else "strict"
    if m.kind == "embedding":
        return "embedding"
    if m.kind == "batchnorm":
        return "norm"
    if m.kind == "norm":
        if m.forward is not None:
            return "measured"
        if m.confidence == "fact":
            return "any" if m.type_name == "RMSNorm" else "norm"
        return _guessed_norm(m)
    return None


def _guessed_norm(m: Module) -> Semantics:
    # A weight-only norm may be an RMSNorm written as weight * x (Hugging Face's), which returns the wider dtype.
    return "norm" if m.leaf("bias") is not None else "promote"


def _settled(m: Module, x: str) -> str | None:
    """What a measured norm's forward returns for input ``x``, where the measurement settles it, else None.

    The meta device computes output dtypes exactly but does not run CPU kernels' dtype checks, so a measured
    output is trusted where it differs from the input (a promotion is certain) and where the weight is the
    input's dtype or float32 (which every measured norm kernel accepts); otherwise the guess decides.
    """
    p = m.dtype
    out = m.forward.get(f"{p}/{x}") if m.forward is not None and p is not None else None
    if out is None or (out == x and p not in (x, "float32")):
        return None
    return out


_TABLE_LEAVES: dict[str, tuple[str, ...]] = {"batchnorm": ("weight", "bias", "stats"), "embedding": ("weight",)}


def table_verdict(m: Module, x: str) -> kernels.Verdict | None:
    """What the kernel table says of ``m``'s forward on input ``x`` over every measured backend, for a module whose
    type ``--model`` gave; None where the table has no row for its dtypes."""
    if m.confidence != "fact" or not m.type_name or m.weight is None:
        return None
    w = m.weight.dtype
    leaves = {"weight": w}
    wanted = _TABLE_LEAVES.get(m.kind, ("weight",) if m.type_name == "RMSNorm" else ("weight", "bias"))
    if m.type_name.startswith(("InstanceNorm", "LazyInstanceNorm")):
        wanted = ("weight", "bias", "stats")
    if "bias" in wanted:
        bias = m.leaf("bias")
        leaves["bias"] = bias.dtype if bias is not None else w  # no bias: nothing to mix with the weight
    if "stats" in wanted:
        stats = {t.dtype for t in (m.leaf("running_mean"), m.leaf("running_var")) if t is not None}
        if len(stats) != 1:
            return None  # no running statistics (batch statistics in eval), or two dtypes: not a measured row
        leaves["stats"] = stats.pop()
    return kernels.verdict(m.type_name, x, leaves)


def backend_note(m: Module, x: str) -> str:
    """``; it raises on ... though it runs on ...`` where backends disagree about ``m`` on input ``x``, else ``""``."""
    v = table_verdict(m, x)
    text = v.disagreement if v is not None else None
    return f"; {text}" if text else ""


def forward_dtype(m: Module, x: str) -> str | None:
    """The dtype ``m`` hands on for input of dtype ``x``, ``"crash"`` if its forward raises, None if unknown.

    For a module type the kernel table measured, the strictest outcome over every backend it was measured on.
    """
    sem = semantics(m)
    found = m.kernel_dtypes
    p = m.dtype
    if sem is None or not found:
        return None
    measured = table_verdict(m, x)
    if measured is not None:
        return _CRASH if measured.result == kernels.RAISE else measured.result
    if sem == "measured":
        settled = _settled(m, x)
        if settled is not None:
            return settled
        sem = _guessed_norm(m)
    if sem == "embedding":
        return p
    if sem == "strict":
        return x if found == {x} else _CRASH
    if sem == "transpose":
        w, b = m.weight, m.leaf("bias")
        ok = w is not None and w.dtype == x and (b is None or b.dtype == x or x == "float32")
        return x if ok else _CRASH
    if p is None:
        return _CRASH  # a norm whose weight, bias and statistics disagree
    if sem == "any":
        return x
    if sem == "promote":
        return _promote(p, x)
    return x if p == x or (p == "float32" and x in structure.HALF_DTYPES) else _CRASH


def certain(m: Module, x: str) -> bool:
    """Whether what ``m`` does with input ``x`` is known (a module type with measured rules, or a forward the
    factory measured) or guessed."""
    if m.confidence != "fact":
        return False
    return _settled(m, x) is not None if semantics(m) == "measured" else semantics(m) != "promote"


def _mix_finding(m: Module, dominant: str | None) -> Finding | None:
    """A module whose own tensors disagree in a way its kernel refuses for the model's input dtype."""
    if len(m.kernel_dtypes) < 2 or (m.kind == "unknown" and not m.prefix):
        return None  # loose tensors at the root are not a module
    inputs = (dominant,) if dominant in _MEASURED else _MEASURED
    reason = _MIX_REASONS.get(m.kind)
    if reason is not None and all(forward_dtype(m, x) != _CRASH for x in inputs):
        return None  # ConvTranspose2d with a float16 bias in a float32 model runs
    listing = ", ".join(f"{structure.split_name(t.name)[1]} {t.dtype}" for t in m.kernel_tensors)
    known = reason is not None and m.confidence != "low"
    notes = "".join(dict.fromkeys(backend_note(m, x) for x in inputs))
    return Finding(
        "module-dtype-mix",
        "error" if known else "warning",
        f"{m.label} ({m.provenance}) mixes floating dtypes ({listing}); "
        + (reason or "its forward fails if it combines them (give --model for module types)")
        + notes,
        tensor=m.prefix,
        file=m.file,
    )


def _outlier_reason(m: Module, p: str, d: str) -> str | None:
    """Why ``m``, all in ``p``, breaks a ``d`` model's forward pass; None if it does not."""
    if semantics(m) == "measured" and _settled(m, d) is not None:
        result = _settled(m, d)
        if result == d:
            return None
        return (
            f"its forward returns {result} for {d} input (measured through --model on the meta device; transformers' "
            f"LlamaRMSNorm and the norms written like it return weight * x.to(input_dtype)), so the next {d} layer "
            "fails ('mat1 and mat2 must have the same dtype')"
        )
    if semantics(m) in ("promote", "measured"):
        if p == "float32" and d in structure.HALF_DTYPES:
            return (
                f"torch's own norms return the input's dtype, but a norm written as weight * x (Hugging Face's RMSNorm) "
                f"returns float32 and the next {d} layer fails"
            )
        wider = _promote(p, d)
        return f"a LayerNorm without bias fails on {d} input; a norm written as weight * x (Hugging Face's RMSNorm) returns {wider}"
    result = forward_dtype(m, d)
    if result is None or result == d:
        return None  # an all-fp32 norm in a half model is fine
    if m.kind in ("linear", "conv"):
        error = "mat1 and mat2 must have the same dtype" if m.kind == "linear" else "Input type ... should be the same"
        return f"it needs its input in its own dtype, so a forward pass that reaches it in {d} fails ('{error}'){backend_note(m, d)}"
    if m.kind == "rnn":
        return f"it needs its input in its own dtype, so {d} input fails ('RNN input dtype ... does not match weight dtype')"
    if m.kind == "embedding":
        return f"it hands {p} activations on, and the next {d} layer fails"
    if result == _CRASH:
        return (
            f"a norm takes only its own dtype as input (an all-float32 norm also takes half input), so {d} input fails "
            f"('mixed dtype (CPU): expect parameter to have scalar type of Float'){backend_note(m, d)}"
        )
    return f"it hands {result} activations on, and the next {d} layer fails"


class _Promoters:
    """What may promote an embedding's output back to the model's dtype (``_promoted_back``), found once per dtype
    rather than by a walk over every module for each outlier (which made a header of many embeddings quadratic)."""

    def __init__(self, modules: list[Module]) -> None:
        self.modules = modules
        self._embeddings: dict[str, list[Module]] = {}
        self._norms: dict[tuple[str, str], Module | None] = {}

    def embeddings(self, d: str) -> list[Module]:
        """The first two embeddings all in ``d``: one that is not a given module is among them."""
        if d not in self._embeddings:
            found: list[Module] = []
            for m in self.modules:
                if m.kind == "embedding" and m.dtype == d:
                    found.append(m)
                    if len(found) == 2:
                        break
            self._embeddings[d] = found
        return self._embeddings[d]

    def norm(self, p: str, d: str) -> Module | None:
        """The first norm that multiplies by its ``d`` weight and returns ``d`` for ``p`` input."""
        if (p, d) not in self._norms:
            self._norms[p, d] = next(
                (
                    n
                    for n in self.modules
                    if n.kind == "norm" and n.dtype == d and semantics(n) in ("measured", "promote") and forward_dtype(n, p) == d
                ),
                None,
            )
        return self._norms[p, d]


def _promoted_back(m: Module, p: str, d: str, promoters: _Promoters) -> str | None:
    """Where an embedding's narrower output (``p`` in a ``d`` model) is promoted back to ``d`` before a kernel that
    needs ``d``: what promotes it, or None.

    Its output meets float32 tensors in most models before a strict kernel: a position embedding added to it (BERT,
    CLIP, Whisper), or a norm computed as ``weight * x`` (LlamaRMSNorm, T5LayerNorm), which returns float32. Where
    neither is in the model (GPT-NeoX: rotary positions, torch's LayerNorm, which hands half input on), it is not.
    The data flow is not in a checkpoint, so this lowers the finding to a warning; ``trace`` knows.
    """
    if m.kind != "embedding" or _promote(p, d) != d:
        return None
    for other in promoters.embeddings(d):
        if other is not m:
            return f"another {d} embedding ({other.name}) it may be added to"
    n = promoters.norm(p, d)
    if n is not None:
        return f"a norm that multiplies by its {d} weight ({n.label} {n.name}) and returns {d}"
    return None


def _outlier_finding(m: Module, dominant: str | None, promoters: _Promoters) -> Finding | None:
    """A module, all in one dtype, that does not take the model's dominant dtype or hands on another one."""
    p = m.dtype
    if dominant not in _MEASURED or p is None or p == dominant:
        return None  # fp8 and fp64 models: their forwards were not measured (fp8 weights need kernels of their own)
    if m.input_cast:
        return None  # its parent casts its input to its dtype (T5's wo, measured through --model): it runs as it is
    reason = _outlier_reason(m, p, dominant)
    if reason is None:
        return None
    sure = certain(m, dominant)
    hint = "" if sure or m.type_name else "; give --model to know the module types"
    promoted = _promoted_back(m, p, dominant, promoters)
    if promoted is not None:
        sure = False
        hint = (
            f"; unless its output meets {promoted} first, which promotes it back to {dominant} (`dtypeaudit trace` follows the data flow)"
        )
    return Finding(
        "dtype-outlier",
        "error" if sure else "warning",
        f"{m.label} ({m.provenance}) is {p} in a {dominant} model: {reason}{hint}",
        tensor=m.prefix,
        file=m.file,
        expected=(dominant,),
        actual=p,
    )


_ALIKE = 1 << 16
"""At most this many kinds of module remembered by ``_alike_outlier`` per check: a million different ones cost no more."""


def _alike_outlier(
    m: Module, dominant: str | None, promoters: _Promoters, alike: dict[tuple[object, ...], Finding | None]
) -> Finding | None:
    """``_outlier_finding(m, ...)``, worked out once per kind of module: what it says depends on the module's kind,
    types, confidence, whether its input is cast, its tensors' leaves, dtypes and layouts, and what promotes an
    embedding's output back (which names another embedding), which repeat layer after layer (a million-tensor header's
    375,000 outliers are a few kinds). An alike module's finding is the first one's with its own tensor and file."""
    p = m.dtype
    if dominant not in _MEASURED or p is None or p == dominant or m.input_cast or m.forward is not None:
        return _outlier_finding(m, dominant, promoters)  # no finding, at once; or a measured forward, its own
    promoted = _promoted_back(m, p, dominant, promoters)
    alike_tensors = m.signature if m.signature is not None else tuple((t.name.rpartition(".")[2], t.dtype, t.layout) for t in m.tensors)
    key = (m.kind, m.type_name, m.confidence, m.guessed_type, promoted, alike_tensors)
    if key in alike:
        first = alike[key]
        if first is None:
            return None
        return Finding(first.rule, first.severity, first.message, m.prefix, m.file, first.expected, first.actual)
    found = _outlier_finding(m, dominant, promoters)
    if len(alike) < _ALIKE:
        alike[key] = found
    return found


def _module_findings(inv: Inventory, *, mixes: bool = True, outliers: bool = True, policy: Policy | None = None) -> list[Finding]:
    modules = structure.modules_of(inv)  # annotate's, where ``inv`` is the inventory it returned
    voters = modules
    by_class = _class_keeps(inv)
    if (policy is not None and policy.keep_in_fp32) or by_class is not None:
        # A policy's keep_in_fp32 modules cast their input to fp32 on entry (dtypeaudit.apply), and the modules a
        # transformers class keeps in float32 under a half dtype run so by its design (T5's wo casts its input):
        # they run as they are, and the model's dtype is the one the others hold.
        def kept(m: Module) -> bool:
            if policy is not None and policy.kept_in_fp32(m.name):
                return True
            return by_class is not None and m.dtype == "float32" and all(by_class(t.name) for t in m.tensors)

        voters = [m for m in modules if not kept(m)] or modules
        modules = [replace(m, input_cast=True) if kept(m) else m for m in modules]
    dominant = structure.dominant_dtype(inv, voters)
    out: list[Finding] = []
    promoters = _Promoters(modules)
    alike: dict[tuple[object, ...], Finding | None] = {}
    for m in modules:
        mix = _mix_finding(m, dominant) if mixes else None
        outlier = _alike_outlier(m, dominant, promoters, alike) if outliers else None
        out.extend(f for f in (mix, outlier) if f is not None)
    return out


def _class_keeps(inv: Inventory) -> Callable[[str], str | None] | None:
    """A Hugging Face folder's: stored name -> the class's list that from_pretrained keeps it in float32 by (hfload)."""
    if inv.format != Format.HF_DIRECTORY:
        return None
    from .formats import hfload

    load = hfload.from_metadata(inv.metadata)
    return hfload.fp32_keeper(load) if load is not None else None


def module_dtype_mix(inv: Inventory) -> list[Finding]:
    """Modules whose own tensors disagree in floating dtype where PyTorch's kernel refuses the combination."""
    return _module_findings(inv, outliers=False)


def dtype_outliers(inv: Inventory) -> list[Finding]:
    """Modules whose dtype differs from the model's dominant one in a way a forward pass does not survive."""
    return _module_findings(inv, mixes=False)


def module_consistency(inv: Inventory, policy: Policy | None = None) -> list[Finding]:
    """``module-dtype-mix`` and ``dtype-outlier``, over one inference of the model's structure (of the logical
    weights: a quantized Linear computes in the dtype it dequantizes to, not in its storage's); a policy's
    ``keep_in_fp32`` modules run in fp32 by design."""
    if inv.format == Format.GGUF:
        return []  # llama.cpp computes each op in its tensors' own types; transformers' GGUF loader casts all to one dtype
    return _module_findings(logical(inv), policy=policy)


def loaded_dtype(inv: Inventory) -> dict[str, str]:
    """name -> the dtype from_pretrained gives the tensor, where it is not the stored one (HF folders only)."""
    if inv.format != Format.HF_DIRECTORY:
        return {}
    from .formats import hfload

    load = hfload.from_metadata(inv.metadata)
    return hfload.loaded_dtypes(logical(inv).tensors, load) if load is not None else {}  # a scale is no loaded tensor


def loaded_dtype_findings(inv: Inventory) -> list[Finding]:
    """``load-cast`` and ``keep-in-fp32-unknown`` for a Hugging Face folder (see ``formats.hfload``)."""
    if inv.format != Format.HF_DIRECTORY:
        return []
    from .formats import hfload

    load = hfload.from_metadata(inv.metadata)
    return hfload.loaded_findings(logical(inv).tensors, load) if load is not None else []


def config_dtype(inv: Inventory) -> list[Finding]:
    """A Hugging Face config.json that names another dtype than the weights hold."""
    declared = inv.metadata.get("config_dtype")
    if not isinstance(declared, str) or declared == "auto":
        return []
    name = dtypes.canonical(declared)
    # The config dtype is what from_pretrained builds the unquantized parts in; quantized weights and their
    # scales stay as the quantizer keeps them (FP8Linear's float8 weight and float32 weight_scale_inv).
    quantized = quantized_storage(inv)
    weights = Counter()  # type: Counter[str]
    for t in inv.tensors:
        if t.name in quantized:
            continue
        if t.dtype in dtypes.DTYPES and dtypes.get(t.dtype).is_floating:
            weights[t.dtype] += t.nbytes
    if not weights or name is None:
        return []
    dominant = weights.most_common(1)[0][0]
    if dominant == name:
        return []
    return [
        Finding(
            "config-dtype-mismatch",
            "warning",
            f"config.json says {declared} but the weights are mostly {dominant}; from_pretrained(torch_dtype='auto') would cast them",
            file="config.json",
            expected=(name,),
            actual=dominant,
        )
    ]


def quantized_storage(inv: Inventory) -> frozenset[str]:
    """The names of the tensors that quantized weights consume (``quant.group.view``); none, without importing
    quant/, where nothing hints at quantization."""
    if not might_be_quantized(inv):
        return frozenset()
    from .quant.group import view

    return view(inv).consumed


def quant_consistency(inv: Inventory) -> list[Finding]:
    """The quantization consistency findings (``quant.consistency.quant_consistency``); none, without importing quant/,
    where nothing hints at quantization."""
    if not might_be_quantized(inv):
        return []
    from .quant.consistency import quant_consistency as consistency

    return consistency(inv)


def no_quantized_weights(inv: Inventory, policy: Policy) -> list[Finding]:
    """``no-quantized-weights``: a policy for quantized checkpoints (``requires_quantized``) and a checkpoint whose
    weights are all unquantized, whatever the scheme the policy allows (a GPTQ checkpoint under fp8-serving holds
    quantized weights: the policy's scheme rules judge those)."""
    if not policy.requires_quantized or any(t.scheme for t in logical(inv).tensors):
        return []
    held = Counter(t.dtype for t in inv.tensors if dtypes.is_floating(t.dtype))
    what = " and ".join(d for d, _ in held.most_common(2)) or "no floating"
    return [
        Finding(
            "no-quantized-weights",
            "error",
            f"no quantized weights: every tensor is stored unquantized ({what}), but the policy {policy.source.rsplit('/', 1)[-1]} is for "
            "quantized checkpoints; quantize the model first, or check it against a policy for its dtype (--preset bf16)",
        )
    ]


def checks_for(policy: Policy | None) -> list[Check]:
    """Every check to run: the policy-free ones, plus the policy's when there is one (and its hardware ``target``)."""
    consistency = partial(module_consistency, policy=policy) if policy is not None and policy.keep_in_fp32 else module_consistency
    checks: list[Check] = [consistency, config_dtype, loaded_dtype_findings, quant_consistency]
    if policy is not None:
        # partials, not closures: checks travel to worker processes and Dask workers (fleet.py) by pickle
        checks += [
            partial(policy_findings, policy=policy),
            partial(tied_conflicts, policy=policy),
            partial(training_state_findings, policy=policy),
        ]
        if policy.requires_quantized:
            checks.append(partial(no_quantized_weights, policy=policy))
        if policy.target is not None:
            from .hardware import check_for

            checks.append(check_for(policy.target))
    return checks


def strict_findings(findings: Iterable[Finding]) -> list[Finding]:
    """Strict mode (``--strict``, ``strict: true``): every finding of a STRICT_RULES rule becomes an error.

    The message keeps its words and gains a "(strict)" marker, so a reader of any report sees why a
    warning now fails the run.
    """
    return [
        replace(f, severity="error", message=f.message + STRICT_MARKER) if f.rule in STRICT_RULES and f.severity != "error" else f
        for f in findings
    ]


def run_checks(inv: Inventory, checks: Iterable[Check], *, strict: bool = False) -> tuple[Inventory, list[Finding]]:
    """The one path from an inventory to its findings, for scan, convert's plans and live audits alike.

    The inventory is annotated with the structure's module guesses first (``structure.annotate``, which infers
    nothing again for an inventory it returned: ``pipeline.prepare``'s), so policy ``module:`` rules see the same
    types everywhere; then the reader's own findings, each check's, and ``strict`` promotes what a loader might read
    differently. Returns the annotated inventory and the findings.
    """
    inv = structure.annotate(inv)
    out = list(inv.findings)
    for c in checks:
        out.extend(c(inv))
    return inv, strict_findings(out) if strict else out


def check(inv: Inventory, policy: Policy | None = None, *, strict: bool = False) -> list[Finding]:
    """All findings for one inventory under ``policy`` (see ``run_checks``)."""
    return run_checks(inv, checks_for(policy), strict=strict)[1]
