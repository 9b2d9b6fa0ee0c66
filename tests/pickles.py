"""A small pickle assembler for crafting torch-shaped pickles by hand: each function returns the opcodes
that push one value. Files built from these are only ever loaded by torch.load(weights_only=True),
``pickle.loads`` of data-only streams, or dtypeaudit."""

from __future__ import annotations

import struct

from .hostile import call, global_op, text

NONE, TRUE, FALSE = b"N", b"\x88", b"\x89"


def integer(n: int) -> bytes:
    return b"J" + struct.pack("<i", n)


def tup(*items: bytes) -> bytes:
    return b"(" + b"".join(items) + b"t"


def dictionary(*pairs: tuple[bytes, bytes]) -> bytes:
    return b"}(" + b"".join(k + v for k, v in pairs) + b"u"


def ordered_dict() -> bytes:
    return call(global_op("collections", "OrderedDict"))


def build(obj: bytes, state: bytes) -> bytes:
    return obj + state + b"b"


def storage(key: str, cls: str = "FloatStorage", numel: int = 4, module: str = "torch") -> bytes:
    """A torch storage record (BINPERSID), as torch.save's zip format writes it."""
    return tup(text("storage"), global_op(module, cls), text(key), text("cpu"), integer(numel)) + b"Q"


def ints(values: tuple[int, ...]) -> bytes:
    return tup(*(integer(v) for v in values))


def tensor(st: bytes, shape: tuple[int, ...], stride: tuple[int, ...] | None = None, offset: int = 0, grad: bytes = FALSE) -> bytes:
    """``torch._utils._rebuild_tensor_v2(storage, offset, size, stride, requires_grad, OrderedDict())``."""
    if stride is None:
        stride = _contiguous(shape)
    return call(global_op("torch._utils", "_rebuild_tensor_v2"), st, integer(offset), ints(shape), ints(stride), grad, ordered_dict())


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, run = [], 1
    for size in reversed(shape):
        out.append(run)
        run *= size
    return tuple(reversed(out))


def pickle2(body: bytes) -> bytes:
    """A protocol-2 pickle whose value is ``body``."""
    return b"\x80\x02" + body + b"."
