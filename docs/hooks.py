"""MkDocs hooks: the pages that are generated from the code, so that they cannot drift from it.

* ``<!-- cli-reference -->`` becomes the reference of every command, walked from the Typer app's click tree
  (``typer.main.get_command``): usage, help and each argument and option with its type and default.
* ``<!-- python-api -->`` becomes the list of ``dtypeaudit.__all__``: each name's signature and docstring.
* ``<!-- report-schema -->`` becomes the table of the ``dtypeaudit.report/1`` fields and the JSON Schema itself,
  from ``dtypeaudit.render.schema.report_schema()``.

In the repository each marker opens a note that ends at ``<!-- /NAME -->``: the section is generated at build
time, and how to see it without building. The hook replaces the marker and its note together, so the note never
reaches the site. ``tests/test_report_schema.py``, ``tests/test_docs_examples.py`` and
``tests/test_messages_true.py`` check what they render.
"""

from __future__ import annotations

import json
import re
from typing import Any

CLI_MARKER = "<!-- cli-reference -->"
SCHEMA_MARKER = "<!-- report-schema -->"
API_MARKER = "<!-- python-api -->"


def on_page_markdown(markdown: str, **_: Any) -> str:
    for marker, generate in ((CLI_MARKER, cli_reference), (SCHEMA_MARKER, report_schema_markdown), (API_MARKER, python_api)):
        if marker in markdown:
            text = generate()
            markdown = _section(marker).sub(lambda _, text=text: text, markdown)  # a function: no backslash escapes
    return markdown


def _section(marker: str) -> re.Pattern[str]:
    """``marker``, and the repository's note after it up to its closing ``<!-- /NAME -->`` where there is one."""
    closing = marker.replace("<!-- ", "<!-- /", 1)
    return re.compile(re.escape(marker) + r"(?:.*?" + re.escape(closing) + ")?", re.DOTALL)


# -- the CLI reference ------------------------------------------------------------------------------------------------


def cli_reference() -> str:
    import typer.main

    from dtypeaudit.cli import app

    root = typer.main.get_command(app)
    return "\n".join(_command(root, root.context_class(root, info_name="dtypeaudit"), level=2))


# Typer 0.28 carries its own copy of click (typer._click), so the walk goes by click's interface, not its classes.
def _command(cmd: Any, ctx: Any, level: int) -> list[str]:
    lines = [f"{'#' * level} `{ctx.command_path}`", ""]
    usage = " ".join(cmd.collect_usage_pieces(ctx))
    lines += ["```text", f"{ctx.command_path} {usage}".rstrip(), "```", ""]
    lines += [*_help_text(cmd.help or ""), ""]
    rows = [_param_row(p, ctx) for p in cmd.get_params(ctx) if not getattr(p, "hidden", False)]
    if rows:
        lines += ["| argument / option | value | default | meaning |", "|---|---|---|---|", *rows, ""]
    if hasattr(cmd, "list_commands"):
        for name in cmd.list_commands(ctx):
            sub = cmd.get_command(ctx, name)
            if sub is not None and not sub.hidden:
                lines += _command(sub, sub.context_class(sub, info_name=name, parent=ctx), level + 1)
    return lines


def _help_text(text: str) -> list[str]:
    """click's help: paragraphs, and ``\\b`` blocks (kept as written; ours are examples) as code."""
    out: list[str] = []
    for paragraph in text.strip().split("\n\n"):
        if paragraph.startswith("\b"):
            body = paragraph[1:].strip("\n")
            heading, _, rest = body.partition("\n")
            if heading.rstrip().endswith(":") and rest:
                out += [f"**{heading.strip().rstrip(':')}**", ""]
                body = rest
            out += ["```text", *(line[2:] if line.startswith("  ") else line for line in body.splitlines()), "```", ""]
        else:
            out += [" ".join(paragraph.split()), ""]
    return out


def _cell(text: str) -> str:
    return re.sub(r"(?<!\\)\|", r"\\|", " ".join(text.split()))  # a table cell: escape the pipes not escaped yet


def _param_row(param: Any, ctx: Any) -> str:
    argument = param.param_type_name == "argument"
    if argument:
        names = f"`{param.make_metavar(ctx)}`"
        value = "required" if param.required else "optional"
        help_text = getattr(param, "help", None) or ""
    else:
        names = ", ".join(f"`{o}`" for o in [*param.opts, *param.secondary_opts])
        value = "" if param.is_flag else _value(param, ctx)
        help_text = param.help or ""
    default = param.default
    shown = "" if default in (None, False, (), []) or callable(default) or argument else f"`{default}`"
    return f"| {names} | {_cell(value)} | {shown} | {_cell(help_text)} |"


def _value(option: Any, ctx: Any) -> str:
    if hasattr(option.type, "choices"):
        return " \\| ".join(f"`{c}`" for c in option.type.choices)
    name = option.type.name.upper() if option.type.name else "VALUE"
    return f"`{option.metavar or name}`" + (" (repeatable)" if option.multiple else "")


# -- the report schema ------------------------------------------------------------------------------------------------


def report_schema_markdown() -> str:
    from dtypeaudit.render.schema import fields_table, report_schema

    schema = report_schema()
    lines = ["| field | type | always there | meaning |", "|---|---|---|---|"]
    for path, kind, required, description in fields_table(schema):
        lines.append(f"| `{path}` | {_cell(kind)} | {'yes' if required else 'no'} | {_cell(description)} |")
    lines += ["", "The JSON Schema (draft 2020-12), as `dtypeaudit.render.schema.report_schema()` returns it:", ""]
    lines += ["```json", json.dumps(schema, indent=2), "```"]
    return "\n".join(lines)


# -- the Python API ---------------------------------------------------------------------------------------------------


def python_api() -> str:
    import inspect

    import dtypeaudit

    lines: list[str] = []
    for name in dtypeaudit.__all__:
        obj = getattr(dtypeaudit, name)
        if not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue
        try:
            signature = str(_unquoted(inspect.signature(obj)))
        except (TypeError, ValueError):
            signature = "(...)"
        kind = "class" if inspect.isclass(obj) else "def"
        lines += [f"### `{name}`", "", "```python", f"{kind} dtypeaudit.{name}{signature}", "```", ""]
        doc = inspect.getdoc(obj) or ""
        lines += [doc.replace("``", "`"), ""]
    return "\n".join(lines)


class _Written(str):
    """An annotation as the source writes it (``from __future__ import annotations`` keeps them as strings)."""

    def __repr__(self) -> str:
        return str(self)


def _unquoted(signature: Any) -> Any:
    def plain(annotation: Any) -> Any:
        return _Written(annotation) if isinstance(annotation, str) else annotation

    params = [p.replace(annotation=plain(p.annotation)) for p in signature.parameters.values()]
    return signature.replace(parameters=params, return_annotation=plain(signature.return_annotation))
