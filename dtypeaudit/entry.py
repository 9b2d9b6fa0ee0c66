"""The console entry point: ``--version`` answers before anything is imported, and a ``scan`` or ``convert`` line
the light interpreter (cli_parse.py) fully understands runs without Typer or Click; anything else goes to the Typer app.

A pre-commit hook pays this start-up on every commit (benchmarks/STARTUP.md).
"""

from __future__ import annotations

import os
import sys


def main() -> None:
    args = sys.argv[1:]
    if args == ["--version"]:
        from ._version import __version__

        print(f"dtypeaudit {__version__}")
        return
    from .cli_parse import light_command

    run = light_command(args, os.environ)
    if run is not None:
        from .cli_commands import leave_fast_after_torch

        leave_fast_after_torch(run)
        return
    from .cli import main as cli_main

    cli_main()
