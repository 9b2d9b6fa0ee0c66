"""The light install (`pip install dtypeaudit`, no torch): scan, policies, reports and diff work; convert, trace,
--model and factories exit 2 with the one line naming the extra; nothing a scan does imports torch.

The light environment is a fresh venv that sees dtypeaudit's source and exactly the distributions its core
dependencies pull in (resolved from pyproject.toml through the installed packages' own metadata, linked
from this environment): the set `pip install dtypeaudit` installs, built offline in a second. Checkpoints
are written beforehand by this process, with torch. With ``pytest -m slow`` a real `pip install -e .` into
a fresh venv is tested too (it needs the package index).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest
import torch
from torch import nn

from .helpers import ROOT, json_report, run_cli


def _pyproject() -> dict:
    """pyproject.toml, parsed by tomllib (Python 3.11+): only the tests that read it skip on 3.10."""
    tomllib = pytest.importorskip("tomllib")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


EXTRA_LINE = re.compile(r"^dtypeaudit: error: dtypeaudit (\S+).* needs torch: pip install 'dtypeaudit\[torch\]'$")


def _light_distributions() -> dict[str, object]:
    """The distributions `pip install dtypeaudit` installs: the core dependencies and theirs, no extras."""
    from importlib import metadata

    Requirement = pytest.importorskip("packaging.requirements").Requirement
    pyproject = _pyproject()
    todo = [Requirement(r) for r in pyproject["project"]["dependencies"]]
    found: dict[str, object] = {}
    while todo:
        req = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = re.sub(r"[-_.]+", "-", req.name).lower()
        if name in found:
            continue
        dist = metadata.distribution(req.name)
        found[name] = dist
        todo.extend(Requirement(r) for r in dist.requires or ())
    return found


def _top_level(dist) -> set[str]:
    """The names a distribution puts in site-packages (packages, modules, extension modules, its .dist-info)."""
    names = set()
    for f in dist.files or ():
        first = f.parts[0]
        if first in ("..", "__pycache__") or first.endswith(".pth") or first.startswith("__editable__"):
            continue
        names.add(first)
    return names


@pytest.fixture(scope="module")
def light(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv's python that sees dtypeaudit and its light dependencies, and no torch."""
    home = tmp_path_factory.mktemp("light")
    env_dir = home / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    deps = home / "site"
    deps.mkdir()
    dists = _light_distributions()
    assert "torch" not in dists and "dask" not in dists and "distributed" not in dists, sorted(dists)
    for dist in dists.values():
        base = Path(dist.locate_file(""))
        for name in _top_level(dist):
            if (base / name).exists() and not (deps / name).exists():
                (deps / name).symlink_to(base / name)
    python = env_dir / "bin" / "python"
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], capture_output=True, text=True)
    Path(purelib.stdout.strip(), "light.pth").write_text(f"{ROOT}\n{deps}\n")
    check = subprocess.run(
        [python, "-c", "import importlib.util as u; print(u.find_spec('torch'), u.find_spec('dask'))"], capture_output=True
    )
    assert check.stdout.decode().split() == ["None", "None"], check
    return python


def _run(python: Path, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(NO_COLOR="1", COLUMNS="160")
    return subprocess.run([python, "-m", "dtypeaudit", *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=120)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.norm = nn.LayerNorm(3)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Checkpoints and a policy, written here with torch, for the light environment to read."""
    d = tmp_path_factory.mktemp("light_files")
    torch.manual_seed(0)
    net = Net()
    out = {"fp32": d / "net.pt", "fp16": d / "net.fp16.pt", "legacy": d / "legacy.pt", "st": d / "net.safetensors"}
    torch.save(net.state_dict(), out["fp32"])
    torch.save({k: v.half() if k.startswith("fc.") else v for k, v in net.state_dict().items()}, out["fp16"])  # fp16-mixed
    torch.save(net.state_dict(), out["legacy"], _use_new_zipfile_serialization=False)
    out["f64"] = d / "net64.pt"
    torch.save({k: v.double() for k, v in net.state_dict().items()}, out["f64"])  # only torch measures its cast's errors
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, out["st"])
    out["policy"] = d / "policy.yaml"
    out["policy"].write_text("version: 1\nextends: fp16-mixed\n")
    out["factory"] = d / "build.py"
    out["factory"].write_text("from torch import nn\n\ndef build():\n    return nn.Linear(4, 3)\n")
    return out


def test_light_env_has_no_torch_but_the_core(light: Path) -> None:
    dists = _light_distributions()
    assert {"typer", "rich", "pyyaml", "numpy"} <= set(dists)


def test_scan_json_report_equals_full_install(light: Path, files: dict[str, Path]) -> None:
    targets = [str(files[k]) for k in ("fp32", "fp16", "legacy", "st")]
    proc = _run(light, "scan", *targets, "--format", "json")
    assert proc.returncode == 0, proc.stderr
    code, full, _ = json_report("scan", *targets)
    assert code == 0
    assert json.loads(proc.stdout) == full
    assert [c["format"] for c in full["checkpoints"]] == ["torch-zip", "torch-zip", "torch-legacy", "safetensors"]


def test_policy_reports_and_values_without_torch(light: Path, files: dict[str, Path]) -> None:
    valid = _run(light, "policy", "validate", str(files["policy"]), "fp16-mixed")
    assert valid.returncode == 0, valid.stderr
    assert f"{files['policy']}: valid" in valid.stdout
    # fp32 weights against an fp16 policy: findings, exit 1, every report format renders
    for fmt in ("json", "sarif", "markdown", "github", "junit", "plain"):
        proc = _run(light, "scan", str(files["fp32"]), "--policy", str(files["policy"]), "--format", fmt)
        assert proc.returncode == 1, (fmt, proc.stderr)
        assert proc.stdout.strip(), fmt
    assert _run(light, "scan", str(files["fp16"]), "--preset", "fp16-mixed").returncode == 0
    # scan --values on float32 and float16 tensors reads values with numpy alone
    values = _run(light, "scan", str(files["fp32"]), str(files["fp16"]), "--values", "--format", "json")
    assert values.returncode == 0, values.stderr
    baseline = _run(light, "policy", "init", str(files["fp16"]))
    assert baseline.returncode == 0, baseline.stderr
    assert "float16" in baseline.stdout


def test_diff_without_torch(light: Path, files: dict[str, Path]) -> None:
    same = _run(light, "diff", str(files["fp32"]), str(files["legacy"]))
    assert same.returncode == 0, same.stdout + same.stderr
    changed = _run(light, "diff", str(files["fp32"]), str(files["fp16"]), "--format", "json")
    assert changed.returncode == 1, changed.stderr
    doc = json.loads(changed.stdout)
    assert doc == json.loads(_run_full("diff", str(files["fp32"]), str(files["fp16"]), "--format", "json").stdout)
    tolerant = _run(light, "diff", str(files["fp32"]), str(files["st"]), "--tolerance", "0")
    assert tolerant.returncode == 0, tolerant.stdout + tolerant.stderr


def _run_full(*args: str) -> subprocess.CompletedProcess[str]:
    return run_cli(*args)


@pytest.mark.parametrize(
    ("args", "command"),
    [
        (["convert", "{f64}", "--to", "fp32"], "convert"),
        (["convert", "{f64}", "--to", "fp16", "--dry-run", "--check-values"], "convert"),
        (["trace", "{factory}:build"], "trace"),
        (["scan", "{fp32}", "--model", "{factory}:build"], "scan"),
        (["scan", "{factory}:build"], "scan"),
        (["policy", "init", "{factory}:build"], "policy"),
    ],
)
def test_torch_commands_name_the_extra(light: Path, files: dict[str, Path], args: list[str], command: str) -> None:
    proc = _run(light, *(a.format(**{k: str(v) for k, v in files.items()}) for a in args))
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    match = EXTRA_LINE.match(lines[0])
    assert match and match.group(1) == command, lines[0]
    assert "Traceback" not in proc.stderr


def test_a_plain_conversion_needs_no_torch(light: Path, files: dict[str, Path], tmp_path: Path) -> None:
    """float32 weights to fp16 or bf16 are cast with numpy (npcast, bit-equal to torch's cast): the light install
    converts them, and the output is what torch's own cast gives; a float64 source names the extra instead."""
    from safetensors.torch import load_file

    half, bf16 = tmp_path / "net.fp16.pt", tmp_path / "net.bf16.safetensors"
    proc = _run(light, "convert", str(files["fp32"]), "--to", "fp16", "-o", str(half))
    assert proc.returncode == 0, proc.stderr
    # no torch here: the line says what the samples were compared with instead of claiming torch's cast
    assert proc.stdout.splitlines()[-1].endswith("sampled records equal a second cast of the source, by numpy, apart from the writer")
    want = torch.load(files["fp32"], weights_only=True)
    got = torch.load(half, weights_only=True)
    assert list(got) == list(want) and all(torch.equal(got[k], v.half()) and got[k].dtype == torch.float16 for k, v in want.items())
    proc = _run(light, "convert", str(files["st"]), "--to", "bf16", "-o", str(bf16))
    assert proc.returncode == 0, proc.stderr
    got = load_file(bf16)
    assert all(torch.equal(got[k], v.bfloat16()) for k, v in load_file(files["st"]).items())
    dry = _run(light, "convert", str(files["fp32"]), str(files["st"]), "--to", "fp16", "--dry-run", "--jobs", "2")
    assert dry.returncode == 0, dry.stderr
    refused = _run(light, "convert", str(files["f64"]), "--to", "fp32", "-o", str(tmp_path / "f32.pt"))
    assert refused.returncode == 2 and not (tmp_path / "f32.pt").exists()


def test_cluster_names_the_dask_extra(light: Path, files: dict[str, Path]) -> None:
    proc = _run(light, "scan", str(files["fp32"]), "--cluster", "local")
    assert proc.returncode == 2
    assert proc.stderr.strip() == "dtypeaudit: error: --cluster needs dask.distributed: pip install 'dtypeaudit[dask]'"


# Run in the light venv: every import torch (or numpy, for a plain scan) is recorded, even one a caller catches.
_WATCH = """
import sys
attempts = []
class Watch:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name.partition(".")[0] in WATCHED:
            attempts.append(name)
        return None
sys.meta_path.insert(0, Watch)
import dtypeaudit
from dtypeaudit.cli import main
sys.argv = ["dtypeaudit", *ARGS]
try:
    main()
except SystemExit as done:
    code = done.code
print("RESULT", code, sorted(set(attempts)), file=sys.stderr)
"""


@pytest.mark.parametrize(
    ("args", "watched"),
    [
        (["scan", "{fp32}", "{legacy}", "{st}", "--format", "json"], ("torch", "numpy", "safetensors", "dask", "distributed")),
        (["scan", "{fp32}", "--preset", "fp16-mixed", "--format", "sarif"], ("torch", "numpy", "safetensors", "dask", "distributed")),
        (["scan", "{fp32}", "--values", "--format", "json"], ("torch", "dask", "distributed")),
        (["diff", "{fp32}", "{fp16}"], ("torch", "dask", "distributed")),
    ],
)
def test_import_and_scan_never_import_torch(light: Path, files: dict[str, Path], args: list[str], watched: tuple[str, ...]) -> None:
    argv = [a.format(**{k: str(v) for k, v in files.items()}) for a in args]
    code = _WATCH.replace("WATCHED", repr(watched)).replace("ARGS", repr(argv))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    proc = subprocess.run([light, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    result = proc.stderr.strip().splitlines()[-1]
    assert result.startswith("RESULT "), proc.stderr
    assert result.split(" ", 2)[2] == "[]", result


def test_a_convert_line_runs_without_torch(light: Path, files: dict[str, Path], tmp_path: Path) -> None:
    """The console script (entry.main) runs a plain convert without torch. Verification looks torch up
    (``find_spec``: is it installed, to recast with it?) but never imports it here: an ``import torch``, even one
    caught, is recorded through ``__import__``."""
    out = tmp_path / "half.pt"
    argv = ["convert", str(files["fp32"]), "--to", "fp16", "-o", str(out)]
    code = _WATCH.replace("WATCHED", repr(("dask",))).replace("ARGS", repr(argv))
    code = code.replace("from dtypeaudit.cli import main", "from dtypeaudit.entry import main")
    imports = (
        "import builtins\nreal_import = builtins.__import__\n"
        "def watched(name, *args, **kwargs):\n"
        "    if name.partition('.')[0] == 'torch':\n        attempts.append(name)\n"
        "    return real_import(name, *args, **kwargs)\n"
        "builtins.__import__ = watched\n"
    )
    code = code.replace("sys.meta_path.insert(0, Watch)\n", "sys.meta_path.insert(0, Watch)\n" + imports)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    proc = subprocess.run([light, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.stderr.strip().splitlines()[-1] == "RESULT 0 []", proc.stderr
    assert torch.equal(torch.load(out, weights_only=True)["fc.weight"], torch.load(files["fp32"], weights_only=True)["fc.weight"].half())


# What a pre-commit hook's scan of one file imports is its start-up time (benchmarks/STARTUP.md): module sets are
# stable where timings on a shared machine are not, so this holds the start-up work instead of a stopwatch.
_MODULES_AFTER = """
import io, json, sys
sys.argv = ["dtypeaudit", *ARGS]
sys.stdout = io.TextIOWrapper(io.BytesIO(), encoding="utf-8")  # a pipe, as a hook's output is: -f plain by default
from dtypeaudit.entry import main
try:
    main()
except SystemExit as done:
    code = done.code
out = sys.stdout.buffer.getvalue().decode()
sys.stdout = sys.__stdout__
print(json.dumps({"code": code, "out": out, "modules": sorted(sys.modules)}))
"""

NOT_FOR_A_FILE_SCAN = (
    # Typer, Click and Rich (the command line and the text report) are a scan's; what the core needs only for
    # other work is not.
    "yaml",
    "numpy",
    "torch",
    "safetensors",
    "fsspec",
    "huggingface_hub",
    "dask",
    "pickletools",
    "tarfile",  # sniff.py's checksum pre-check (_may_be_tar) says no first, as tarfile would
    "dtypeaudit.policy",
    "dtypeaudit.conversion",
    "dtypeaudit.trace",
    "dtypeaudit.values",
    "dtypeaudit.formats.dcp",
    "dtypeaudit.formats.directory",
    "dtypeaudit.formats.hub",
    "dtypeaudit.formats.factory",
    "dtypeaudit.formats.hfload",
    # an unquantized checkpoint: quant/hints.py says so without the grouping, its records or its checks
    "dtypeaudit.quant.group",
    "dtypeaudit.quant.model",
    "dtypeaudit.quant.consistency",
    "dtypeaudit.quant.dequant",
)


@pytest.mark.parametrize("args", [["scan", "{fp32}"], ["scan", "{st}", "-f", "plain"], ["scan", "{legacy}", "--format", "json"]])
def test_scan_of_one_file_imports_only_what_it_uses(light: Path, files: dict[str, Path], args: list[str]) -> None:
    argv = [a.format(**{k: str(v) for k, v in files.items()}) for a in args]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "COLUMNS")}
    proc = subprocess.run([light, "-c", _MODULES_AFTER.replace("ARGS", repr(argv))], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    run = json.loads(proc.stdout.strip().splitlines()[-1])
    assert run["code"] in (0, None) and argv[1] in run["out"], run
    assert ("✓ 1 checkpoint: no findings" in run["out"]) != (argv[-1] == "json"), run["out"]
    modules = run["modules"]
    imported = {m for m in modules for top in NOT_FOR_A_FILE_SCAN if m == top or m.startswith(top + ".")}
    assert not imported, sorted(imported)
    assert "dtypeaudit.formats.torchzip" in modules and "dtypeaudit.checks" in modules  # the scan did run


def test_tar_precheck_never_refuses_what_tarfile_opens(files: dict[str, Path]) -> None:
    """sniff._may_be_tar says no only where tarfile.open(mode="r:") raises ReadError on the first block: over tar
    headers of every format, blocks with a valid unsigned or signed checksum, random blocks, and the heads of the
    checkpoints a scan sees (which it must refuse, or the scan imports tarfile)."""
    import io
    import random
    import tarfile

    from dtypeaudit.formats.sniff import _may_be_tar

    def checksummed(block: bytearray, signed: bool) -> bytes:
        block[148:156] = b" " * 8
        total = sum((b - 256 if b > 127 else b) if signed else b for b in block)
        block[148:156] = f"{total & 0o7777777:06o}".encode() + b"\0 "
        return bytes(block)

    rng = random.Random(18)
    blocks: list[bytes] = []
    for fmt in (tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
            info = tarfile.TarInfo("a" * rng.randint(1, 150))
            info.size = 3
            tar.addfile(info, io.BytesIO(b"abc"))
        blocks.append(buf.getvalue()[:512])
    opened = len(blocks)
    for i in range(1500):
        block = bytearray(rng.randbytes(512)) if i % 3 else bytearray(rng.choice((0, 32, 48, 200)) for _ in range(512))
        blocks.append(checksummed(block, signed=i % 2 == 0) if i < 1000 else bytes(block))
    blocks += [b"\0" * 512, b"\0" * 100, b"x" * 511, b"\x80" * 512, b"\xff" * 512]
    heads = [files[name].read_bytes() for name in ("fp32", "legacy", "st")]
    refused = 0
    for block in blocks + heads:
        data = block + b"\0" * 1024 if len(block) == 512 else block  # a block, or a whole file
        if _may_be_tar(data[:65536], len(data)):
            continue
        refused += 1
        with pytest.raises(tarfile.ReadError):
            tarfile.open(fileobj=io.BytesIO(data), mode="r:")
    assert all(_may_be_tar(b, 4096) for b in blocks[:opened]) and not any(_may_be_tar(h[:65536], len(h)) for h in heads)
    assert refused > 400  # random blocks mostly fail the checksum: the pre-check does refuse


def test_opcode_names_are_pickletools_names() -> None:
    """picklevm names opcodes from pickle's constants, not pickletools (which a scan no longer imports)."""
    import pickletools

    from dtypeaudit.formats.picklevm import _OPCODE_NAMES

    assert _OPCODE_NAMES == {op.code.encode("latin-1")[0]: op.name for op in pickletools.opcodes}


@pytest.mark.slow  # a real pip install from the package index
def test_real_pip_install_is_light(tmp_path: Path) -> None:
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    pip = [str(env_dir / "bin" / "python"), "-m", "pip"]
    subprocess.run([*pip, "install", "--quiet", "-e", str(ROOT)], check=True, timeout=600)
    listed = subprocess.run([*pip, "list", "--format", "json"], capture_output=True, text=True, check=True)
    names = {p["name"].lower() for p in json.loads(listed.stdout)}
    assert "torch" not in names and "dtypeaudit" in names
    proc = subprocess.run(
        [env_dir / "bin" / "dtypeaudit", "scan", str(ROOT / "sample_models"), "--format", "json"], capture_output=True, text=True
    )
    assert proc.returncode == 1, proc.stderr  # the half-converted sample's module-dtype-mix error
    assert len(json.loads(proc.stdout)["checkpoints"]) == 3


def test_full_install_command_is_unchanged() -> None:
    """The README's two one-command flows install torch explicitly, and the test extra pulls it (and dask) in."""
    readme = (ROOT / "README.md").read_text()
    assert "pip install torch==2.13.0 -e . && .venv/bin/dtypeaudit scan sample_models/" in readme
    assert "pip install torch==2.13.0 -e '.[test]' && .venv/bin/python -m pytest -q" in readme
    extras = _pyproject()["project"]["optional-dependencies"]
    assert any(r.startswith("torch>=2.10,<3") for r in extras["torch"])
    assert any(r.startswith("dtypeaudit[") and "torch" in r and "dask" in r for r in extras["test"])
    assert sys.modules.get("torch") is torch


def test_hook_and_action_use_the_light_install() -> None:
    import yaml

    (hook,) = yaml.safe_load((ROOT / ".pre-commit-hooks.yaml").read_text())
    assert hook["language"] == "python" and not any("torch" in d for d in hook.get("additional_dependencies", ()))
    action = yaml.safe_load((ROOT / "action.yml").read_text())
    assert action["inputs"]["version"]["default"] == ""  # the action's own checkout (tests/test_action.py runs it)
    install = action["runs"]["steps"][0]
    assert "pip install" in install["run"] and "torch" not in install["run"]


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """save_pretrained folders: a T5 in float16 (its ``wo`` loads as float32), a GPT-2, a BERT (renamed keys)."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    d = tmp_path_factory.mktemp("light_hf")
    torch.manual_seed(0)
    models = {
        "t5": transformers.T5ForConditionalGeneration(
            transformers.T5Config(vocab_size=16, d_model=8, d_kv=4, d_ff=16, num_layers=1, num_heads=2)
        ).half(),
        "gpt2": transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16, n_positions=8)),
        "bert": transformers.BertForMaskedLM(
            transformers.BertConfig(
                vocab_size=16, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16, max_position_embeddings=8
            )
        ).bfloat16(),
    }
    out = {}
    for name, model in models.items():
        model.save_pretrained(str(d / name))
        out[name] = d / name
    return out


def test_hf_folder_verdicts_equal_in_light_and_full_install(light: Path, hf_folders: dict[str, Path]) -> None:
    """The same folders give the same JSON report with and without torch and transformers installed."""
    targets = [str(hf_folders[k]) for k in ("t5", "gpt2", "bert")]
    for args in (["scan", *targets, "--format", "json"], ["scan", *targets, "--preset", "fp16", "--format", "json"]):
        light_run = _run(light, *args)
        full_run = run_cli(*args, process=True)
        assert light_run.returncode == full_run.returncode, (light_run.stderr, full_run.stderr)
        assert json.loads(light_run.stdout) == json.loads(full_run.stdout)
    doc = json.loads(_run(light, "scan", targets[0], "--format", "json").stdout)
    found = {f["rule"]: f for f in doc["checkpoints"][0]["findings"]}
    assert "load-cast" in found and "float32" in found["load-cast"]["message"]  # T5's wo, known without transformers
    assert "keep-in-fp32-unknown" not in found and "load-names-unknown" not in found


@pytest.mark.parametrize("folder", ["t5", "gpt2", "bert"])
def test_scan_of_an_hf_folder_imports_no_torch_nor_transformers(hf_folders: dict[str, Path], folder: str) -> None:
    """In the full install (both importable), a folder scan reads the table and imports neither."""
    argv = ["scan", str(hf_folders[folder]), "--format", "json"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", _MODULES_AFTER.replace("ARGS", repr(argv))], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    run = json.loads(proc.stdout.strip().splitlines()[-1])
    assert run["code"] in (0, 1, None), run
    assert json.loads(run["out"])["checkpoints"][0]["format"] == "hf-directory"
    modules = run["modules"]
    imported = sorted(m for m in modules if m.partition(".")[0] in ("torch", "transformers", "dask", "distributed"))
    assert not imported, imported
    assert "dtypeaudit.formats.hftable" in modules and "dtypeaudit.formats.hfload" in modules  # the table was read


def test_the_wheel_is_pure_python_and_builds_without_a_compiler(tmp_path: Path) -> None:
    """`pip install .` needs no compiler (issue 28): built with every compiler pointing at /bin/false, the wheel is
    py3-none-any, holds no extension module or C source, and its package files are the tree's, byte for byte."""
    pytest.importorskip("setuptools", minversion="68")  # the build backend, used in place (no index needed)
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        (src / name).write_bytes((ROOT / name).read_bytes())
    tree = {
        p.relative_to(ROOT).as_posix(): p.read_bytes()
        for p in sorted((ROOT / "dtypeaudit").rglob("*"))  # rglob follows presets/, a link to ../configs
        if p.is_file() and "__pycache__" not in p.parts
    }
    for name, data in tree.items():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_bytes(data)
    env = {**os.environ, "CC": "/bin/false", "CXX": "/bin/false", "LDSHARED": "/bin/false"}
    pip = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--disable-pip-version-check"]
    proc = subprocess.run([*pip, "-w", str(tmp_path / "out"), str(src)], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    (wheel,) = (tmp_path / "out").glob("*.whl")
    assert wheel.name.endswith("-py3-none-any.whl"), wheel.name
    with zipfile.ZipFile(wheel) as z:
        files = {n: z.read(n) for n in z.namelist() if not n.endswith("/")}
    (meta,) = [n for n in files if n.endswith(".dist-info/WHEEL")]
    assert "Root-Is-Purelib: true" in files[meta].decode()
    assert not [n for n in files if n.endswith((".so", ".pyd", ".dylib", ".c", ".h"))]
    shipped = {n: data for n, data in files.items() if n.startswith("dtypeaudit/")}
    wanted = {n: data for n, data in tree.items() if n.endswith((".py", ".yaml", ".json", "py.typed"))}
    assert shipped.keys() == wanted.keys(), sorted(shipped.keys() ^ wanted.keys())
    assert all(shipped[n] == wanted[n] for n in wanted)
