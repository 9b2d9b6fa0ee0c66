"""The gate cannot be fooled: for files torch writes, and structural mutations of them, dtypeaudit's inventory
is exactly what torch loads, or dtypeaudit refuses (issue 9).

The reference is ``torch.load(weights_only=True)``, or where that refuses, torch.load with CPython's
unpickler behind an allowlist (``diff_oracle.SAFE``); ``.safetensors`` paths go through torch.load's own
routing to safetensors. Benign files must MATCH; mutated ones must never be DIFFERENTIAL or CRASH.
Mutated files run in a memory-capped worker process (``diff_oracle.Runner``), so a hang fails a test
instead of stalling it. ``pytest -m slow`` runs the larger versions; ``fuzz/fuzz_differential.py``
runs millions. A failure prints the case key: ``python fuzz/fuzz_differential.py --replay KEY`` shows both views.
"""

from __future__ import annotations

import io
import pickle
import random
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from . import diff_oracle as d
from .helpers import json_report

slow = pytest.mark.slow
A = d.Asm


def verdict_of(tmp_path: Path, data: bytes, suffix: str = ".pt") -> d.Verdict:
    path = tmp_path / f"case{suffix}"
    path.write_bytes(data)
    return d.compare(d.torch_view(path), d.ours_view(path))


def explain(v: d.Verdict, what: str = "") -> str:
    return f"{what}: {v.outcome} {v.subclass}: {v.detail}"


# -- the oracle itself ------------------------------------------------------------------------------------


def test_safe_unpickler_resolves_only_its_allowlist() -> None:
    canary = "dtypeaudit_differential_canary_module"
    payload = b"\x80\x02c" + canary.encode() + b"\nboom\n)R."
    with pytest.raises(d.OracleRefusal, match="outside the oracle's allowlist"):
        d.SAFE.load(io.BytesIO(payload))
    assert canary not in sys.modules  # refused by name: nothing was imported, let alone called
    system = b"\x80\x02cposix\nsystem\nX\x04\x00\x00\x00true\x85R."
    with pytest.raises(d.OracleRefusal):
        d.SAFE.load(io.BytesIO(system))


def test_safe_unpickler_agrees_with_weights_only_on_torch_files(tmp_path: Path) -> None:
    rng = random.Random(3)
    for _ in range(6):
        # (not "plain": its scalars include bytes, which weights_only refuses to rebuild)
        data, _ = d.torch_case(rng, legacy=rng.random() < 0.5, protocol=2, generator=rng.choice(["state_dict", "training", "params"]))
        path = tmp_path / "case.pt"
        path.write_bytes(data)
        weights_only = torch.load(path, weights_only=True, map_location="cpu")
        full = torch.load(path, weights_only=False, pickle_module=d.SAFE, map_location="cpu")
        assert d.describe(weights_only) == d.describe(full)


def test_the_reference_never_runs_torchscript(tmp_path: Path) -> None:
    members = d.zip_members(d.torch_bytes({"w": torch.ones(2)}, legacy=False, protocol=2))
    path = tmp_path / "case.pt"
    path.write_bytes(d.build_zip([*members, ("archive/constants.pkl", pickle.dumps((), protocol=2), 0)]))
    saved = torch.jit.load
    view = d.torch_view(path)
    assert view.status == "refused"
    assert "never runs torch.jit.load" in view.error  # weights_only=False would have handed the archive to torch.jit.load
    assert torch.jit.load is saved


def test_compare_names_the_difference() -> None:
    def read(*entries: d.Entry, flags: set[str] | None = None) -> d.View:
        return d.View("read", list(entries), set(), flags or set())

    t = ("w", "float32", (2,), "unknown")
    assert d.compare(read(t), read(t)).outcome == d.MATCH
    assert d.compare(read(t), read(("w", "float16", (2,), "unknown"))).subclass == "dtype"
    assert d.compare(read(t), read()).subclass == "missing"
    assert d.compare(read(t), read(("x", "float32", (2,), "unknown"))).subclass == "names"
    assert d.compare(read(t, flags={"tensor-key"}), read(("x", "float32", (2,), "unknown"))).outcome == d.CONVENTION
    assert d.compare(d.View("refused"), read(t)).outcome == d.TORCH_REFUSES
    assert d.compare(read(t), d.View("refused")).outcome == d.REFUSED_BY_US
    assert d.compare(read(t), d.View("crash", error="Traceback\nKeyError: x")).outcome == d.CRASH


def test_cases_are_reproducible_from_their_key() -> None:
    for i in range(8):
        a, b = d.make_case(99, i), d.make_case(99, i)
        assert (a.description, a.suffix, a.mutation) == (b.description, b.suffix, b.mutation)
        if a.container != "legacy":  # legacy files name storages by id(): same meaning, other digits
            assert a.data == b.data


def test_generators_name_optimizer_state_as_dtypeaudit_does() -> None:
    obj = d.training_state(random.Random(1), d.SAVABLE_DTYPES)
    entries, _, flags = d.describe(obj)
    names = {e[0] for e in entries}
    prefix = "state_dict.optimizer.state.0." if "state_dict" in obj else "optimizer.state.0."
    assert any(n.startswith(prefix) for n in names), sorted(names)
    assert not flags


# -- benign files torch writes: every protocol, both formats -----------------------------------------------


@pytest.mark.parametrize("cases", [12, pytest.param(200, marks=slow)])
@pytest.mark.parametrize("container", ["zip", "legacy"])
@pytest.mark.parametrize("protocol", [1, 2, 3, 4, 5])
def test_torch_written_checkpoints_match(tmp_path: Path, container: str, protocol: int, cases: int) -> None:
    rng = random.Random(f"benign:{container}:{protocol}")
    failures = []
    for k in range(cases):
        generator = d.BENIGN_GENERATORS[k % len(d.BENIGN_GENERATORS)]
        data, _ = d.torch_case(rng, legacy=container == "legacy", protocol=protocol, generator=generator)
        v = verdict_of(tmp_path, data)
        if v.outcome != d.MATCH:
            failures.append(explain(v, f"{generator} #{k}"))
    assert not failures, "\n".join(failures[:10])


def test_protocol_0_files_torch_cannot_load_are_refused(tmp_path: Path) -> None:
    """torch.save(pickle_protocol=0) writes persistent ids as text that torch.load cannot read back."""
    rng = random.Random(0)
    for legacy in (False, True):
        data, _ = d.torch_case(rng, legacy=legacy, protocol=0, generator="plain")
        v = verdict_of(tmp_path, data)
        assert v.outcome == d.BOTH_REFUSE, explain(v, f"legacy={legacy}")


def _random_checkpoint_matches_torch(tmp_path: Path, rng: random.Random, legacy: bool, protocol: int, generator: str) -> None:
    data, _ = d.torch_case(rng, legacy=legacy, protocol=protocol, generator=generator)
    v = verdict_of(tmp_path, data)
    assert v.outcome == d.MATCH, explain(v, f"{generator}, legacy={legacy}, protocol {protocol}")


def _random_checkpoints_property(examples: int):
    return settings(
        max_examples=examples, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
    )(
        given(
            rng=st.randoms(use_true_random=False),
            legacy=st.booleans(),
            protocol=st.integers(min_value=1, max_value=5),
            generator=st.sampled_from(d.BENIGN_GENERATORS),
        )(_random_checkpoint_matches_torch)
    )


test_random_checkpoints_match_torch = _random_checkpoints_property(40)
test_random_checkpoints_match_torch_many = slow(_random_checkpoints_property(1000))


@pytest.mark.parametrize("cases", [30, pytest.param(500, marks=slow)])
def test_safetensors_files_match(tmp_path: Path, cases: int) -> None:
    rng = random.Random("safetensors")
    failures = []
    for k in range(cases):
        v = verdict_of(tmp_path, d.safetensors_bytes(rng), ".safetensors")
        if v.outcome != d.MATCH:
            failures.append(explain(v, f"#{k}"))
    assert not failures, "\n".join(failures[:10])


def test_scan_json_agrees_with_read_checkpoint(tmp_path: Path) -> None:
    data, obj = d.torch_case(random.Random(5), legacy=False, protocol=2, generator="training")
    path = tmp_path / "ckpt.pt"
    path.write_bytes(data)
    code, report, _ = json_report("scan", str(path))
    assert code in (0, 1)
    from_cli = sorted((t["name"], t["dtype"], tuple(t["shape"])) for t in report["checkpoints"][0]["tensors"])
    from_torch = sorted((n, dt, s) for n, dt, s, _ in d.describe(torch.load(path, weights_only=True))[0])
    assert from_cli == from_torch


# -- mutated files: never a differential, never a crash ---------------------------------------------------

MUTATIONS = [
    *(f"pickle:{m}" for m in d.PICKLE_MUTATIONS),
    *(f"zip:{m}" for m in d.ZIP_MUTATIONS),
    *(f"st:{m}" for m in d.SAFETENSORS_MUTATIONS),
    *(f"legacy:{m}" for m in d.LEGACY_MUTATIONS),
    "bytes:pickle",
    "confusion:zip-as-safetensors",
    "confusion:safetensors-as-pt",
    "confusion:legacy-as-safetensors",
    "confusion:pickle-as-pt",
]


@pytest.fixture(scope="module")
def runner() -> Iterator[d.Runner]:
    with d.Runner() as r:
        yield r


def _run_family(runner: d.Runner, mutation: str, cases: int, seed: str = "test") -> list[str]:
    bad = []
    for i in range(cases):
        result = runner.run(seed, i, mutation=mutation)
        v = result["verdict"]
        if v["outcome"] in d.BAD_OUTCOMES:
            bad.append(f"{v['outcome']} {v['subclass']} [{result['key']}] {result.get('description', '')}\n      {v['detail'][:300]}")
        assert v["outcome"] != d.ORACLE_FAILED or v["subclass"] != "harness", v["detail"]
    return bad


@pytest.mark.parametrize("mutation", MUTATIONS)
def test_mutated_files_are_read_as_torch_reads_them_or_refused(runner: d.Runner, mutation: str) -> None:
    bad = _run_family(runner, mutation, 10)
    assert not bad, f"{len(bad)} of 10 cases:\n" + "\n".join(bad[:5])


@slow
@pytest.mark.parametrize("mutation", MUTATIONS)
def test_mutated_files_many(runner: d.Runner, mutation: str) -> None:
    bad = _run_family(runner, mutation, 300, seed="slow")
    assert not bad, f"{len(bad)} of 300 cases:\n" + "\n".join(bad[:5])


@slow
def test_random_mix_many(runner: d.Runner) -> None:
    bad = []
    for i in range(5000):
        result = runner.run("slow-mix", i)
        if result["verdict"]["outcome"] in d.BAD_OUTCOMES:
            bad.append(f"[{result['key']}] {result.get('description', '')}: {result['verdict']['detail'][:200]}")
    assert not bad, f"{len(bad)} of 5000 cases:\n" + "\n".join(bad[:10])


# -- the classes the fuzzer found, as crafted files --------------------------------------------------------
# Each reproducer is the smallest pickle that shows one class; torch.load(weights_only=True) loads all of them.

F32 = {"0": bytes(8)}
F32_I32 = {"0": bytes(8), "1": bytes(4)}


def _archive(root: bytes, storages: dict[str, bytes]) -> bytes:
    return d.torch_archive(A.pickle_of(A.dict_((A.s("w"), root))), storages)


def _param(inner: bytes) -> bytes:
    return A.call("torch._utils _rebuild_parameter", inner, A.FALSE, A.odict())


def _with_attribute() -> bytes:
    """A tensor with a Python attribute holding a second tensor (torch.save writes these via _rebuild_from_type_v2)."""
    args = A.tup(A.storage("0"), A.i(0), A.ints((2,)), A.ints((1,)), A.FALSE, A.odict())
    state = A.dict_((A.s("foo"), A.tensor("1", "IntStorage", (1,))))
    return A.call("torch._tensor _rebuild_from_type_v2", A.g("torch._utils _rebuild_tensor_v2"), A.g("torch Tensor"), args, state)


REPRODUCERS = {
    # torch: w is a plain float16 tensor (Tensor.to on a Parameter returns a Tensor); the cast must not keep kind=parameter
    "cast-of-parameter-is-a-plain-tensor": _archive(
        A.call("torch._utils _rebuild_device_tensor_from_cpu_tensor", _param(A.tensor()), A.g("torch float16"), A.s("cpu"), A.FALSE), F32
    ),
    # torch: _rebuild_from_type_v2(func, torch.Tensor, ...) turns a Parameter into a plain Tensor (as_subclass)
    "from-type-tensor-over-parameter": _archive(
        A.call(
            "torch._tensor _rebuild_from_type_v2",
            A.g("torch._utils _rebuild_parameter"),
            A.g("torch Tensor"),
            A.tup(A.tensor(), A.FALSE, A.odict()),
            A.dict_(),
        ),
        F32,
    ),
    # torch: nn.Parameter(data) is a new object; the attributes of data (w.foo) are not carried over
    "rebuild-parameter-drops-attributes": _archive(_param(_with_attribute()), F32_I32),
    "parameter-class-drops-attributes": _archive(A.call("torch.nn.parameter Parameter", _with_attribute()), F32_I32),
    # torch: w and v are one float16 tensor, so they share a storage
    "cast-tensor-under-two-names-shares": d.torch_archive(
        A.pickle_of(
            A.dict_(
                (
                    A.s("w"),
                    A.call("torch._utils _rebuild_device_tensor_from_cpu_tensor", A.tensor(), A.g("torch float16"), A.s("cpu"), A.FALSE)
                    + A.put(0),
                ),
                (A.s("v"), A.get(0)),
            )
        ),
        F32,
    ),
    # torch refuses (the record name is not encodable); dtypeaudit must refuse too, not raise UnicodeEncodeError
    "lone-surrogate-storage-key": _archive(A.tensor("\udfff"), F32),
}


@pytest.mark.parametrize("name", sorted(REPRODUCERS))
def test_found_class(tmp_path: Path, name: str) -> None:
    v = verdict_of(tmp_path, REPRODUCERS[name])
    assert v.outcome not in d.BAD_OUTCOMES, explain(v, name)
