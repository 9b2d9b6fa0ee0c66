"""ZipArchive sees what torch's PyTorchStreamReader (miniz) sees, or refuses: real writers, then crafted bytes.

torch's own reader (``torch._C.PyTorchFileReader``) is the oracle where it can read a file; ``torch.load`` is only
ever called with ``weights_only=True``.
"""

from __future__ import annotations

import io
import struct
import zipfile
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dtypeaudit.errors import CheckpointError, LimitExceeded
from dtypeaudit.formats.ziparchive import ZipArchive

Member = dict[str, Any]


def build(
    members: list[Member], *, lead: bytes = b"", tail: bytes = b"", count: int | None = None, disk: int = 0, comment: bytes = b""
) -> bytes:
    """A stored zip assembled record by record; each member may override what its records say."""
    out, cd = bytearray(lead), bytearray()
    for m in members:
        name = m["name"].encode() if isinstance(m["name"], str) else m["name"]
        local = m["local_name"] if "local_name" in m else name
        data, flags, size = m["data"], m.get("flags", 0), m.get("size", len(m["data"]))
        crc, offset = m.get("crc", zlib.crc32(data)), len(out)
        out += struct.pack("<4sHHHHHIIIHH", b"PK\x03\x04", 20, flags, 0, 0, 0x21, crc, len(data), len(data), len(local), 0) + local + data
        fields = (20, 20, flags, m.get("method", 0), 0, 0x21, crc, m.get("csize", size), size, len(name), 0, 0, 0, 0, m.get("attr", 0))
        cd += struct.pack("<4sHHHHHHIIIHHHHHII", b"PK\x01\x02", *fields, m.get("offset", offset)) + name
    n, start = len(members) if count is None else count, len(out)
    return bytes(out + cd + struct.pack("<4sHHHHIIH", b"PK\x05\x06", disk, disk, n, n, len(cd), start, len(comment)) + comment + tail)


def saved(obj: object) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def members_of(raw: bytes) -> list[Member]:
    zf = zipfile.ZipFile(io.BytesIO(raw))
    return [{"name": i.filename, "data": zf.read(i)} for i in zf.infolist()]


@pytest.fixture(scope="module")
def fp16_raw() -> bytes:
    return saved({"w": torch.arange(6, dtype=torch.float16)})


@pytest.fixture(scope="module")
def fp16(fp16_raw: bytes) -> list[Member]:
    return members_of(fp16_raw)


@pytest.fixture(scope="module")
def fp32_pickle() -> bytes:
    return members_of(saved({"w": torch.arange(3, dtype=torch.float32)}))[0]["data"]


def edit(members: list[Member], name: str, **changes: Any) -> list[Member]:
    return [dict(m, **changes) if m["name"] == name else m for m in members]


def write(tmp_path: Path, data: bytes) -> Path:
    path = tmp_path / "x.pt"
    path.write_bytes(data)
    return path


def refused(path: Path, *words: str) -> str:
    with pytest.raises(CheckpointError) as info:
        ZipArchive.open(path).close()
    message = str(info.value)
    assert "\n" not in message and all(w in message for w in words), message
    return message


def torch_reads(path: Path) -> Any:
    """What torch.load(weights_only=True) returns, or the first line of its error."""
    try:
        return torch.load(path, weights_only=True)
    except Exception as exc:  # the error text is the observation
        return f"error: {str(exc).splitlines()[0]}"


def matches_torch_and_zipfile(path: Path) -> None:
    reader: Any = torch._C.PyTorchFileReader(str(path))  # torch's own PyTorchStreamReader
    zf = zipfile.ZipFile(path)
    blob = path.read_bytes()
    with ZipArchive.open(path) as za, zf:
        infos = zf.infolist()
        assert [e.name for e in za.entries] == [i.filename for i in infos]
        assert [e.name.split("/", 1)[1] for e in za.entries] == reader.get_all_records()
        for e, i in zip(za.entries, infos, strict=True):
            record = e.name.split("/", 1)[1]
            ours = (e.header_offset, e.compressed_size, e.size, e.crc, e.method)
            assert ours == (i.header_offset, i.compress_size, i.file_size, i.CRC, i.compress_type)
            assert (e.header_offset, e.data_offset) == (reader.get_record_header_offset(record), reader.get_record_offset(record))
            assert za.read(e, 1 << 30) == zf.read(i) == reader.get_record(record)
            if e.method == 0:
                offset, length = za.span(e)
                assert blob[offset : offset + length] == zf.read(i)
            swapped = e.name.encode().swapcase().decode()  # A-Z swapped only, as miniz folds
            assert za.find(swapped) == e and reader.has_record(swapped.split("/", 1)[1])


@pytest.mark.parametrize("how", ["file", "bytesio", "jit"])
def test_torch_archives_read_as_torch_and_zipfile_read_them(tmp_path: Path, how: str) -> None:
    path = tmp_path / "model.pt"
    # the uint8 storage opens with the bytes of a PROTO 2 opcode, yet is tensor data, not a pickle
    state = {"a": torch.ones(3), "b": torch.zeros(2, 2, dtype=torch.bfloat16), "n": {"u": torch.tensor([128, 2, 0], dtype=torch.uint8)}}
    if how == "file":
        torch.save(state, path)
    elif how == "bytesio":
        path.write_bytes(saved(state))
    else:
        torch.jit.save(torch.jit.script(torch.nn.Linear(2, 3)), str(path))
    matches_torch_and_zipfile(path)
    with ZipArchive.open(path) as za:
        pickles = {e.name.split("/", 1)[1] for e in za.pickle_entries()}
        assert "data.pkl" in pickles and (how != "jit" or "constants.pkl" in pickles)
        assert all(not p.startswith("data/") for p in pickles)
        assert za.find("model/nothing.pkl") is None


def test_deflated_member_reads_back_and_a_wrong_crc_is_refused(tmp_path: Path) -> None:
    payload = b"\x80\x02" + bytes(range(256)) * 40
    path = tmp_path / "d.zip"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("a/version", "3\n")
        zf.writestr("a/blob", payload)
    matches_torch_and_zipfile(path)
    with ZipArchive.open(path) as za:
        blob = za.find("a/blob")
        assert blob is not None and blob.method == 8 and blob.compressed_size < blob.size
        assert [e.name for e in za.pickle_entries()] == ["a/blob"]  # sniffed by its PROTO opcode
        with pytest.raises(CheckpointError, match="compressed"):
            za.span(blob)
        with pytest.raises(LimitExceeded, match="cap"):
            za.read(blob, cap=100)
    data = bytearray(path.read_bytes())
    cd = data.rfind(b"PK\x01\x02")  # the last central entry, a/blob: flip a bit of its CRC
    data[cd + 16] ^= 1
    path.write_bytes(bytes(data))
    with ZipArchive.open(path) as za:
        blob = za.find("a/blob")
        assert blob is not None
        with pytest.raises(CheckpointError, match="CRC-32"):
            za.read(blob, 1 << 20)
    # torch's miniz does not check CRCs at all, while zipfile refuses: the mismatch is corruption either way
    assert torch._C.PyTorchFileReader(str(path)).get_record("blob") == payload
    with pytest.raises(zipfile.BadZipFile, match="CRC"):
        zipfile.ZipFile(path).read("a/blob")


@pytest.mark.parametrize("writer", ["zipfile", "zipwrite"])
def test_zip64_records_read_as_torch_and_zipfile_read_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, writer: str) -> None:
    from dtypeaudit.formats import zipwrite

    monkeypatch.setattr(zipfile, "ZIP64_LIMIT", 100)  # zip64 extra fields and end records for small files
    monkeypatch.setattr(zipwrite, "ZIP64_LIMIT", 100)
    path = tmp_path / "z64.zip"
    members = [("a/version", b"3\n"), ("a/big", bytes(range(256))), ("a/after", b"x" * 50), ("a/data.pkl", b"\x80\x02N.")]
    with open(path, "wb") as fh:
        if writer == "zipfile":
            with zipfile.ZipFile(fh, "w") as zf:
                for name, data in members:
                    zf.writestr(name, data)
        else:
            zw = zipwrite.StoredZipWriter(fh)
            for name, data in members:
                zw.add(name, data)
            zw.close()
    assert b"PK\x06\x06" in path.read_bytes()
    matches_torch_and_zipfile(path)


def test_crc_zero_is_what_torch_writes_without_crcs(tmp_path: Path) -> None:
    from torch.utils.serialization import config

    path = tmp_path / "nocrc.pt"
    with config.patch({"save.compute_crc32": False}):  # type: ignore[attr-defined]
        torch.save({"w": torch.ones(2)}, path)
    assert torch_reads(path)["w"].tolist() == [1.0, 1.0]
    with ZipArchive.open(path) as za:
        pkl = za.find("nocrc/data.pkl")
        assert pkl is not None and pkl.crc == 0 and za.read(pkl, 1 << 20).startswith(b"\x80")


def test_names_differing_in_case_are_refused_because_torch_reads_the_other_one(
    tmp_path: Path, fp16: list[Member], fp32_pickle: bytes
) -> None:
    path = write(tmp_path, build([*fp16, {"name": "archive/DATA.pkl", "data": fp32_pickle}]))
    assert torch_reads(path)["w"].dtype == torch.float32  # miniz's case-folded binary search lands on DATA.pkl
    assert zipfile.ZipFile(path).read("archive/data.pkl") == fp16[0]["data"]  # the float16 pickle
    refused(path, "differ only in case", "archive/data.pkl", "archive/DATA.pkl", "loaders disagree")
    refused(write(tmp_path, build([*fp16, {"name": "archive/data.pkl", "data": fp32_pickle}])), "'archive/data.pkl' twice")


def test_a_second_central_directory_is_refused(tmp_path: Path, fp16: list[Member]) -> None:
    plain = build(fp16)
    size, offset = struct.unpack_from("<II", plain, len(plain) - 10)
    # a copy of the directory inserted where the end record points: miniz reads the copy, zipfile the real
    # one with every offset shifted by the copy's length ("concat")
    path = write(tmp_path, plain[:offset] + plain[offset : offset + size] + plain[offset:])
    assert torch_reads(path)["w"].dtype == torch.float16
    with pytest.raises(zipfile.BadZipFile):
        zipfile.ZipFile(path).read("archive/data.pkl")
    refused(path, "central directory is not where its end record says", "zipfile shifts offsets")


def test_prepended_bytes_are_refused(tmp_path: Path, fp16: list[Member]) -> None:
    path = write(tmp_path, b"#" * 16 + build(fp16))
    assert zipfile.ZipFile(path).read("archive/data.pkl") == fp16[0]["data"]  # zipfile adjusts
    assert isinstance(torch_reads(path), str)  # torch sees no PK\x03\x04 at 0: a legacy file, and fails
    refused(path, "inserted or prepended")


def test_a_count_short_of_the_directory_is_refused(tmp_path: Path, fp16: list[Member]) -> None:
    path = write(tmp_path, build(fp16, count=len(fp16) - 1))
    assert len(zipfile.ZipFile(path).namelist()) == len(fp16)
    assert len(torch._C.PyTorchFileReader(str(path)).get_all_records()) == len(fp16) - 1
    refused(path, f"after its {len(fp16) - 1} entries", "how many entries")


def test_bytes_after_the_end_record_are_refused(tmp_path: Path, fp16: list[Member]) -> None:
    path = write(tmp_path, build(fp16, tail=b"trailing"))
    assert torch_reads(path)["w"].dtype == torch.float16  # miniz scans back for the record and ignores the rest
    refused(path, "does not end at the end of the file", "8 bytes follow")
    # a signature too close to the end for miniz (it needs 22 bytes) is the one zipfile's rfind picks
    path = write(tmp_path, build(fp16, comment=b"..PK\x05\x06.."))
    assert torch_reads(path)["w"].dtype == torch.float16
    with pytest.raises(zipfile.BadZipFile):
        zipfile.ZipFile(path)
    refused(path, "second end-of-central-directory signature")


def test_a_local_name_other_than_the_directorys_is_refused(tmp_path: Path, fp16: list[Member]) -> None:
    path = write(tmp_path, build(edit(fp16, "archive/data.pkl", local_name=b"archive/evil.pkl")))
    assert torch_reads(path)["w"].dtype == torch.float16  # miniz never reads the local name
    with pytest.raises(zipfile.BadZipFile, match="differ"):
        zipfile.ZipFile(path).read("archive/data.pkl")
    refused(path, "local header names it 'archive/evil.pkl'")


def test_overlapping_members_are_refused(tmp_path: Path, fp16: list[Member]) -> None:
    n = len(fp16[0]["data"])
    path = write(tmp_path, build(edit(fp16, "archive/data.pkl", size=n + 40)))
    assert torch_reads(path)["w"].dtype == torch.float16  # the pickle stops early; its record ran into the next
    refused(path, "'archive/data.pkl' and 'archive/.format_version' overlap")
    last = fp16[-1]["name"]
    refused(write(tmp_path, build(edit(fp16, last, size=len(fp16[-1]["data"]) + 10))), "overlaps the central directory")


def test_a_directory_with_data_is_refused_because_torch_reads_none(tmp_path: Path, fp16: list[Member]) -> None:
    path = write(tmp_path, build(edit(fp16, "archive/data.pkl", attr=0x10)))
    assert isinstance(torch_reads(path), str)  # miniz skips directories: torch unpickles unread memory
    assert zipfile.ZipFile(path).read("archive/data.pkl") == fp16[0]["data"]
    refused(path, "marked as a directory")


def _zip64(data: bytes, field: str) -> bytes:
    """Rewrite one field of a torch.save archive's zip64 end records."""
    buf = bytearray(data)
    loc = len(buf) - 22 - 20
    if field == "locator":
        struct.pack_into("<Q", buf, loc + 8, struct.unpack_from("<Q", buf, loc + 8)[0] - 1)
    elif field == "count":
        struct.pack_into("<QQ", buf, loc - 56 + 24, 99, 99)
    else:
        struct.pack_into("<I", buf, loc + 16, 0)
    return bytes(buf)


CRAFTED = {
    "encrypted": (lambda ms, raw: build(edit(ms, "archive/version", flags=1)), ["'archive/version' is encrypted"]),
    "multi-disk": (lambda ms, raw: build(ms, disk=1), ["several disks"]),
    "not at offset 0": (lambda ms, raw: build(ms, lead=b"\0" * 8), ["does not start with its first member", "legacy"]),
    "header past the end": (lambda ms, raw: build(edit(ms, "archive/version", offset=1 << 20)), ["past the end of the file"]),
    "bad local signature": (lambda ms, raw: b"PK\x03\x05" + build(ms)[4:], ["'archive/data.pkl' has no local header", "bad signature"]),
    "invalid utf-8": (lambda ms, raw: build([*ms, {"name": b"archive/\xff", "data": b""}]), ["not valid UTF-8"]),
    "NUL in a name": (lambda ms, raw: build([*ms, {"name": b"archive/constants.pkl\0x", "data": b""}]), ["NUL byte"]),
    "cp437 or utf-8": (lambda ms, raw: build([*ms, {"name": "archive/é", "data": b""}]), ["not ASCII and not flagged UTF-8"]),
    "two sizes": (lambda ms, raw: build(edit(ms, "archive/version", csize=2, size=3)), ["stored but records two sizes (2 and 3)"]),
    "nothing stored": (lambda ms, raw: build(edit(ms, "archive/version", method=8, csize=0)), ["claims 2 bytes from 0"]),
    "zip64 locator": (lambda ms, raw: _zip64(raw, "locator"), ["not where its locator points"]),
    "zip64 count": (lambda ms, raw: _zip64(raw, "count"), ["disagree on the entry count (7 vs 99)"]),
    "zip64 disks": (lambda ms, raw: _zip64(raw, "disks"), ["several disks"]),
    "empty": (lambda ms, raw: b"PK\x05\x06" + bytes(18), ["holds no entries"]),
    "not a zip": (lambda ms, raw: b"hello" * 10, ["no end-of-central-directory record"]),
}


@pytest.mark.parametrize("case", CRAFTED)
def test_crafted_archives_are_refused_in_one_line(tmp_path: Path, fp16: list[Member], fp16_raw: bytes, case: str) -> None:
    make, words = CRAFTED[case]
    refused(write(tmp_path, make(fp16, fp16_raw)), *words)


def test_unsupported_method_is_refused_when_read(tmp_path: Path, fp16: list[Member]) -> None:
    path = write(tmp_path, build(edit(fp16, "archive/version", method=12)))
    with ZipArchive.open(path) as za:
        version = za.find("archive/version")
        assert version is not None and version.method == 12
        with pytest.raises(CheckpointError, match="compression method 12"):
            za.read(version, 100)


names = st.text(st.characters(codec="utf-8", blacklist_characters="\0/"), min_size=1, max_size=12)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    members=st.lists(
        st.tuples(names, st.binary(max_size=2000), st.sampled_from([zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED])),
        max_size=8,
        unique_by=lambda m: m[0].encode().lower(),
    ),
)
def test_random_archives_read_as_zipfile_and_torch_read_them(tmp_path: Path, members: list[tuple[str, bytes, int]]) -> None:
    path = tmp_path / "p.zip"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("a/version", "3\n")
        for name, data, method in members:
            if name.encode().lower() != b"version":
                zf.writestr(f"a/{name}", data, compress_type=method)
    matches_torch_and_zipfile(path)
