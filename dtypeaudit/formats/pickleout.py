"""Write an object graph read by :class:`PickleVM` (with no reducers) back out as a protocol-2 pickle.

Read with no reducers, a pickle becomes a faithful graph: every call is an :class:`Opaque` that keeps
its callable, arguments, items and state, and every persistent id a :class:`Persistent`. Conversion
uses it only where it leaves entries out (``--strip-optimizer``), or where a storage type is named in a
way the byte edits of formats/picklesplice.py (its usual rewrite) cannot change alone: it edits the storage
types inside persistent ids, drops the entries, then writes the graph back with the opcodes torch.save
itself uses, so everything else keeps its meaning: hyper-parameters, loop state, an OrderedDict's
``_metadata``, Lightning's AttributeDict.
"""

from __future__ import annotations

import struct
from typing import Any

from ..errors import ConversionError
from .picklevm import Global, Opaque


class Persistent:
    """A persistent id (a storage record for torch), kept as the tuple it was."""

    __slots__ = ("pid",)

    def __init__(self, pid: Any) -> None:
        self.pid = pid


def keep_persistent(pid: Any) -> Persistent:
    return Persistent(pid)


class PickleWriter:
    """Protocol 2, memoising every container and call so shared objects stay shared."""

    def __init__(self) -> None:
        self.out = bytearray(b"\x80\x02")
        self.memo: dict[int, int] = {}
        self.globals: dict[str, int] = {}
        self.keep_alive: list[Any] = []

    def dump(self, obj: Any) -> bytes:
        self.save(obj)
        self.out += b"."
        return bytes(self.out)

    def _put(self, obj: Any) -> None:
        index = len(self.memo) + len(self.globals)
        self.memo[id(obj)] = index
        self.keep_alive.append(obj)
        self._put_index(index)

    def _put_index(self, index: int) -> None:
        self.out += b"q" + bytes([index]) if index < 256 else b"r" + struct.pack("<I", index)

    def _get(self, index: int) -> None:
        self.out += b"h" + bytes([index]) if index < 256 else b"j" + struct.pack("<I", index)

    def save(self, obj: Any) -> None:
        if obj is None:
            self.out += b"N"
        elif obj is True:
            self.out += b"\x88"
        elif obj is False:
            self.out += b"\x89"
        elif isinstance(obj, int):
            self._int(obj)
        elif isinstance(obj, float):
            self.out += b"G" + struct.pack(">d", obj)
        elif isinstance(obj, str):
            if id(obj) in self.memo:
                self._get(self.memo[id(obj)])
                return
            data = obj.encode("utf-8", "surrogatepass")
            self.out += b"X" + struct.pack("<I", len(data)) + data
            self._put(obj)
        elif isinstance(obj, Global):
            self._global(obj)
        elif id(obj) in self.memo:
            self._get(self.memo[id(obj)])
        elif isinstance(obj, bytes):
            # Protocol 2 spells bytes as _codecs.encode(latin-1 text), as CPython's pickler does.
            self._global(Global("_codecs", "encode"))
            self.save((obj.decode("latin-1"), "latin1"))
            self.out += b"R"
            self._put(obj)
        elif isinstance(obj, tuple):
            self._tuple(obj)
        elif isinstance(obj, list):
            self.out += b"]"
            self._put(obj)
            self._batched(obj, b"e", pairs=False)
        elif isinstance(obj, dict):
            self.out += b"}"
            self._put(obj)
            self._batched([x for kv in obj.items() for x in kv], b"u", pairs=True)
        elif isinstance(obj, (set, frozenset)):
            self._global(Global("builtins", type(obj).__name__))
            self.save((list(obj),))
            self.out += b"R"
            self._put(obj)
        elif isinstance(obj, Persistent):
            self.save(obj.pid)
            self.out += b"Q"
        elif isinstance(obj, Opaque):
            self._opaque(obj)
        else:
            raise ConversionError(f"cannot write a {type(obj).__name__} back into a pickle")

    def _int(self, value: int) -> None:
        if 0 <= value < 256:
            self.out += b"K" + bytes([value])
        elif 0 <= value < 65536:
            self.out += b"M" + struct.pack("<H", value)
        elif -(2**31) <= value < 2**31:
            self.out += b"J" + struct.pack("<i", value)
        else:
            data = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
            self.out += b"\x8a" + bytes([len(data)]) + data

    def _global(self, g: Global) -> None:
        if g.qualname in self.globals:
            self._get(self.globals[g.qualname])
            return
        self.out += b"c" + g.module.encode("utf-8") + b"\n" + g.name.encode("utf-8") + b"\n"
        index = len(self.memo) + len(self.globals)
        self.globals[g.qualname] = index
        self._put_index(index)

    def _tuple(self, t: tuple[Any, ...]) -> None:
        if not t:
            self.out += b")"
            return
        if len(t) <= 3:
            for item in t:
                self.save(item)
            if id(t) in self.memo:  # a recursive tuple was written while saving its items
                self.out += b"0" * len(t)
                self._get(self.memo[id(t)])
                return
            self.out += {1: b"\x85", 2: b"\x86", 3: b"\x87"}[len(t)]
        else:
            self.out += b"("
            for item in t:
                self.save(item)
            self.out += b"t"
        self._put(t)

    def _batched(self, items: list[Any], opcode: bytes, *, pairs: bool) -> None:
        step = 2000 if pairs else 1000
        for start in range(0, len(items), step):
            chunk = items[start : start + step]
            if len(chunk) == (2 if pairs else 1):
                for item in chunk:
                    self.save(item)
                self.out += b"s" if pairs else b"a"
                continue
            self.out += b"("
            for item in chunk:
                self.save(item)
            self.out += opcode

    def _opaque(self, obj: Opaque) -> None:
        self.save(obj.callable)
        self.save(obj.args)
        if isinstance(obj.state, dict) and "__kwargs__" in obj.state:
            raise ConversionError("keyword-argument object construction (NEWOBJ_EX) cannot be written back")
        self.out += b"\x81" if obj.new else b"R"
        self._put(obj)
        if obj.list_items:
            self._batched(list(obj.list_items), b"e", pairs=False)
        if obj.items:
            self._batched([x for kv in obj.items.items() for x in kv], b"u", pairs=True)
        if obj.state is not None:
            self.save(obj.state)
            self.out += b"b"


def dumps(obj: Any) -> bytes:
    return PickleWriter().dump(obj)
