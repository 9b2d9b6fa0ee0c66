"""The console entry point: ``--version`` answers before Typer and the command line are imported.

A pre-commit hook or CI step that asks for the version pays for the interpreter only.
"""

from __future__ import annotations

import sys


def main() -> None:
    if sys.argv[1:] == ["--version"]:
        from ._version import __version__

        print(f"dtypeaudit {__version__}")
        return
    from .cli import main as cli_main

    cli_main()
