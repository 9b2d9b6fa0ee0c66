"""YAML dtype policies: parse safely, validate against a schema table with line numbers, compile matchers once.

A policy says which dtype each tensor should have::

    version: 1
    extends: fp16-weights-fp32-norms  # a preset name or another file, relative to this one
    default: float16             # floating tensors no rule matches
    check_integers: true         # also hold integer/bool tensors to the rules that name an integer dtype
    strict: true                 # fail on anything a loader might read differently (security gates)
    requires_quantized: true     # a checkpoint without a quantized weight fails (no-quantized-weights)
    trace:                       # what `dtypeaudit trace` must show
      fail_on: warning           # the trace's failing severity (--fail-on wins; else the policy's fail_on)
      allow_promotion: ["head*"] # module paths whose implicit promotion is meant (as --allow-promotion)
    ignore: ["optimizer.*"]      # never checked
    keep_in_fp32: [blocks.5.ff]  # modules that run in fp32 (parameters fp32, floating inputs cast to fp32 on entry,
                                 # floating outputs cast back on exit): what `dtypeaudit tune` writes, `apply` follows
    rules:                       # first match wins
      - match: "*norm*"          # glob, or "re:<regex>"; a list means any of them
        ndim: "<=1"              # also: kind, module, region, scheme
        dtype: float32           # a dtype, a list of them, or "any"
        severity: error
        reason: LayerNorm is unstable in fp16
        optional: true           # may match nothing without an unused-rule warning

Name patterns. A glob matches a whole dotted name or any tail of it that starts after a dot, so
``lm_head.*`` matches ``lm_head.weight`` and ``model.lm_head.weight`` but not ``my_lm_head.weight``,
and ``bias`` matches every ``*.bias``. A leading ``^`` anchors the glob at the start of the name
(``^lm_head.*`` matches ``lm_head.weight`` only). ``*`` and ``?`` cross dots, as in ``fnmatch``.
``re:<regex>`` is searched anywhere in the name (write ``^``/``$`` to anchor it).

Module types. ``module:`` globs match the owning module's type name: the one ``--model`` gives
(``TensorRecord.module``, a fact), or the one the structure guesses from names and shapes where the type is
unknown or not one of PyTorch's own (``module_guess``: ``BatchNorm``, ``LayerNorm``, ``RMSNorm``, ``Linear``,
``Conv2d``, ``Embedding``; see ``structure.annotate``). Either matching is enough.

Quantized checkpoints. A quantized weight meets the rules once, as its logical weight (its scales and zeros
folded into it): its name is the weight's (``q_proj.weight``), its dtype the one it dequantizes to, and
``scheme:`` globs match its scheme's name (``fp8-e4m3 block 128x128``, ``int4 gptq g128 sym``); ``scheme: none``
selects unquantized tensors. ``dtype: none`` allows nothing, so ``scheme: "*"`` with ``dtype: none`` forbids
quantizing what the rule selects.

Dtype scope. A rule holds floating-point tensors to its dtypes; integer and bool tensors meet only
the rules whose ``dtype`` names an integer or bool dtype (or ``any``), and only with
``check_integers: true``. So ``module: "*Norm*"`` with ``dtype: float32`` never catches BatchNorm's
int64 ``num_batches_tracked``.

No silent no-ops. ``Policy.unused_rules`` reports, across every checkpoint of one run, each rule and
ignore pattern of the user's own files that decides no tensor (``unused-rule``); the shipped presets'
rules and rules marked ``optional: true`` may go unused.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from . import dtypes
from .errors import PolicyError
from .inventory import SEVERITIES, Finding, Inventory, Severity, TensorRecord
from .quant.group import policy_records

MAX_POLICY_BYTES = 1 << 20
PRESET_DIR = Path(__file__).resolve().parent / "presets"
_NDIM = re.compile(r"^\s*(<=|>=|==|<|>|!=)?\s*(\d+)\s*$")
_OPS: dict[str, Callable[[int, int], bool]] = {
    "<=": lambda a, b: a <= b,
    ">=": lambda a, b: a >= b,
    "==": lambda a, b: a == b,
    "<": lambda a, b: a < b,
    ">": lambda a, b: a > b,
    "!=": lambda a, b: a != b,
}
KINDS = ("parameter", "buffer", "unknown")
REGIONS = ("model", "optimizer")
GLOB_RULE = (
    "a glob matches the whole name or any tail of it that starts after a dot (lm_head.* matches model.lm_head.weight); "
    "a leading ^ anchors it at the start; re:<regex> is searched anywhere"
)


# -- matchers ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Matcher:
    """A name pattern: a glob matched on dotted-name boundaries (``^`` anchors it), or ``re:<regex>``.

    Compiled at load time. A glob is tried at one start position only, whatever the name's length:
    without ``*`` its length fixes where a match must start; with one, the earliest dot boundary where
    the part before the first ``*`` fits is the only one to try (any later match implies a match there).
    """

    text: str
    regex: re.Pattern[str]
    """The whole pattern, matched with ``fullmatch`` from a start position (a search for ``re:``)."""
    head: re.Pattern[str] | None = None
    """A glob's part before its first ``*``, of ``head_len`` characters; None for ``re:`` and ``*``-free globs."""
    head_len: int = 0
    fixed_len: int | None = None
    """A ``*``-free glob's length in characters (each ``?`` and ``[...]`` is one)."""
    anchored: bool = False
    mode: str = "glob"
    """``re``, ``anchored``, ``fixed`` (no ``*``), ``star`` (starts with ``*``) or ``glob``: how ``start`` looks."""
    literal: str | None = None
    """The text before the first ``*`` (the whole glob without one) when it has no ``?`` or ``[``: found with str methods."""

    def __call__(self, name: str) -> bool:
        if self.mode == "star" or self.mode == "anchored":
            return self.regex.fullmatch(name) is not None
        if self.mode == "re":
            return self.regex.search(name) is not None
        return self.start(name) is not None

    def start(self, name: str) -> int | None:
        """Where in ``name`` the match begins (0, or just after a dot), or None if it does not match."""
        if self.mode == "re":
            found = self.regex.search(name)
            return found.start() if found else None
        if self.mode in ("anchored", "star"):
            return 0 if self.regex.fullmatch(name) else None
        lit = self.literal
        if lit is not None:
            if self.fixed_len is not None:  # the whole glob is literal text
                pos = len(name) - len(lit)
                return pos if name.endswith(lit) and (pos == 0 or name[pos - 1] == ".") else None
            if name.startswith(lit):
                pos = 0
            else:
                dot = name.find("." + lit)
                if dot < 0:
                    return None
                pos = dot + 1
            return pos if self.regex.fullmatch(name, pos) else None
        if self.fixed_len is not None:
            pos = len(name) - self.fixed_len
            if pos < 0 or (pos > 0 and name[pos - 1] != "."):
                return None
            return pos if self.regex.fullmatch(name, pos) else None
        pos = 0
        while pos + self.head_len <= len(name):
            if self.head is None or self.head.fullmatch(name, pos, pos + self.head_len):
                return pos if self.regex.fullmatch(name, pos) else None
            dot = name.find(".", pos)
            if dot < 0:
                return None
            pos = dot + 1
        return None


def _glob_tokens(pattern: str) -> list[tuple[int, bool]]:
    """``(offset, is_star)`` for each token of a glob, tokenised as ``fnmatch.translate`` does."""
    out = []
    i, n = 0, len(pattern)
    while i < n:
        start, c = i, pattern[i]
        i += 1
        if c == "[":
            j = i
            if j < n and pattern[j] == "!":
                j += 1
            if j < n and pattern[j] == "]":
                j += 1
            while j < n and pattern[j] != "]":
                j += 1
            if j < n:
                i = j + 1
        out.append((start, c == "*"))
    return out


def _has_nested_repeat(pattern: str) -> bool:
    """True for patterns such as ``(a+)+`` or ``(a|aa)*`` whose backtracking can take exponential time."""
    try:
        import re._parser as sre_parse  # type: ignore[import-not-found]
    except ImportError:  # Python 3.10
        import sre_parse

    repeats = {sre_parse.MAX_REPEAT, sre_parse.MIN_REPEAT, getattr(sre_parse, "POSSESSIVE_REPEAT", None)}

    def walk(items: Any, inside_unbounded: bool) -> bool:
        for op, arg in items:
            if op in repeats:
                _lo, hi, sub = arg
                unbounded = hi == sre_parse.MAXREPEAT or hi > 50
                if inside_unbounded and unbounded:
                    return True
                if walk(sub, inside_unbounded or unbounded):
                    return True
            elif op == sre_parse.SUBPATTERN:
                if walk(arg[-1], inside_unbounded):
                    return True
            elif op == sre_parse.BRANCH:
                if inside_unbounded and _ambiguous(arg[1]):
                    return True
                if any(walk(branch, inside_unbounded) for branch in arg[1]):
                    return True
        return False

    def _ambiguous(branches: Any) -> bool:
        # Alternatives that can start alike ((x|xx)*) let a repetition split the input many ways.
        firsts = []
        for branch in branches:
            items = list(branch)
            if not items or items[0][0] != sre_parse.LITERAL:
                return True
            firsts.append(items[0][1])
        return len(set(firsts)) != len(firsts)

    return walk(sre_parse.parse(pattern), False)


def compile_matcher(text: str) -> Matcher:
    """Raise ValueError with a reason a person understands when ``text`` is not a usable pattern."""
    if text.startswith("re:"):
        body = text[3:]
        try:
            regex = re.compile(body)
        except re.error as exc:
            raise ValueError(f"invalid regex '{body}': {exc}") from None
        if _has_nested_repeat(body):
            raise ValueError(f"regex '{body}' nests repetitions (like (a+)+) and can take exponential time; simplify it")
        return Matcher(text, regex, mode="re")
    anchored = text.startswith("^")
    glob = text[1:] if anchored else text
    if not glob:
        raise ValueError("empty pattern")
    regex = re.compile(fnmatch.translate(glob))
    if anchored:
        return Matcher(text, regex, anchored=True, mode="anchored")
    tokens = _glob_tokens(glob)
    star = next((offset for offset, is_star in tokens if is_star), None)
    head = glob if star is None else glob[:star]
    literal = head if not any(c in head for c in "?[") else None
    if star is None:
        return Matcher(text, regex, fixed_len=len(tokens), mode="fixed", literal=literal)
    if star == 0:  # a leading * already reaches every dotted tail
        return Matcher(text, regex, mode="star")
    head_len = sum(1 for offset, _ in tokens if offset < star)
    return Matcher(text, regex, head=re.compile(fnmatch.translate(head)), head_len=head_len, literal=literal)


# -- the policy ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    """One ordered rule: selectors (all must hold) and the dtypes they expect."""

    index: int
    source: str
    """Where it was written: ``file:line``."""
    name: str | None = None
    match: tuple[Matcher, ...] = ()
    ndim: tuple[str, int] | None = None
    kind: frozenset[str] | None = None
    module: tuple[Matcher, ...] = ()
    region: str | None = None
    scheme: tuple[Matcher, ...] = ()
    """Quantization schemes (globs over ``int4 gptq g128 sym``, ``fp8-e4m3 block 128x128``); ``none`` selects
    unquantized tensors, any other pattern only quantized logical weights."""
    dtypes: frozenset[str] | None = None
    """None means any dtype; empty (written ``none``) allows nothing: every tensor the rule selects is a finding."""
    severity: Severity = "error"
    reason: str | None = None
    optional: bool = False
    """May match nothing without an ``unused-rule`` warning: written ``optional: true``, or a shipped preset's rule."""

    covers_integers: bool = field(init=False, repr=False, compare=False)
    """Whether integer and bool tensors meet this rule: only when its dtypes name one (or are ``any``)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "covers_integers", self.dtypes is None or any(not dtypes.is_floating(d) for d in self.dtypes))

    @property
    def label(self) -> str:
        return self.name or f"rule {self.index + 1} ({self.source})"

    def selectors(self) -> str:
        """The rule's selectors as written, for messages: ``match: lm_head.*; ndim: <=1``."""
        parts = []
        if self.match:
            parts.append("match: " + ", ".join(m.text for m in self.match))
        if self.ndim is not None:
            parts.append(f"ndim: {self.ndim[0]}{self.ndim[1]}")
        if self.kind is not None:
            parts.append("kind: " + "/".join(sorted(self.kind)))
        if self.module:
            parts.append("module: " + ", ".join(m.text for m in self.module))
        if self.region is not None:
            parts.append(f"region: {self.region}")
        if self.scheme:
            parts.append("scheme: " + ", ".join(m.text for m in self.scheme))
        return "; ".join(parts)

    def miss(self, t: TensorRecord) -> str | None:
        """The first selector that does not hold for ``t`` (``dtype`` for the dtype scope, else the key as
        written: ``match``, ``ndim``, ...), or None when the rule applies.

        The one matcher: ``applies`` and ``why_not`` both ask it, so what decides a tensor and what ``--explain``
        says about it cannot drift apart. It returns a constant, so the hot path composes no message.
        """
        if not self.covers_integers and not dtypes.is_floating(t.dtype):
            return "dtype"
        if self.match and not any(m(t.name) for m in self.match):
            return "match"
        if self.ndim is not None and not _OPS[self.ndim[0]](t.ndim, self.ndim[1]):
            return "ndim"
        if self.kind is not None and t.kind not in self.kind:
            return "kind"
        if self.module and self.module_via(t) is None:
            return "module"
        if self.region is not None and t.region != self.region:
            return "region"
        if self.scheme and not self.scheme_matches(t):
            return "scheme"
        return None

    def applies(self, t: TensorRecord) -> bool:
        """Whether every selector holds for ``t``."""
        return self.miss(t) is None

    def why_not(self, t: TensorRecord) -> str | None:
        """None when the rule applies to ``t``; otherwise why the first selector that does not hold fails."""
        missed = self.miss(t)
        if missed is None:
            return None
        if missed == "dtype":
            return f"{t.dtype} is not floating-point, and the rule's dtypes ({_dtype_text(self.dtypes)}) name no integer type"
        if missed == "match":
            return f"name does not match {', '.join(m.text for m in self.match)}"
        if missed == "ndim":
            assert self.ndim is not None
            return f"ndim {t.ndim} is not {self.ndim[0]} {self.ndim[1]}"
        if missed == "kind":
            return f"kind {t.kind} is not {'/'.join(sorted(self.kind or ()))}"
        if missed == "module":
            if t.module is None and t.module_guess is None:
                return "module type unknown (not sure from names and shapes; give --model FACTORY)"
            return f"module {module_text(t)} is not {', '.join(m.text for m in self.module)}"
        if missed == "region":
            return f"region {t.region} is not {self.region}"
        return f"scheme {t.scheme or 'none (not quantized)'} is not {', '.join(m.text for m in self.scheme)}"

    def scheme_matches(self, t: TensorRecord) -> bool:
        if t.scheme is None:
            return any(m.text == "none" for m in self.scheme)
        return any(m.text != "none" and m(t.scheme) for m in self.scheme)

    def module_via(self, t: TensorRecord) -> str | None:
        """``module`` or ``guess``: which of ``t``'s module types a ``module:`` selector matches; None for neither."""
        if t.module is not None and any(m(t.module) for m in self.module):
            return "module"
        if t.module_guess is not None and any(m(t.module_guess) for m in self.module):
            return "guess"
        return None

    def how(self, t: TensorRecord) -> str:
        """For ``--explain``: the tail of ``t``'s name a glob matched, when it is not the whole name, and the
        guessed module type a ``module:`` selector matched; else ``""``."""
        parts = []
        for m in self.match:
            at = m.start(t.name)
            if at is not None:
                if at and not m.text.startswith("re:"):
                    parts.append(f"{m.text} matches '{t.name[at:]}' after the '{t.name[:at]}' prefix")
                break
        if self.module and self.module_via(t) == "guess":
            parts.append(f"module type guessed from names and shapes: {t.module_guess}")
        return "; ".join(parts)

    def expects(self, dtype: str) -> bool:
        return self.dtypes is None or dtype in self.dtypes


def _inside(m: Matcher, module: str) -> bool:
    """Whether an ancestor of ``module`` (a dotted path) matches ``m``."""
    while "." in module:
        module = module.rpartition(".")[0]
        if m(module):
            return True
    return False


KEEP_IN_FP32 = "keep-in-fp32"
KEPT_REASON = "kept in fp32 (keep_in_fp32): it runs in fp32, its inputs cast to fp32 on entry and its outputs cast back on exit"


def _kept_rule(path: str, index: int, source: str) -> Rule:
    """The rule a ``keep_in_fp32`` entry implies: every floating tensor under the module is float32."""
    return Rule(
        index=index,
        source=source,
        name=f"{KEEP_IN_FP32} {path}",
        match=(compile_matcher(f"{path}.*"),),
        dtypes=frozenset({"float32"}),
        reason=KEPT_REASON,
        optional=True,  # a kept module may hold no tensor of its own (attention's score arithmetic, a residual add)
    )


def _dtype_text(expected: frozenset[str] | None) -> str:
    return "any dtype" if expected is None else " or ".join(sorted(expected))


def module_text(t: TensorRecord) -> str:
    """``t``'s module type for messages: ``LlamaRMSNorm``, ``RMSNorm (guessed from names and shapes)``, ``unknown``."""
    guess = f"{t.module_guess} (guessed from names and shapes)" if t.module_guess else None
    if t.module and guess:
        return f"{t.module}, {guess}"
    return t.module or guess or "unknown"


@dataclass(frozen=True)
class TracePolicy:
    """A policy's ``trace:`` section: what ``dtypeaudit trace`` must show."""

    fail_on: Severity | None = None
    """The trace's failing severity; ``--fail-on`` wins over it, and it wins over the policy's own ``fail_on``."""
    allow_promotion: tuple[Matcher, ...] = ()
    """Module paths whose implicit promotion is meant: ``--allow-promotion``'s patterns, matched as names are."""


@dataclass(frozen=True)
class Policy:
    """A validated policy; ``rules`` are in precedence order (a file's own before those it extends)."""

    source: str
    version: int = 1
    default: frozenset[str] | None = None
    default_severity: Severity = "error"
    check_integers: bool = False
    ignore: tuple[Matcher, ...] = ()
    rules: tuple[Rule, ...] = ()
    fail_on: Severity | None = None
    strict: bool = False
    """Raise every finding a loader might read differently from dtypeaudit to an error (``--strict``)."""
    requires_quantized: bool = False
    """The policy is for quantized checkpoints (fp8-serving): one without any quantized weight is an error."""
    target: str | None = None
    """A hardware target's name (``targets.resolve``): dtypes it cannot compute or only emulates are findings."""
    default_dtype: str | None = None
    """What ``torch.get_default_dtype()`` must be when a live object is audited (``dtypeaudit.audit``)."""
    trace: TracePolicy = field(default_factory=TracePolicy)
    """The ``trace:`` section, for ``dtypeaudit trace``."""
    extends: tuple[str, ...] = field(default=())
    """The chain of sources this policy extends, nearest first."""
    optional_ignores: frozenset[int] = frozenset()
    """Indices into ``ignore`` of patterns that come from a shipped preset (no ``unused-rule`` for them)."""
    keep_in_fp32: tuple[Matcher, ...] = ()
    """Module paths kept in fp32 (``keep_in_fp32:``): their floating tensors expect float32 (a rule of their own,
    ahead of the others), and at run time they cast their floating inputs to fp32 on entry and their floating outputs
    back on exit (``dtypeaudit.apply``), so the checks do not count them as outliers of a half model."""

    def kept_in_fp32(self, module: str) -> bool:
        """Whether the module at dotted path ``module`` is one of ``keep_in_fp32`` or inside one."""
        return any(m(module) or _inside(m, module) for m in self.keep_in_fp32)

    def unused_rules(self, inventories: Iterable[Inventory]) -> list[Finding]:
        """``unused-rule`` warnings: each rule and ignore pattern that decides no tensor of any inventory.

        Computed over every checkpoint of one run, so a rule for tensors that only some checkpoints
        hold is not reported. A rule is unused when no tensor meets its selectors, when every tensor
        that does is decided by an earlier rule, or when it selects by module type and no tensor
        carries one (no ``--model``). Preset rules and ``optional: true`` rules are exempt.
        """
        if all(r.optional for r in self.rules) and len(self.optional_ignores) == len(self.ignore):
            return []  # a preset as shipped: nothing of the user's to report
        invs = list(inventories)
        selected = [0] * len(self.rules)
        decided = [0] * len(self.rules)
        gated = [0] * len(self.rules)
        first_decider: dict[int, int] = {}
        ignored = [0] * len(self.ignore)
        have_modules = have_guesses = False
        for inv in invs:
            for t in policy_records(inv):
                have_modules = have_modules or t.module is not None
                have_guesses = have_guesses or t.module_guess is not None
                hit = next((i for i, m in enumerate(self.ignore) if m(t.name)), None)
                if hit is not None:
                    ignored[hit] += 1
                    continue
                unchecked = not self.check_integers and not dtypes.is_floating(t.dtype)
                winner: int | None = None
                for i, r in enumerate(self.rules):
                    if (r.optional and winner is not None) or not r.applies(t):
                        continue
                    if unchecked:
                        gated[i] += 1
                        continue
                    selected[i] += 1
                    if winner is None:
                        winner = i
                        decided[i] += 1
                    else:
                        first_decider.setdefault(i, winner)
        where = invs[0].path if len(invs) == 1 else f"any of the {len(invs)} checkpoints scanned"
        out = []
        for i, r in enumerate(self.rules):
            if r.optional or decided[i]:
                continue
            head = f"rule {r.label} ({r.selectors()})"
            if r.module and not have_modules and not have_guesses:
                why = (
                    "selects by module type, but no tensor's module type is known or can be guessed from names and shapes "
                    "(give --model FACTORY, or select by name with match)"
                )
            elif r.module and not have_modules and not selected[i] and not gated[i]:
                why = (
                    f"matches no tensor in {where}: without --model, module types are guessed from names and shapes "
                    "(BatchNorm, LayerNorm, RMSNorm, Linear, Conv1d/2d/3d, Embedding); give --model FACTORY for the model's own"
                )
            elif selected[i]:
                why = f"matches {selected[i]} tensor(s), but {self.rules[first_decider[i]].label} comes first and decides them all"
            elif gated[i]:
                why = f"matches only {gated[i]} integer/bool tensor(s), which are not checked without check_integers: true"
            else:
                why = f"matches no tensor in {where}"
                if r.match and not any(m.text.startswith("re:") for m in r.match):
                    why += f" ({GLOB_RULE})"
            out.append(Finding("unused-rule", "warning", f"{head} {why}; it checks nothing (mark it optional: true if that is expected)"))
        for i, m in enumerate(self.ignore):
            if not ignored[i] and i not in self.optional_ignores:
                out.append(Finding("unused-rule", "warning", f"ignore pattern '{m.text}' matches no tensor in {where}; it ignores nothing"))
        return out


@dataclass(frozen=True)
class Decision:
    """How the policy treats one tensor."""

    tensor: TensorRecord
    rule: Rule | None
    """The rule that matched, or None for the default / skipped."""
    expected: frozenset[str] | None
    """None: any dtype. Meaningless when ``skipped``."""
    severity: Severity
    skipped: str | None = None
    """Why the tensor is not checked (ignored, non-floating), or None."""

    @property
    def ok(self) -> bool:
        return self.skipped is not None or self.expected is None or self.tensor.dtype in self.expected


def decide(policy: Policy, t: TensorRecord) -> Decision:
    """First matching rule wins; floating tensors no rule matches get the default."""
    for m in policy.ignore:
        if m(t.name):
            return Decision(t, None, None, "info", skipped=f"ignored by '{m.text}'")
    floating = dtypes.is_floating(t.dtype)
    if not floating and not policy.check_integers:
        return Decision(t, None, None, "info", skipped=f"{t.dtype} is not floating-point and check_integers is off")
    for r in policy.rules:
        if r.applies(t):
            return Decision(t, r, r.dtypes, r.severity)
    if not floating:
        return Decision(t, None, None, "info", skipped=f"no rule matches this {t.dtype} tensor, and the default covers floating-point only")
    return Decision(t, None, policy.default, policy.default_severity)


# -- loading --------------------------------------------------------------------------------------


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


@dataclass(frozen=True)
class Preset:
    """A shipped policy, as ``policy presets`` lists it."""

    name: str
    description: str
    """The YAML header's first comment line, without the ``name:`` it starts with."""
    alias_of: str | None = None
    """The preset this one only renames (a file of just ``version`` and ``extends``), or None."""


def presets() -> list[Preset]:
    """Every shipped preset, canonical ones first, then the aliases kept for compatibility."""
    import yaml

    out = []
    for name in preset_names():
        text = (PRESET_DIR / f"{name}.yaml").read_text(encoding="utf-8")
        first = text.splitlines()[0].lstrip("# ") if text else ""
        description = first.removeprefix(f"{name}:").strip()
        raw = yaml.safe_load(text)
        alias_of = raw.get("extends") if isinstance(raw, dict) and set(raw) <= {"version", "extends"} else None
        out.append(Preset(name, description, alias_of))
    return sorted(out, key=lambda p: (p.alias_of is not None, p.name))


def _is_preset_file(path: Path) -> bool:
    try:
        return path.resolve().parent == PRESET_DIR.resolve()
    except OSError:
        return False


def resolve_source(spec: str, *, relative_to: Path | None = None) -> Path:
    """A preset name or a file path (relative to the extending file)."""
    candidate = Path(spec)
    if relative_to is not None and not candidate.is_absolute():
        candidate = relative_to.parent / candidate
    if candidate.suffix in (".yaml", ".yml") or candidate.exists():
        if not candidate.is_file():
            raise PolicyError("no such policy file", path=str(candidate))
        return candidate
    preset = PRESET_DIR / f"{spec}.yaml"
    if preset.is_file():
        return preset
    raise PolicyError(
        f"unknown preset '{spec}'",
        hint=did_you_mean(spec, preset_names()) + f"presets: {', '.join(preset_names())}; or give a path to a .yaml file",
    )


def load_policy(spec: str) -> Policy:
    """Load a policy file or preset (``--policy`` / ``--preset``), following ``extends``."""
    return _load(resolve_source(spec), chain=())


def _load(path: Path, chain: tuple[str, ...]) -> Policy:
    key = str(path.resolve())
    if key in chain:
        raise PolicyError("extends itself through a cycle", path=str(path))
    raw, lines = _parse(path)
    own = _validate(raw, lines, str(path), builtin=_is_preset_file(path))
    parent_spec = raw.get("extends") if isinstance(raw, dict) else None
    if parent_spec is None:
        return own
    try:
        parent = _load(resolve_source(parent_spec, relative_to=path), chain + (key,))
    except PolicyError as exc:
        if exc.line is None and exc.path is None:
            raise PolicyError(
                f"extends '{parent_spec}': {exc.message}", path=str(path), line=lines.get(("extends",)), hint=exc.hint
            ) from None
        raise
    rules = tuple(replace(r, index=i) for i, r in enumerate(own.rules + parent.rules))
    return Policy(
        source=own.source,
        version=own.version,
        default=own.default if "default" in raw else parent.default,
        default_severity=own.default_severity if "default" in raw else parent.default_severity,
        check_integers=own.check_integers if "check_integers" in raw else parent.check_integers,
        ignore=own.ignore + parent.ignore,
        optional_ignores=own.optional_ignores | {i + len(own.ignore) for i in parent.optional_ignores},
        rules=rules,
        keep_in_fp32=own.keep_in_fp32 + parent.keep_in_fp32,
        fail_on=own.fail_on if own.fail_on is not None else parent.fail_on,
        strict=own.strict if "strict" in raw else parent.strict,
        requires_quantized=own.requires_quantized if "requires_quantized" in raw else parent.requires_quantized,
        target=own.target if "target" in raw else parent.target,
        default_dtype=own.default_dtype if "default_dtype" in raw else parent.default_dtype,
        trace=TracePolicy(
            fail_on=own.trace.fail_on if own.trace.fail_on is not None else parent.trace.fail_on,
            allow_promotion=own.trace.allow_promotion + parent.trace.allow_promotion,
        ),
        extends=(parent.source, *parent.extends),
    )


Lines = dict[tuple[object, ...], int]
_CORE_TAGS = frozenset({"!", *(f"tag:yaml.org,2002:{t}" for t in ("str", "int", "float", "bool", "null", "map", "seq"))})


def _parse(path: Path) -> tuple[dict[str, Any], Lines]:
    """safe YAML only: no aliases, no tags beyond the core schema, no duplicate keys, size capped."""
    import yaml

    try:
        data = path.read_bytes()
    except OSError as exc:
        raise PolicyError(f"cannot read ({exc.strerror or exc})", path=str(path)) from None
    if len(data) > MAX_POLICY_BYTES:
        raise PolicyError(f"policy is {len(data)} bytes, over the {MAX_POLICY_BYTES}-byte cap", path=str(path))
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise PolicyError("policy is not UTF-8 text", path=str(path)) from None
    try:
        for event in yaml.parse(text, Loader=yaml.SafeLoader):
            if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None):
                raise PolicyError("YAML anchors and aliases are not allowed in a policy", path=str(path), line=_line(event))
            tag = getattr(event, "tag", None)
            if tag and tag not in _CORE_TAGS:
                raise PolicyError(f"YAML tag '{tag}' is not allowed in a policy", path=str(path), line=_line(event))
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        problem = getattr(exc, "problem", None) or str(exc)
        raise PolicyError(f"not valid YAML: {problem}", path=str(path), line=mark.line + 1 if mark else None) from None
    if node is None:
        raise PolicyError("policy is empty", path=str(path), hint="start from `dtypeaudit policy init CHECKPOINT` or a preset")
    lines: Lines = {}
    value = _construct(node, (), lines, str(path))
    if not isinstance(value, dict):
        raise PolicyError("a policy must be a mapping (version, default, rules, ...)", path=str(path), line=node.start_mark.line + 1)
    return value, lines


def _line(event: Any) -> int | None:
    mark = event.start_mark
    return mark.line + 1 if mark is not None else None


def _construct(node: Any, where: tuple[object, ...], lines: Lines, path: str) -> Any:
    import yaml

    lines[where] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        out: dict[Any, Any] = {}
        for key_node, value_node in node.value:
            key = _construct(key_node, where + ("<key>",), lines, path)
            if not isinstance(key, str):
                raise PolicyError(f"keys must be strings, not {key!r}", path=path, line=key_node.start_mark.line + 1)
            if key in out:
                raise PolicyError(f"duplicate key '{key}'", path=path, line=key_node.start_mark.line + 1)
            out[key] = _construct(value_node, where + (key,), lines, path)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_construct(item, where + (i,), lines, path) for i, item in enumerate(node.value)]
    return yaml.SafeLoader(" ").construct_object(node)


# -- validation: a schema table ------------------------------------------------------------------
#
# Each section of a policy is a table of fields: the key, the parser that checks and converts its value
# (raising a line-numbered PolicyError through ``fail``), the value when the key is absent, and the record
# attribute it fills. One walker (``_walk``) checks a section against its table: a mapping, no unknown keys,
# the required ones present, a rule selecting something; then each field's parser in table order.

Where = tuple[object, ...]
Fail = Callable[..., PolicyError]
Parse = Callable[[Any, Where, Fail], Any]


@dataclass(frozen=True)
class PolicyField:
    """One key of a policy section."""

    key: str
    parse: Parse
    default: Any = None
    """The parsed value when the key is absent."""
    attr: str = ""
    """The record attribute the parsed value fills; the key itself when empty."""
    required: str | None = None
    """The message when the key is missing; None for an optional key."""
    selector: bool = False
    """A rule selector: a rule must give at least one."""


@dataclass(frozen=True)
class PolicySection:
    """A mapping of a policy (the top level, ``default``, ``trace``, a rule) as a table of its fields."""

    label: str
    """How messages name it (``in rule``); empty for the top level."""
    fields: tuple[PolicyField, ...]
    not_mapping: str = ""
    """The message when the value is not a mapping."""
    not_mapping_hint: bool = False
    """Whether that message lists the valid keys."""

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(f.key for f in self.fields)


def _walk(section: PolicySection, value: Any, where: Where, fail: Fail) -> dict[str, Any]:
    """Check ``value`` against ``section``'s table; its fields' parsed values by attribute name."""
    keys = section.keys
    if not isinstance(value, dict):
        raise fail(where, section.not_mapping, hint=f"valid keys: {', '.join(keys)}" if section.not_mapping_hint else None)
    for key in value:
        if key not in keys:
            raise fail(
                where + (key,),
                f"unknown key '{key}'" + (f" in {section.label}" if section.label else ""),
                hint=did_you_mean(key, keys) + f"valid keys: {', '.join(keys)}",
            )
    for f in section.fields:
        if f.required is not None and f.key not in value:
            raise fail(where, f.required)
    selectors = [f.key for f in section.fields if f.selector]
    if selectors and not any(k in value for k in selectors):
        raise fail(where, f"{section.label} selects nothing: give {', '.join(selectors[:-1])} or {selectors[-1]}")
    return {f.attr or f.key: f.parse(value[f.key], where + (f.key,), fail) if f.key in value else f.default for f in section.fields}


# -- field parsers: (value, where, fail) -> the parsed value


def _boolean(value: Any, where: Where, fail: Fail) -> bool:
    if not isinstance(value, bool):
        raise fail(where, f"{where[-1]} must be true or false")
    return value


def _text(value: Any, where: Where, fail: Fail) -> str | None:
    """A string, or None for ``null``."""
    if value is not None and not isinstance(value, str):
        raise fail(where, f"{where[-1]} must be a string")
    return value


def _version(value: Any, where: Where, fail: Fail) -> int:
    if value != 1:
        raise fail(where, f"unsupported version {value!r}", hint="this dtypeaudit reads version: 1")
    return 1


def _extends(value: Any, where: Where, fail: Fail) -> str:
    if not isinstance(value, str):
        raise fail(where, "extends must be a preset name or a file path")
    return value


def _default(value: Any, where: Where, fail: Fail) -> tuple[frozenset[str] | None, Severity]:
    """``default: DTYPES`` or ``default: {dtype: DTYPES, severity: SEVERITY}``: (dtypes, severity)."""
    if not isinstance(value, dict):
        return _dtypes(value, where, fail), "error"
    spec = _walk(DEFAULT, value, where, fail)
    return spec["dtype"], spec["severity"]


def _default_dtype(value: Any, where: Where, fail: Fail) -> str:
    name = dtypes.canonical(value) if isinstance(value, str) else None
    if name is None or not dtypes.is_floating(name):
        raise fail(where, f"default_dtype must be a floating dtype, not {value!r}", hint="float32, float64, ...")
    return name


def _trace(value: Any, where: Where, fail: Fail) -> TracePolicy:
    """The ``trace:`` section: ``{fail_on: SEVERITY, allow_promotion: [PATTERN, ...]}``."""
    return TracePolicy(**_walk(TRACE, value, where, fail))


def _rules(value: Any, where: Where, fail: Fail) -> list[tuple[Where, dict[str, Any]]]:
    """Each rule's place and its fields (``_validate`` numbers them and adds where they were written)."""
    if not isinstance(value, list):
        raise fail(where, "rules must be a list of rules")
    return [(where + (i,), _walk(RULE, r, where + (i,), fail)) for i, r in enumerate(value)]


def _ndim(value: Any, where: Where, fail: Fail) -> tuple[str, int]:
    m = _NDIM.match(str(value)) if isinstance(value, (int, str)) and not isinstance(value, bool) else None
    if not m:
        raise fail(where, f"bad ndim {value!r}", hint="an integer or a comparison such as '<=1' or '>=2'")
    return (m.group(1) or "==", int(m.group(2)))


def _one_of(value: Any, where: Where, fail: Fail, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise fail(where, f"unknown {where[-1]} {value!r}", hint=did_you_mean(value, choices) + f"valid: {', '.join(choices)}")


def _kinds(value: Any, where: Where, fail: Fail) -> frozenset[str]:
    kinds = value if isinstance(value, list) else [value]
    for k in kinds:
        _one_of(k, where, fail, KINDS)
    return frozenset(kinds)


def _region(value: Any, where: Where, fail: Fail) -> str | None:
    if value is not None:
        _one_of(value, where, fail, REGIONS)
    return value


def _rule_dtypes(value: Any, where: Where, fail: Fail) -> frozenset[str] | None:
    return _dtypes(value, where, fail, allow_none=True)


def _target(value: Any, where: Where, fail: Fail) -> str:
    """A hardware target's name, as ``--target`` takes it; its canonical name."""
    from .errors import UsageError
    from .hardware import names, resolve

    if not isinstance(value, str):
        raise fail(where, "target must be a hardware target's name", hint=f"valid: {', '.join(names())}; or sm_XY")
    try:
        return resolve(value).name
    except UsageError as exc:
        raise fail(where, exc.message, hint=did_you_mean(value, names()) + f"valid: {', '.join(names())}; or sm_XY") from None


def did_you_mean(word: object, choices: Iterable[str]) -> str:
    """``"did you mean 'X'? "`` for the choice closest to a typo (difflib), else ``""``: a hint's first words."""
    import difflib

    if not isinstance(word, str):
        return ""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f"did you mean '{close[0]}'? " if close else ""


def _dtypes(value: Any, where: tuple[object, ...], fail: Fail, *, allow_none: bool = False) -> frozenset[str] | None:
    items = value if isinstance(value, list) else [value]
    if not items:
        raise fail(where, "an empty list of dtypes allows nothing", hint="write 'any' to allow every dtype, or 'none' to allow none")
    if allow_none and value == "none":
        return frozenset()  # a rule that forbids what it selects (``scheme: "*"`` with ``dtype: none``)
    out = set()
    for item in items:
        if item == "any":
            return None
        name = dtypes.canonical(item) if isinstance(item, str) else None
        if name is None:
            raise fail(
                where,
                f"unknown dtype {item!r}",
                hint=did_you_mean(item, [*dtypes.DTYPES, *dtypes.ALIASES, "any"])
                + "use torch's names (float32, float16, bfloat16, float8_e4m3fn, int64, ...), fp16/bf16/fp32, or any",
            )
        out.add(name)
    return frozenset(out)


def _module_paths(value: Any, where: Where, fail: Fail) -> tuple[str, ...]:
    """``keep_in_fp32``: a list of dotted module paths (``blocks.5.ff``), no wildcards."""
    items = value if isinstance(value, list) else [value]
    for i, item in enumerate(items):
        at = where + (i,) if isinstance(value, list) else where
        if not isinstance(item, str) or not re.fullmatch(r"[\w.-]+", item) or item.startswith(".") or item.endswith("."):
            raise fail(at, f"keep_in_fp32 takes dotted module paths (blocks.5.ff), not {item!r}")
    return tuple(items)


def _severity(value: Any, where: tuple[object, ...], fail: Fail) -> Severity:
    if value not in SEVERITIES:
        raise fail(where, f"unknown severity {value!r}", hint=did_you_mean(value, SEVERITIES) + "valid: error, warning, info")
    return value


def _matchers(value: Any, where: tuple[object, ...], fail: Fail) -> tuple[Matcher, ...]:
    items = value if isinstance(value, list) else [value]
    out = []
    for i, item in enumerate(items):
        at = where + (i,) if isinstance(value, list) else where
        if not isinstance(item, str):
            raise fail(at, f"pattern must be a string, not {item!r}")
        try:
            out.append(compile_matcher(item))
        except ValueError as exc:
            raise fail(at, str(exc)) from None
    return tuple(out)


DEFAULT = PolicySection(
    "default",
    (
        PolicyField("dtype", _dtypes),
        PolicyField("severity", _severity, default="error"),
    ),
)
TRACE = PolicySection(
    "trace",
    (
        PolicyField("fail_on", _severity),
        PolicyField("allow_promotion", _matchers, default=()),
    ),
    not_mapping="trace must be a mapping",
    not_mapping_hint=True,
)
RULE = PolicySection(
    "rule",
    (
        PolicyField("name", _text),
        PolicyField("match", _matchers, default=(), selector=True),
        PolicyField("ndim", _ndim, selector=True),
        PolicyField("kind", _kinds, selector=True),
        PolicyField("module", _matchers, default=(), selector=True),
        PolicyField("region", _region, selector=True),
        PolicyField("scheme", _matchers, default=(), selector=True),
        PolicyField("dtype", _rule_dtypes, attr="dtypes", required="rule has no 'dtype' (a dtype, a list of dtypes, or any)"),
        PolicyField("severity", _severity, default="error"),
        PolicyField("reason", _text),
        PolicyField("optional", _boolean, default=False),
    ),
    not_mapping="each rule must be a mapping with at least 'dtype'",
)
TOP = PolicySection(
    "",
    (
        PolicyField("version", _version, default=1),
        PolicyField("extends", _extends),
        PolicyField("default", _default, default=(None, "error")),
        PolicyField("check_integers", _boolean, default=False),
        PolicyField("ignore", _matchers, default=()),
        PolicyField("keep_in_fp32", _module_paths, default=()),
        PolicyField("rules", _rules, default=()),
        PolicyField("fail_on", _severity),
        PolicyField("strict", _boolean, default=False),
        PolicyField("requires_quantized", _boolean, default=False),
        PolicyField("target", _target),
        PolicyField("default_dtype", _default_dtype),
        PolicyField("trace", _trace, default=TracePolicy()),
    ),
)


def _validate(raw: dict[str, Any], lines: Lines, source: str, *, builtin: bool = False) -> Policy:
    def fail(where: Where, message: str, hint: str | None = None) -> PolicyError:
        line = lines.get(where)
        while line is None and where:
            where = where[:-1]
            line = lines.get(where)
        return PolicyError(message, path=source, line=line, hint=hint)

    top = _walk(TOP, raw, (), fail)
    kept = tuple(
        _kept_rule(path, i, f"{Path(source).name}:{lines.get(('keep_in_fp32', i), lines.get(('keep_in_fp32',), '?'))}")
        for i, path in enumerate(top["keep_in_fp32"])
    )
    rules = kept + tuple(
        Rule(
            index=len(kept) + i,
            source=f"{Path(source).name}:{lines.get(where, '?')}",
            **{**fields, "optional": fields["optional"] or builtin},
        )
        for i, (where, fields) in enumerate(top["rules"])
    )
    default, default_severity = top["default"]
    return Policy(
        source=source,
        version=1,
        default=default,
        default_severity=default_severity,
        check_integers=top["check_integers"],
        ignore=top["ignore"],
        optional_ignores=frozenset(range(len(top["ignore"]))) if builtin else frozenset(),
        rules=rules,
        fail_on=top["fail_on"],
        strict=top["strict"],
        requires_quantized=top["requires_quantized"],
        target=top["target"],
        default_dtype=top["default_dtype"],
        trace=top["trace"],
        keep_in_fp32=tuple(compile_matcher(p) for p in top["keep_in_fp32"]),
    )
