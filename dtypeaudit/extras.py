"""The optional parts of the install, and the one line that names the extra a command needs.

``pip install dtypeaudit`` is the light install: scan, policies, reports and diff, no torch. What runs
torch (conversions numpy cannot make, ``--model``, factories, ``trace``, ``scan --values`` on float64 tensors)
is the ``torch`` extra; ``--cluster`` is the ``dask`` extra.
"""

from __future__ import annotations

import importlib.util

from .errors import UsageError

EXTRAS = {"torch": ("torch", "torch"), "dask": ("distributed", "dask.distributed")}
"""Each extra: the top-level module whose presence says it is installed, and the name the error line gives."""


class MissingExtra(UsageError):
    """A command needs an optional dependency that is not installed (exit 2, one line naming the extra)."""


def installed(extra: str) -> bool:
    """Whether ``extra``'s module can be imported, found without importing it (torch takes a second)."""
    return importlib.util.find_spec(EXTRAS[extra][0]) is not None


def require(extra: str, what: str) -> None:
    """Raise MissingExtra, "WHAT needs EXTRA: pip install 'dtypeaudit[EXTRA]'", unless ``extra`` is installed."""
    if not installed(extra):
        raise MissingExtra(f"{what} needs {EXTRAS[extra][1]}: pip install 'dtypeaudit[{extra}]'")
