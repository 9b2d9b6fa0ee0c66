"""Retype the storages of a torch.save pickle by editing the opcodes that name their types, not by running it again.

A dtype conversion changes, in each persistent id ``('storage', <storage type>, key, location, numel)``, only the
storage type. The reader's one run noted where each type was pushed (``Layout.storage_sites``), so the rewrite
copies the pickle's bytes and edits those opcodes alone; everything else stays byte for byte as written.

The edits keep what ``torch.load(weights_only=True)`` accepts (it knows no POP, DUP, FRAME or STACK_GLOBAL):

- a memo read (GET, BINGET, LONG_BINGET) of a type that changes becomes ``GLOBAL torch <NewStorage>``: a memo
  read writes nothing, so the memo and every other use of it keep their meaning;
- a GLOBAL that makes a type which changes is renamed in place, and the memo entry it fills with it. Only where
  every later push of it is a storage record's type (then each is given its own type as above); otherwise the
  rename would change a use this module cannot see, and it refuses (:class:`SpliceRefused`);
- a STACK_GLOBAL (protocol 4 and later, which weights_only refuses anyway) keeps what it makes and memoises, and
  is followed by POP and ``GLOBAL torch <NewStorage>``;
- a legacy record's sixth field (a None, which an archive's record does not have) loses the NONE that pushed it.

FRAME lengths (protocol 4 and later) grow or shrink with the edits inside each frame. Pickle offsets are
never absolute otherwise, so the edited pickle means what the original did with the new types (as CPython's
unpickler and torch's weights_only unpickler read it).
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence

from ..errors import ConversionError

GLOBAL, STACK_GLOBAL, GET, BINGET, LONG_BINGET, DUP = b"c", b"\x93", b"g", b"h", b"j", b"2"
NONE, FRAME, POP = b"N", b"\x95", b"0"
_MEMO_PUTS = {b"q": 2, b"r": 5, b"\x94": 1}  # BINPUT, LONG_BINPUT, MEMOIZE; PUT (b"p") runs to its newline


class SpliceRefused(ConversionError):
    """The pickle names a storage type in a way the edits cannot change alone (the rewrite then re-emits it)."""


Site = tuple[int, str, str, int]
"""``(type_at, key, storage type, none_at)``, as ``Layout.storage_sites``."""


def retype(
    buf: bytes | memoryview,
    start: int,
    end: int,
    sites: Sequence[Site],
    type_pushes: Sequence[Sequence[int]],
    frames: Sequence[int],
    new_type: Mapping[str, str],
    *,
    drop_sixth: bool = False,
) -> bytes:
    """The pickle ``buf[start:end]`` with the storage type of each key in ``new_type`` renamed to that storage class
    (``HalfStorage``), and, ``drop_sixth``, each record's sixth field left out (a legacy file into an archive).
    Positions (``sites``, ``type_pushes``, ``frames``) are in ``buf``, as the reader noted them."""
    data = bytes(buf[start:end])
    edits: dict[int, tuple[int, bytes]] = {}  # where -> (bytes replaced, bytes put there)

    def edit(at: int, length: int, new: bytes) -> None:
        edits[at - start] = (length, new)

    if len({site[0] for site in sites}) != len(sites) or any(site[0] < start for site in sites):
        # a record whose type was not pushed for it (its pid tuple fetched again from the memo): the site the reader
        # noted belongs to another record, so an edit there would retype the wrong storage
        raise SpliceRefused("a storage record reuses another's persistent id, which the rewrite does not follow")
    by_site = {site[0]: site for site in sites}
    for pushes in type_pushes:
        named = [by_site[p] for p in pushes if p in by_site]
        if not named:
            continue
        old = named[0][2]
        want = {p: new_type.get(by_site[p][1], old) if p in by_site else old for p in pushes}
        if all(w == old for w in want.values()):
            continue
        if any(p < start or data[p - start : p - start + 1] == DUP for p in pushes):
            raise SpliceRefused("a storage type is pushed by a reducer's result or a DUP, which the rewrite does not follow")
        made, memo = pushes[0], old
        if want[made] != old:
            op = data[made - start : made - start + 1]
            if op == GLOBAL and all(p in by_site for p in pushes):
                edit(made, _length(data, made - start), _global(want[made]))
                memo = want[made]
            elif op == STACK_GLOBAL:
                after = made - start + 1
                edit(made + 1 + _memo_put(data, after), 0, POP + _global(want[made]))
            else:
                raise SpliceRefused(f"the storage type made at byte {made} is also used where no storage record names it")
        for p in pushes[1:]:
            if want[p] == memo:
                continue
            if data[p - start : p - start + 1] not in (GET, BINGET, LONG_BINGET):
                raise SpliceRefused(f"the storage type at byte {p} is pushed by an opcode the rewrite cannot rename")
            edit(p, _length(data, p - start), _global(want[p]))
    if drop_sixth:
        for _, key, _, none_at in sites:
            if none_at < start or data[none_at - start : none_at - start + 1] != NONE:
                raise SpliceRefused(f"storage '{key}' has a sixth field the rewrite cannot leave out")
            edit(none_at, 1, b"")
    for f in frames:
        at = f - start
        if data[at : at + 1] != FRAME:
            raise SpliceRefused(f"no FRAME at byte {f}")
        (length,) = struct.unpack_from("<Q", data, at + 1)
        inside = range(at + 9, at + 9 + length)
        # an insertion belongs to the frame of the opcode it follows
        delta = sum(len(new) - n for where, (n, new) in edits.items() if (where - 1 if n == 0 else where) in inside)
        if any(where in inside and where + n > inside.stop for where, (n, _) in edits.items()):
            raise SpliceRefused(f"an edited opcode runs past the end of the frame at byte {f}")
        if delta:
            edits[at + 1] = (8, struct.pack("<Q", length + delta))
    out = bytearray()
    pos = 0
    for where in sorted(edits):
        n, new = edits[where]
        out += data[pos:where]
        out += new
        pos = where + n
    out += data[pos:]
    return bytes(out)


def _global(name: str) -> bytes:
    return b"ctorch\n" + name.encode("ascii") + b"\n"


def _length(data: bytes, at: int) -> int:
    """The length of the GLOBAL, GET, BINGET or LONG_BINGET opcode at ``at``, argument included."""
    op = data[at : at + 1]
    if op == BINGET:
        return 2
    if op == LONG_BINGET:
        return 5
    lines = 2 if op == GLOBAL else 1 if op == GET else 0
    if not lines:
        raise SpliceRefused(f"byte {at} of the pickle is not an opcode that names a storage type")
    stop = at
    for _ in range(lines):
        stop = data.index(b"\n", stop + 1)
    return stop + 1 - at


def _memo_put(data: bytes, at: int) -> int:
    """The length of the memo put at ``at`` (what memoises the value just made), or 0 when there is none."""
    op = data[at : at + 1]
    if op in _MEMO_PUTS:
        return _MEMO_PUTS[op]
    if op == b"p":
        return data.index(b"\n", at) + 1 - at
    return 0
