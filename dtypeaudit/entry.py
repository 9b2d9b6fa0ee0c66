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
    # numpy's OpenBLAS starts a thread per core when numpy is imported, and each spins a while (0.1 s of CPU here,
    # taken from the other core's share of a conversion); no command does linear algebra with numpy.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    from .cli_parse import light_command

    run = light_command(args, os.environ)
    if run is not None:
        from .cli_commands import leave_fast_after_torch

        leave_fast_after_torch(run)
        return
    from .cli import main as cli_main

    cli_main()
