"""convert casts with numpy (npcast) and writes while the value checks run: no torch for a plain conversion,
the same refusals and outputs as when the write followed the checks, and --clamp of bfloat16 saturating."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import dtypeaudit.conversion.value_policy as conversion_checks
from dtypeaudit import crc, pieces
from dtypeaudit.conversion import convert
from dtypeaudit.errors import ConversionError

from .helpers import ROOT


def _weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = {f"layer{i}.weight": torch.randn(64, 64, generator=g) * 0.02 for i in range(3)}
    w["layer0.weight"][0, :4] = torch.tensor([0.0, -0.0, 1e-9, 3e-6])  # zero, underflow and subnormal among normals
    w["bias"] = torch.zeros(64)
    return w


NO_TORCH = "import sys\nsys.modules['torch'] = None\n"  # as in the light install: no import of torch succeeds


def test_plain_conversions_make_their_bytes_without_torch(tmp_path: Path) -> None:
    """numpy makes every byte of a plain conversion: with torch unimportable, fp16 and bf16 outputs are torch's
    own cast, and verification recasts with numpy's second cast, as it does where torch is installed."""
    pt, st = tmp_path / "m.pt", tmp_path / "m.safetensors"
    torch.save(_weights(), pt)
    save_file(_weights(1), st)
    code = NO_TORCH + (
        "from dtypeaudit.conversion import convert\n"
        "for path, to in zip(sys.argv[1:], ('fp16', 'bf16')):\n"
        "    result = convert(path, to)\n"
        "    print([w.recast_with for w in result.written.values()])\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", code, str(pt), str(st)], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["['numpy']", "['numpy']"]
    for name, t in torch.load(tmp_path / "m.fp16.pt", weights_only=True).items():
        assert t.dtype == torch.float16 and torch.equal(t, _weights()[name].half()), name
    for name, t in load_file(tmp_path / "m.bf16.safetensors").items():
        assert t.dtype == torch.bfloat16 and torch.equal(t, _weights(1)[name].bfloat16()), name
    with_torch = convert(pt, "fp16", output=tmp_path / "again.pt")
    assert [w.recast_with for w in with_torch.written.values()] == ["numpy"]


def test_the_last_line_says_what_the_samples_were_compared_with(tmp_path: Path) -> None:
    """The command line never claims a comparison with torch's cast that did not happen, and it says the same
    with torch installed or not: verification is the same on every install."""
    pt = tmp_path / "m.pt"
    torch.save(_weights(), pt)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    light = NO_TORCH + "from dtypeaudit.entry import main\nsys.argv = ['dtypeaudit', *sys.argv[1:]]\nmain()\n"
    lines = {}
    for label, cmd in (("without", [sys.executable, "-c", light]), ("with", [sys.executable, "-m", "dtypeaudit"])):
        out = tmp_path / f"{label}.pt"
        proc = subprocess.run([*cmd, "convert", str(pt), "--to", "fp16", "-o", str(out)], capture_output=True, text=True, env=env)
        assert proc.returncode == 0, proc.stderr
        lines[label] = proc.stdout.splitlines()[-1]
        assert torch.equal(torch.load(out, weights_only=True)["layer1.weight"], _weights()["layer1.weight"].half())
    head = "verified: names, shapes, dtypes and ties; bytes read back and CRC-checked; sampled records equal "
    assert lines == {
        "without": head + "a second cast of the source, by numpy, apart from the writer",
        "with": head + "a second cast of the source, by numpy, apart from the writer",
    }
    same = tmp_path / "h.pt"  # nothing to cast: the samples are compared with the source's own bytes
    torch.save({"w": torch.randn(8).half(), "n": torch.arange(4)}, same)
    proc = subprocess.run(
        [sys.executable, "-m", "dtypeaudit", "convert", str(same), "--to", "fp16", "-o", str(tmp_path / "h2.pt")],
        capture_output=True,
        text=True,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == head + "the source's bytes"


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_clamping_bfloat16_to_float16_saturates_instead_of_inf(tmp_path: Path, suffix: str) -> None:
    # bfloat16 cannot hold float16's largest value: 65504 rounds to 65536 there, which float16 makes inf.
    values = torch.tensor([70000.0, -70000.0, 65536.0, 65504.0, -1e30, 1.0, 0.5]).bfloat16()
    src = tmp_path / f"m{suffix}"
    if suffix == ".pt":
        torch.save({"w": values}, src)
    else:
        save_file({"w": values}, src)
    out = tmp_path / f"out{suffix}"
    result = convert(src, "fp16", output=out, clamp=True)
    assert result.output == out and not result.unsafe
    got = (torch.load(out, weights_only=True) if suffix == ".pt" else load_file(out))["w"]
    assert got.dtype == torch.float16 and torch.isfinite(got).all()
    assert got.tolist() == [65504.0, -65504.0, 65504.0, 65504.0, -65504.0, 1.0, 0.5]


def _listing(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir())


def _with_overflow(tmp_path: Path) -> Path:
    w = _weights()
    w["scales"] = torch.linspace(-2, 2, 64)
    w["scales"][3] = 1e6
    src = tmp_path / "m.pt"
    torch.save(w, src)
    return src


def _checks_see(monkeypatch: pytest.MonkeyPatch, where: Path) -> list[list[str]]:
    """Record ``where``'s listing at the moment the value checks' outcome is known."""
    seen: list[list[str]] = []
    real = conversion_checks.ValueChecks.outcome

    def outcome(self: Any) -> Any:
        seen.append(_listing(where))
        return real(self)

    monkeypatch.setattr(conversion_checks.ValueChecks, "outcome", outcome)
    return seen


def test_the_output_is_written_while_the_values_are_checked_and_renamed_after(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / "m.pt"
    torch.save(_weights(), src)
    seen = _checks_see(monkeypatch, tmp_path)
    result = convert(src, "fp16")
    assert result.output == tmp_path / "m.fp16.pt"
    # when the checks' results were collected, the output existed only as its temporary
    assert len(seen) == 1 and len(seen[0]) == 2 and "m.pt" in seen[0] and "m.fp16.pt" not in seen[0]
    assert _listing(tmp_path) == ["m.fp16.pt", "m.pt"]


def test_values_found_unsafe_leave_nothing_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = _with_overflow(tmp_path)
    seen = _checks_see(monkeypatch, tmp_path)
    result = convert(src, "fp16")
    assert result.output is None and [s.name for s in result.unsafe] == ["scales"]
    assert result.unsafe[0].overflow == 1
    assert len(seen) == 1 and len(seen[0]) == 2  # the write had been made, then abandoned
    assert _listing(tmp_path) == ["m.pt"]


def test_keep_unsafe_rewrites_with_the_unsafe_tensor_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = _with_overflow(tmp_path)
    _checks_see(monkeypatch, tmp_path)
    out = tmp_path / "out.pt"
    result = convert(src, "fp16", output=out, keep_unsafe=True)
    assert result.output == out and not result.unsafe
    got, original = torch.load(out, weights_only=True), torch.load(src, weights_only=True)
    assert got["scales"].dtype == torch.float32 and torch.equal(got["scales"], original["scales"])
    for name in ("layer0.weight", "layer1.weight", "bias"):
        assert got[name].dtype == torch.float16 and torch.equal(got[name], original[name].half()), name
    assert _listing(tmp_path) == ["m.pt", "out.pt"]


def test_unsafe_values_are_told_before_an_existing_output(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _checks_see(monkeypatch, tmp_path)
    existing = tmp_path / "existing.pt"
    existing.write_bytes(b"keep me")
    src = _with_overflow(tmp_path)
    assert [s.name for s in convert(src, "fp16", output=existing).unsafe] == ["scales"]
    safe = tmp_path / "safe.pt"
    torch.save(_weights(), safe)
    with pytest.raises(ConversionError, match="already exists; pass --force"):
        convert(safe, "fp16", output=existing)
    assert existing.read_bytes() == b"keep me"
    assert _listing(tmp_path) == ["existing.pt", "m.pt", "safe.pt"]


def test_an_abandoned_write_leaves_no_note_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The safetensors writer notes a tie kept as an alias; a write abandoned for --keep-unsafe is made again,
    # and a refused one is not made at all: each says it once, or not at all.
    _checks_see(monkeypatch, tmp_path)
    w = _weights()
    w["head.weight"] = w["layer1.weight"]  # tied: one storage under two names
    w["scales"] = torch.linspace(-2, 2, 64)
    w["scales"][3] = 1e6
    src = tmp_path / "tied.pt"
    torch.save(w, src)
    refused = convert(src, "fp16", output=tmp_path / "refused.safetensors")
    assert refused.unsafe and not any("stored once" in n for n in refused.plan.notes)
    kept = convert(src, "fp16", output=tmp_path / "kept.safetensors", keep_unsafe=True)
    assert kept.output == tmp_path / "kept.safetensors"
    assert sum("stored once" in n for n in kept.plan.notes) == 1
    got = load_file(tmp_path / "kept.safetensors")
    assert got["scales"].dtype == torch.float32 and torch.equal(got["layer1.weight"], w["layer1.weight"].half())


def test_a_plain_conversion_is_numpys_at_any_size_and_gives_torchs_bytes(tmp_path: Path) -> None:
    """No size rule hands a plain conversion to torch (numpy's pass on every core is sooner at every size): the plan
    says numpy casts, and the bytes are torch's own ``.half()``."""
    st = tmp_path / "m.safetensors"
    save_file(_weights(2), st)
    done = convert(str(st), "fp16", output=str(tmp_path / "out.safetensors"))
    assert not done.plan.casts_with_torch
    assert [p.action for p in done.plan.tensors].count("cast") == len(_weights(2))
    for name, t in load_file(tmp_path / "out.safetensors").items():
        assert torch.equal(t, _weights(2)[name].half()), name


def test_crc32_of_parts_is_the_crc32_of_the_whole() -> None:
    import zlib

    rng = np.random.default_rng(5)
    for a_len, b_len in [(0, 0), (0, 7), (5, 0), (1000, 3_000_001), (1 << 20, 1 << 21)]:
        a, b = rng.bytes(a_len), rng.bytes(b_len)
        whole = zlib.crc32(a + b)
        assert crc.crc32_of_parts(zlib.crc32(a), zlib.crc32(b), len(b)) == whole
        assert crc.crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == whole


def test_records_cut_into_pieces_made_on_the_pool_give_torchs_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A record longer than a piece is made in parts on the pool's threads: its CRC is combined and its value
    checks merged in order, so the output verifies, equals torch's cast, and the checks equal one pass's."""
    import threading

    g = torch.Generator().manual_seed(2)
    emb = torch.randn(5 * pieces.CHUNK_ELEMENTS // 1024, 1024, generator=g) * 0.02  # five chunks
    state = {"emb": emb, "small": torch.randn(1000, generator=g) * 1e-4, "step": torch.tensor(3)}
    src = tmp_path / "m.pt"
    torch.save(state, src)
    monkeypatch.setattr(pieces, "thread_count", lambda most=4: 1)
    alone = convert(src, "fp16", dry_run=True)  # the checks in one pass, on this thread
    monkeypatch.setattr(pieces, "thread_count", lambda most=4: 2)
    monkeypatch.setattr(pieces, "PIECE_ELEMENTS", pieces.CHUNK_ELEMENTS)  # one-chunk pieces: the weight is five
    made_on: list[str] = []
    real = pieces.Maker.make
    monkeypatch.setattr(pieces.Maker, "make", lambda self, piece: made_on.append(threading.current_thread().name) or real(self, piece))
    result = convert(src, "fp16")
    assert result.output is not None
    assert len(made_on) >= 6 and all(name.startswith("dtypeaudit-work") for name in made_on)
    got = torch.load(result.output, weights_only=True)
    assert all(torch.equal(got[k], v.half() if v.is_floating_point() else v) for k, v in state.items())
    assert [vars(s) for s in result.plan.values.values()] == [vars(s) for s in alone.plan.values.values()]


def test_writeback_makes_the_bytes_durable_as_they_land(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every STEP bytes reported, the file is fdatasynced (the real call, counted) while the writer goes on, so that
    the fsync before the rename finds little left; a file removed before its sync is no error."""
    synced: list[int] = []
    real = pieces._datasync
    monkeypatch.setattr(pieces, "_datasync", lambda fd: (synced.append(fd), real(fd)))
    monkeypatch.setattr(pieces.Writeback, "STEP", 1 << 20)
    out = tmp_path / "out.bin"
    gone = tmp_path / "gone.bin"
    gone.write_bytes(b"")
    gone.unlink()
    with out.open("wb") as fh, pieces.Writeback() as writeback:
        for _ in range(8):
            fh.write(bytes(512 << 10))
            fh.flush()
            writeback.landed(str(out), 512 << 10)
        writeback.landed(str(gone), 2 << 20)
    assert 1 <= len(synced) <= 4  # 4 MiB in steps of 1 MiB; a report that lands during a sync joins the next one
    assert out.stat().st_size == 4 << 20


# Unmappable: only a safetensors output, whose reader reads its header without a map (a zip's reader maps the file).
@pytest.mark.parametrize(("suffix", "mappable"), [(".pt", True), (".safetensors", True), (".safetensors", False)])
def test_verification_fails_on_a_changed_byte_and_a_short_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, suffix: str, mappable: bool
) -> None:
    """What convert's writer recorded (``Written``) holds against its own output, and not against a copy with one
    byte of a record flipped, or one cut short (checked while the conversion's sources are open); also where the
    output's file system cannot map it (``mmap`` refused, as on some FUSE mounts: read with ``pread``)."""
    import mmap

    import dtypeaudit.conversion as conversion
    from dtypeaudit.conversion.verify import verify_written
    from dtypeaudit.formats import read_checkpoint

    src = tmp_path / "m.pt"
    torch.save({"w": torch.randn(300, 200), "b": torch.randn(200)}, src)
    copy = tmp_path / f"copy{suffix}"
    failures: list[str] = []

    def verify_and_corrupt(out: Path, written: Any) -> None:
        if not mappable:  # the sources are mapped already: only verification's maps are refused

            def refused(*args: Any, **kwargs: Any) -> Any:
                raise OSError(19, "No such device")

            monkeypatch.setattr(mmap, "mmap", refused)
        verify_written(out, written)
        data = bytearray(out.read_bytes())
        copy.write_bytes(bytes(data))
        verify_written(copy, written)  # the copy is the output: it holds
        layout = read_checkpoint(copy).layout
        assert layout is not None
        span = dict(layout.storages)[next(iter(written.crcs))]
        middle = span.offset + span.length // 2
        data[middle] ^= 0x40
        for corrupt in (bytes(data), bytes(data[:middle])):
            copy.write_bytes(corrupt)
            with pytest.raises(ConversionError, match="verification failed") as caught:
                verify_written(copy, written)
            failures.append(str(caught.value))

    monkeypatch.setattr(conversion, "verify_written", verify_and_corrupt)
    convert(src, "fp16", output=tmp_path / f"out{suffix}")
    assert len(failures) == 2 and "differs from" in failures[0]


def test_a_nan_is_never_cast_it_is_refused_or_kept_bit_for_bit(tmp_path: Path) -> None:
    """Which NaN a widening cast writes is not promised (a float16 signalling NaN: numpy keeps it signalling,
    torch quiets it), so convert casts no NaN at all: callback state is left as stored, and optimizer state with a
    NaN is unsafe (refused) unless --keep-unsafe keeps it in its own dtype, bit for bit."""
    snan = torch.tensor([0x7C01, 0x3C00, 0xFE00 - 0x10000], dtype=torch.int16).view(torch.float16)  # sNaN, 1.0, -qNaN
    src = tmp_path / "m.pt"
    optimizer = {"state": {0: {"exp_avg": snan}}, "param_groups": [{"lr": 0.1, "params": [0]}]}
    torch.save({"w": torch.ones(4, dtype=torch.float16), "optimizer": optimizer, "callbacks": {"best": snan}}, src)
    refused = convert(src, "fp32", include_optimizer=True)
    assert refused.output is None and [u.name for u in refused.unsafe] == ["optimizer.state.0.exp_avg"]
    kept = convert(src, "fp32", include_optimizer=True, keep_unsafe=True)
    assert kept.output is not None
    got = torch.load(kept.output, weights_only=True)
    assert got["w"].dtype == torch.float32
    for stored in (got["optimizer"]["state"][0]["exp_avg"], got["callbacks"]["best"]):
        assert stored.dtype == torch.float16 and stored.view(torch.int16).tolist() == snan.view(torch.int16).tolist()
