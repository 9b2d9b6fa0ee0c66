"""The package's shape: no import cycles inside dtypeaudit/ (not even through imports inside functions), and a
package root that imports nothing eagerly."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "dtypeaudit"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _runtime_imports(tree: ast.Module):
    """Every import statement that can run: at module level or inside a function (an import moved into a function
    to dodge a cycle is still a cycle of the design), but not under ``if TYPE_CHECKING:``."""
    todo: list[ast.AST] = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            todo.extend(node.orelse)
        else:
            todo.extend(ast.iter_child_nodes(node))


def import_graph() -> dict[str, set[str]]:
    """Module -> the dtypeaudit modules its import runs (a submodule import runs its packages' __init__ too, unless
    they are the importing module's own packages, which are already running)."""
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    packages = {name for name, p in files.items() if p.name == "__init__.py"}

    def with_parents(name: str) -> set[str]:
        out = set()
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            prefix = ".".join(parts[:i])
            if prefix in files:
                out.add(prefix)
        return out

    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        here = name if name in packages else name.rpartition(".")[0]
        edges: set[str] = set()
        for node in _runtime_imports(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = here.split(".")
                if node.level:
                    base = base[: len(base) - (node.level - 1)]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                targets = [mod] + [f"{mod}.{a.name}" for a in node.names]
            for t in targets:
                if t.split(".")[0] == "dtypeaudit":
                    edges |= with_parents(t)
        # A module's own packages are already being imported when it runs: an edge to one is no cycle.
        edges -= {a for a in with_parents(name) if a != name} | {name}
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_relative_package_and_function_level_imports():
    graph = import_graph()
    assert "dtypeaudit.inventory" in graph["dtypeaudit.exitcodes"]
    assert "dtypeaudit.pipeline" in graph["dtypeaudit.cli_commands"]  # imported inside the scan command
    # a submodule import runs its package's __init__ first
    assert {"dtypeaudit.formats", "dtypeaudit.formats.sniff"} <= graph["dtypeaudit.pipeline"]


def test_no_import_cycles_inside_the_package():
    assert cycles(import_graph()) == []


def test_importing_the_package_imports_nothing_else():
    code = "import sys, dtypeaudit; print(sorted(m for m in sys.modules if m.startswith('dtypeaudit')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['dtypeaudit', 'dtypeaudit._version']"


def test_version_answers_before_the_command_line_is_imported():
    code = (
        "import sys; sys.argv = ['dtypeaudit', '--version']\n"
        "from dtypeaudit.entry import main; main()\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('typer', 'rich', 'click') or m == 'dtypeaudit.cli'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[0].startswith("dtypeaudit ") and out[1] == "[]"


def test_only_the_invoked_command_is_built(monkeypatch):
    from dtypeaudit import cli

    monkeypatch.setattr(cli.app, "registered_commands", list(cli.app.registered_commands))
    monkeypatch.setattr(cli.app, "registered_groups", list(cli.app.registered_groups))
    cli.only_the_invoked_command(["scan", "model.pt"])
    assert [c.callback.__name__ for c in cli.app.registered_commands] == ["scan"] and cli.app.registered_groups == []
