"""An allowlist-only pickle interpreter.

It understands every opcode of protocols 0-5 but imports nothing and calls nothing from the file.
A global is only ever a name (:class:`Global`). Calling one (REDUCE, NEWOBJ, INST, OBJ) runs a
reducer the caller supplied for that exact name, written in this project; any other call yields an
:class:`Opaque` stand-in that keeps its arguments and state, so values around it can still be read.

Hostile input fails closed with a CheckpointError, and its cost is bounded: opcodes executed, memo
entries, stack depth and the length of any single string are all capped (:class:`Limits`).
The opcode semantics follow the documentation in CPython's ``pickletools`` module.
"""

from __future__ import annotations

import codecs
import mmap
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import CheckpointError, LimitExceeded


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


Reducer = Callable[[tuple[Any, ...]], Any]


@dataclass(frozen=True)
class Limits:
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
    """Every global named, with the offset of its first mention."""
    calls: dict[str, int] = field(default_factory=dict)
    """Every global called (REDUCE, NEWOBJ, INST, OBJ) with the offset of its first call."""


_PY2_MODULES = {"__builtin__": "builtins", "copy_reg": "copyreg"}


class _Mark:
    __slots__ = ()


_MARK = _Mark()


class PickleVM:
    """Runs one pickle from ``data[start:]`` and returns its value (see :meth:`load`)."""

    def __init__(
        self,
        data: bytes | mmap.mmap,
        *,
        reducers: Mapping[str, Reducer] | None = None,
        persistent_load: Callable[[Any], Any] | None = None,
        limits: Limits | None = None,
        source: str | None = None,
    ) -> None:
        self.data = data
        self.reducers = reducers or {}
        self.persistent_load = persistent_load
        self.limits = limits or Limits()
        self.source = source
        self.trace = Trace()
        self.pos = 0
        self.stack: list[Any] = []
        self.metastack: list[list[Any]] = []
        self.memo: dict[int, Any] = {}

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
        end = self.data.find(b"\n", self.pos, min(len(self.data), self.pos + (1 << 20)))
        if end < 0:
            raise self._fail("unterminated text argument")
        line = bytes(self.data[self.pos : end])
        self.pos = end + 1
        return line

    def _sized(self, fmt: str) -> int:
        size = struct.calcsize(fmt)
        (n,) = struct.unpack(fmt, self._read(size))
        if n > self.limits.max_bytes_item:
            raise LimitExceeded(f"a pickle string of {n} bytes is over the {self.limits.max_bytes_item}-byte cap", path=self.source)
        if n > len(self.data) - self.pos:
            raise self._fail(f"a {n}-byte string runs past the end of the pickle")
        return int(n)

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
        if index not in self.memo and len(self.memo) >= self.limits.max_memo:
            raise LimitExceeded(f"pickle memo over its cap of {self.limits.max_memo} entries", path=self.source)
        self.memo[index] = value

    def _memo_get(self, index: int) -> Any:
        try:
            return self.memo[index]
        except KeyError:
            raise self._fail(f"memo entry {index} is read before it is written") from None

    def _global(self, module: str, name: str) -> Global:
        # Python 2 spellings, as CPython's unpickler maps them for old protocols.
        module = _PY2_MODULES.get(module, module)
        g = Global(module, name)
        self.trace.globals.setdefault(g.qualname, self.pos)
        return g

    def _call(self, func: Any, args: Any, *, new: bool = False) -> Any:
        if not isinstance(args, tuple):
            raise self._fail("call arguments are not a tuple")
        if isinstance(func, Global):
            self.trace.calls.setdefault(func.qualname, self.pos)
            reducer = self.reducers.get(func.qualname)
            if reducer is not None:
                return reducer(args)
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
            dest = target.items
        else:
            raise self._fail(f"SETITEM on a {type(target).__name__}, not a dict")
        for i in range(0, len(pairs), 2):
            dest[self._hashable(pairs[i], "dict key", self._fail)] = pairs[i + 1]

    def _appends(self, target: Any, values: list[Any]) -> None:
        if isinstance(target, list):
            target.extend(values)
        elif isinstance(target, Opaque):
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
        ops = 0
        data = self.data
        end = len(data)
        max_ops = self.limits.max_opcodes
        while True:
            if self.pos >= end:
                raise self._fail("the pickle ends without a STOP opcode (truncated?)")
            ops += 1
            if ops > max_ops:
                raise LimitExceeded(f"pickle runs over {max_ops} opcodes", path=self.source)
            op = data[self.pos]
            self.pos += 1
            if op == 0x2E:  # STOP
                return self._pop(), self.pos
            handler = _DISPATCH.get(op)
            if handler is None:
                self.pos -= 1
                raise self._fail(f"unknown opcode 0x{op:02x}")
            handler(self)

    # -- opcodes -----------------------------------------------------------------------------

    def op_proto(self) -> None:
        proto = self._read(1)[0]
        if proto > 5:
            raise self._fail(f"unsupported pickle protocol {proto}")

    def op_frame(self) -> None:
        (n,) = struct.unpack("<Q", self._read(8))
        if n > len(self.data) - self.pos:
            raise self._fail("a frame runs past the end of the pickle")

    def op_mark(self) -> None:
        if len(self.metastack) >= self.limits.max_depth:
            raise LimitExceeded(f"pickle nests deeper than {self.limits.max_depth} levels", path=self.source)
        self.metastack.append(self.stack)
        self.stack = []

    def op_pop(self) -> None:
        if self.stack:
            self.stack.pop()
        else:
            self._pop_mark()

    def op_pop_mark(self) -> None:
        self._pop_mark()

    def op_dup(self) -> None:
        self._push(self._top())

    # numbers
    def op_int(self) -> None:
        line = self._readline()
        if line == b"00":
            self._push(False)
        elif line == b"01":
            self._push(True)
        else:
            self._push(self._parse_int(line))

    def op_long(self) -> None:
        line = self._readline()
        self._push(self._parse_int(line[:-1] if line.endswith(b"L") else line))

    def _parse_int(self, text: bytes) -> int:
        if len(text) > 4 * self.limits.max_int_bytes:
            raise LimitExceeded("an integer literal is over its cap", path=self.source)
        try:
            return int(text, 0) if text.strip().lower().startswith((b"0x", b"-0x")) else int(text)
        except ValueError:
            raise self._fail("bad integer literal") from None

    def op_binint(self) -> None:
        self._push(struct.unpack("<i", self._read(4))[0])

    def op_binint1(self) -> None:
        self._push(self._read(1)[0])

    def op_binint2(self) -> None:
        self._push(struct.unpack("<H", self._read(2))[0])

    def op_long1(self) -> None:
        n = self._read(1)[0]
        self._push(int.from_bytes(self._read(n), "little", signed=True))

    def op_long4(self) -> None:
        (n,) = struct.unpack("<i", self._read(4))
        if n < 0 or n > self.limits.max_int_bytes:
            raise LimitExceeded(f"a {n}-byte integer is over the cap", path=self.source)
        self._push(int.from_bytes(self._read(n), "little", signed=True))

    def op_float(self) -> None:
        try:
            self._push(float(self._readline()))
        except ValueError:
            raise self._fail("bad float literal") from None

    def op_binfloat(self) -> None:
        self._push(struct.unpack(">d", self._read(8))[0])

    def op_none(self) -> None:
        self._push(None)

    def op_newtrue(self) -> None:
        self._push(True)

    def op_newfalse(self) -> None:
        self._push(False)

    # strings and bytes
    def op_string(self) -> None:
        line = self._readline()
        if len(line) < 2 or line[0] != line[-1] or line[:1] not in (b"'", b'"'):
            raise self._fail("STRING argument is not quoted")
        try:
            value = codecs.escape_decode(line[1:-1])[0]
        except ValueError:
            raise self._fail("bad escape in STRING") from None
        self._push(value.decode("latin-1"))

    def op_binstring(self) -> None:
        (n,) = struct.unpack("<i", self._read(4))
        if n < 0:
            raise self._fail("negative BINSTRING length")
        self._push(self._read(self._check_len(n)).decode("latin-1"))

    def _check_len(self, n: int) -> int:
        if n > self.limits.max_bytes_item:
            raise LimitExceeded(f"a pickle string of {n} bytes is over the cap", path=self.source)
        if n > len(self.data) - self.pos:
            raise self._fail(f"a {n}-byte string runs past the end of the pickle")
        return n

    def op_short_binstring(self) -> None:
        n = self._read(1)[0]
        self._push(self._read(n).decode("latin-1"))

    def op_binbytes(self) -> None:
        self._push(self._read(self._sized("<I")))

    def op_short_binbytes(self) -> None:
        self._push(self._read(self._read(1)[0]))

    def op_binbytes8(self) -> None:
        self._push(self._read(self._sized("<Q")))

    def op_bytearray8(self) -> None:
        self._push(bytearray(self._read(self._sized("<Q"))))

    def _decode(self, raw: bytes) -> str:
        try:
            return raw.decode("utf-8", "surrogatepass")
        except UnicodeDecodeError:
            raise self._fail("string is not valid UTF-8") from None

    def op_unicode(self) -> None:
        try:
            self._push(self._readline().decode("raw-unicode-escape"))
        except UnicodeDecodeError:
            raise self._fail("bad UNICODE argument") from None

    def op_binunicode(self) -> None:
        self._push(self._decode(self._read(self._sized("<I"))))

    def op_short_binunicode(self) -> None:
        self._push(self._decode(self._read(self._read(1)[0])))

    def op_binunicode8(self) -> None:
        self._push(self._decode(self._read(self._sized("<Q"))))

    # containers
    def op_empty_list(self) -> None:
        self._push([])

    def op_append(self) -> None:
        value = self._pop()
        self._appends(self._top(), [value])

    def op_appends(self) -> None:
        items = self._pop_mark()
        self._appends(self._top(), items)

    def op_list(self) -> None:
        self._push(self._pop_mark())

    def op_empty_tuple(self) -> None:
        self._push(())

    def op_tuple(self) -> None:
        self._push(tuple(self._pop_mark()))

    def op_tuple1(self) -> None:
        self._push((self._pop(),))

    def op_tuple2(self) -> None:
        b = self._pop()
        a = self._pop()
        self._push((a, b))

    def op_tuple3(self) -> None:
        c = self._pop()
        b = self._pop()
        a = self._pop()
        self._push((a, b, c))

    def op_empty_dict(self) -> None:
        self._push({})

    def op_dict(self) -> None:
        items = self._pop_mark()
        d: dict[Any, Any] = {}
        self._setitems(d, items)
        self._push(d)

    def op_setitem(self) -> None:
        value = self._pop()
        key = self._pop()
        self._setitems(self._top(), [key, value])

    def op_setitems(self) -> None:
        items = self._pop_mark()
        self._setitems(self._top(), items)

    def op_empty_set(self) -> None:
        self._push(set())

    def op_additems(self) -> None:
        items = self._pop_mark()
        target = self._top()
        if not isinstance(target, set):
            raise self._fail(f"ADDITEMS on a {type(target).__name__}, not a set")
        for item in items:
            target.add(self._hashable(item, "set member", self._fail))

    def op_frozenset(self) -> None:
        items = self._pop_mark()
        self._push(frozenset(self._hashable(i, "set member", self._fail) for i in items))

    # memo
    def op_get(self) -> None:
        self._push(self._memo_get(self._parse_int(self._readline())))

    def op_binget(self) -> None:
        self._push(self._memo_get(self._read(1)[0]))

    def op_long_binget(self) -> None:
        self._push(self._memo_get(struct.unpack("<I", self._read(4))[0]))

    def op_put(self) -> None:
        self._memo_put(self._parse_int(self._readline()), self._top())

    def op_binput(self) -> None:
        self._memo_put(self._read(1)[0], self._top())

    def op_long_binput(self) -> None:
        self._memo_put(struct.unpack("<I", self._read(4))[0], self._top())

    def op_memoize(self) -> None:
        self._memo_put(len(self.memo), self._top())

    # globals and calls
    def op_global(self) -> None:
        module = self._readline().decode("utf-8", "replace")
        name = self._readline().decode("utf-8", "replace")
        self._push(self._global(module, name))

    def op_stack_global(self) -> None:
        name = self._pop()
        module = self._pop()
        if not isinstance(module, str) or not isinstance(name, str):
            raise self._fail("STACK_GLOBAL needs two strings")
        self._push(self._global(module, name))

    def op_reduce(self) -> None:
        args = self._pop()
        func = self._pop()
        self._push(self._call(func, args))

    def op_newobj(self) -> None:
        args = self._pop()
        cls = self._pop()
        self._push(self._call(cls, args, new=True))

    def op_newobj_ex(self) -> None:
        kwargs = self._pop()
        args = self._pop()
        cls = self._pop()
        if not isinstance(kwargs, dict):
            raise self._fail("NEWOBJ_EX keyword arguments are not a dict")
        obj = self._call(cls, args, new=True)
        if isinstance(obj, Opaque) and kwargs:
            obj.state = {"__kwargs__": kwargs}
        self._push(obj)

    def op_inst(self) -> None:
        module = self._readline().decode("utf-8", "replace")
        name = self._readline().decode("utf-8", "replace")
        args = tuple(self._pop_mark())
        self._push(self._call(self._global(module, name), args))

    def op_obj(self) -> None:
        items = self._pop_mark()
        if not items:
            raise self._fail("OBJ without a class")
        self._push(self._call(items[0], tuple(items[1:])))

    def op_build(self) -> None:
        state = self._pop()
        target = self._top()
        if isinstance(target, Opaque):
            if isinstance(target.state, dict) and isinstance(state, dict):
                target.state.update(state)
            else:
                target.state = state
        # BUILD on a value we made ourselves (an OrderedDict's ``_metadata``, a tensor's hooks)
        # carries nothing an inventory needs; it is dropped rather than applied.

    def op_persid(self) -> None:
        self._persistent(self._readline().decode("ascii", "replace"))

    def op_binpersid(self) -> None:
        self._persistent(self._pop())

    def _persistent(self, pid: Any) -> None:
        if self.persistent_load is None:
            raise self._fail("a persistent id appears where none is expected")
        self._push(self.persistent_load(pid))

    def op_unsupported(self) -> None:
        op = self.data[self.pos - 1]
        names = {0x82: "EXT1", 0x83: "EXT2", 0x84: "EXT4", 0x97: "NEXT_BUFFER", 0x98: "READONLY_BUFFER"}
        raise self._fail(f"{names.get(op, hex(op))} is not supported in a checkpoint")


_DISPATCH: dict[int, Callable[[PickleVM], None]] = {
    0x80: PickleVM.op_proto,
    0x95: PickleVM.op_frame,
    0x28: PickleVM.op_mark,
    0x30: PickleVM.op_pop,
    0x31: PickleVM.op_pop_mark,
    0x32: PickleVM.op_dup,
    0x49: PickleVM.op_int,
    0x4C: PickleVM.op_long,
    0x4A: PickleVM.op_binint,
    0x4B: PickleVM.op_binint1,
    0x4D: PickleVM.op_binint2,
    0x8A: PickleVM.op_long1,
    0x8B: PickleVM.op_long4,
    0x46: PickleVM.op_float,
    0x47: PickleVM.op_binfloat,
    0x4E: PickleVM.op_none,
    0x88: PickleVM.op_newtrue,
    0x89: PickleVM.op_newfalse,
    0x53: PickleVM.op_string,
    0x54: PickleVM.op_binstring,
    0x55: PickleVM.op_short_binstring,
    0x42: PickleVM.op_binbytes,
    0x43: PickleVM.op_short_binbytes,
    0x8E: PickleVM.op_binbytes8,
    0x96: PickleVM.op_bytearray8,
    0x56: PickleVM.op_unicode,
    0x58: PickleVM.op_binunicode,
    0x8C: PickleVM.op_short_binunicode,
    0x8D: PickleVM.op_binunicode8,
    0x5D: PickleVM.op_empty_list,
    0x61: PickleVM.op_append,
    0x65: PickleVM.op_appends,
    0x6C: PickleVM.op_list,
    0x29: PickleVM.op_empty_tuple,
    0x74: PickleVM.op_tuple,
    0x85: PickleVM.op_tuple1,
    0x86: PickleVM.op_tuple2,
    0x87: PickleVM.op_tuple3,
    0x7D: PickleVM.op_empty_dict,
    0x64: PickleVM.op_dict,
    0x73: PickleVM.op_setitem,
    0x75: PickleVM.op_setitems,
    0x8F: PickleVM.op_empty_set,
    0x90: PickleVM.op_additems,
    0x91: PickleVM.op_frozenset,
    0x67: PickleVM.op_get,
    0x68: PickleVM.op_binget,
    0x6A: PickleVM.op_long_binget,
    0x70: PickleVM.op_put,
    0x71: PickleVM.op_binput,
    0x72: PickleVM.op_long_binput,
    0x94: PickleVM.op_memoize,
    0x63: PickleVM.op_global,
    0x93: PickleVM.op_stack_global,
    0x52: PickleVM.op_reduce,
    0x81: PickleVM.op_newobj,
    0x92: PickleVM.op_newobj_ex,
    0x69: PickleVM.op_inst,
    0x6F: PickleVM.op_obj,
    0x62: PickleVM.op_build,
    0x50: PickleVM.op_persid,
    0x51: PickleVM.op_binpersid,
    0x82: PickleVM.op_unsupported,
    0x83: PickleVM.op_unsupported,
    0x84: PickleVM.op_unsupported,
    0x97: PickleVM.op_unsupported,
    0x98: PickleVM.op_unsupported,
}
