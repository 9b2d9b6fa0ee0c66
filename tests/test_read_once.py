"""What ``convert`` and ``scan`` cost in reads, counted at the real byte-access points (issue 18).

Each counter wraps a real function with monkeypatch and calls through: nothing here changes behaviour.
Counted per file: header/pickle bytes through ``formats.source.LocalSource`` (the reader's one accounting
point), pickle runs (``PickleVM.load``), zip central-directory parses (``ziparchive._read_entries``),
JSON documents read from a model folder (``locate.read_small``), the tensor bytes conversion streams
out of each source file (``MappedCheckpoint.bytes_at`` / ``tensor_at``, its only ways to the mapped bytes), and the
faithful graphs made for a re-emitted pickle (``MappedCheckpoint.faithful``, a second run of the source's pickle).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import pytest
import torch

from dtypeaudit.conversion import convert, mapped
from dtypeaudit.formats import locate, read_checkpoint, ziparchive
from dtypeaudit.formats.picklevm import PickleVM
from dtypeaudit.formats.source import LocalSource

from .helpers import write_sharded
from .models import TinyLM


def _file(name: object) -> str:
    """A counter's key: the file's path (a pickle's source may carry ``:member`` after it)."""
    return str(Path(str(name).split(":", 1)[0]))


def _outside(counter: Counter[str], root: Path) -> Counter[str]:
    """The counts of files outside ``root`` (the output and its temporaries), by file name."""
    out: Counter[str] = Counter()
    for key, n in counter.items():
        if not key.startswith(str(root) + "/") and key != str(root):
            out[Path(key).name] += n
    return out


@dataclass
class Counts:
    header_bytes: Counter[str] = field(default_factory=Counter)
    pickle_runs: Counter[str] = field(default_factory=Counter)
    zip_parses: Counter[str] = field(default_factory=Counter)
    json_reads: Counter[str] = field(default_factory=Counter)
    tensor_bytes: Counter[str] = field(default_factory=Counter)
    faithful_pickles: Counter[str] = field(default_factory=Counter)


@pytest.fixture
def counts(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counts]:
    c = Counts()
    account, load, entries, small = LocalSource._account, PickleVM.load, ziparchive._read_entries, locate.read_small
    bytes_at, tensor_at = mapped.MappedCheckpoint.bytes_at, mapped.MappedCheckpoint.tensor_at
    faithful = mapped.MappedCheckpoint.__dict__["faithful"].func

    def counted_account(self: LocalSource, n: int) -> None:
        c.header_bytes[_file(self.name)] += n
        account(self, n)

    def counted_load(self: PickleVM, start: int = 0) -> Any:
        c.pickle_runs[_file(self.source)] += 1
        return load(self, start)

    def counted_entries(path: str, mm: Any, src: Any) -> Any:
        c.zip_parses[_file(path)] += 1
        return entries(path, mm, src)

    def counted_small(path: Any, cap: int) -> bytes:
        if str(path).endswith(".json"):
            c.json_reads[_file(path)] += 1
        return small(path, cap)

    def counted_bytes_at(self: mapped.MappedCheckpoint, offset: int, length: int) -> Any:
        c.tensor_bytes[_file(self.path)] += length
        return bytes_at(self, offset, length)

    def counted_tensor_at(self: mapped.MappedCheckpoint, dtype: str, count: int, offset: int) -> Any:
        from dtypeaudit import dtypes

        c.tensor_bytes[_file(self.path)] += count * dtypes.get(dtype).itemsize
        return tensor_at(self, dtype, count, offset)

    def counted_faithful(self: mapped.MappedCheckpoint) -> Any:
        c.faithful_pickles[_file(self.path)] += 1
        return faithful(self)

    counted = cached_property(counted_faithful)
    counted.__set_name__(mapped.MappedCheckpoint, "faithful")
    monkeypatch.setattr(mapped.MappedCheckpoint, "faithful", counted)
    monkeypatch.setattr(LocalSource, "_account", counted_account)
    monkeypatch.setattr(PickleVM, "load", counted_load)
    monkeypatch.setattr(ziparchive, "_read_entries", counted_entries)
    monkeypatch.setattr(locate, "read_small", counted_small)
    monkeypatch.setattr(mapped.MappedCheckpoint, "bytes_at", counted_bytes_at)
    monkeypatch.setattr(mapped.MappedCheckpoint, "tensor_at", counted_tensor_at)
    yield c


def _one_read(path: Path, counts: Counts) -> Counter[str]:
    """The header bytes a single read of ``path`` accounts, per file."""
    before = Counter(counts.header_bytes)
    read_checkpoint(path)
    after = Counter(counts.header_bytes)
    after.subtract(before)
    return +after


def _reset(counts: Counts) -> None:
    for c in vars(counts).values():
        c.clear()


def _tensor_bytes(path: Path) -> int:
    return sum(t.nbytes for t in read_checkpoint(path).tensors)


def _bf16_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {k: v.to(torch.bfloat16) for k, v in TinyLM().state_dict().items()}


def _samples(path: Path) -> int:
    """Source bytes verification recasts to check the writer's cast: first, middle and last SAMPLE_BYTES of each
    record (``verify._matches_cast``), all of a small one."""
    from dtypeaudit.conversion.verify import SAMPLE_BYTES

    inv = read_checkpoint(path)
    total = 0
    for t in {t.storage or t.name: t for t in inv.tensors}.values():
        itemsize = t.nbytes // max(1, t.numel)
        numel = inv.layout.storages[t.storage or t.name].length // itemsize  # type: ignore[union-attr]
        step = max(1, SAMPLE_BYTES // itemsize)
        starts = {0, (numel // 2) // step * step, max(0, (numel - 1) // step * step)} if numel else set()
        total += sum(min(step, numel - first) * itemsize for first in starts)
    return total


def _fp32_state() -> dict[str, torch.Tensor]:
    """float32, with records of up to 1 MiB: well over verification's three samples of each (3 x SAMPLE_BYTES),
    so a second read of the source bytes shows in the counts (in TinyLM's default size the samples are everything)."""
    torch.manual_seed(0)
    return {k: v.clone() for k, v in TinyLM(vocab=1024, dim=256).state_dict().items()}


@pytest.mark.parametrize(
    ("state", "to", "dtype"),
    [
        # float32 to float16: a narrowing cast, whose value checks (overflow, underflow) fold into the one read of
        # the source bytes that the writer casts from
        (_fp32_state, "fp16", torch.float16),
        # bfloat16 to float32: an exact widening, no value checks at all
        (_bf16_state, "fp32", torch.float32),
    ],
    ids=["fp32-to-fp16", "bf16-to-fp32"],
)
def test_two_shard_bin_directory(tmp_path: Path, counts: Counts, state: Any, to: str, dtype: torch.dtype) -> None:
    source_state = state()
    src = write_sharded(tmp_path / "bin", source_state, 2, kind="bin")
    shards = sorted(p.name for p in src.glob("*.bin"))
    want = {shard: _expected(src / shard) for shard in shards}
    reader = _one_read(src, counts)
    _reset(counts)
    out = tmp_path / "out"
    convert(src, to, output=out)
    for shard in shards:
        path, (nbytes, samples, pickles) = str(src / shard), want[shard]
        # The source's headers and pickle are read once (by the reader), its tensor bytes once by the writer
        # (and verification's recast samples).
        assert counts.header_bytes[path] == reader[path]
        assert counts.tensor_bytes[path] == nbytes + samples
        # One central-directory parse per file: the source's (the reader's) and the output's (its verification's).
        assert counts.zip_parses[path] == 1
        assert _outside(counts.zip_parses, src)[shard] == 1
        # The source's pickle runs once, by the reader, which notes where its storage types are named: the rewrite
        # edits those bytes (formats/picklesplice.py) instead of running it again; the output's: its verification's.
        assert counts.pickle_runs[path] == pickles
        assert counts.faithful_pickles[path] == 0
        assert _outside(counts.pickle_runs, src)[shard] == pickles
    got: dict[str, torch.Tensor] = {}
    for shard in shards:
        got.update(torch.load(out / shard, weights_only=True))
    assert set(got) == set(source_state)
    for name, value in source_state.items():  # the values torch's own cast gives, bit for bit
        assert got[name].dtype == dtype and torch.equal(got[name], value.to(dtype)), name


def test_a_value_float16_cannot_hold_is_found_in_the_same_single_read(tmp_path: Path, counts: Counts) -> None:
    """The value checks of a float32 to float16 cast run on the bytes the writer reads: an overflow is found
    (and nothing published) without a second read of the source."""
    state = _fp32_state()
    state["embed.weight"][0, 0] = 1e6  # over float16's largest finite value, 65504
    src = write_sharded(tmp_path / "bin", state, 2, kind="bin")
    shards = sorted(p.name for p in src.glob("*.bin"))
    want = {shard: _expected(src / shard) for shard in shards}
    reader = _one_read(src, counts)
    _reset(counts)
    out = tmp_path / "out"
    result = convert(src, "fp16", output=out)
    assert [(v.name, v.overflow) for v in result.unsafe] == [("embed.weight", 1)]
    assert result.output is None and not out.exists()
    for shard in shards:
        path, (nbytes, samples, pickles) = str(src / shard), want[shard]
        assert counts.header_bytes[path] == reader[path]
        assert nbytes <= counts.tensor_bytes[path] <= nbytes + samples
        assert counts.pickle_runs[path] == pickles


def _expected(path: Path) -> tuple[int, int, int]:
    """What one conversion of ``path`` should cost it: tensor bytes, verification's samples, the reader's pickle runs
    (measured before the counters start, since measuring reads the file)."""
    return _tensor_bytes(path), _samples(path), reader_pickles(path)


def reader_pickles(path: Path) -> int:
    """Pickle runs of one read of ``path`` alone (the main pickle, and the probe for data after it)."""
    before = PickleVM.load
    runs = [0]

    def counted(self: PickleVM, start: int = 0) -> Any:
        runs[0] += 1
        return before(self, start)

    PickleVM.load = counted  # type: ignore[method-assign]
    try:
        read_checkpoint(path)
    finally:
        PickleVM.load = before  # type: ignore[method-assign]
    return runs[0]


def test_two_shard_safetensors_directory(tmp_path: Path, counts: Counts) -> None:
    src = write_sharded(tmp_path / "st", _bf16_state(), 2)
    shards = sorted(p.name for p in src.glob("*.safetensors"))
    want = {shard: _expected(src / shard) for shard in shards}
    reader = _one_read(src, counts)
    _reset(counts)
    convert(src, "fp16", output=tmp_path / "out")
    for shard in shards:
        path, (nbytes, samples, pickles) = str(src / shard), want[shard]
        assert counts.header_bytes[path] == reader[path]
        # bfloat16 to float16: torch's cast measures its errors (as torch does, in bfloat16), so the value checks
        # read the bytes before it (a cast numpy makes folds them from the same read: see the .bin directory)
        assert counts.tensor_bytes[path] == 2 * nbytes + samples
        assert counts.pickle_runs[path] == pickles  # the sniffer's probe, by the reader
        assert counts.zip_parses[path] == 0


def test_single_torch_save_file(tmp_path: Path, counts: Counts) -> None:
    src = tmp_path / "model.pt"
    torch.save(_bf16_state(), src)
    nbytes, samples, pickles = _expected(src)
    reader = _one_read(src, counts)
    _reset(counts)
    out = tmp_path / "model.fp16.pt"
    convert(src, "fp16", output=out)
    path = str(src)
    assert counts.header_bytes[path] == reader[path]
    assert counts.tensor_bytes[path] == 2 * nbytes + samples  # the checks' read, then torch's cast (see above)
    assert counts.zip_parses[path] == 1
    assert sum(_outside(counts.zip_parses, src).values()) == 1  # the output, read once to verify it
    assert counts.pickle_runs[path] == pickles
    assert counts.faithful_pickles[path] == 0
    assert sum(_outside(counts.pickle_runs, src).values()) == pickles


def test_strip_optimizer_costs_one_more_run_only_where_it_strips(tmp_path: Path, counts: Counts) -> None:
    """--strip-optimizer re-emits the pickle from its faithful graph (a second run) where it leaves something out,
    and only there: a plain state dict (every entry a tensor, as the reader noted) keeps the one run."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    training = tmp_path / "training.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 1}, training)
    plain = tmp_path / "plain.pt"
    torch.save(model.state_dict(), plain)
    for src, stripped in ((training, 1), (plain, 0)):
        pickles = reader_pickles(src)
        _reset(counts)
        out = tmp_path / f"{src.stem}.fp16.pt"
        result = convert(src, "fp16", output=out, strip_optimizer=True)
        path = str(src)
        assert counts.faithful_pickles[path] == stripped
        assert counts.pickle_runs[path] == pickles + stripped
        assert sum(_outside(counts.pickle_runs, src).values()) == pickles  # the output, verified
        got = torch.load(out, weights_only=True)
        if stripped:
            assert result.plan.stripped == {"": (("optimizer",),)}
            assert set(got) == {"model", "epoch"} and got["epoch"] == 1
            assert all(v.dtype == torch.float16 for v in got["model"].values())
        else:
            assert result.plan.stripped == {}
            assert set(got) == set(model.state_dict()) and all(v.dtype == torch.float16 for v in got.values())


def test_directory_scan_parses_each_json_once(tmp_path: Path, counts: Counts) -> None:
    src = write_sharded(tmp_path / "st", _bf16_state(), 2)
    (src / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    (src / "config.json").write_text('{"architectures": ["TinyLM"], "torch_dtype": "float16", "torch_dtype": "float32"}')
    inv = read_checkpoint(src)
    # generation_config.json is not read as JSON by the scan at all (from_pretrained's model load does not).
    assert counts.json_reads == Counter({str(src / "config.json"): 1, str(src / "model.safetensors.index.json"): 1})
    # The one parse answers both readings: the loader's (the last value wins) and the duplicate-key warning.
    assert inv.metadata["config_dtype"] == "float32"
    assert [f.rule for f in inv.findings if f.file == "config.json"] == ["duplicate-key"]


def _model_folder(root: Path) -> Path:
    src = write_sharded(root, _bf16_state(), 2)
    (src / "config.json").write_text(json.dumps({"architectures": ["TinyLM"], "torch_dtype": "bfloat16"}))
    return src


def _parsed_once(src: Path) -> Counter[str]:
    return Counter({str(src / "config.json"): 1, str(src / "model.safetensors.index.json"): 1})


def test_scan_of_a_model_folder_parses_each_json_once(tmp_path: Path, counts: Counts) -> None:
    """Telling a folder is a model (the expansion) and reading it share one parse of config.json and of the index:
    named, and found by walking the folder above it."""
    from dtypeaudit.pipeline import scan

    src = _model_folder(tmp_path / "runs" / "st")
    want = read_checkpoint(src)
    for named in (src, src.parent):
        _reset(counts)
        report = scan([str(named)], jobs=1)
        assert counts.json_reads == _parsed_once(src)
        (only,) = report.checkpoints
        assert only.error is None and only.path == str(src)
        assert only.inventory is not None
        assert [(t.name, t.dtype, t.file) for t in only.inventory.tensors] == [(t.name, t.dtype, t.file) for t in want.tensors]
        assert only.inventory.metadata["config_dtype"] == "bfloat16"
        # the JSON read while expanding still counts, once, in what reading the folder cost
        assert only.inventory.bytes_read == want.bytes_read


def test_cli_scan_of_a_model_folder_parses_each_json_once(tmp_path: Path, counts: Counts) -> None:
    from .helpers import json_report

    src = _model_folder(tmp_path / "st")
    code, report, _ = json_report("scan", str(src))
    assert code == 0
    assert counts.json_reads == _parsed_once(src)
    assert [c["path"] for c in report["checkpoints"]] == [str(src)]
    want = read_checkpoint(src)
    assert len(report["checkpoints"][0]["tensors"]) == len(want.tensors)
    assert report["checkpoints"][0]["bytes_read"] == want.bytes_read


@pytest.fixture
def inferences(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Calls of ``structure.infer_modules`` (the structure step's work), by the inventory's path."""
    from dtypeaudit import structure
    from dtypeaudit.inventory import Inventory

    calls: Counter[str] = Counter()
    infer = structure.infer_modules

    def counted(inv: Any, **kwargs: Any) -> Any:
        calls[inv.path if isinstance(inv, Inventory) else "records"] += 1
        return infer(inv, **kwargs)

    monkeypatch.setattr(structure, "infer_modules", counted)
    return calls


def test_scan_infers_each_checkpoints_structure_once(tmp_path: Path, inferences: Counter[str]) -> None:
    """prepare infers the modules; run_checks' annotate and the module checks reuse them (the findings are those
    the public ``check`` gives each file alone)."""
    from safetensors.torch import save_file

    from dtypeaudit.checks import check, checks_for
    from dtypeaudit.pipeline import scan
    from dtypeaudit.policy import load_policy

    policy = load_policy("bf16-weights-fp32-norms")
    pt, st = tmp_path / "a.pt", tmp_path / "b.safetensors"
    torch.save(_bf16_state(), pt)  # norms in bfloat16: the policy's norm rules fail
    torch.manual_seed(0)
    state = {k: v.clone() for k, v in TinyLM().state_dict().items()}
    state["layers.0.attn.weight"] = state["layers.0.attn.weight"].to(torch.bfloat16)  # one outlier in a float32 model
    save_file(state, st)
    report = scan([str(pt), str(st)], checks=checks_for(policy), policy=policy, jobs=1)
    assert inferences == Counter({str(pt): 1, str(st): 1})
    for got, path in zip(report.checkpoints, (pt, st), strict=True):
        want = check(read_checkpoint(path), policy)
        assert want and [f for f in got.findings if f.rule != "unused-rule"] == want


def test_live_audit_infers_the_structure_once(inferences: Counter[str]) -> None:
    import dtypeaudit

    torch.manual_seed(0)
    model = TinyLM().to(torch.bfloat16)
    found = dtypeaudit.audit(model, "bf16-weights-fp32-norms")
    assert sum(inferences.values()) == 1
    # the policy wants its LayerNorms (guessed from names and shapes, as a scan guesses them) in float32
    norms = sorted(f"{name}.{p}" for name, m in model.named_modules() if isinstance(m, torch.nn.LayerNorm) for p in ("weight", "bias"))
    assert sorted((f.rule, f.severity, f.tensor) for f in found) == [("dtype-mismatch", "error", n) for n in norms]


def test_a_worker_reads_a_walked_model_folder_without_parsing_its_json_again(
    tmp_path: Path, counts: Counts, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the expansion parsed travels with the target to a worker (pickled, and named by its absolute path there,
    as fleet sends a relative one to a Dask worker) and is not parsed again; its bytes still count once."""
    import pickle

    from dtypeaudit import fleet
    from dtypeaudit.pipeline import expand_targets, read_target

    src = _model_folder(tmp_path / "st")
    want = read_checkpoint(src)
    monkeypatch.chdir(tmp_path)
    (found,) = expand_targets(["st"])
    assert found.documents is not None and set(found.documents) == {"config.json", "model.safetensors.index.json"}
    sent = pickle.loads(pickle.dumps(fleet._absolute(found)))
    assert sent.where == src and sent.documents is not None and set(sent.documents) == set(found.documents)
    _reset(counts)
    inv = read_target(sent)
    assert counts.json_reads == Counter()
    assert inv.bytes_read == want.bytes_read and [t.name for t in inv.tensors] == [t.name for t in want.tensors]
