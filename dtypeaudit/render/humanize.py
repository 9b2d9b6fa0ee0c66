"""Numbers and names as people read them; shared by the text and markdown renderers."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..inventory import CheckpointReport, Finding, TensorRecord

if TYPE_CHECKING:
    from ..diff import Change


def human_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


def human_count(n: int) -> str:
    for limit, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= limit:
            return f"{n / limit:.1f}{suffix}"
    return str(n)


def change_parts(c: Change, *, arrow: str = "->", tolerance: float | None = None) -> list[str]:
    """What changed in one tensor between two checkpoints, in words (``float32 -> float16``, ``values differ``);
    with ``tolerance``, values equal within it say so. The diff's text and HTML renderers both say it this way."""
    parts = []
    if c.dtype_changed:
        parts.append(f"{c.before.dtype} {arrow} {c.after.dtype}")
    if c.shape_changed:
        parts.append(f"{shape_text(c.before.shape)} {arrow} {shape_text(c.after.shape)}")
    if c.values_differ:
        parts.append("values differ")
    elif c.values is not None and c.values.state == "equal" and tolerance is not None:
        parts.append(f"values within {tolerance:g}")
    return parts


def shape_text(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


@dataclass(frozen=True)
class TensorGroup:
    """Tensors that differ only in their layer numbers, shown as one row."""

    label: str
    dtype: str
    shape: tuple[int, ...]
    kind: str
    count: int
    nbytes: int
    members: tuple[TensorRecord, ...]


_NUMBER = re.compile(r"(?<=\.)\d+(?=\.)|^\d+(?=\.)")


_DOTTED_NUMBER = re.compile(r"\.(\d+)(?=\.)")
"""``_NUMBER`` in names each written with a leading dot (``_dotted``), where it needs no lookbehind and no anchor."""


def _dotted(names: list[str]) -> str | None:
    """The names joined by newlines, each with a leading dot, for one regex call over all of them (a call per name was
    most of a million-tensor table's grouping); None where a name holds a newline itself."""
    joined = "\n.".join(names)
    return None if joined.count("\n") != max(len(names) - 1, 0) else "." + joined


_FOLD_BATCH = 1 << 16
"""Names folded per regex call by ``_folded``: the joined text of a batch is held, never a million names' at once."""


def _folded(records: Sequence[TensorRecord]) -> Iterator[str]:
    """``"." + _NUMBER.sub("*", name)`` of each record's name."""
    for at in range(0, len(records), _FOLD_BATCH):
        names = [t.name for t in records[at : at + _FOLD_BATCH]]
        dotted = _dotted(names)
        if dotted is None:
            yield from ("." + _NUMBER.sub("*", n) for n in names)
        else:
            yield from _DOTTED_NUMBER.sub(".*", dotted).split("\n")


def fold_label(names: list[str]) -> str:
    if len(names) == 1:
        return names[0]
    parts = [n.split(".") for n in names]
    if len({len(p) for p in parts}) != 1:
        return _NUMBER.sub("*", names[0])
    out = []
    for column in zip(*parts, strict=True):
        values = list(dict.fromkeys(column))
        if len(values) == 1:
            out.append(values[0])
        elif all(v.isdigit() for v in values):
            nums = sorted(int(v) for v in values)
            contiguous = nums == list(range(nums[0], nums[-1] + 1))
            out.append(f"{{{nums[0]}..{nums[-1]}}}" if contiguous else "*")
        else:
            out.append("*")
    return ".".join(out)


def _fold(pattern: str, names: list[str]) -> str:
    """``fold_label(names)`` for names that all fold to ``pattern`` (``_NUMBER.sub("*", name)``): only its ``*``
    components can differ between them (the others are the names' own), so only those are compared, where
    ``fold_label`` compares every component of every name (a million-tensor header's groups hold a million)."""
    if len(names) == 1:
        return names[0]
    out = pattern.split(".")
    stars = [i for i, part in enumerate(out) if part == "*"]
    dotted = _dotted(names)
    numbers = _DOTTED_NUMBER.findall(dotted) if dotted is not None else []
    if len(numbers) != len(stars) * len(names):  # a name with a ``*`` of its own, or a newline
        split = [n.split(".") for n in names]
        columns = [{s[i] for s in split} for i in stars]
    else:  # each name's numbers, in order, are its ``*`` components
        columns = [set(numbers[j :: len(stars)]) for j in range(len(stars))]
    for i, values in zip(stars, columns, strict=True):
        if len(values) == 1:
            out[i] = values.pop()
        elif all(v.isdigit() for v in values):
            nums = sorted(int(v) for v in values)
            contiguous = nums == list(range(nums[0], nums[-1] + 1))
            out[i] = f"{{{nums[0]}..{nums[-1]}}}" if contiguous else "*"
    return ".".join(out)


def group_tensors(tensors: Iterable[TensorRecord]) -> list[TensorGroup]:
    """Merge tensors whose names differ only in numeric components and share dtype, shape and kind."""
    buckets: dict[tuple[object, ...], list[TensorRecord]] = {}
    records = tensors if isinstance(tensors, (list, tuple)) else list(tensors)
    for t, folded in zip(records, _folded(records), strict=True):
        name = t.name
        # a name with no number to fold is its own pattern: the record's string, not a copy of it per tensor
        pattern = name if len(folded) == len(name) + 1 and folded.endswith(name) else folded[1:]
        key = (pattern, t.dtype, t.shape, t.kind, t.file)
        bucket = buckets.get(key)
        if bucket is None:
            buckets[key] = [t]  # not ``setdefault(key, [])``, which makes a list per tensor
        else:
            bucket.append(t)
    groups = []
    for found, members in buckets.items():
        first = members[0]
        groups.append(
            TensorGroup(
                label=_fold(str(found[0]), [m.name for m in members]),
                dtype=first.dtype,
                shape=first.shape,
                kind=first.kind,
                count=len(members),
                nbytes=sum(m.nbytes for m in members),
                members=tuple(members),
            )
        )
    return groups


# -- names in narrow columns ------------------------------------------------------------------------------------

_BREAK_AFTER = re.compile(r"(?<=[^.]\.)(?=[^.])|(?<=[\s,/])")  # after a lone dot: never inside a folded {0..31}


def name_parts(name: str) -> list[str]:
    """The pieces ``wrap_name`` never splits: dotted components with their dot (words, for a key with spaces)."""
    return [p for p in _BREAK_AFTER.split(name) if p]


def wrap_name(name: str, width: int) -> str:
    """``name`` in lines of at most ``width`` characters, broken after a dot (else a space, comma or slash),
    so that no dotted component is split; a component longer than the width alone is folded."""
    if width < 1 or len(name) <= width:
        return name
    lines: list[str] = []
    line = ""
    for piece in _BREAK_AFTER.split(name):
        while len(piece) > width:  # one component wider than the column: fold it, nothing else fits
            if line:
                lines.append(line)
                line = ""
            lines.append(piece[:width])
            piece = piece[width:]
        if len(line) + len(piece) > width and line:
            lines.append(line)
            line = ""
        line += piece
    if line:
        lines.append(line)
    return "\n".join(s.rstrip() or s for s in lines)


# -- text for consoles that cannot show everything -------------------------------------------------------------

_ASCII = str.maketrans(
    {
        "✓": "OK",
        "✗": "FAIL",
        "·": "-",
        "×": "x",
        "…": "...",
        "→": "->",
        "←": "<-",
        "—": "-",
        "–": "-",
        "≤": "<=",
        "≥": ">=",
        "─": "-",
        "━": "-",
        "═": "=",
        "│": "|",
        "┃": "|",
        "‘": "'",
        "’": "'",
        "“": '"',
        "”": '"',
    }
)


def for_encoding(text: str, encoding: str | None) -> str:
    """``text`` as a stream in ``encoding`` can write it: unchanged where it can, else the report's symbols and
    rules in ASCII (``✓`` -> ``OK``, box lines -> ``-``) and anything else left over as ``?``."""
    if not encoding:
        return text
    try:
        text.encode(encoding)
        return text
    except UnicodeEncodeError:
        pass
    except LookupError:
        encoding = "ascii"
    text = text.replace("✅ ", "").replace("❌ ", "")  # markdown's status marks: the word beside them says it
    return text.translate(_ASCII).encode(encoding, errors="replace").decode(encoding)


# -- findings that share a cause ----------------------------------------------------------------------------------

_TOKEN = re.compile(r"[\w.]+|[^\w.]")


@dataclass(frozen=True)
class FindingGroup:
    """Findings of one severity and rule that say the same thing about different subjects (tensors, globals)."""

    severity: str
    rule: str
    cause: str
    """The message, with ``{}`` where the subjects differ when they are named in it (a global's name)."""
    subjects: tuple[str, ...]
    """What each finding is about: its tensor (or file), else the part of its message that differs; "" for none."""
    also: tuple[str, ...] = ()
    """Other rules whose findings about these subjects are the same cause (a pickled module's class is also an
    unsafe global), folded in here."""

    @property
    def count(self) -> int:
        return len(self.subjects)

    def message(self) -> str:
        """The cause, with the subject put back when there is one (``{}`` stays only for several)."""
        if "{}" not in self.cause:
            text = self.cause
        elif len(self.subjects) == 1:
            text = self.cause.replace("{}", self.subjects[0], 1)
        else:
            text = self.cause.replace("{}", "each of these", 1)
        return text + (f" (each also {', '.join(self.also)})" if self.also else "")

    def first(self, shown: int = 3, *, every: bool = False) -> tuple[list[str], int]:
        """The first ``shown`` subjects named (all of them with ``every``), and how many more there are."""
        named = [s for s in self.subjects if s]
        if every or len(named) <= shown + 1:
            return named, 0
        return named[:shown], len(named) - shown

    def places(self, shown: int = 3, *, every: bool = False) -> str:
        """The subjects, the first ``shown`` and a count of the rest (all of them with ``every``)."""
        names, more = self.first(shown, every=every)
        return ", ".join(names) + (f" and {more} more" if more else "")


def _masked(tokens: list[str], at: int) -> str:
    return "".join(tokens[:at]) + "{}" + "".join(tokens[at + 1 :])


def group_findings(findings: Iterable[Finding]) -> list[FindingGroup]:
    """Findings grouped by severity, rule and cause, worst severity first, in order of first appearance.

    Findings about tensors share a cause when their messages are equal. Findings about no tensor (a global
    the pickle calls) share one when their messages differ in one word only, the same word for all: that word
    is the subject. So do those about one file of a folder (the globals ``training_args.bin`` calls): the cause
    then names the file, and the file is the subject when nothing else varies. A ``pickled-module`` finding's
    class is also reported as an ``unsafe-global``: one cause, so those ``unsafe-global`` findings are folded
    into the ``pickled-module`` group.
    """
    from ..inventory import severity_rank

    items = sorted(findings, key=lambda f: -severity_rank(f.severity))
    named: dict[tuple[str, str, str], list[str]] = {}
    loose: dict[tuple[str, str, str, int], list[list[str]]] = {}
    in_files: dict[tuple[str, str, str], list[str]] = {}
    for f in items:
        if f.tensor:
            named.setdefault((f.severity, f.rule, f.message), []).append(f.tensor)
        elif f.file:
            in_files.setdefault((f.severity, f.rule, f.message), []).append(f.file)
        else:
            tokens = _TOKEN.findall(f.message)
            loose.setdefault((f.severity, f.rule, "", len(tokens)), []).append(tokens)
    for (severity, rule, message), files in in_files.items():
        if len(files) > 1:  # the same words about several files: the files are the subjects
            named[(severity, rule, message)] = files
        else:
            tokens = _TOKEN.findall(message)
            loose.setdefault((severity, rule, files[0], len(tokens)), []).append(tokens)
    groups: dict[tuple[str, str, str], list[str]] = {key: subjects for key, subjects in named.items()}
    for (severity, rule, file, _), messages in loose.items():
        at = _varying_word(messages)
        for tokens in messages:
            if at is None:
                groups.setdefault((severity, rule, "".join(tokens)), []).append(file)
            else:
                cause = _masked(tokens, at)
                groups.setdefault((severity, rule, f"{file}: {cause}" if file else cause), []).append(tokens[at])
    out = [FindingGroup(s, r, c, tuple(subjects)) for (s, r, c), subjects in groups.items()]
    return _fold_pickled_modules(out)


def _varying_word(messages: list[list[str]]) -> int | None:
    """The one token position where messages of equal length differ, if masking it merges them at all."""
    if len(messages) < 2:
        return None
    best: tuple[int, int] | None = None
    for at in range(len(messages[0])):
        kinds = len({_masked(m, at) for m in messages})
        if kinds < len(messages) and (best is None or kinds < best[0]):
            best = (kinds, at)
    return best[1] if best else None


def _fold_pickled_modules(groups: list[FindingGroup]) -> list[FindingGroup]:
    modules = {s for g in groups if g.rule == "pickled-module" for s in g.subjects}
    if not modules:
        return groups
    out = []
    folded = False
    for g in groups:
        if g.rule == "unsafe-global" and "{}" in g.cause:
            rest = tuple(s for s in g.subjects if s not in modules)
            folded = folded or len(rest) < len(g.subjects)
            if not rest:
                continue
            g = FindingGroup(g.severity, g.rule, g.cause, rest, g.also)
        out.append(g)
    if folded:
        out = [FindingGroup(g.severity, g.rule, g.cause, g.subjects, ("unsafe-global",)) if g.rule == "pickled-module" else g for g in out]
    return out


def locator(c: CheckpointReport) -> Callable[..., str]:
    """``where(names, file=None)``: the path an annotation of ``c`` points at: the one file inside a folder that
    holds ``names`` (or ``file``, where a finding names it), else the checkpoint's own path (a single file, or
    names spread over several files). The tensors' files are looked up once per checkpoint."""
    holder = {t.name: t.file for t in (c.inventory.tensors if c.inventory is not None else ())}

    def where(names: Iterable[str | None], file: str | None = None) -> str:
        files = {file} if file else {holder.get(n or "", "") for n in names}
        if len(files) != 1 or not (only := files.pop()):
            return c.path
        return f"{c.path.rstrip('/')}/{only}"

    return where
