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


def _runtime_imports(tree: ast.Module, *, with_level: bool = False):
    """Every import statement that can run: at module level or inside a function (an import moved into a function
    to dodge a cycle is still a cycle of the design), but not under ``if TYPE_CHECKING:``. ``with_level``: yield
    (statement, whether it runs when the module is imported) instead: False inside a function (or class body of one)."""
    todo: list[tuple[ast.AST, bool]] = [(tree, True)]
    while todo:
        node, at_import = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield (node, at_import) if with_level else node
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            todo.extend((n, at_import) for n in node.orelse)
        else:
            inner = at_import and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            todo.extend((n, inner) for n in ast.iter_child_nodes(node))


def import_graph() -> dict[str, set[str]]:
    """Module -> the dtypeaudit modules its imports run or lean on (a submodule import runs its packages' __init__
    too). An edge to one of the importing module's own packages is dropped only where Python has run that package
    anyway: when the module itself is imported (a module-level import), or as the parent of a submodule imported
    (``from .plan import Plan``). A function that imports its own package's names (``from . import Result``) leans
    on the package's __init__, which imports the module: that edge is kept, so such a cycle is seen."""
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
        own = {a for a in with_parents(name) if a != name}
        edges: set[str] = set()
        for node, at_import in _runtime_imports(ast.parse(path.read_text(encoding="utf-8")), with_level=True):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = here.split(".")
                if node.level:
                    base = base[: len(base) - (node.level - 1)]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                # ``from pkg import x`` names the submodule pkg.x where there is one, else pkg's own attribute x
                submodules = [f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in files]
                targets = submodules if len(submodules) == len(node.names) else [mod, *submodules]
            for t in targets:
                if t.split(".")[0] != "dtypeaudit":
                    continue
                edges |= with_parents(t) - own  # parents of what is imported: the own ones have already run
                if t in own and not at_import:
                    edges.add(t)  # a function leaning on its own package's __init__
        edges.discard(name)
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


def test_the_graph_sees_a_function_that_imports_its_own_package(tmp_path, monkeypatch):
    """conversion <-> conversion.remote: the package imports remote inside convert(), and remote imports the
    package's names inside a function. A module-level import of the own package, or a submodule of it imported
    anywhere, is no edge to the package (Python has run it already)."""
    package = tmp_path / "dtypeaudit"
    (package / "conversion").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "conversion" / "__init__.py").write_text(
        "class Result:\n    pass\n\n\ndef convert():\n    from .remote import go\n\n    return go()\n"
    )
    (package / "conversion" / "remote.py").write_text(
        "from .plan import Plan\n\n\ndef go():\n    from . import Result\n    from .plan import Plan\n\n    return Result(), Plan\n"
    )
    (package / "conversion" / "plan.py").write_text("from . import Result\n\nPlan = Result\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", package)
    graph = import_graph()
    assert graph["dtypeaudit.conversion.plan"] == set()  # module level: the package has run first
    assert graph["dtypeaudit.conversion.remote"] == {"dtypeaudit.conversion", "dtypeaudit.conversion.plan"}
    assert graph["dtypeaudit.conversion"] == {"dtypeaudit.conversion.remote"}
    assert cycles(graph) == [["dtypeaudit.conversion", "dtypeaudit.conversion.remote"]]


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


# -- names (issue 18): one meaning per name -------------------------------------------------------------------


def _trees() -> dict[str, tuple[Path, ast.Module]]:
    return {_module_name(p): (p, ast.parse(p.read_text(encoding="utf-8"))) for p in PACKAGE.rglob("*.py")}


def _bound_at_module_level(tree: ast.Module) -> set[str]:
    """Names a module binds when it runs: defs, classes, assignments, imports (a ``from . import x`` binds the
    submodule itself, which is no shadow), and the keys of a lazy ``_LAZY`` table of attributes."""
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            names.update(a.asname or a.name for a in node.names)
        elif isinstance(node, ast.Import):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
            if any(isinstance(t, ast.Name) and t.id == "_LAZY" for t in targets) and isinstance(node.value, ast.Dict):
                names.update(k.value for k in node.value.keys if isinstance(k, ast.Constant) and isinstance(k.value, str))
    return names


def shadowed_modules() -> list[str]:
    """``package.name`` where the package binds ``name`` to something other than its submodule ``name`` (after
    ``from .sniff import sniff``, ``formats.sniff`` is a function, and the module can no longer be reached by
    attribute)."""
    found = []
    for name, (path, tree) in _trees().items():
        if path.name == "__init__.py":
            submodules = {p.stem for p in path.parent.glob("*.py")} | {p.parent.name for p in path.parent.glob("*/__init__.py")}
            found += [f"{name}.{n}" for n in sorted(_bound_at_module_level(tree) & (submodules - {"__init__", "__main__"}))]
    return found


def test_no_name_shadows_a_module():
    assert shadowed_modules() == []


def test_the_shadow_finder_finds_a_function_bound_over_its_module(tmp_path, monkeypatch):
    package = tmp_path / "dtypeaudit"
    (package / "formats").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "formats" / "__init__.py").write_text("from .sniff import sniff\nfrom . import verify\n")
    (package / "formats" / "verify.py").write_text("")
    (package / "formats" / "sniff.py").write_text("def sniff(path):\n    return 'zip'\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", package)
    assert shadowed_modules() == ["dtypeaudit.formats.sniff"]  # ``from . import verify`` binds the module itself


def test_one_class_per_name_across_the_package():
    where: dict[str, list[str]] = {}
    for name, (_, tree) in _trees().items():
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                where.setdefault(node.name, []).append(name)
    assert {cls: modules for cls, modules in where.items() if len(modules) > 1} == {}


def test_no_private_name_is_used_across_modules():
    """``from .x import _y`` and ``x._y`` on another dtypeaudit module: what one module keeps private, another
    must not lean on (a name used elsewhere is public: give it a public name)."""
    trees = _trees()
    uses = []
    for name, (_, tree) in trees.items():
        modules = set()  # local names of the dtypeaudit modules this module imports
        for node in _runtime_imports(tree):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("dtypeaudit")):
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        uses.append(f"{name}: from {'.' * node.level}{node.module or ''} import {alias.name}")
                    modules.add(alias.asname or alias.name)
            elif isinstance(node, ast.Import):
                modules.update((a.asname or a.name).split(".")[0] for a in node.names if a.name.startswith("dtypeaudit"))
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and isinstance(node.value, ast.Name)
                and node.value.id in modules
            ):
                uses.append(f"{name}: {node.value.id}.{node.attr}")
    assert uses == []
