"""YAML dtype policies: parse safely, validate declaratively with line numbers, compile matchers once.

A policy says which dtype each tensor should have::

    version: 1
    extends: fp16-mixed          # a preset name or another file, relative to this one
    default: float16             # floating tensors no rule matches
    check_integers: true         # also hold integer/bool tensors to the rules
    strict: true                 # fail on anything a loader might read differently (security gates)
    ignore: ["optimizer.*"]      # never checked
    rules:                       # first match wins
      - match: "*norm*"          # glob, or "re:<regex>"; a list means any of them
        ndim: "<=1"              # also: kind, module, region
        dtype: float32           # a dtype, a list of them, or "any"
        severity: error
        reason: LayerNorm is unstable in fp16
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import dtypes
from .errors import PolicyError
from .inventory import SEVERITIES, Severity, TensorRecord

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


# -- matchers ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Matcher:
    """A name pattern: a glob, or a regex written ``re:<pattern>``; compiled at load time."""

    text: str
    regex: re.Pattern[str]

    def __call__(self, name: str) -> bool:
        return self.regex.fullmatch(name) is not None if not self.text.startswith("re:") else self.regex.search(name) is not None


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
        return Matcher(text, regex)
    if not text:
        raise ValueError("empty pattern")
    return Matcher(text, re.compile(fnmatch.translate(text)))


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
    dtypes: frozenset[str] | None = None
    """None means any dtype."""
    severity: Severity = "error"
    reason: str | None = None

    @property
    def label(self) -> str:
        return self.name or f"rule {self.index + 1} ({self.source})"

    def why_not(self, t: TensorRecord) -> str | None:
        """None when the rule applies to ``t``; otherwise the first selector that does not hold."""
        if self.match and not any(m(t.name) for m in self.match):
            return f"name does not match {', '.join(m.text for m in self.match)}"
        if self.ndim is not None and not _OPS[self.ndim[0]](t.ndim, self.ndim[1]):
            return f"ndim {t.ndim} is not {self.ndim[0]} {self.ndim[1]}"
        if self.kind is not None and t.kind not in self.kind:
            return f"kind {t.kind} is not {'/'.join(sorted(self.kind))}"
        if self.module:
            if t.module is None:
                return "module type unknown (give --model FACTORY)"
            if not any(m(t.module) for m in self.module):
                return f"module {t.module} is not {', '.join(m.text for m in self.module)}"
        if self.region is not None and t.region != self.region:
            return f"region {t.region} is not {self.region}"
        return None

    def expects(self, dtype: str) -> bool:
        return self.dtypes is None or dtype in self.dtypes


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
    extends: tuple[str, ...] = field(default=())
    """The chain of sources this policy extends, nearest first."""


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
    floating = dtypes.get(t.dtype).is_floating if t.dtype in dtypes.DTYPES else False
    if not floating and not policy.check_integers:
        return Decision(t, None, None, "info", skipped=f"{t.dtype} is not floating-point and check_integers is off")
    for r in policy.rules:
        if r.why_not(t) is None:
            return Decision(t, r, r.dtypes, r.severity)
    if not floating:
        return Decision(t, None, None, "info", skipped=f"no rule matches this {t.dtype} tensor, and the default covers floating-point only")
    return Decision(t, None, policy.default, policy.default_severity)


# -- loading --------------------------------------------------------------------------------------


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


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
    raise PolicyError(f"unknown preset '{spec}'", hint=f"presets: {', '.join(preset_names())}; or give a path to a .yaml file")


def load_policy(spec: str) -> Policy:
    """Load a policy file or preset (``--policy`` / ``--preset``), following ``extends``."""
    return _load(resolve_source(spec), chain=())


def _load(path: Path, chain: tuple[str, ...]) -> Policy:
    key = str(path.resolve())
    if key in chain:
        raise PolicyError("extends itself through a cycle", path=str(path))
    raw, lines = _parse(path)
    own = _validate(raw, lines, str(path))
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
    rules = tuple(Rule(**{**r.__dict__, "index": i}) for i, r in enumerate(own.rules + parent.rules))
    return Policy(
        source=own.source,
        version=own.version,
        default=own.default if "default" in raw else parent.default,
        default_severity=own.default_severity if "default" in raw else parent.default_severity,
        check_integers=own.check_integers if "check_integers" in raw else parent.check_integers,
        ignore=own.ignore + parent.ignore,
        rules=rules,
        fail_on=own.fail_on if own.fail_on is not None else parent.fail_on,
        strict=own.strict if "strict" in raw else parent.strict,
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


# -- validation: a declarative schema ------------------------------------------------------------

TOP_KEYS = ("version", "extends", "default", "check_integers", "ignore", "rules", "fail_on", "strict")
RULE_KEYS = ("name", "match", "ndim", "kind", "module", "region", "dtype", "severity", "reason")


def _validate(raw: dict[str, Any], lines: Lines, source: str) -> Policy:
    def fail(where: tuple[object, ...], message: str, hint: str | None = None) -> PolicyError:
        line = lines.get(where)
        while line is None and where:
            where = where[:-1]
            line = lines.get(where)
        return PolicyError(message, path=source, line=line, hint=hint)

    for key in raw:
        if key not in TOP_KEYS:
            raise fail((key,), f"unknown key '{key}'", hint=f"valid keys: {', '.join(TOP_KEYS)}")
    version = raw.get("version", 1)
    if version != 1:
        raise fail(("version",), f"unsupported version {version!r}", hint="this dtypeaudit reads version: 1")
    if "extends" in raw and not isinstance(raw["extends"], str):
        raise fail(("extends",), "extends must be a preset name or a file path")

    default: frozenset[str] | None = None
    default_severity: Severity = "error"
    if "default" in raw:
        spec = raw["default"]
        if isinstance(spec, dict):
            for key in spec:
                if key not in ("dtype", "severity"):
                    raise fail(("default", key), f"unknown key '{key}' in default", hint="valid keys: dtype, severity")
            default = _dtypes(spec.get("dtype", "any"), ("default", "dtype"), fail)
            default_severity = _severity(spec.get("severity", "error"), ("default", "severity"), fail)
        else:
            default = _dtypes(spec, ("default",), fail)
    check_integers = raw.get("check_integers", False)
    if not isinstance(check_integers, bool):
        raise fail(("check_integers",), "check_integers must be true or false")
    fail_on = _severity(raw["fail_on"], ("fail_on",), fail) if "fail_on" in raw else None
    strict = raw.get("strict", False)
    if not isinstance(strict, bool):
        raise fail(("strict",), "strict must be true or false")

    ignore = _matchers(raw.get("ignore", []), ("ignore",), fail)
    rules_raw = raw.get("rules", [])
    if not isinstance(rules_raw, list):
        raise fail(("rules",), "rules must be a list of rules")
    rules = []
    for i, r in enumerate(rules_raw):
        where = ("rules", i)
        if not isinstance(r, dict):
            raise fail(where, "each rule must be a mapping with at least 'dtype'")
        for key in r:
            if key not in RULE_KEYS:
                raise fail(where + (key,), f"unknown key '{key}' in rule", hint=f"valid keys: {', '.join(RULE_KEYS)}")
        if "dtype" not in r:
            raise fail(where, "rule has no 'dtype' (a dtype, a list of dtypes, or any)")
        if not any(k in r for k in ("match", "ndim", "kind", "module", "region")):
            raise fail(where, "rule selects nothing: give match, ndim, kind, module or region")
        ndim = None
        if "ndim" in r:
            m = _NDIM.match(str(r["ndim"])) if isinstance(r["ndim"], (int, str)) and not isinstance(r["ndim"], bool) else None
            if not m:
                raise fail(where + ("ndim",), f"bad ndim {r['ndim']!r}", hint="an integer or a comparison such as '<=1' or '>=2'")
            ndim = (m.group(1) or "==", int(m.group(2)))
        kind = None
        if "kind" in r:
            kinds = r["kind"] if isinstance(r["kind"], list) else [r["kind"]]
            for k in kinds:
                if k not in KINDS:
                    raise fail(where + ("kind",), f"unknown kind {k!r}", hint=f"valid: {', '.join(KINDS)}")
            kind = frozenset(kinds)
        region = r.get("region")
        if region is not None and region not in REGIONS:
            raise fail(where + ("region",), f"unknown region {region!r}", hint=f"valid: {', '.join(REGIONS)}")
        name = r.get("name")
        if name is not None and not isinstance(name, str):
            raise fail(where + ("name",), "name must be a string")
        reason = r.get("reason")
        if reason is not None and not isinstance(reason, str):
            raise fail(where + ("reason",), "reason must be a string")
        rules.append(
            Rule(
                index=i,
                source=f"{Path(source).name}:{lines.get(where, '?')}",
                name=name,
                match=_matchers(r.get("match", []), where + ("match",), fail),
                ndim=ndim,
                kind=kind,
                module=_matchers(r.get("module", []), where + ("module",), fail),
                region=region,
                dtypes=_dtypes(r["dtype"], where + ("dtype",), fail),
                severity=_severity(r.get("severity", "error"), where + ("severity",), fail),
                reason=reason,
            )
        )
    return Policy(
        source=source,
        version=1,
        default=default,
        default_severity=default_severity,
        check_integers=check_integers,
        ignore=ignore,
        rules=tuple(rules),
        fail_on=fail_on,
        strict=strict,
    )


Fail = Callable[..., PolicyError]


def _dtypes(value: Any, where: tuple[object, ...], fail: Fail) -> frozenset[str] | None:
    items = value if isinstance(value, list) else [value]
    if not items:
        raise fail(where, "an empty list of dtypes allows nothing", hint="write 'any' to allow every dtype")
    out = set()
    for item in items:
        if item == "any":
            return None
        name = dtypes.canonical(item) if isinstance(item, str) else None
        if name is None:
            raise fail(
                where,
                f"unknown dtype {item!r}",
                hint="use torch's names (float32, float16, bfloat16, float8_e4m3fn, int64, ...), fp16/bf16/fp32, or any",
            )
        out.add(name)
    return frozenset(out)


def _severity(value: Any, where: tuple[object, ...], fail: Fail) -> Severity:
    if value not in SEVERITIES:
        raise fail(where, f"unknown severity {value!r}", hint="valid: error, warning, info")
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
