"""Every example in README.md and docs/*.md that shows output is run, and must print what the page shows.

Conventions, for whoever writes a page:

* A shell example is a fenced block whose first line starts with ``$ ``. Each ``$ `` line is a command and the lines
  under it, up to the next ``$ ``, are what it prints (stdout and stderr, as a terminal shows them). Commands are
  ``dtypeaudit ...`` (optionally ``VAR=value`` before it and ``| head -N`` / ``| tail -N`` after it) and
  ``echo $?``. They run in-process through Typer's CliRunner with ``COLUMNS=100``, in a fresh folder holding a copy of
  ``sample_models/`` (so ``sample_models/cnn_fp32.pt`` is the shipped sample) and whatever the fixtures named by a
  ``<!-- fixture: NAME -->`` line just above the block wrote there.
* A Python example is a fenced block with ``>>> `` prompts, run as a doctest in such a folder.
* ``...`` in the shown output stands for any text, across lines (doctest's ELLIPSIS): pages may elide long output.
  Trailing spaces are ignored.
* An example that cannot run here (S3, the hub, a GPU, an install without torch) carries
  ``<!-- not-run: REASON -->`` just above it; it is listed as skipped with that reason.

``DTYPEAUDIT_UPDATE_DOCS=1 pytest tests/test_docs_examples.py`` rewrites the shown output of every example that no
longer matches, in place, with what it prints now (a shell block's elisions are lost: trim them again), and skips
it with "output rewritten"; review the diff.
"""

from __future__ import annotations

import doctest
import importlib.util
import json
import os
import re
import shlex
import shutil
import textwrap
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from typer.testing import CliRunner

from .helpers import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]
UPDATE = os.environ.get("DTYPEAUDIT_UPDATE_DOCS") == "1"
ENV = {"COLUMNS": "100", "NO_COLOR": "1", "TERM": "dumb"}

FENCE = re.compile(r"^(?P<indent>[ ]*)(?P<fence>```+|~~~+)(?P<info>[^\n`]*)\n(?P<body>.*?)^(?P=indent)(?P=fence)[ ]*$", re.M | re.S)
MARKER = re.compile(r"<!--\s*(fixture|not-run):\s*(.*?)\s*-->")


@dataclass
class Example:
    page: Path
    line: int
    body: str
    start: int
    """Offset of the body in the page, for --update."""
    fixtures: list[str] = field(default_factory=list)
    not_run: str | None = None
    indented: bool = False
    """Inside a list item: not run (its output could not be rewritten in place); the test says so."""

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def is_shell(self) -> bool:
        return self.body.lstrip().startswith("$ ")

    @property
    def is_python(self) -> bool:
        return bool(re.search(r"^\s*>>> ", self.body, re.M))


def examples(page: Path) -> Iterator[Example]:
    text = page.read_text(encoding="utf-8")
    for m in FENCE.finditer(text):
        indent = m.group("indent")
        body = textwrap.dedent(m.group("body")) if indent else m.group("body")
        # the markers: consecutive comment lines right above the fence
        above = text[: m.start()].rstrip("\n").split("\n")
        markers: list[tuple[str, str]] = []
        while above and MARKER.fullmatch(above[-1].strip()):
            kind, value = MARKER.fullmatch(above.pop().strip()).groups()  # type: ignore[union-attr]
            markers.append((kind, value))
        example = Example(page, text.count("\n", 0, m.start()) + 1, body, m.start("body"))
        example.fixtures = [v for k, v in markers if k == "fixture"]
        example.not_run = next((v for k, v in markers if k == "not-run"), None)
        example.indented = bool(indent)
        if example.is_shell or example.is_python:
            yield example


ALL = [e for page in PAGES for e in examples(page)]


# -- fixtures: files an example needs beside the samples, written by the real writers --------------------------------


def _bad_policy(folder: Path) -> None:
    (folder / "policy.yaml").write_text("version: 1\nrules:\n  - match: ['*.weight']\n    dtype: fp17\n")


def _gpt2_pair(folder: Path) -> None:
    """A GPT-2-shaped model (GPT-2's names, its head tied to the token embedding) saved as it is, and with the tie
    broken. Built with torch alone: importing transformers would cost this example ten seconds."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    block = nn.ModuleDict({"ln_1": nn.LayerNorm(16), "attn": nn.ModuleDict({"c_attn": nn.Linear(16, 48)}), "ln_2": nn.LayerNorm(16)})
    transformer = nn.ModuleDict(
        {"wte": nn.Embedding(64, 16), "wpe": nn.Embedding(16, 16), "h": nn.ModuleList([block]), "ln_f": nn.LayerNorm(16)}
    )
    model = nn.ModuleDict({"transformer": transformer, "lm_head": nn.Linear(16, 64, bias=False)})
    model["lm_head"].weight = transformer["wte"].weight
    state = model.state_dict()
    torch.save(state, folder / "gpt2.pt")
    untied = dict(state)
    untied["lm_head.weight"] = state["lm_head.weight"].clone()
    torch.save(untied, folder / "gpt2.untied.pt")


NET = '''\
import torch
from torch import nn


def build():
    """A bf16 Linear, GELU, Linear."""
    return nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2)).to(torch.bfloat16)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1)
        self.act = nn.ReLU()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, 10)

    def forward(self, x):
        return self.fc(self.pool(self.act(self.conv(x))).flatten(1))


def build_model():
    """A half model whose classifier bias was left in float32."""
    net = Net().half()
    net.fc.bias.data = net.fc.bias.data.float()
    return net
'''


def _trace_net(folder: Path) -> None:
    (folder / "net.py").write_text(NET)


FIXTURES: dict[str, Callable[[Path], None]] = {"bad-policy": _bad_policy, "gpt2-pair": _gpt2_pair, "net.py": _trace_net}


# -- running ----------------------------------------------------------------------------------------------------------


def _workdir(tmp_path: Path, example: Example) -> Path:
    shutil.copytree(ROOT / "sample_models", tmp_path / "sample_models")  # as shipped: a scan of it reads what a user's does
    for name in example.fixtures:
        assert name in FIXTURES, f"{example.id}: unknown fixture {name!r} (known: {', '.join(FIXTURES)})"
        FIXTURES[name](tmp_path)
    return tmp_path


def _commands(body: str) -> list[tuple[str, str]]:
    """``(command, shown output)`` for each ``$ `` line of a shell example."""
    out: list[tuple[str, list[str]]] = []
    for line in body.splitlines():
        if line.startswith("$ "):
            out.append((line[2:], []))
        else:
            out[-1][1].append(line)
    return [(cmd, "\n".join(lines)) for cmd, lines in out]


def run_command(command: str, cwd: Path, last_code: int) -> tuple[str, int]:
    """What a terminal shows for one example command, and its exit status."""
    words = shlex.split(command, comments=True)
    if words == ["echo", "$?"]:
        return f"{last_code}\n", 0
    env = dict(ENV)
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    pipes: list[list[str]] = []
    while "|" in words:
        at = len(words) - 1 - words[::-1].index("|")
        pipes.insert(0, words[at + 1 :])
        words = words[:at]
    assert words[:1] == ["dtypeaudit"], f"only dtypeaudit commands and 'echo $?' run here, not {command!r}: mark it not-run"
    from dtypeaudit.cli import app

    old = Path.cwd()
    os.chdir(cwd)
    try:
        result = CliRunner().invoke(app, words[1:], env=env, prog_name="dtypeaudit")
    finally:
        os.chdir(old)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    if not pipes:
        return result.output, result.exit_code
    output = result.stdout  # a pipe takes stdout only; stderr still reaches the terminal, first
    for pipe in pipes:
        assert pipe[:1] in (["head"], ["tail"]) and len(pipe) == 2 and re.fullmatch(r"-\d+", pipe[1]), f"unsupported pipe {pipe}"
        lines, n = output.splitlines(keepends=True), int(pipe[1][1:])
        output = "".join(lines[:n] if pipe[0] == "head" else lines[-n:])
    return result.stderr + output, 0  # the status of the last command of a pipe, as bash reports it


def normalise(text: str, cwd: Path) -> str:
    """The example's folder is the working directory; the package lives wherever pip put it."""
    import dtypeaudit

    text = text.replace(str(cwd) + os.sep, "").replace(str(cwd), ".")
    text = text.replace(str(Path(dtypeaudit.__file__).parent), "<site-packages>/dtypeaudit")
    return "\n".join(line.rstrip() for line in text.splitlines()).strip("\n")


def matches(shown: str, actual: str) -> bool:
    """Doctest's ELLIPSIS: ``...`` in what the page shows stands for any text, newlines included. A page that shows
    nothing but ``...`` for a command that prints something shows nothing: that is no example."""
    if shown.strip() == "..." and actual:
        return False
    pattern = ".*?".join(re.escape(part) for part in shown.split("..."))
    return re.fullmatch(pattern, actual, re.S) is not None


def _rewrite(example: Example, runs: list[tuple[str, str, str]]) -> None:
    _replace_block(example, "".join(f"$ {cmd}\n" + (f"{actual}\n" if actual else "") for cmd, _, actual in runs))


def _replace_block(example: Example, body: str) -> None:
    text = example.page.read_text(encoding="utf-8")
    # an earlier example of the page may have been rewritten in this run: the block is where its text is now
    found = [m.start() for m in re.finditer(re.escape(example.body), text)]
    assert found, f"{example.id} changed while the examples ran; run the update again"
    start = min(found, key=lambda at: abs(at - example.start))
    example.page.write_text(text[:start] + body + text[start + len(example.body) :], encoding="utf-8")


SHELL = [e for e in ALL if e.is_shell]
PYTHON = [e for e in ALL if e.is_python]


def _skip_not_run(example: Example) -> None:
    assert not example.indented, f"{example.id}: an example inside a list item is not supported; move it out of the list"
    if example.not_run is not None:
        pytest.skip(f"{example.id}: {example.not_run}")


@pytest.mark.parametrize("example", SHELL, ids=[e.id for e in SHELL])
def test_shell_example(example: Example, tmp_path: Path) -> None:
    _skip_not_run(example)
    cwd = _workdir(tmp_path, example)
    runs, code = [], 0
    for command, shown in _commands(example.body):
        output, code = run_command(command, cwd, code)
        runs.append((command, normalise(shown, cwd), normalise(output, cwd)))
    wrong = [(cmd, shown, actual) for cmd, shown, actual in runs if not matches(shown, actual)]
    if wrong and UPDATE:
        _rewrite(example, runs)
        pytest.skip(f"{example.id}: output rewritten; review the diff")
    assert not wrong, "\n\n".join(
        f"{example.id}: `$ {cmd}` printed:\n{actual}\n\nbut the page shows:\n{shown}" for cmd, shown, actual in wrong
    )


@pytest.mark.parametrize("example", PYTHON, ids=[e.id for e in PYTHON])
class _Recorder(doctest.DocTestRunner):
    """A doctest runner that also keeps what each failing example printed, for the update."""

    def __init__(self) -> None:
        super().__init__(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
        self.got: list[tuple[doctest.Example, str]] = []

    def report_failure(self, out: typing.Any, test: doctest.DocTest, example: doctest.Example, got: str) -> None:
        self.got.append((example, got))
        super().report_failure(out, test, example, got)


def updated_doctest(body: str, got: list[tuple[doctest.Example, str]]) -> str:
    """The block with each failing example's shown output replaced by what it printed."""
    lines = body.splitlines(keepends=True)
    for example, output in sorted(got, key=lambda pair: -pair[0].lineno):
        start = example.lineno + example.source.count("\n")
        shown = [" " * example.indent + line + "\n" for line in output.splitlines()]
        lines[start : start + example.want.count("\n")] = shown
    return "".join(lines)


@pytest.mark.parametrize("example", PYTHON, ids=[e.id for e in PYTHON])
def test_python_example(example: Example, tmp_path: Path) -> None:
    _skip_not_run(example)
    cwd = _workdir(tmp_path, example)
    test = doctest.DocTestParser().get_doctest(example.body, {}, example.id, str(example.page), example.line)
    runner = _Recorder()
    old = Path.cwd()
    os.chdir(cwd)
    report: list[str] = []
    try:
        runner.run(test, out=report.append)
    finally:
        os.chdir(old)
    if runner.got and UPDATE:
        _replace_block(example, updated_doctest(example.body, runner.got))
        pytest.skip(f"{example.id}: output rewritten; review the diff")
    assert runner.failures == 0 and test.examples, "".join(report)


def test_examples_are_found_and_markers_are_known() -> None:
    """The conventions above are used: the README's own examples run, and no marker is misspelt."""
    readme = [e for e in ALL if e.page.name == "README.md"]
    assert readme and all(e.not_run is None for e in readme if e.is_shell and "scan sample_models" in e.body)
    for page in PAGES:
        for m in re.finditer(r"<!--\s*([\w-]+):", page.read_text(encoding="utf-8")):
            assert m.group(1) in ("fixture", "not-run"), f"{page.name}: unknown marker {m.group(0)!r}"


# -- the generated pages (docs/hooks.py) -------------------------------------------------------------------------------


def _hooks() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_cli_reference_shows_every_command_and_option() -> None:
    import typer.main

    from dtypeaudit.cli import app

    page = _hooks().on_page_markdown("# CLI reference\n\n<!-- cli-reference -->\n")
    assert "<!-- cli-reference -->" not in page

    def walk(cmd: typing.Any, path: str) -> Iterator[tuple[str, typing.Any]]:
        yield path, cmd
        for name, sub in getattr(cmd, "commands", {}).items():
            yield from walk(sub, f"{path} {name}")

    commands = list(walk(typer.main.get_command(app), "dtypeaudit"))
    assert {"dtypeaudit scan", "dtypeaudit convert", "dtypeaudit diff", "dtypeaudit trace", "dtypeaudit policy validate"} <= {
        p for p, _ in commands
    }
    for path, cmd in commands:
        heading = re.search(rf"^#+ `{re.escape(path)}`$", page, re.M)
        assert heading, f"no section for {path}"
        section = page[heading.end() : page.find("\n#", heading.end())]
        for param in cmd.params:
            for opt in param.opts if param.param_type_name == "option" else []:
                assert f"`{opt}`" in section, f"{path}: {opt} is missing from its section"


def test_the_report_schema_and_python_api_pages_are_generated() -> None:
    import dtypeaudit
    from dtypeaudit.render.schema import report_schema

    hooks = _hooks()
    schema_page = hooks.on_page_markdown("<!-- report-schema -->")
    assert "| `checkpoints[].tensors[].dtype` | string | yes |" in schema_page
    assert json.loads(schema_page[schema_page.index("```json\n") + 8 : schema_page.rindex("```")]) == report_schema()
    api_page = hooks.on_page_markdown("<!-- python-api -->")
    for name in dtypeaudit.__all__:
        if callable(getattr(dtypeaudit, name)):
            assert f"### `{name}`" in api_page


def test_the_update_rewrites_only_what_changed(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "Intro.\n\n```\n$ dtypeaudit policy presets | head -1\nstale\n```\n\n"
        "```pycon\n>>> 1 + 1\n3\n>>> print('kept')\nkept\n```\n\nEnd.\n",
        encoding="utf-8",
    )
    shell, python = examples(page)
    output, code = run_command("dtypeaudit policy presets | head -1", tmp_path, 0)
    assert code == 0 and output.startswith("amp-training ")
    _rewrite(shell, [("dtypeaudit policy presets | head -1", "stale", normalise(output, tmp_path))])
    python = next(e for e in examples(page) if e.is_python)
    runner = _Recorder()
    runner.run(doctest.DocTestParser().get_doctest(python.body, {}, "x", "page.md", 0), out=lambda _: None)
    assert [got for _, got in runner.got] == ["2\n"]
    _replace_block(python, updated_doctest(python.body, runner.got))
    assert page.read_text(encoding="utf-8") == (
        f"Intro.\n\n```\n$ dtypeaudit policy presets | head -1\n{normalise(output, tmp_path)}\n```\n\n"
        "```pycon\n>>> 1 + 1\n2\n>>> print('kept')\nkept\n```\n\nEnd.\n"
    )
    assert all(matches(*pair) for pair in [("a ... c", "a b\nb c"), ("...", "")]) and not matches("...", "x")
