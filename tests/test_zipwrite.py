"""The stored-zip writer against the real readers: zipfile (CRCs, names), torch.load (mmap), zip64 included."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import pytest
import torch

import dtypeaudit.formats.zipwrite as zipwrite
from dtypeaudit.conversion import convert
from dtypeaudit.formats.ziparchive import ZipArchive
from dtypeaudit.formats.zipwrite import StoredZipWriter


def write_archive(members: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    zf = StoredZipWriter(buffer)
    for name, data in members.items():
        with zf.member(name, len(data)) as write:
            for start in range(0, len(data), 7):  # many small writes: the CRC must run across them
                write(data[start : start + 7])
    zf.close()
    return buffer.getvalue()


def test_members_read_back_with_valid_crcs_and_aligned_data(tmp_path: Path) -> None:
    members = {"a/data.pkl": b"\x80\x02}q\x00.", "a/data/0": bytes(range(256)) * 3, "a/empty": b"", "a/mödel": b"unicode name"}
    path = tmp_path / "x.zip"
    path.write_bytes(write_archive(members))
    with zipfile.ZipFile(path) as zf:
        assert zf.testzip() is None
        assert {i.filename: zf.read(i) for i in zf.infolist()} == members
    with ZipArchive.open(path) as za:
        assert all(e.data_offset % 64 == 0 for e in za.entries)


def test_a_short_member_is_an_error() -> None:
    zf = StoredZipWriter(io.BytesIO())
    with pytest.raises(ValueError, match="3 bytes written, 4 declared"), zf.member("m", 4) as write:
        write(b"abc")


def test_zip64_records_read_by_zipfile_and_torch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(zipwrite, "ZIP64_LIMIT", 100)  # every size and offset past 100 bytes goes zip64
    src = tmp_path / "m.pt"
    state = {f"w{i}": torch.randn(64, 8) for i in range(3)} | {"step": torch.tensor(7)}
    torch.save(state, src)
    out = tmp_path / "m16.pt"
    convert(src, "fp16", output=out)
    with zipfile.ZipFile(out) as zf:
        assert zf.testzip() is None
        assert any(i.file_size > 100 for i in zf.infolist())
    for mmap in (False, True):
        got = torch.load(out, weights_only=True, mmap=mmap)
        assert got.keys() == state.keys()
        assert all(torch.equal(got[k], v.half() if v.is_floating_point() else v) for k, v in state.items())
