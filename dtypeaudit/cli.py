"""The Typer app, built from the option tables (cli_options.py); each command calls its body (cli_commands.py).

Help, completion and every usage error are Typer's. ``scan`` lines the light interpreter (cli_parse.py) fully
understands never reach this module: the console script (entry.py) runs them without importing Typer.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from typing import Annotated, Any, Optional

import typer

from . import cli_commands, cli_options
from ._version import __version__
from .cli_commands import default_format as default_format  # where callers found it
from .cli_commands import leave_fast_after_torch
from .cli_options import REQUIRED, Command, Opt

app = typer.Typer(
    name="dtypeaudit",
    help=(
        "Audit the dtypes of PyTorch checkpoints without running their code, and convert them safely.\n\n"
        + "Exit codes: 0 clean, 1 findings at or above --fail-on, 2 unreadable input or misuse, "
        + "3 internal error (a bug: please report it), 130 interrupted."
    ),
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
    # Click's own help: paragraphs rewrapped to the terminal, \b blocks kept as written, brackets such as
    # 'dtypeaudit[dask]' shown as typed (Rich markup took them for tags), no box drawing for a cp1252 console.
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _help_keeps_hyphenated_words() -> None:
    """Click wraps help text with textwrap's default break_on_hyphens: '--keep-unsafe' and 'security-sensitive'
    were split at their hyphens. Its wrapper class is looked up at each call (in the Click that Typer vendors as
    ``typer._click``, and in Click itself), so a subclass here changes how help wraps and nothing else."""
    from importlib import import_module

    for name in ("typer._click._textwrap", "click._textwrap"):
        try:
            wrapping = import_module(name)
        except ImportError:
            continue
        base = wrapping.TextWrapper
        if getattr(base, "keeps_hyphenated_words", False):
            continue

        class KeepHyphenatedWords(base):  # type: ignore[misc, valid-type]
            keeps_hyphenated_words = True

            def __init__(self, *args: Any, **kwargs: Any) -> None:
                kwargs.setdefault("break_on_hyphens", False)
                super().__init__(*args, **kwargs)

        wrapping.TextWrapper = KeepHyphenatedWords  # type: ignore[attr-defined]


_help_keeps_hyphenated_words()


def _version(value: bool) -> None:
    if value:
        typer.echo(f"dtypeaudit {__version__}")
        raise typer.Exit()


def typer_annotation(opt: Opt) -> Any:
    """An option or argument of the table (cli_options.py) as Typer declares it: Annotated[type, typer.Option(...)]."""
    kwargs: dict[str, Any] = {"help": opt.help}
    if opt.metavar is not None:
        kwargs["metavar"] = opt.metavar
    if opt.show_default is not None:
        kwargs["show_default"] = opt.show_default
    if opt.callback is not None:
        kwargs["callback"] = globals()[opt.callback]
    if opt.is_eager:
        kwargs["is_eager"] = True
    info = typer.Option(*opt.flags, **kwargs) if opt.flags else typer.Argument(**kwargs)
    kind: Any = list[opt.type] if opt.multiple else opt.type  # type: ignore[name-defined]
    if opt.default is None:
        kind = Optional[kind]
    return Annotated[kind, info]


def _callback(spec: Command) -> Callable[..., None]:
    """A command of the table as Typer takes it: a callback whose signature Typer reads (one parameter per option, in the
    table's order, which is the help's) and which calls the command's body in cli_commands.py, looked up by name
    at each call."""

    def callback(**values: Any) -> None:
        getattr(cli_commands, spec.body)(**values)

    params = [
        inspect.Parameter(
            o.name,
            inspect.Parameter.KEYWORD_ONLY,
            annotation=typer_annotation(o),
            default=inspect.Parameter.empty if o.default is REQUIRED else o.default,
        )
        for o in spec.params
    ]
    callback.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    callback.__annotations__ = {p.name: p.annotation for p in params}
    callback.__doc__ = spec.help
    callback.__name__ = callback.__qualname__ = spec.body
    return callback


app.callback()(_callback(cli_options.ROOT))
for command in (cli_options.SCAN, cli_options.TARGETS, cli_options.DIFF, cli_options.CONVERT, cli_options.TRACE):
    app.command(command.name)(_callback(command))
policy_app = typer.Typer(help=cli_options.POLICY_GROUP_HELP, no_args_is_help=True, rich_markup_mode=None)
for command in (cli_options.POLICY_INIT, cli_options.POLICY_VALIDATE, cli_options.POLICY_PRESETS):
    policy_app.command(command.name)(_callback(command))
app.add_typer(policy_app, name="policy")


def only_the_invoked_command(args: list[str]) -> None:
    """Typer builds every command's options (signatures, type hints) on each run, a tenth of a small scan's time:
    where the first argument names a top-level command or group, register only that one. ``dtypeaudit --help`` and
    a mistyped command still see them all (benchmarks/STARTUP.md measured it)."""
    if not args:
        return

    def name(c: Any) -> str:
        return c.name or getattr(c.callback, "__name__", "").lower().replace("_", "-")

    commands = [c for c in app.registered_commands if name(c) == args[0]]
    groups = [g for g in app.registered_groups if g.name == args[0]]
    if commands or groups:
        app.registered_commands = commands
        app.registered_groups = groups


def main() -> None:
    """The console entry point for what the light interpreter (cli_parse.py) left to Typer."""
    only_the_invoked_command(sys.argv[1:])
    leave_fast_after_torch(app)


if __name__ == "__main__":
    main()
