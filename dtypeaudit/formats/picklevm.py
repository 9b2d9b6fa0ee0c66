"""An allowlist-only pickle interpreter.

It understands every opcode of protocols 0-5 but imports nothing and calls nothing from the file.
A global is only ever a name (:class:`Global`). Calling one (REDUCE, NEWOBJ, INST, OBJ) runs a
reducer the caller supplied for that exact name, written in this project; any other call yields an
:class:`Opaque` stand-in that keeps its arguments and state, so values around it can still be read.

Where the file means something, it means what CPython's C unpickler (``_pickle``, which
``torch.load(weights_only=False)`` and ``pickle.load`` run) makes of it: the same integer and string
parsing, the same Python 2 name mapping below protocol 3, the same text encoding (torch.load passes
``encoding="utf-8"``). The interpreter also notes everything torch's ``weights_only`` unpickler would
refuse (:attr:`Trace.weights_only_refusal`), since that decides which of the two loaders a user ends up with.

Hostile input fails closed with a CheckpointError, and its cost is bounded: opcodes executed, memo
entries, stack depth and the length of any single string are all capped (:class:`Limits`).
Opcodes are named after CPython's ``pickletools`` table (as ``pickle`` names them), and the dispatch is built from it.
"""

from __future__ import annotations

import _compat_pickle
import codecs
import mmap
import pickle
import re
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ..errors import CheckpointError, LimitExceeded
from . import allowlist


@dataclass(frozen=True)
class Global:
    """A reference to ``module.name`` found in the pickle; never resolved to a Python object."""

    module: str
    name: str

    @property
    def qualname(self) -> str:
        return f"{self.module}.{self.name}"

    def __repr__(self) -> str:
        return f"<global {self.qualname}>"


class Opaque:
    """An object the pickle builds from a global we do not execute.

    ``callable`` is what was called; ``args`` its arguments; ``state`` what BUILD set;
    ``items``/``list_items`` what SETITEMS/APPENDS added (dict and list subclasses).
    """

    __slots__ = ("callable", "args", "state", "items", "list_items", "new")

    def __init__(self, callable_: Any, args: tuple[Any, ...], *, new: bool = False) -> None:
        self.callable = callable_
        self.new = new
        """True when built by NEWOBJ (``cls.__new__``) rather than REDUCE (a call)."""
        self.args = args
        self.state: Any = None
        self.items: dict[Any, Any] = {}
        self.list_items: list[Any] = []

    @property
    def qualname(self) -> str:
        c = self.callable
        return c.qualname if isinstance(c, Global) else f"<{type(c).__name__}>"

    def __repr__(self) -> str:
        return f"<opaque {self.qualname}>"


class DictObject(dict):
    """A dict made by a dict class the loaders allow (``OrderedDict``, ``Counter``).

    Unlike a plain dict it has a ``__dict__``: BUILD stores attributes there (an OrderedDict's
    ``_metadata``), in ``attrs``.
    """

    __slots__ = ("cls", "attrs")

    def __init__(self, cls: str, *args: Any) -> None:
        super().__init__(*args)
        self.cls = cls
        self.attrs: dict[str, Any] = {}


Reducer = Callable[[tuple[Any, ...]], Any]
Builder = Callable[[Any, Any], bool]
"""Applies BUILD's state to a value a reducer made; False when it does not own that value."""


class Limits(NamedTuple):
    """Caps on what one pickle may cost. Real checkpoints stay far below each."""

    max_opcodes: int = 50_000_000
    max_memo: int = 10_000_000
    max_depth: int = 1_000
    """Open MARKs at once."""
    max_stack: int = 10_000_000
    max_bytes_item: int = 1 << 31
    """Longest single string or bytes object."""
    max_int_bytes: int = 1 << 16


@dataclass
class Trace:
    """What the pickle referred to, for findings."""

    globals: dict[str, int] = field(default_factory=dict)
    """Every global named, with the offset of its first mention (CPython's resolution of the name)."""
    calls: dict[str, int] = field(default_factory=dict)
    """Every global called (REDUCE, NEWOBJ, INST, OBJ) with the offset of its first call."""
    weights_only_refusals: list[str] = field(default_factory=list)
    """What ``torch.load(weights_only=True)`` would refuse in the stream (the first few kinds); empty if it loads it."""
    protocol: int = 0
    """The protocol the stream declares (0 when it has no PROTO opcode)."""

    def refuse_weights_only(self, reason: str) -> None:
        if reason not in self.weights_only_refusals and len(self.weights_only_refusals) < 8:
            self.weights_only_refusals.append(reason)


class _Mark:
    __slots__ = ()


_MARK = _Mark()

# pickle's own one-byte opcode constants: the names and codes of pickletools.opcodes (a test holds them equal),
# without importing pickletools' documentation tables on every scan
_OPCODE_NAMES: dict[int, str] = {v[0]: k for k, v in vars(pickle).items() if k.isupper() and isinstance(v, bytes) and len(v) == 1}
_WEIGHTS_ONLY_OPCODE_BYTES = frozenset(code for code, name in _OPCODE_NAMES.items() if name in allowlist.WEIGHTS_ONLY_OPCODES)

# C strtol(s, &end, 0) as CPython's INT opcode calls it: optional space and sign, then 0x-hex, 0-octal or decimal.
_STRTOL = re.compile(rb"[ \t\n\v\f\r]*([+-]?)(?:0[xX]([0-9a-fA-F]+)|(0[0-7]*)|([1-9][0-9]*))")
# PyOS_string_to_double as the FLOAT opcode calls it: no spaces, no underscores; inf and nan spelt out.
_FLOAT = re.compile(rb"[+-]?(?:(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|inf(?:inity)?|nan)", re.IGNORECASE)


class PickleVM:
    """Runs one pickle from ``data[start:]`` and returns its value (see :meth:`load`).

    ``encoding`` decodes the protocol-0/2 byte-string opcodes as the loader would: ``utf-8`` for
    torch.load (its default), ``ASCII`` for ``pickle.load``, ``bytes`` to keep them as bytes.
    """

    def __init__(
        self,
        data: bytes | mmap.mmap,
        *,
        reducers: Mapping[str, Reducer] | None = None,
        new_reducers: Mapping[str, Reducer] | None = None,
        builder: Builder | None = None,
        persistent_load: Callable[[Any], Any] | None = None,
        limits: Limits | None = None,
        source: str | None = None,
        encoding: str = "utf-8",
        module_renames: Mapping[str, str] | None = None,
        track_global: Callable[[Global], bool] | None = None,
    ) -> None:
        self.data = data
        self.reducers = reducers or {}
        self.new_reducers = new_reducers if new_reducers is not None else self.reducers
        self.builder = builder
        self.persistent_load = persistent_load
        self.limits = limits or Limits()
        self.source = source
        self.encoding = encoding
        self.module_renames = module_renames or {}
        self.trace = Trace()
        self.pos = 0
        self.stack: list[Any] = []
        self.metastack: list[list[Any]] = []
        self.memo: dict[int, Any] = {}
        self.track_global = track_global
        """Which globals to follow (``pushes``), for a rewrite that edits the opcodes naming them."""
        self.pushes: dict[int, list[int]] = {}
        """id of a followed Global -> where each opcode that pushed it starts: GLOBAL or STACK_GLOBAL first, then
        GET, BINGET, LONG_BINGET or DUP; -1 where a reducer's result was it."""
        self.persistent_ids: list[tuple[Any, ...]] = []
        """With ``track_global``: each persistent id whose second item is a followed Global, in order, and beside it
        (``type_pushed_at``) the opcode that pushed that item (its latest push; -1 when a reducer returned it), and
        (``none_pushed_at``) the NONE that pushed its last item where that NONE directly precedes the TUPLE that
        built it (else -1): what a rewrite that renames the storage types edits (formats/picklesplice.py)."""
        self.type_pushed_at: list[int] = []
        self.none_pushed_at: list[int] = []
        self.frames: list[int] = []
        """Where each FRAME opcode starts."""
        self._none_at = self._tuple_at = -1
        self._tuple: Any = None

    # -- helpers -----------------------------------------------------------------------------

    def _fail(self, message: str) -> CheckpointError:
        return CheckpointError(f"malformed pickle at byte {self.pos}: {message}", path=self.source)

    def _read(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise self._fail(f"needs {n} bytes but the pickle ends at byte {len(self.data)}")
        chunk = bytes(self.data[self.pos : self.pos + n])
        self.pos += n
        return chunk

    def _readline(self) -> bytes:
        """The line up to (not including) its newline; CPython's unpickler requires the newline."""
        end = self.data.find(b"\n", self.pos, min(len(self.data), self.pos + (1 << 20)))
        if end < 0:
            raise self._fail("unterminated text argument")
        line = bytes(self.data[self.pos : end])
        self.pos = end + 1
        return line

    def _sized(self, fmt: str) -> int:
        size = struct.calcsize(fmt)
        (n,) = struct.unpack(fmt, self._read(size))
        return self._check_len(int(n))

    def _check_len(self, n: int) -> int:
        if n > self.limits.max_bytes_item:
            raise LimitExceeded(f"a pickle string of {n} bytes is over the {self.limits.max_bytes_item}-byte cap", path=self.source)
        if n > len(self.data) - self.pos:
            raise self._fail(f"a {n}-byte string runs past the end of the pickle")
        return n

    def _pop_mark(self) -> list[Any]:
        if not self.metastack:
            raise self._fail("MARK expected but none is open")
        items = self.stack
        self.stack = self.metastack.pop()
        return items

    def _pop(self) -> Any:
        if not self.stack:
            raise self._fail("stack underflow")
        value = self.stack.pop()
        if value is _MARK:
            raise self._fail("unexpected MARK")
        return value

    def _top(self) -> Any:
        if not self.stack or self.stack[-1] is _MARK:
            raise self._fail("stack underflow")
        return self.stack[-1]

    def _push(self, value: Any) -> None:
        if len(self.stack) >= self.limits.max_stack:
            raise LimitExceeded("pickle stack over its cap", path=self.source)
        self.stack.append(value)

    def _memo_put(self, index: int, value: Any) -> None:
        if index < 0:
            raise self._fail("negative memo index")
        if index not in self.memo and len(self.memo) >= self.limits.max_memo:
            raise LimitExceeded(f"pickle memo over its cap of {self.limits.max_memo} entries", path=self.source)
        self.memo[index] = value

    def _memo_get(self, index: int) -> Any:
        try:
            return self.memo[index]
        except KeyError:
            raise self._fail(f"memo entry {index} is read before it is written") from None

    def _utf8(self, raw: bytes, what: str) -> str:
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self._fail(f"{what} is not valid UTF-8") from None

    def _global(self, module: str, name: str) -> Global:
        # CPython maps Python 2 names only below protocol 3 (fix_imports); weights_only always maps,
        # with a smaller table. Where the two disagree on what a name means, neither can be trusted.
        cpython = module, name
        if self.trace.protocol < 3:
            if (module, name) in _compat_pickle.NAME_MAPPING:
                cpython = _compat_pickle.NAME_MAPPING[(module, name)]
            elif module in _compat_pickle.IMPORT_MAPPING:
                cpython = _compat_pickle.IMPORT_MAPPING[module], name
        # torch.load's own unpickler (UnpicklerWrapper) also renames modules that moved (torch.tensor).
        cpython = self.module_renames.get(cpython[0], cpython[0]), cpython[1]
        g = Global(*cpython)
        wo_name = allowlist.weights_only_name(module, name)
        if wo_name != g.qualname and allowlist.weights_only_accepts_global(wo_name):
            raise self._fail(
                f"global {module}.{name} means {wo_name} to torch.load(weights_only=True) but {g.qualname} to the full "
                "unpickler; loaders disagree on what it is"
            )
        self.trace.globals.setdefault(g.qualname, self.pos)
        if not allowlist.weights_only_accepts_global(wo_name):
            self.trace.refuse_weights_only(f"global {wo_name}")
        return g

    def _call(self, func: Any, args: Any, *, new: bool = False) -> Any:
        if not isinstance(args, tuple):
            raise self._fail("call arguments are not a tuple")
        if isinstance(func, Global):
            self.trace.calls.setdefault(func.qualname, self.pos)
            reducer = (self.new_reducers if new else self.reducers).get(func.qualname)
            if reducer is not None:
                result = reducer(args)
                if self.pushes and type(result) is Global:
                    self._pushed(result, -1)  # a reducer handed back a global it was given: no opcode names it here
                return result
        elif not isinstance(func, Opaque):
            # A tuple, string, number or container called: every unpickler raises "not callable".
            raise self._fail(f"calls a {type(func).__name__}, which cannot be called")
        else:
            self.trace.refuse_weights_only(f"a call of {type(func).__name__}, not of an allowed global")
        return Opaque(func, args, new=new)

    @staticmethod
    def _hashable(value: Any, what: str, fail: Callable[[str], CheckpointError]) -> Any:
        try:
            hash(value)
        except TypeError:
            raise fail(f"unhashable {type(value).__name__} used as a {what}") from None
        return value

    def _setitems(self, target: Any, pairs: list[Any]) -> None:
        if len(pairs) % 2:
            raise self._fail("SETITEMS with an odd number of items")
        if isinstance(target, dict):
            dest = target
        elif isinstance(target, Opaque):
            self.trace.refuse_weights_only("SETITEM on an object that is not a dict")
            dest = target.items
        else:
            raise self._fail(f"SETITEM on a {type(target).__name__}, not a dict")
        for i in range(0, len(pairs), 2):
            dest[self._hashable(pairs[i], "dict key", self._fail)] = pairs[i + 1]

    def _appends(self, target: Any, values: list[Any]) -> None:
        if isinstance(target, list):
            target.extend(values)
        elif isinstance(target, Opaque):
            self.trace.refuse_weights_only("APPEND to an object that is not a list")
            target.list_items.extend(values)
        else:
            raise self._fail(f"APPEND on a {type(target).__name__}, not a list")

    # -- the loop ----------------------------------------------------------------------------

    def load(self, start: int = 0) -> tuple[Any, int]:
        """Interpret one pickle from ``start``; return its value and the offset just past STOP."""
        self.pos = start
        self.stack = []
        self.metastack = []
        self.memo = {}
        self.pushes, self.frames = {}, []
        self.persistent_ids, self.type_pushed_at, self.none_pushed_at = [], [], []
        ops = 0
        data = self.data
        end = len(data)
        max_ops = self.limits.max_opcodes
        seen = bytearray(256)
        try:
            while True:
                if self.pos >= end:
                    raise self._fail("the pickle ends without a STOP opcode (truncated?)")
                ops += 1
                if ops > max_ops:
                    raise LimitExceeded(f"pickle runs over {max_ops} opcodes", path=self.source)
                op = data[self.pos]
                self.pos += 1
                seen[op] = 1
                if op == 0x2E:  # STOP
                    return self._pop(), self.pos
                handler = _DISPATCH.get(op)
                if handler is None:
                    self.pos -= 1
                    raise self._fail(f"unknown opcode 0x{op:02x}")
                handler(self)
        finally:
            for code, flag in enumerate(seen):
                if flag and code not in _WEIGHTS_ONLY_OPCODE_BYTES:
                    self.trace.refuse_weights_only(f"opcode {_OPCODE_NAMES.get(code, hex(code))}")

    # -- opcodes, by their pickletools names -----------------------------------------------------

    def op_PROTO(self) -> None:
        proto = self._read(1)[0]
        if proto > 5:
            raise self._fail(f"unsupported pickle protocol {proto}")
        self.trace.protocol = proto

    def op_FRAME(self) -> None:
        self.frames.append(self.pos - 1)
        (n,) = struct.unpack("<Q", self._read(8))
        if n > len(self.data) - self.pos:
            raise self._fail("a frame runs past the end of the pickle")

    def op_MARK(self) -> None:
        if len(self.metastack) >= self.limits.max_depth:
            raise LimitExceeded(f"pickle nests deeper than {self.limits.max_depth} levels", path=self.source)
        self.metastack.append(self.stack)
        self.stack = []

    def op_POP(self) -> None:
        if self.stack:
            self.stack.pop()
        else:
            self._pop_mark()

    def op_POP_MARK(self) -> None:
        self._pop_mark()

    def op_DUP(self) -> None:
        value = self._top()
        if self.pushes and type(value) is Global:
            self._pushed(value, self.pos - 1)
        self._push(value)

    def _pushed(self, g: Global, at: int) -> None:
        """Note a push of ``g`` again, where it is followed."""
        pushes = self.pushes.get(id(g))
        if pushes is not None:
            pushes.append(at)

    # numbers
    def op_INT(self) -> None:
        line = self._readline()
        if not line:
            raise self._fail("empty INT argument")
        value, text_end = _c_strtol(line)
        if value is None or (text_end < len(line) and line[text_end] != 0):
            # CPython falls back to int(text, 0) on the whole line, newline included.
            self._push(self._py_int(line + b"\n", 0))
        elif len(line) == 2 and value in (0, 1):
            self._push(bool(value))
        else:
            self._push(value)

    def op_LONG(self) -> None:
        line = self._readline()
        if line.endswith(b"L"):
            line = line[:-1]
        self._push(self._py_int(line, 0))

    def _py_int(self, text: bytes, base: int) -> int:
        """int(text, base) as PyLong_FromString parses it."""
        if len(text) > 4 * self.limits.max_int_bytes:
            raise LimitExceeded("an integer literal is over its cap", path=self.source)
        text = text.split(b"\0", 1)[0]  # a C string: PyLong_FromString stops at a NUL
        try:
            return int(text.decode("ascii"), base)
        except (ValueError, UnicodeDecodeError):
            raise self._fail("bad integer literal") from None

    def op_BININT(self) -> None:
        self._push(struct.unpack("<i", self._read(4))[0])

    def op_BININT1(self) -> None:
        self._push(self._read(1)[0])

    def op_BININT2(self) -> None:
        self._push(struct.unpack("<H", self._read(2))[0])

    def op_LONG1(self) -> None:
        n = self._read(1)[0]
        self._push(int.from_bytes(self._read(n), "little", signed=True))

    def op_LONG4(self) -> None:
        (n,) = struct.unpack("<i", self._read(4))
        if n < 0:
            raise self._fail("negative LONG4 length")
        if n > self.limits.max_int_bytes:
            raise LimitExceeded(f"a {n}-byte integer is over the cap", path=self.source)
        self._push(int.from_bytes(self._read(n), "little", signed=True))

    def op_FLOAT(self) -> None:
        line = self._readline()
        m = _FLOAT.match(line)
        if m is None or (m.end() < len(line) and line[m.end()] != 0):
            raise self._fail("bad float literal")
        value = float(m.group(0))
        if value in (float("inf"), float("-inf")) and b"inf" not in m.group(0).lower():
            raise self._fail("float literal out of range")
        self._push(value)

    def op_BINFLOAT(self) -> None:
        self._push(struct.unpack(">d", self._read(8))[0])

    def op_NONE(self) -> None:
        self._none_at = self.pos - 1
        self._push(None)

    def op_NEWTRUE(self) -> None:
        self._push(True)

    def op_NEWFALSE(self) -> None:
        self._push(False)

    # strings and bytes
    def _string(self, raw: bytes) -> Any:
        """A protocol-0/2 byte string, decoded with the loader's encoding (strictly, as CPython does)."""
        if self.encoding == "bytes":
            return raw
        try:
            return raw.decode(self.encoding)
        except (UnicodeDecodeError, LookupError):
            raise self._fail(f"byte string does not decode as {self.encoding}") from None

    def op_STRING(self) -> None:
        line = self._readline()
        if len(line) < 2 or line[0] != line[-1] or line[:1] not in (b"'", b'"'):
            raise self._fail("STRING argument is not quoted")
        try:
            value = codecs.escape_decode(line[1:-1])[0]
        except ValueError:
            raise self._fail("bad escape in STRING") from None
        self._push(self._string(value))

    def op_BINSTRING(self) -> None:
        (n,) = struct.unpack("<i", self._read(4))
        if n < 0:
            raise self._fail("negative BINSTRING length")
        self._push(self._string(self._read(self._check_len(n))))

    def op_SHORT_BINSTRING(self) -> None:
        n = self._read(1)[0]
        self._push(self._string(self._read(n)))

    def op_BINBYTES(self) -> None:
        self._push(self._read(self._sized("<I")))

    def op_SHORT_BINBYTES(self) -> None:
        self._push(self._read(self._read(1)[0]))

    def op_BINBYTES8(self) -> None:
        self._push(self._read(self._sized("<Q")))

    def op_BYTEARRAY8(self) -> None:
        self._push(bytearray(self._read(self._sized("<Q"))))

    def _decode(self, raw: bytes) -> str:
        try:
            return raw.decode("utf-8", "surrogatepass")
        except UnicodeDecodeError:
            raise self._fail("string is not valid UTF-8") from None

    def op_UNICODE(self) -> None:
        try:
            self._push(self._readline().decode("raw-unicode-escape"))
        except UnicodeDecodeError:
            raise self._fail("bad UNICODE argument") from None

    def op_BINUNICODE(self) -> None:
        self._push(self._decode(self._read(self._sized("<I"))))

    def op_SHORT_BINUNICODE(self) -> None:
        self._push(self._decode(self._read(self._read(1)[0])))

    def op_BINUNICODE8(self) -> None:
        self._push(self._decode(self._read(self._sized("<Q"))))

    # containers
    def op_EMPTY_LIST(self) -> None:
        self._push([])

    def op_APPEND(self) -> None:
        value = self._pop()
        self._appends(self._top(), [value])

    def op_APPENDS(self) -> None:
        items = self._pop_mark()
        self._appends(self._top(), items)

    def op_LIST(self) -> None:
        self._push(self._pop_mark())

    def op_EMPTY_TUPLE(self) -> None:
        self._push(())

    def op_TUPLE(self) -> None:
        value = self._tuple = tuple(self._pop_mark())
        self._tuple_at = self.pos - 1
        self._push(value)

    def op_TUPLE1(self) -> None:
        self._push((self._pop(),))

    def op_TUPLE2(self) -> None:
        b = self._pop()
        a = self._pop()
        self._push((a, b))

    def op_TUPLE3(self) -> None:
        c = self._pop()
        b = self._pop()
        a = self._pop()
        self._push((a, b, c))

    def op_EMPTY_DICT(self) -> None:
        self._push({})

    def op_DICT(self) -> None:
        items = self._pop_mark()
        d: dict[Any, Any] = {}
        self._setitems(d, items)
        self._push(d)

    def op_SETITEM(self) -> None:
        value = self._pop()
        key = self._pop()
        self._setitems(self._top(), [key, value])

    def op_SETITEMS(self) -> None:
        items = self._pop_mark()
        self._setitems(self._top(), items)

    def op_EMPTY_SET(self) -> None:
        self._push(set())

    def op_ADDITEMS(self) -> None:
        items = self._pop_mark()
        target = self._top()
        if not isinstance(target, set):
            raise self._fail(f"ADDITEMS on a {type(target).__name__}, not a set")
        for item in items:
            target.add(self._hashable(item, "set member", self._fail))

    def op_FROZENSET(self) -> None:
        items = self._pop_mark()
        self._push(frozenset(self._hashable(i, "set member", self._fail) for i in items))

    # memo
    def op_GET(self) -> None:
        at = self.pos - 1
        value = self._memo_get(self._py_int(self._readline(), 10))
        if self.pushes and type(value) is Global and id(value) in self.pushes:
            self.pushes[id(value)].append(at)
        self._push(value)

    def op_BINGET(self) -> None:
        value = self._memo_get(self._read(1)[0])
        if self.pushes and type(value) is Global and id(value) in self.pushes:
            self.pushes[id(value)].append(self.pos - 2)
        self._push(value)

    def op_LONG_BINGET(self) -> None:
        value = self._memo_get(struct.unpack("<I", self._read(4))[0])
        if self.pushes and type(value) is Global and id(value) in self.pushes:
            self.pushes[id(value)].append(self.pos - 5)
        self._push(value)

    def op_PUT(self) -> None:
        self._memo_put(self._py_int(self._readline(), 10), self._top())

    def op_BINPUT(self) -> None:
        self._memo_put(self._read(1)[0], self._top())

    def op_LONG_BINPUT(self) -> None:
        self._memo_put(struct.unpack("<I", self._read(4))[0], self._top())

    def op_MEMOIZE(self) -> None:
        self._memo_put(len(self.memo), self._top())

    # globals and calls
    def op_GLOBAL(self) -> None:
        at = self.pos - 1
        module = self._utf8(self._readline(), "GLOBAL module")
        name = self._utf8(self._readline(), "GLOBAL name")
        self._push(self._made(self._global(module, name), at))

    def op_STACK_GLOBAL(self) -> None:
        name = self._pop()
        module = self._pop()
        if type(module) is not str or type(name) is not str:
            raise self._fail("STACK_GLOBAL needs two strings")
        self._push(self._made(self._global(module, name), self.pos - 1))

    def _made(self, g: Global, at: int) -> Global:
        """Start following ``g`` (a new object: one opcode makes it) where ``track_global`` asks."""
        if self.track_global is not None and self.track_global(g):
            self.pushes[id(g)] = [at]
        return g

    def op_REDUCE(self) -> None:
        args = self._pop()
        func = self._pop()
        self._push(self._call(func, args))

    def op_NEWOBJ(self) -> None:
        args = self._pop()
        cls = self._pop()
        self._push(self._call(cls, args, new=True))

    def op_NEWOBJ_EX(self) -> None:
        kwargs = self._pop()
        args = self._pop()
        cls = self._pop()
        if not isinstance(kwargs, dict):
            raise self._fail("NEWOBJ_EX keyword arguments are not a dict")
        obj = self._call(cls, args, new=True)
        if kwargs:
            if not isinstance(obj, Opaque):
                raise self._fail("keyword arguments to a constructor that takes none")
            obj.state = {"__kwargs__": kwargs}
        self._push(obj)

    def op_INST(self) -> None:
        module = self._utf8(self._readline(), "INST module")
        name = self._utf8(self._readline(), "INST name")
        args = tuple(self._pop_mark())
        self._push(self._call(self._global(module, name), args))

    def op_OBJ(self) -> None:
        items = self._pop_mark()
        if not items:
            raise self._fail("OBJ without a class")
        self._push(self._call(items[0], tuple(items[1:])))

    def op_BUILD(self) -> None:
        state = self._pop()
        target = self._top()
        if isinstance(target, Opaque):
            self.trace.refuse_weights_only("BUILD on an object weights_only does not allow")
            if isinstance(target.state, dict) and isinstance(state, dict):
                target.state.update(state)
            else:
                target.state = state
        elif isinstance(target, DictObject):
            # OrderedDict and Counter have no __setstate__: both loaders update the instance __dict__.
            if isinstance(state, tuple) and len(state) == 2:
                state, slots = state
                if slots:
                    raise self._fail(f"BUILD sets slots on a {target.cls}, which has none")
            if state is not None and not isinstance(state, dict):
                raise self._fail(f"BUILD state for a {target.cls} is not a dict")
            for key, value in (state or {}).items():
                if not isinstance(key, str):
                    raise self._fail("BUILD sets an attribute whose name is not a string")
                target.attrs[key] = value
        elif self.builder is None or not self.builder(target, state):
            # A plain dict, list, string or number has no __dict__ and no __setstate__: the loaders fail.
            raise self._fail(f"BUILD on a {type(target).__name__}, which cannot take state")

    def op_PERSID(self) -> None:
        line = self._readline()
        try:
            pid = line.decode("ascii")
        except UnicodeDecodeError:
            raise self._fail("PERSID argument is not ASCII") from None
        self._persistent(pid)

    def op_BINPERSID(self) -> None:
        self._persistent(self._pop())

    def _persistent(self, pid: Any) -> None:
        if self.persistent_load is None:
            raise self._fail("a persistent id appears where none is expected")
        if self.pushes and type(pid) is tuple and len(pid) > 1 and type(pid[1]) is Global and id(pid[1]) in self.pushes:
            self.persistent_ids.append(pid)
            self.type_pushed_at.append(self.pushes[id(pid[1])][-1])
            self.none_pushed_at.append(self._none_at if self._tuple is pid and self._none_at == self._tuple_at - 1 else -1)
        self._push(self.persistent_load(pid))

    def op_unsupported(self) -> None:
        name = _OPCODE_NAMES.get(self.data[self.pos - 1], "?")
        raise self._fail(f"{name} is not supported in a checkpoint (the loaders need out-of-band buffers or a registry)")


def _c_strtol(line: bytes) -> tuple[int | None, int]:
    """C ``strtol(line, &end, 0)``: the value (None on overflow or no digits) and the index of ``end``."""
    m = _STRTOL.match(line)
    if m is None:
        return None, 0
    sign, hexdigits, octal, decimal = m.groups()
    if hexdigits is not None:
        value = int(hexdigits, 16)
    elif octal is not None:
        value = int(octal, 8)
    else:
        value = int(decimal)
    if sign == b"-":
        value = -value
    if not -(1 << 63) <= value < (1 << 63):
        return None, m.end()
    return value, m.end()


_UNSUPPORTED = ("EXT1", "EXT2", "EXT4", "NEXT_BUFFER", "READONLY_BUFFER")
_DISPATCH: dict[int, Callable[[PickleVM], None]] = {
    code: getattr(PickleVM, "op_unsupported" if name in _UNSUPPORTED else f"op_{name}")
    for code, name in _OPCODE_NAMES.items()
    if name != "STOP"
}
