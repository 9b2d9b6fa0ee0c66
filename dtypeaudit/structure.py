"""The module structure a state dict implies, from names, shapes and buffers alone.

A module is the set of tensors directly under one dotted prefix (``layer1.0.bn1.{weight,bias,running_mean,
running_var,num_batches_tracked}``). Its kind comes from ``--model`` where the factory names a module type
PyTorch's kernels are known for, or whose forward the factory measured (a fact), else from the tensors' names
and shapes (a guess, high or low). A sure guess also names a type (``RMSNorm``, ``Linear``) that policy
``module:`` selectors match: ``annotate`` writes it into each tensor's ``module_guess``, once per checkpoint,
so that checks, presets, ``--explain`` and conversion plans all read this one structure. No torch here:
metadata only.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from operator import attrgetter
from typing import Literal

from . import dtypes
from .inventory import Inventory, TensorRecord, slot_init

ModuleKind = Literal["batchnorm", "linear", "conv", "embedding", "norm", "rnn", "unknown"]
Confidence = Literal["fact", "high", "low"]

# What training code wraps a state_dict in: the PyTorch tutorial's ``model_state_dict``, Lightning's
# ``state_dict``, a plain ``model``, DDP's ``module``, torch.compile's ``_orig_mod``. Stripped for naming only.
WRAPPER_PREFIXES: tuple[str, ...] = ("model_state_dict.", "state_dict.", "model.", "module.", "_orig_mod.")

HALF_DTYPES = dtypes.HALF
MEASURED_DTYPES: tuple[str, ...] = ("float32", "float16", "bfloat16")
"""The dtypes whose forward rules were measured (tests/test_runtime_truth.py), and that factories probe."""

# Module types whose forward dtype rules are known: measured on CPU by tests/test_runtime_truth.py for the
# common ones, the rest run the same kernels. A type named here makes the kind a fact; any other type name is
# kept, but its kind is guessed from the tensors.
_TYPE_KINDS: dict[str, ModuleKind] = {
    **dict.fromkeys(("BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "SyncBatchNorm"), "batchnorm"),
    **dict.fromkeys(("LazyBatchNorm1d", "LazyBatchNorm2d", "LazyBatchNorm3d"), "batchnorm"),
    # transformers' Conv1D (GPT-2) is a Linear with a transposed weight: addmm(bias, x, weight).
    **dict.fromkeys(("Linear", "LazyLinear", "NonDynamicallyQuantizableLinear", "Conv1D"), "linear"),
    **dict.fromkeys(("Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d"), "conv"),
    **dict.fromkeys(("LazyConv1d", "LazyConv2d", "LazyConv3d"), "conv"),
    **dict.fromkeys(("Embedding",), "embedding"),
    # InstanceNorm's running statistics are not held to its input's dtype: a norm, not a BatchNorm.
    **dict.fromkeys(("LayerNorm", "GroupNorm", "RMSNorm", "InstanceNorm1d", "InstanceNorm2d", "InstanceNorm3d"), "norm"),
    **dict.fromkeys(("LazyInstanceNorm1d", "LazyInstanceNorm2d", "LazyInstanceNorm3d"), "norm"),
    # "RNN input dtype ... does not match weight dtype": input, weights and biases in one dtype (measured on CPU).
    **dict.fromkeys(("LSTM", "GRU", "RNN"), "rnn"),
}
# Where each of those types is defined: a class is matched by identity, not by name, so a user's own class called
# RMSNorm or Linear is not given PyTorch's rules (``type_name``).
_TYPE_HOMES: dict[str, tuple[str, ...]] = {"Conv1D": ("transformers.",)}
_TORCH_HOME = ("torch.nn.",)


def type_name(cls: type) -> str:
    """The module type name records carry: the class name, or ``module.QualName`` for a class that is not the
    PyTorch (or transformers) class of that name, so that rules for PyTorch's type never apply to it by name."""
    name = cls.__name__
    if name in _TYPE_KINDS and not cls.__module__.startswith(_TYPE_HOMES.get(name, _TORCH_HOME)):
        return f"{cls.__module__}.{cls.__qualname__}"
    return name


def is_torch_type(type_name: str) -> bool:
    """Whether ``type_name`` is one of PyTorch's own module types whose forward dtype rules are known."""
    return type_name in _TYPE_KINDS


_EMBED_HINT = re.compile(r"(?i)(embed|emb$|wte$|wpe$|tok|vocab|shared$)")
_PROJ_HINT = re.compile(r"(?i)(head$|proj$|fc\d*$|linear\d*$|dense$|classifier$|(^|_)(q|k|v|o|gate|up|down|query|key|value|out)$)")
# A lone 1-D weight under a norm's name (Llama's input_layernorm, model.norm; Meta's attention_norm; GPT-NeoX's
# ln_f): a weight-only norm, RMSNorm-style.
_NORM_HINT = re.compile(r"(?i)(norm|^ln(_|\d|$)|^rms)")
_STATS = ("running_mean", "running_var")
# nn.LSTM / GRU / RNN parameters: weight_ih_l0, weight_hh_l0_reverse, bias_ih_l1, weight_hr_l0 (projections).
_RNN_LEAF = re.compile(r"^(weight|bias)_(ih|hh|hr)_l\d+(_reverse)?$")


def strip_wrappers(name: str) -> str:
    """``model_state_dict.module.fc.weight`` -> ``fc.weight``: the name without the wrappers training code adds.

    For naming and matching only: a model whose own child is called ``model`` (Hugging Face's
    ``model.layers.0``) loses it too, which is why modules are never grouped by the stripped name.
    """
    changed = True
    while changed:
        changed = False
        for prefix in WRAPPER_PREFIXES:
            if name.startswith(prefix) and len(name) > len(prefix):
                name = name[len(prefix) :]
                changed = True
    return name


def split_name(name: str) -> tuple[str, str]:
    """``a.b.weight`` -> ``("a.b", "weight")``; a name without a dot belongs to the root module ``""``."""
    prefix, _, leaf = name.rpartition(".")
    return prefix, leaf


_DTYPE_SETS: dict[frozenset[str], frozenset[str]] = {}
_DERIVED: dict[tuple[object, ...], tuple[frozenset[str], int | None]] = {}
"""(kind, signature) -> what ``Module`` derives from its tensors (``Module._derived``): at most ``_SIGNATURES`` of
them, emptied when full."""
_FLOATING = frozenset(name for name in dtypes.DTYPES if dtypes.is_floating(name))


_KERNEL_LEAVES = {"batchnorm": frozenset(("weight", "bias", *_STATS))}
_WEIGHT_AND_BIAS = frozenset(("weight", "bias"))


def _in_kernel(kind: ModuleKind, leaf: str) -> bool:
    """Whether a floating tensor called ``leaf`` in a module of ``kind`` is one its kernel reads."""
    if kind == "unknown":
        return True
    if kind == "rnn":
        return _RNN_LEAF.match(leaf) is not None
    return leaf in _KERNEL_LEAVES.get(kind, _WEIGHT_AND_BIAS)


@dataclass(frozen=True, slots=True)
class Module:
    """The tensors directly under one dotted prefix, and what kind of module they look like.

    What every check asks of every module (``kernel_dtypes``, ``weight``) is worked out once, when it is made, and
    it has slots, not a ``__dict__``: a header may hold a million modules.
    """

    prefix: str
    """The prefix as the checkpoint spells it (``model.layer1.0.bn1``); ``""`` for tensors at the root."""
    kind: ModuleKind
    """``batchnorm``, ``linear``, ``conv``, ``embedding``, ``norm`` (LayerNorm/RMSNorm/GroupNorm-like) or ``unknown``."""
    type_name: str | None
    """The module's class name where ``--model`` gave it (``BatchNorm2d``), else None."""
    confidence: Confidence
    """``fact`` where the kind comes from ``--model``'s module type, else ``high`` or ``low`` for a guess."""
    tensors: tuple[TensorRecord, ...]
    """Every tensor directly under the prefix, in file order, integer buffers included."""
    guessed_type: str | None = None
    """The type its names and shapes make sure (``BatchNorm``, ``LayerNorm`` for a norm with weight and bias,
    ``RMSNorm`` for a weight-only norm, ``Linear``, ``Conv2d``, ``Embedding``), where ``--model`` gives no type or
    one that is not PyTorch's own; None where the guess is low or the type is PyTorch's own."""
    forward: Mapping[str, str] | None = None
    """``"{weight dtype}/{input dtype}"`` -> the dtype its forward returned, as ``--model``'s factory measured
    it on the meta device (weight-only norms of types that are not PyTorch's own); None if not measured."""
    input_cast: bool = False
    """Whether its parent's forward casts its input to its weight's dtype, as ``--model``'s factory measured
    (T5's ``wo``): it runs in its own dtype whatever the model's."""
    signature: tuple[object, ...] | None = field(default=None, repr=False, compare=False)
    """What its guess was made from (``_module_parts``): its prefix's last part, its tensors' leaves, and each one's
    dtype, shape and layout, in order; two modules of one kind and signature answer every check alike. None where its kind is a
    fact (``--model``)."""
    signed: tuple[TensorRecord, ...] | None = field(default=None, repr=False, compare=False)
    """The tensors ``signature`` was made for: a module made again with other tensors (``dataclasses.replace``) drops
    it, and derives what it needs from its own."""
    kernel_dtypes: frozenset[str] = field(init=False, repr=False, compare=False)
    """The dtypes of its ``kernel_tensors``."""
    weight: TensorRecord | None = field(init=False, repr=False, compare=False)
    """Its ``weight`` (an RNN's first input weight, ``weight_ih_l0``)."""
    dtype: str | None = field(init=False, repr=False, compare=False)
    """The one floating dtype its kernel tensors share; None when they mix dtypes or there are none."""

    def __post_init__(self) -> None:
        # worked out once per kind and signature, which repeat layer after layer: this runs once per module
        if self.signature is not None and self.signed is not self.tensors:
            object.__setattr__(self, "signature", None)
        key = (self.kind, self.signature) if self.signature is not None else None
        derived = _DERIVED.get(key) if key is not None else None
        if derived is None:
            derived = self._derived()
            if key is not None:
                if len(_DERIVED) >= _SIGNATURES:
                    _DERIVED.clear()  # a new run of modules' kinds: the old ones are not asked again
                _DERIVED[key] = derived
        kernel_dtypes, at = derived
        object.__setattr__(self, "kernel_dtypes", kernel_dtypes)
        object.__setattr__(self, "weight", None if at is None else self.tensors[at])
        object.__setattr__(self, "dtype", next(iter(kernel_dtypes)) if len(kernel_dtypes) == 1 else None)

    def _derived(self) -> tuple[frozenset[str], int | None]:
        """``kernel_dtypes``, and where ``weight`` stands in ``tensors``: one pass over its tensors."""
        kind = self.kind
        wanted = "weight_ih_l0" if kind == "rnn" else "weight"
        leaves = _KERNEL_LEAVES.get(kind, _WEIGHT_AND_BIAS)
        weight = None
        found = set()
        for i, t in enumerate(self.tensors):
            leaf = t.name.rpartition(".")[2]
            if weight is None and leaf == wanted:
                weight = i
            if t.dtype in _FLOATING and not t.layout.startswith("sparse"):
                # ``_in_kernel``, with its usual answer here
                if leaf in leaves if kind != "unknown" and kind != "rnn" else _in_kernel(kind, leaf):
                    found.add(t.dtype)
        dtypes_found = frozenset(found)
        return _DTYPE_SETS.setdefault(dtypes_found, dtypes_found), weight  # one set per mix

    @property
    def name(self) -> str:
        """The prefix without wrapper prefixes (``model.``, ``module.``, ``_orig_mod.``), for messages and matching."""
        return strip_wrappers(self.prefix)

    @property
    def floating(self) -> tuple[TensorRecord, ...]:
        """The tensors a floating-dtype rule applies to: integer and bool buffers (``num_batches_tracked``) never are."""
        return tuple(t for t in self.tensors if t.dtype in _FLOATING and not t.layout.startswith("sparse"))

    @property
    def floating_dtypes(self) -> frozenset[str]:
        return frozenset(t.dtype for t in self.floating)

    @property
    def kernel_tensors(self) -> tuple[TensorRecord, ...]:
        """The floating tensors its kind's kernel reads: weight and bias (and running statistics for a BatchNorm).

        Other tensors under the prefix (an fp8 checkpoint's ``weight_scale``) are not held to the kernel's dtype
        rules; for a module of unknown kind every floating tensor is.
        """
        return tuple(t for t in self.floating if _in_kernel(self.kind, t.name.rpartition(".")[2]))

    @property
    def file(self) -> str | None:
        """The file holding it inside a directory checkpoint, if all its tensors sit in one."""
        files = {t.file for t in self.tensors}
        return next(iter(files)) or None if len(files) == 1 else None

    def leaf(self, leaf: str) -> TensorRecord | None:
        """Its first tensor named ``leaf`` after the prefix."""
        for t in self.tensors:
            if t.name.rpartition(".")[2] == leaf:
                return t
        return None

    @property
    def label(self) -> str:
        """``BatchNorm2d`` for a fact, ``Linear-like`` / ``RMSNorm-like`` for a guess."""
        if self.confidence == "fact" and self.type_name:
            return self.type_name
        base = self.guessed_type or {
            "batchnorm": "BatchNorm",
            "linear": "Linear",
            "conv": "Conv",
            "embedding": "Embedding",
            "norm": "norm",
            "rnn": "LSTM/GRU/RNN",
        }.get(self.kind)
        what = f"{base}-like" if base else "module of unknown kind"
        return f"{self.type_name}, {what}" if self.type_name else what

    @property
    def provenance(self) -> str:
        """How the kind is known, in words."""
        if self.confidence == "fact":
            if self.forward is not None:
                return "module type from the model, its forward measured on the meta device"
            return "module type from the model"
        if self.type_name:
            return f"a type from the model whose dtype rules are not known; kind guessed from its tensors, {self.confidence} confidence"
        return f"guessed from names and shapes, {self.confidence} confidence"


slot_init(Module)  # a header may hold a million modules


def _guess(prefix: str, leaves: dict[str, TensorRecord]) -> tuple[ModuleKind, Confidence]:
    """Kind and confidence from the tensors' names and shapes alone."""
    if any(s in leaves for s in _STATS):
        return "batchnorm", "high"
    if "weight_ih_l0" in leaves and all(_RNN_LEAF.match(leaf) for leaf in leaves):
        return "rnn", "high"
    w, b = leaves.get("weight"), leaves.get("bias")
    if w is None:
        return "unknown", "low"
    extra = [t for leaf, t in leaves.items() if leaf not in ("weight", "bias") and dtypes.is_floating(t.dtype)]
    if b is not None and b.ndim != 1:
        return "unknown", "low"
    name = prefix.rpartition(".")[2]
    kind: ModuleKind
    conf: Confidence
    if w.ndim in (3, 4, 5):
        # Conv weights are [out, in/groups, *k] with a bias of [out]; a transposed conv's are [in, out/groups, *k],
        # and its kernel differs (tests/test_runtime_truth.py), so a bias of the second dimension is a low guess.
        kind, conf = "conv", "high" if b is None or b.shape[0] == w.shape[0] else "low"
    elif w.ndim == 2:
        if b is not None:
            # nn.Linear: bias of the weight's first dimension; transformers' Conv1D: of its second.
            kind, conf = "linear", "high" if b.shape[0] in w.shape else "low"
        elif _EMBED_HINT.search(name):
            kind, conf = "embedding", "high"
        elif _PROJ_HINT.search(name):
            kind, conf = "linear", "low"
        else:
            kind, conf = "embedding", "low"
    elif w.ndim == 1:
        sure = b.shape == w.shape if b is not None else bool(_NORM_HINT.search(name))
        kind, conf = "norm", "high" if sure else "low"
    else:
        return "unknown", "low"
    return kind, "low" if extra else conf


def _type_guess(kind: ModuleKind, leaves: dict[str, TensorRecord]) -> str | None:
    """The type name a sure guess of ``kind`` stands for, as policy ``module:`` selectors see it."""
    if kind == "norm":
        return "LayerNorm" if "bias" in leaves else "RMSNorm"
    if kind == "conv":
        w = leaves["weight"]
        return f"Conv{w.ndim - 2}d"
    return {"batchnorm": "BatchNorm", "linear": "Linear", "embedding": "Embedding"}.get(kind)


_SIGNED = attrgetter("dtype", "shape", "layout")
"""What of each tensor a module's signature holds, besides its leaf name."""
_SIGNATURES = 1 << 16
"""At most this many module signatures remembered per inference: a header of a million different ones costs no more."""


def infer_modules(inv: Inventory | Iterable[TensorRecord], *, tagged: list[TensorRecord] | None = None) -> list[Module]:
    """Every module of the model region, in the order its first tensor appears.

    Grouping uses the names as written: wrapper prefixes are stripped for naming only, so two prefixes that
    differ only by a wrapper stay two modules. Module types come from ``TensorRecord.module`` (``--model``)
    only, never from ``module_guess``: a guess is recomputed here, not taken for a fact. The forwards a
    factory measured come from the inventory's ``module_forward`` metadata.

    ``tagged``: ``inv``'s records in order (``annotate``'s), where each record whose ``module_guess`` is not its
    module's guessed type is replaced by one that is; the modules are then made over those, each once.
    """
    if tagged is None:
        return [Module(*parts, parts[4]) for parts, _ in _module_parts(inv)]  # signed for its own tensors
    modules = []
    for (prefix, kind, type_name, conf, members, g, forward, cast, signature), places in _module_parts(inv):
        # most records of a header are tagged (their guess was None): one pass, tagging each that is not yet
        members = tuple([t if t.module_guess == g else t.with_guess(g) for t in members])
        for i, t in zip(places, members, strict=True):
            tagged[i] = t
        modules.append(Module(prefix, kind, type_name, conf, members, g, forward, cast, signature, members))
    return modules


_Parts = tuple[
    str, ModuleKind, "str | None", Confidence, tuple[TensorRecord, ...], "str | None", "Mapping[str, str] | None", bool,
    "tuple[object, ...] | None",
]  # fmt: skip


def _module_parts(inv: Inventory | Iterable[TensorRecord]) -> Iterator[tuple[_Parts, list[int]]]:
    """``infer_modules``'s modules as the arguments of ``Module``, each with where its tensors stand in ``inv``, so
    that ``annotate`` makes each module once, over its tagged records."""
    tensors = inv.tensors if isinstance(inv, Inventory) else tuple(inv)
    measured = inv.metadata.get("module_forward") if isinstance(inv, Inventory) else None
    probes: Mapping[str, Mapping[str, str]] = measured if isinstance(measured, Mapping) else {}
    cast_list = inv.metadata.get("input_casts") if isinstance(inv, Inventory) else None
    casts = frozenset(cast_list) if isinstance(cast_list, list) else frozenset()
    seen: dict[tuple[object, ...], tuple[ModuleKind, Confidence, str | None, tuple[object, ...]]] = {}
    groups: dict[str, list[int]] = {}
    for i, t in enumerate(tensors):
        if t.region == "model":
            prefix = t.name.rpartition(".")[0]
            places = groups.get(prefix)
            if places is None:
                groups[prefix] = [i]  # not ``setdefault(prefix, [])``, which makes a list per tensor
            else:
                places.append(i)
    for prefix, places in groups.items():
        members = tuple(map(tensors.__getitem__, places))
        names = [t.name.rpartition(".")[2] for t in members]
        leaves = dict(zip(names, members, strict=True))
        type_name = None
        for t in members:  # the first type given (a loop, not a generator: this runs once per module)
            if t.module:
                type_name = t.module
                break
        fact = _TYPE_KINDS.get(type_name) if type_name else None
        guessed: str | None = None
        forward: Mapping[str, str] | None = None
        signature: tuple[object, ...] | None = None
        if fact is not None:
            kind: ModuleKind = fact
            conf: Confidence = "fact"
        else:
            # what names and shapes say depends on the prefix's last part and the tensors' leaves, dtypes and
            # shapes alone, which repeat layer after layer: guessed once per signature
            signature = (prefix.rpartition(".")[2], tuple(names), *map(_SIGNED, members))
            known = seen.get(signature)
            if known is None:
                kind, conf = _guess(prefix, leaves)
                known = kind, conf, _type_guess(kind, leaves) if conf == "high" else None, signature
                if len(seen) < _SIGNATURES:
                    seen[signature] = known
            kind, conf, guessed, signature = known  # the first module's signature: one held, not one per module
            if type_name and kind == "norm" and "norm" in type_name.lower() and conf == "low":
                conf = "high"  # the factory says it is a norm of its own making (LlamaRMSNorm)
                guessed = _type_guess(kind, leaves)
            table = probes.get(type_name) if type_name else None
            if kind == "norm" and isinstance(table, Mapping) and set(leaves) == {"weight"}:
                forward, conf = table, "fact"  # its own forward, measured by the factory
        yield (prefix, kind, type_name, conf, members, guessed, forward, prefix in casts, signature), places


@dataclass(frozen=True)
class Inferred:
    """What ``annotate`` inferred, carried by the inventory it returns (``Inventory.inferred``): the modules, and the
    tensors and metadata they were inferred from, so that an inventory made from it with other tensors or metadata
    (``dataclasses.replace``) is not answered from modules that are not its own."""

    tensors: tuple[TensorRecord, ...]
    metadata: Mapping[str, object]
    modules: tuple[Module, ...]


def _known(inv: Inventory) -> tuple[Module, ...] | None:
    done = inv.inferred
    if isinstance(done, Inferred) and done.tensors is inv.tensors and done.metadata is inv.metadata:
        return done.modules
    return None


def modules_of(inv: Inventory) -> list[Module]:
    """``infer_modules(inv)``, inferred once: an inventory ``annotate`` returned answers from what it carries."""
    known = _known(inv)
    return list(known) if known is not None else infer_modules(inv)


def annotate(inv: Inventory) -> Inventory:
    """``inv`` with each model tensor's ``module_guess`` set from the structure (None where nothing is sure).

    Done once per checkpoint, after ``--model`` is attached, by ``scan``, ``--explain`` and ``convert``, so that
    every check, preset and plan reads the same guesses. Idempotent, and once per inventory: the inventory it returns
    carries the modules inferred (``Inventory.inferred``, read by ``modules_of``), so annotating it again
    (``checks.run_checks``) infers nothing.
    """
    if _known(inv) is not None:
        return inv
    records = list(inv.tensors)
    modules = infer_modules(inv, tagged=records)  # over the annotated records (inference reads ``module``, never ``module_guess``)
    if any(t.region != "model" for t in inv.tensors):
        # a tensor outside the model (optimizer state) takes the guess of a model tensor of its name, if any
        guesses = {t.name: m.guessed_type for m in modules for t in m.tensors}
        records = [
            t if t.region == "model" or t.module_guess == guesses.get(t.name) else t.with_(module_guess=guesses.get(t.name))
            for t in records
        ]
    out = inv
    if any(a is not b for a, b in zip(records, inv.tensors, strict=True)):
        out = replace(inv, tensors=tuple(records))
    return replace(out, inferred=Inferred(out.tensors, out.metadata, tuple(modules)))


COMPUTE_KINDS = frozenset({"linear", "conv", "embedding", "rnn"})


def dominant_dtype(inv: Inventory | Iterable[TensorRecord], modules: Iterable[Module] | None = None) -> str | None:
    """The floating dtype activations flow in: the dtype most compute modules (Linear, Conv, Embedding) hold.

    Counted by module, ties broken by elements: a forgotten ``.half()`` on one big layer must not make the
    rest of the model look like the outlier, and bytes would count an fp32 layer twice. Norm layers do not
    vote (fp32 norms in a half model are ordinary). Without compute modules, the floating dtype with the most
    elements in the model region. None if the model holds no floating tensor.
    """
    mods = list(modules) if modules is not None else modules_of(inv) if isinstance(inv, Inventory) else infer_modules(inv)
    votes: Counter[str] = Counter()
    elements: Counter[str] = Counter()
    for m in mods:
        w = m.weight
        if m.kind in COMPUTE_KINDS and w is not None and dtypes.is_floating(w.dtype):
            votes[w.dtype] += 1
            elements[w.dtype] += w.numel
    if not votes:
        for m in mods:
            for t in m.floating:
                votes[t.dtype] += t.numel
    if not votes:
        return None
    # Deterministic on a full tie: the narrower dtype (a half model with one fp32 layer is the common case).
    return max(votes, key=lambda d: (votes[d], elements[d], -dtypes.get(d).itemsize, d))


def by_tensor(modules: Iterable[Module]) -> dict[str, Module]:
    """Tensor name -> the module that holds it."""
    return {t.name: m for m in modules for t in m.tensors}
