"""A command line the light interpreter fully understands runs without Typer or Click (a tenth of a small scan's
time is their import); anything else goes to the Typer app, untouched, which gives every help text and error.

It reads the same tables as the Typer app (cli_options.py) and mirrors Click's parser (``click.parser``:
``_process_args_for_options``, ``_process_opts``, ``_match_long_opt``, ``_match_short_opt``) and Typer's
conversions (``click.INT``/``FLOAT``, ``click.Choice`` of an Enum's values, ``Path``, a repeated option's list),
for exactly the cases it accepts. ``tests/test_cli_parse.py`` holds it equal to Click's parse.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from enum import Enum
from pathlib import Path
from typing import Any, Optional

from .cli_options import LIGHT, REQUIRED, Command, Opt


class Declined(Exception):
    """Something only Typer should answer: help, completion, a usage error, anything not understood."""


def parse(command: Command, args: list[str]) -> dict[str, Any]:
    """The values the command's body gets for ``args`` (what follows the command's name), or Declined."""
    longs: dict[str, Opt] = {}
    shorts: dict[str, Opt] = {}
    for opt in command.params:
        if opt.callback is not None or opt.is_eager:
            raise Declined(opt.name)  # callbacks run inside Click only
        for flag in opt.flags:
            if flag[:1] != "-" or flag[:2] == "--" or len(flag) != 2:
                longs[flag] = opt  # Click: a prefix of two characters, or a name longer than one, is a long option
            else:
                shorts[flag[1]] = opt
    given: dict[str, list[str]] = {}
    positional: list[str] = []
    rest = list(args)
    while rest:
        arg = rest.pop(0)
        if arg == "--":  # the rest are arguments, whatever they look like
            positional.extend(rest)
            break
        if arg[:1] != "-" or len(arg) == 1:  # "-" alone is an argument too (Click's arglen > 1)
            positional.append(arg)
            continue
        name, equals, explicit = arg.partition("=")
        if name in longs:
            opt = longs[name]
            if opt.type is bool:
                if equals:
                    raise Declined(arg)  # Click: "Option '--x' does not take a value"
                given.setdefault(opt.name, []).append("")
            elif equals:
                given.setdefault(opt.name, []).append(explicit)
            elif rest:
                given.setdefault(opt.name, []).append(rest.pop(0))
            else:
                raise Declined(arg)  # "Option requires an argument"
            continue
        if arg[:2] == "--":
            raise Declined(arg)  # no such option (Click matches no abbreviation)
        # a cluster of short options: flags, then at most one taking the rest of the word (or the next) as its value
        i = 1
        while i < len(arg):
            short = shorts.get(arg[i])
            if short is None:
                raise Declined(arg)  # -h, or no such option
            opt = short
            i += 1
            if opt.type is bool:
                given.setdefault(opt.name, []).append("")
                continue
            if i < len(arg):
                given.setdefault(opt.name, []).append(arg[i:])
            elif rest:
                given.setdefault(opt.name, []).append(rest.pop(0))
            else:
                raise Declined(arg)
            break
    return {opt.name: _value(opt, given.get(opt.name), positional) for opt in command.params}


def _value(opt: Opt, given: Optional[list[str]], positional: list[str]) -> Any:
    if not opt.flags:  # the argument: every positional (nargs=-1)
        if not opt.multiple:
            raise Declined(opt.name)
        if not positional:
            if opt.default is REQUIRED:
                raise Declined(opt.name)  # "Missing argument"
            return opt.default
        return [_converted(opt, v) for v in positional]
    if given is None:
        if opt.default is REQUIRED:
            raise Declined(opt.name)  # "Missing option"
        return opt.default
    if opt.type is bool:
        return True
    if opt.multiple:
        return [_converted(opt, v) for v in given]
    return _converted(opt, given[-1])  # a repeated single option: the last one wins, as in Click


def _converted(opt: Opt, text: str) -> Any:
    kind = opt.type
    if kind is str:
        return text
    if isinstance(kind, type) and issubclass(kind, Enum):  # click.Choice, case-sensitive, then the Enum member
        for member in kind:
            if member.value == text:
                return member
        raise Declined(text)
    if kind in (int, float):
        try:
            return kind(text)  # what click.INT and click.FLOAT call
        except ValueError:
            raise Declined(text) from None
    if kind is Path and text:
        return Path(text)
    raise Declined(text)


def light_command(args: list[str], environ: Mapping[str, str]) -> Optional[Callable[[], None]]:
    """The command body to run for ``dtypeaudit ARGS``, bound to its values, or None to hand the line to Typer."""
    if not args or args[0] not in LIGHT:
        return None
    if any(key[:1] == "_" and key.endswith("_COMPLETE") for key in environ):
        return None  # shell completion (Click's _PROG_COMPLETE): Typer's
    command = LIGHT[args[0]]
    try:
        values = parse(command, args[1:])
    except Declined:
        return None
    from . import cli_commands

    body = getattr(cli_commands, command.body)
    return lambda: body(**values)
