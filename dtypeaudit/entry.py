"""The console entry point: ``--version`` answers before anything is imported; every other line goes to the Typer
app (cli.py).

A pre-commit hook pays this start-up on every commit (benchmarks/STARTUP.md).
"""

from __future__ import annotations

import gc
import os
import sys


def main() -> None:
    if sys.argv[1:] == ["--version"]:
        from ._version import __version__

        print(f"dtypeaudit {__version__}")
        return
    # numpy's OpenBLAS starts a thread per core when numpy is imported, and each spins a while (0.1 s of CPU here,
    # taken from the other core's share of a conversion); no command does linear algebra with numpy.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    # No cyclic collection while the modules load: an import makes modules, classes and functions that live until
    # exit, and the collector's passes over them were 4 % of a one-file scan (benchmarks/STARTUP.md). cli.main
    # freezes what was loaded and turns the collector back on before the command runs.
    gc.disable()
    from .cli import main as cli_main

    cli_main()
