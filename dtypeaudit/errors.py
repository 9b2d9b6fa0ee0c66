"""One exception family. Each error renders as a single line that names the file and the problem."""

from __future__ import annotations

from typing import TypeVar

from .redact import redact

_E = TypeVar("_E", bound="DtypeAuditError")
_ESCAPES = {c: f"\\x{c:02x}" for c in (*range(32), 127)}


class DtypeAuditError(Exception):
    """Base of every error the tool reports to the user (exit code 2)."""

    def __init__(self, message: str, *, path: str | None = None, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.path = path
        self.hint = hint

    def one_line(self) -> str:
        text = f"{self.path}: {self.message}" if self.path else self.message
        if self.hint:
            text += f" ({self.hint})"
        # Messages quote names from hostile files: control characters are shown escaped, never acted on.
        # A URL named in one is shown without its credentials.
        return redact(text).translate(_ESCAPES)

    def __str__(self) -> str:
        return self.one_line()

    def naming(self: _E, path: str, *, message: str | None = None) -> _E:
        """A new error of this class that says the same (or ``message``) about ``path``, for a caller that knows
        which file a reader's error is about; raise it ``from`` this one. An error is never changed once raised:
        whoever else holds it (a retry, a report, a traceback) keeps what it said."""
        said = self.message if message is None else message
        # Built without __init__ (subclasses take other arguments): the same attributes, then the new ones.
        new = type(self).__new__(type(self), said)
        new.__dict__.update(self.__dict__)
        new.path, new.message = path, said
        return new


class CheckpointError(DtypeAuditError):
    """The input is not a readable checkpoint (wrong kind of file, truncated, malformed, hostile)."""


class LimitExceeded(CheckpointError):
    """The input asks for more work or memory than any real checkpoint needs."""


class PolicyError(DtypeAuditError):
    """A policy file is invalid."""

    def __init__(self, message: str, *, path: str | None = None, line: int | None = None, hint: str | None = None) -> None:
        super().__init__(message, path=f"{path}:{line}" if path and line else path, hint=hint)
        self.line = line


class UsageError(DtypeAuditError):
    """The command was misused (bad option combination, missing argument)."""


class ConversionError(DtypeAuditError):
    """A conversion could not be planned, written or verified."""


class FactoryError(DtypeAuditError):
    """A user-named script or factory could not build a model."""
