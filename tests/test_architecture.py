"""The package's shape: its layers (pyproject.toml's import-linter contracts, imports inside functions included), no
cycle through a package's own ``__init__``, a package root that imports nothing eagerly, one meaning per name."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

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


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` over the package under ``root``, with ``root``'s pyproject.toml (import-linter puts the
    working directory first on the path, so it is that tree's package that is analysed); no cache is written."""
    code = "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(no_cache=True, no_logo=True))"
    return subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)


def test_the_layers_hold():
    """pyproject.toml's import-linter contracts: the rooms of ARCHITECTURE.md each import only the rooms below
    them, byte sources know no reader, the metadata-only modules import no torch, and no sibling modules or
    packages import each other in a cycle, imports inside functions included."""
    pytest.importorskip("importlinter")
    run = lint_imports(PACKAGE.parent)
    assert run.returncode == 0 and "Contracts: 4 kept, 0 broken." in run.stdout, run.stdout + run.stderr


@pytest.mark.parametrize(
    ("module", "line", "broken"),
    [
        # the data model reaching up to the pipeline, from inside a function
        ("inventory.py", "def _up():\n    from .pipeline import scan\n", "Rooms: each imports only the rooms below it"),
        ("formats/source.py", "def _up():\n    from . import sniff\n", "Byte sources know no reader"),
        ("kernels.py", "def _up():\n    import torch\n", "Metadata only"),
        # within one room: dcp.py reads a folder's other files through directory.py, and now the other way too
        ("formats/directory.py", "def _up():\n    from . import dcp\n", "No import cycles"),
    ],
)
def test_a_contract_breaks_on_a_forbidden_import(tmp_path, module, line, broken):
    pytest.importorskip("importlinter")
    shutil.copytree(PACKAGE, tmp_path / "dtypeaudit", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(PACKAGE.parent / "pyproject.toml", tmp_path)
    with (tmp_path / "dtypeaudit" / module).open("a", encoding="utf-8") as f:
        f.write("\n\n" + line)
    run = lint_imports(tmp_path)
    assert run.returncode == 1, run.stdout + run.stderr
    assert f"{broken}" in run.stdout.split("Broken contracts")[1], run.stdout


def own_package_imports() -> list[str]:
    """What import-linter cannot see: a package's ``__init__`` importing a submodule and the submodule importing the
    package's own names back (``from . import Result`` inside a function) is a cycle through the package, where
    its contracts only compare siblings. So no function imports names of a package it lies in. A module-level
    import of its own package is no cycle (Python has run the package first), nor is importing a submodule."""
    trees = _trees()
    packages = {name for name, (path, _) in trees.items() if path.name == "__init__.py"}
    found = []
    for name, (_, tree) in trees.items():
        here = (name if name in packages else name.rpartition(".")[0]).split(".")
        for node, at_import in _runtime_imports(tree, with_level=True):
            if at_import or not isinstance(node, ast.ImportFrom):
                continue
            base = ".".join(here[: len(here) - (node.level - 1)] + ([node.module] if node.module else [])) if node.level else node.module
            if base in packages and name.startswith(f"{base}."):
                found += [f"{name}: from {base} import {a.name}" for a in node.names if f"{base}.{a.name}" not in trees]
    return found


def test_no_function_imports_its_own_packages_names():
    assert own_package_imports() == []


def test_the_own_package_finder_finds_one(tmp_path, monkeypatch):
    package = tmp_path / "dtypeaudit"
    (package / "conversion").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "conversion" / "__init__.py").write_text("class Result:\n    pass\n")
    (package / "conversion" / "remote.py").write_text(
        "from . import Result as Top\n\n\ndef go():\n"  # module level: no cycle; in the function: the package's name
        "    from . import Result, plan\n    from .plan import Plan\n\n    return Top, Result, Plan, plan\n"
    )
    (package / "conversion" / "plan.py").write_text("Plan = 1\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", package)
    assert own_package_imports() == ["dtypeaudit.conversion.remote: from dtypeaudit.conversion import Result"]


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


def test_start_up_pauses_the_collector_and_the_command_runs_with_it():
    """entry.main loads the command line with the cyclic collector off; the command itself runs with it on, and
    what start-up loaded frozen (a long convert or tune must still collect its cycles). ``policy presets`` is a
    command that does not pause the collector itself (scan does, for its whole run)."""
    code = (
        "import gc, sys\n"
        "seen = {}\n"
        "class Watch:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name in ('dtypeaudit.cli', 'typer'):\n"
        "            seen[name] = gc.isenabled()\n"
        "sys.meta_path.insert(0, Watch())\n"
        "import dtypeaudit.policy\n"
        "real = dtypeaudit.policy.presets\n"
        "def presets(*a, **k):\n"
        "    seen['command'] = (gc.isenabled(), gc.get_freeze_count() > 0)\n"
        "    return real(*a, **k)\n"
        "dtypeaudit.policy.presets = presets\n"
        "sys.argv = ['dtypeaudit', 'policy', 'presets']\n"
        "from dtypeaudit.entry import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "print(sorted(seen.items()), file=sys.stderr)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert proc.stderr.strip().splitlines()[-1] == "[('command', (True, True)), ('dtypeaudit.cli', False), ('typer', False)]"


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
