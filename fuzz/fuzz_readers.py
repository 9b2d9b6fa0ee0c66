"""Mutation fuzzer for the readers and the policy loader, run by hand:

    python fuzz/fuzz_readers.py --seconds 300

It mutates real files (torch.save zip and legacy, safetensors, a bare pickle, a policy) and feeds them
to the same entry points the CLI uses. Anything other than a clean DtypeAuditError or a successful read
is a crash: the input is saved under fuzz/crashes/ and should become a test in tests/test_hostile.py.
Each input also runs under a wall-clock budget, so hangs are caught as crashes too.
"""

from __future__ import annotations

import argparse
import io
import random
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from dtypeaudit.errors import DtypeAuditError  # noqa: E402
from dtypeaudit.formats import read_checkpoint  # noqa: E402
from dtypeaudit.policy import load_policy  # noqa: E402


def corpus() -> dict[str, bytes]:
    import pickle

    import torch
    from safetensors.torch import save

    state = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "n": {"b": torch.ones(2, dtype=torch.bfloat16)}, "e": 3}
    zip_buf = io.BytesIO()
    torch.save(state, zip_buf)
    legacy_buf = io.BytesIO()
    torch.save(state, legacy_buf, _use_new_zipfile_serialization=False)
    policy = (HERE.parent / "configs" / "fp16-weights-fp32-norms.yaml").read_bytes()  # the full preset, not its alias
    return {
        "zip.pt": zip_buf.getvalue(),
        "legacy.pt": legacy_buf.getvalue(),
        "model.safetensors": save({"a": torch.ones(3), "b": torch.zeros(2, 2, dtype=torch.float16)}),
        "bare.pkl": pickle.dumps({"a": [1, 2.5, "x"], "b": (None, True)}, protocol=2),
        "policy.yaml": policy,
    }


def rezip_with_mutated_pickle(data: bytes, rng: random.Random) -> bytes:
    """Mutate only the archive's data.pkl and re-zip it, so the CRC holds and the pickle VM is what gets fuzzed."""
    import zipfile

    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as zin, zipfile.ZipFile(out, "w") as zout:
        for info in zin.infolist():
            member = zin.read(info.filename)
            zout.writestr(info.filename, mutate(member, rng) if info.filename.endswith("data.pkl") else member)
    return out.getvalue()


def mutate(data: bytes, rng: random.Random) -> bytes:
    blob = bytearray(data)
    for _ in range(rng.randint(1, 12)):
        if not blob:
            break
        pos = rng.randrange(len(blob))
        op = rng.choice(("flip", "set", "cut", "dup", "insert", "interesting"))
        if op == "flip":
            blob[pos] ^= 1 << rng.randrange(8)
        elif op == "set":
            blob[pos] = rng.randrange(256)
        elif op == "cut":
            del blob[pos : pos + rng.randint(1, 64)]
        elif op == "dup":
            blob[pos:pos] = blob[pos : pos + rng.randint(1, 64)]
        elif op == "insert":
            blob[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
        else:
            value = rng.choice((0, 1, 0x7F, 0x80, 0xFF, 0x7FFFFFFF, 0xFFFFFFFF, 2**63 - 1))
            blob[pos : pos + 8] = value.to_bytes(8, "little")
    return bytes(blob)


class Hang(Exception):
    pass


def _alarm(signum: int, frame: object) -> None:
    raise Hang


def run_one(name: str, data: bytes, workdir: Path) -> str | None:
    path = workdir / name
    path.write_bytes(data)
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(10)
    try:
        if name.endswith(".yaml"):
            load_policy(str(path))
        else:
            read_checkpoint(path)
    except DtypeAuditError:
        return None
    except Hang:
        return "hang (over 10 s)"
    except BaseException:
        return traceback.format_exc()
    finally:
        signal.alarm(0)
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    seeds = corpus()
    crashes = HERE / "crashes"
    runs = found = 0
    deadline = time.monotonic() + args.seconds
    with tempfile.TemporaryDirectory() as tmp:
        while time.monotonic() < deadline:
            name = rng.choice([*seeds, "zip-pickle.pt"])
            data = rezip_with_mutated_pickle(seeds["zip.pt"], rng) if name == "zip-pickle.pt" else mutate(seeds[name], rng)
            runs += 1
            failure = run_one(name, data, Path(tmp))
            if failure:
                found += 1
                crashes.mkdir(exist_ok=True)
                out = crashes / f"{runs:08d}-{name}"
                out.write_bytes(data)
                print(f"crash #{found}: {out}\n{failure}", flush=True)
    print(f"{runs} inputs in {args.seconds:.0f} s, {found} crashes", flush=True)


if __name__ == "__main__":
    main()
