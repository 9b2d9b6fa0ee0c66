"""The user's own functions that a tune calls (a model factory, a metric): ``file.py:func`` or ``package.module:func``,
only ever one the user named."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..errors import FactoryError, UsageError


def user_callable(reference: str, option: str) -> Callable[..., Any]:
    """The callable ``reference`` names; ``UsageError`` for a malformed reference, ``FactoryError`` for one that fails."""
    from ..formats.factory import import_user_module

    module_name, _, attr = reference.rpartition(":")
    if not module_name or not attr.isidentifier():
        raise UsageError(f"{option} '{reference}': expected path/to/file.py:func or package.module:func")
    try:
        fn = getattr(import_user_module(module_name), attr, None)
    except FactoryError as exc:
        raise FactoryError(exc.message, path=reference) from None
    except Exception as exc:  # the user's module failed while importing
        raise FactoryError(f"importing '{module_name}' failed: {type(exc).__name__}: {exc}", path=reference) from None
    if fn is None or not callable(fn):
        raise FactoryError(f"'{module_name}' has no callable '{attr}'", path=reference)
    return fn
