"""``--format html`` without a browser: the page's structure from checkpoints the real writers make.

The page is parsed with the standard library's HTML parser, as a browser tokenises it: every tensor must sit in a
map cell and in the table's data, every finding must link to a cell that holds its tensor, and hostile names must
stay text. The same builders make the pages tests/test_html_browser.py loads in Chromium.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import struct
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from dtypeaudit.checks import checks_for
from dtypeaudit.diff import diff
from dtypeaudit.formats import read_checkpoint
from dtypeaudit.inventory import CheckpointReport, Finding, Inventory, Report, TensorRecord
from dtypeaudit.pipeline import scan
from dtypeaudit.policy import load_policy
from dtypeaudit.render import OutputFormat, renderer_for
from dtypeaudit.render import html as html_render
from dtypeaudit.render.html import dtype_abbrev, dtype_colours, render, render_diff

from .helpers import run_cli
from .models import TwoConvNet

# -- checkpoints the pages are made of ------------------------------------------------------------------------------


def write_cnn(path: Path) -> Path:
    """A half-finished fp16 conversion: ``fc``'s bias stayed fp32, the crash ``module-dtype-mix`` reports."""
    torch.manual_seed(0)
    state = {k: v.half() if v.is_floating_point() else v for k, v in TwoConvNet().state_dict().items()}
    state["fc.bias"] = state["fc.bias"].float()
    torch.save(state, path)
    return path


def write_gpt2(folder: Path, layers: int = 12) -> Path:
    """A tiny GPT-2 from transformers' own save_pretrained, in fp16 with fp32 layer norms, and layer 5's
    attention bias left in fp32 beside its fp16 weight."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=layers, n_embd=32, n_head=2, vocab_size=128, n_positions=64)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).half()
    for module in model.modules():
        if isinstance(module, nn.LayerNorm):
            module.float()
    model.transformer.h[5].attn.c_attn.bias.data = model.transformer.h[5].attn.c_attn.bias.data.float()
    model.save_pretrained(folder)
    return folder


LLAMA_7B = {"hidden": 4096, "intermediate": 11008, "vocab": 32000, "layers": 32}


def llama_names_and_shapes(layers: int = 32) -> list[tuple[str, tuple[int, ...]]]:
    h, i, v = LLAMA_7B["hidden"], LLAMA_7B["intermediate"], LLAMA_7B["vocab"]
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (v, h))]
    for n in range(layers):
        p = f"model.layers.{n}."
        out += [(p + f"self_attn.{x}_proj.weight", (h, h)) for x in "qkvo"]
        out += [(p + "mlp.gate_proj.weight", (i, h)), (p + "mlp.up_proj.weight", (i, h)), (p + "mlp.down_proj.weight", (h, i))]
        out += [(p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,))]
    return out + [("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]


def write_llama_7b_header(path: Path) -> Path:
    """A safetensors file with Llama-2-7B's 291 names and shapes, bf16 with fp32 norms, and layer 17's
    ``v_proj`` in fp16. The header is real; the 13 GB of data is a sparse hole, which a metadata scan never reads."""
    header: dict[str, object] = {}
    offset = 0
    for name, shape in llama_names_and_shapes():
        dtype, size = ("F32", 4) if name.endswith("norm.weight") else ("BF16", 2)
        if name == "model.layers.17.self_attn.v_proj.weight":
            dtype = "F16"
        n = size
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)
    return path


def many_tensors_report(layers: int = 400, per_layer: int = 25) -> Report:
    """A Report of ``layers x per_layer`` TensorRecords (10,000 by default), bf16 with fp32 norms, and a finding."""
    tensors = []
    for n in range(layers):
        for k in range(per_layer):
            dtype = "float32" if k == 0 else "bfloat16"
            tensors.append(TensorRecord(f"model.layers.{n}.block{k}.weight", dtype, (64, 64), 64 * 64 * (4 if k == 0 else 2)))
    finding = Finding("dtype-mismatch", "warning", "expected bfloat16", tensor="model.layers.123.block0.weight")
    inv = Inventory("synthetic-10k.safetensors", "safetensors", tuple(tensors))
    return Report((CheckpointReport(inv.path, inv.format, None, inv, (finding,)),))


def scan_report(*paths: Path, preset: str | None = "fp16-mixed") -> Report:
    policy = load_policy(preset) if preset else None
    return scan([str(p) for p in paths], checks=checks_for(policy), policy_name=preset, jobs=1)


# -- reading the page back ------------------------------------------------------------------------------------------


class Page(HTMLParser):
    """What a browser would build from the page, as far as these tests need it."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict[str, str]]] = []
        self.ids: dict[str, dict[str, str]] = {}
        self.scripts: list[tuple[dict[str, str], str]] = []
        self._in_script = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        d = {k: v or "" for k, v in attrs}
        self.tags.append((tag, d))
        if "id" in d:
            assert d["id"] not in self.ids, f"duplicate id {d['id']}"
            self.ids[d["id"]] = d
        if tag == "script":
            self._in_script = True
            self.scripts.append((d, ""))

    def handle_endtag(self, tag: str) -> None:
        if tag == "script":
            self._in_script = False

    def handle_data(self, data: str) -> None:
        if self._in_script:
            attrs, text = self.scripts[-1]
            self.scripts[-1] = (attrs, text + data)

    @classmethod
    def of(cls, text: str) -> Page:
        page = cls()
        page.feed(text)
        page.close()
        return page

    def cells(self, prefix: str = "") -> list[dict[str, str]]:
        return [a for _, a in self.tags if "data-names" in a and a["id"].startswith(prefix)]

    def single_cells(self, prefix: str = "ck0-") -> dict[str, dict[str, str]]:
        """Cells under ``prefix`` that each show one tensor (folded rows' members, unfolded rows): name -> cell."""
        out: dict[str, dict[str, str]] = {}
        for a in self.cells(prefix):
            names = a["data-names"].split("\n")
            if len(names) == 1:
                assert names[0] not in out, names[0]
                out[names[0]] = a
        return out

    def data(self) -> dict[str, Any]:
        (text,) = [text for attrs, text in self.scripts if attrs.get("id") == "dtypeaudit-data"]
        return json.loads(text)  # type: ignore[no-any-return]


def check_page(text: str, report: Report) -> Page:
    """The invariants every scan page keeps; returns the parsed page for more."""
    page = Page.of(text)
    # every tensor: a single cell of its own on its checkpoint's map, with its dtype's class, and a row of the data
    for n, c in enumerate(report.checkpoints):
        single = page.single_cells(f"ck{n}-")
        assert set(single) == {t.name for t in c.tensors}, {t.name for t in c.tensors} ^ set(single)
        for t in c.tensors:
            assert single[t.name]["data-dtype"] == t.dtype
            assert f"dt-{t.dtype}" in single[t.name]["class"].split()
    rows = page.data()["rows"]
    assert sorted((r[0], r[1]) for r in rows) == sorted((n, t.name) for n, c in enumerate(report.checkpoints) for t in c.tensors)
    # every finding on a tensor links, from its own list item, to a cell that shows that tensor (or one of the module's)
    links = [a for t, a in page.tags if t == "a" and "to-cell" in a.get("class", "")]
    assert all(a["href"] == "#" + a["data-cell"] and a["data-cell"] in page.ids for a in links)
    for n, c in enumerate(report.checkpoints):
        for k, f in enumerate(c.findings):
            item = re.search(rf'<li class="finding sev-{f.severity}" id="ck{n}-f{k}">(.*?)</li>', text)
            assert item, f
            if f.tensor is None or not any(t.name == f.tensor or t.name.startswith(f.tensor + ".") for t in c.tensors):
                assert "to-cell" not in item.group(1)
                continue
            (cell_id,) = re.findall(r'data-cell="([^"]+)"', item.group(1))
            assert cell_id.startswith(f"ck{n}-")
            names = page.ids[cell_id]["data-names"].split("\n")
            assert any(name == f.tensor or name.startswith(f.tensor + ".") for name in names), (f, names)
    # the only scripts are ours: the data and the one whose hash the Content-Security-Policy names
    (csp,) = [a["content"] for t, a in page.tags if t == "meta" and a.get("http-equiv") == "Content-Security-Policy"]
    code = [text for attrs, text in page.scripts if "type" not in attrs]
    assert len(page.scripts) == 2 and len(code) == 1
    digest = base64.b64encode(hashlib.sha256(code[0].encode()).digest()).decode()
    assert f"script-src 'sha256-{digest}'" in csp and "default-src 'none'" in csp
    assert not [a for _, a in page.tags if any(k.startswith("on") for k in a)], "inline event handler"
    return page


def no_network(text: str) -> None:
    """Nothing that would fetch: no URL, no src, no stylesheet link, no CSS import or url()."""
    for needle in ("http://", "https://", "//cdn", "<link", "@import", "url(", " src="):
        assert needle not in text, needle


# -- tests ----------------------------------------------------------------------------------------------------------


def test_cnn_page_lists_every_tensor_and_links_its_finding(tmp_path: Path) -> None:
    path = write_cnn(tmp_path / "cnn.pt")
    report = scan_report(path)
    text = render(report)
    page = check_page(text, report)
    no_network(text)
    (mix,) = [f for f in report.findings if f.rule == "module-dtype-mix"]
    assert mix.tensor == "fc"
    (link,) = [a for t, a in page.tags if t == "a" and a.get("data-cell") and page.ids[a["data-cell"]]["data-names"].startswith("fc.")]
    cell = page.ids[link["data-cell"]]
    assert "mark-error" in cell["class"] and "error" in cell["title"]
    assert {n: a["data-dtype"] for n, a in page.single_cells().items() if n.startswith("fc.")} == {
        "fc.weight": "float16",
        "fc.bias": "float32",
    }
    # no layer numbers in a CNN: one row per module, outside the repeated layers
    assert "Outside the repeated layers: 11 tensors" in text
    assert re.search(r'<th scope="row">bn1</th>', text)


def test_format_html_through_the_cli(tmp_path: Path) -> None:
    path = write_cnn(tmp_path / "cnn.pt")
    out = tmp_path / "report.html"
    proc = run_cli("scan", str(path), "--preset", "fp16-mixed", "--format", "html", "-o", str(out))
    assert proc.returncode == 1, proc.stderr  # the fc finding
    assert proc.stdout == "" and f"report written to {out}" in proc.stderr
    text = out.read_text(encoding="utf-8")
    assert text.startswith("<!DOCTYPE html>")
    report = scan_report(path)
    check_page(text, report)
    assert f"failed</strong>: 1 checkpoint, {len(report.findings)} findings, failing at error" in text
    assert renderer_for(OutputFormat.html) is render


@pytest.mark.slow  # transformers' import and a model build: about 15 s here
def test_gpt2_layers_fold_around_the_odd_one(tmp_path: Path) -> None:
    folder = write_gpt2(tmp_path / "gpt2")
    report = scan_report(folder)
    page = check_page(render(report), report)
    folds = [a for t, a in page.tags if t == "button" and "fold" in a.get("class", "")]
    # layers 0-4 and 6-11 fold; layer 5 (its fp32 attention bias) stands alone and carries the finding
    text = render(report)
    assert "layers 0\u20134</button>" in text and "layers 6\u201311</button>" in text and '<th scope="row">layer 5</th>' in text
    assert len(folds) == 2
    marked = [a for a in page.cells() if "mark-error" in a.get("class", "")]
    assert {n for a in marked for n in a["data-names"].split("\n")} >= {"transformer.h.5.attn.c_attn.bias"}
    # fp32 layer norms, fp16 elsewhere, as the model was saved
    single = page.single_cells()
    assert single["transformer.h.0.ln_1.weight"]["data-dtype"] == "float32"
    assert single["transformer.h.0.attn.c_attn.weight"]["data-dtype"] == "float16"


def test_llama_7b_layout_fits_in_a_few_rows(tmp_path: Path) -> None:
    path = write_llama_7b_header(tmp_path / "model.safetensors")
    report = scan_report(path, preset=None)
    assert len(report.checkpoints[0].tensors) == 291 and report.checkpoints[0].error is None
    text = render(report)
    check_page(text, report)
    # 32 layers in three rows: the 17th's fp16 v_proj splits the fold
    assert "model.layers: 32 layers \u00d7 9 tensors, folded into 3 rows" in text
    assert "layers 0\u201316</button>" in text and '<th scope="row">layer 17</th>' in text and "layers 18\u201331</button>" in text


def test_hostile_names_stay_text(tmp_path: Path) -> None:
    hostile = [
        "<script>alert(1)</script>",
        '"><img src=x onerror=alert(2)>',
        "</script><script>alert(3)</script>",
        "x' onmouseover='alert(4)",
        "a&amp;b<!--",
        "line\u2028sep</SCRIPT >",
        "layers.0.<b>bold</b>.weight",
        "layers.1.<b>bold</b>.weight",
    ]
    folder = tmp_path / 'dir"<i>'
    folder.mkdir()
    path = folder / "h<img src=y>.safetensors"
    save_file({n: torch.zeros(2) for n in hostile}, str(path))
    report = scan_report(path, preset=None)
    assert {t.name for t in report.checkpoints[0].tensors} == set(hostile)
    findings = (Finding("dtype-mismatch", "error", f"{hostile[0]} is float32", tensor=hostile[1]),)
    report = Report((CheckpointReport(report.checkpoints[0].path, "safetensors", None, report.checkpoints[0].inventory, findings),))
    text = render(report)
    page = check_page(text, report)  # every name back, exactly, from the attributes and the JSON
    assert [t for t, _ in page.tags].count("script") == 2
    assert not [t for t, _ in page.tags if t in ("img", "i", "b")]
    for name in hostile:
        if re.search(r'[<>&"]', name):
            assert name not in text, name
    assert page.data()["checkpoints"] == [str(path)]
    assert str(path) not in text


def test_several_checkpoints_in_one_page(tmp_path: Path) -> None:
    write_cnn(tmp_path / "a.pt")
    torch.save(TwoConvNet().state_dict(), tmp_path / "b.pt")
    report = scan_report(tmp_path)
    assert len(report.checkpoints) == 2
    text = render(report)
    page = check_page(text, report)
    data = page.data()
    assert data["multi"] is True and data["checkpoints"] == [c.path for c in report.checkpoints]
    assert sorted({r[0] for r in data["rows"]}) == [0, 1]
    # each checkpoint has its own section and its own cells (same names, different ids)
    assert {"ck0-h", "ck1-h"} <= set(page.ids)
    fc_bias = [a for a in page.cells() if a["data-names"] == "fc.bias"]
    assert sorted(a["data-dtype"] for a in fc_bias) == ["float32", "float32"] and len({a["id"] for a in fc_bias}) == 2
    assert '<button type="button" class="sort" data-key="checkpoint">' in text


def test_unreadable_checkpoint_says_why(tmp_path: Path) -> None:
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint <script>")
    report = scan_report(bad, preset=None)
    text = render(report)
    page = Page.of(text)
    assert "unreadable" in text and report.checkpoints[0].error and page.data()["rows"] == []
    assert len(page.scripts) == 2


def test_diff_page_marks_changed_cells_on_both_sides(tmp_path: Path) -> None:
    torch.manual_seed(0)
    state = TwoConvNet().state_dict()
    state["head.weight"] = state["fc.weight"]  # tied in A
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    torch.save(state, a)
    # B: a DataParallel-style prefix, convs in fp16, one tensor added, one removed, the tie broken
    half = {f"module.{k}": v.half() if k.startswith("conv") else v.clone() for k, v in state.items()}
    half["module.extra.weight"] = torch.zeros(3)
    del half["module.bn1.num_batches_tracked"]
    torch.save(half, b)
    out = tmp_path / "diff.html"
    proc = run_cli("diff", str(a), str(b), "--format", "html", "-o", str(out))
    assert proc.returncode == 1, proc.stderr
    text = out.read_text(encoding="utf-8")
    no_network(text)
    assert text == render_diff(diff(read_checkpoint(str(a)), read_checkpoint(str(b))))
    page = Page.of(text)

    def marks(side: str) -> dict[str, str]:
        return {
            c["data-names"]: next(k[5:] for k in c["class"].split() if k.startswith("mark-"))
            for c in page.cells(f"{side}-")
            if "mark" in c["class"].split()
        }

    convs = ("conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias")
    assert marks("a") == {**dict.fromkeys(convs, "changed"), "bn1.num_batches_tracked": "removed"}
    assert marks("b") == {**{f"module.{n}": "changed" for n in convs}, "module.extra.weight": "added"}
    assert page.single_cells("a-")["conv1.weight"]["data-dtype"] == "float32"
    assert page.single_cells("b-")["module.conv1.weight"]["data-dtype"] == "float16"
    # each change's links land on the cells of its tensor in A and in B
    for n in convs:
        item = re.search(rf'<li class="change change-changed"><span class="sev">changed</span> {re.escape(n)}: (.*?)</li>', text)
        assert item and item.group(1).startswith("float32 \u2192 float16"), n
        cell_a, cell_b = re.findall(r'data-cell="([^"]+)"', item.group(1))
        assert (page.ids[cell_a]["data-names"], page.ids[cell_b]["data-names"]) == (n, f"module.{n}")
    assert '<span class="sev">tie broken</span> fc.weight = head.weight' in text
    assert "1 added, 1 removed, 4 changed (4 dtype), 1 tie broken" in text
    # side by side: two sections, A then B
    assert text.index('id="side-A"') < text.index('id="side-B"') and text.count('class="side"') == 2


class _Work:
    """What a render of a one-checkpoint report does, counted: map cells written (and the records each shows), name
    indexes built, lookups in them."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.cells = self.cell_records = self.indexes = self.lookups = 0
        work = self

        class CountedIndex(dict):  # type: ignore[type-arg]
            def get(self, key: Any, default: Any = None) -> Any:
                work.lookups += 1
                return super().get(key, default)

        real_cell, real_index = html_render._MapWriter._cell, html_render.names_index

        def cell(writer: Any, cell_id: str, records: list[int], **kw: Any) -> str:
            self.cells += 1
            self.cell_records += len(records)
            return real_cell(writer, cell_id, records, **kw)

        def names_index(tensors: Any) -> dict[str, list[int]]:
            self.indexes += 1
            # one report of one checkpoint here: a second index is the regression itself (an index per finding, 10,000
            # of 10,000 names each), so it fails at once rather than after the minutes that would take
            assert self.indexes == 1, "the names were indexed again"
            return CountedIndex(real_index(tensors))

        monkeypatch.setattr(html_render._MapWriter, "_cell", cell)
        monkeypatch.setattr(html_render, "names_index", names_index)


def test_renders_ten_thousand_tensors_in_linear_work(monkeypatch: pytest.MonkeyPatch) -> None:
    report = many_tensors_report()
    work = _Work(monkeypatch)
    text = render(report)
    # 3 folded-row cells per column, and one cell per member of the two folded groups (layers 0-122, 124-399): each
    # record is shown by at most two cells, its row's and its own, so the map's work grows with the tensors, no faster
    assert (work.cells, work.cell_records) == (3 * 25 + (123 + 276) * 25, 10_000 + (123 + 276) * 25)
    assert (work.indexes, work.lookups) == (1, 1)  # one index of names per checkpoint, one lookup per finding
    page = check_page(text, report)
    # 400 layers: the fp32 block0 of layer 123 is marked, so three rows: 0-122, 123, 124-399
    assert "model.layers: 400 layers \u00d7 25 tensors, folded into 3 rows" in text
    assert len(page.data()["rows"]) == 10_000


def _luminance(hex_colour: str) -> float:
    """WCAG 2's relative luminance."""
    channels = [int(hex_colour[i : i + 2], 16) / 255 for i in (1, 3, 5)]
    r, g, b = (c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in channels)
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


@pytest.mark.parametrize(
    "dtype", ["float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "int8", "uint8", "int64", "bool", "complex64"]
)
def test_cell_text_contrast_passes_wcag_aa(dtype: str) -> None:
    background, text = dtype_colours(dtype)
    light, dark = sorted((_luminance(background), _luminance(text)), reverse=True)
    assert (light + 0.05) / (dark + 0.05) >= 4.5


def test_a_finding_on_every_tensor_costs_one_lookup_each(monkeypatch: pytest.MonkeyPatch) -> None:
    """A whole model in the wrong dtype gives a finding per tensor: 10,000 of them, each linked and marked."""
    base = many_tensors_report().checkpoints[0]
    assert base.inventory is not None
    findings = tuple(Finding("dtype-mismatch", "error", "expected float16", tensor=t.name) for t in base.tensors)
    report = Report((CheckpointReport(base.path, base.format, None, base.inventory, findings),))
    work = _Work(monkeypatch)
    text = render(report)
    # a scan of all 10,000 names per finding took minutes: one index, then one lookup per finding
    assert (work.indexes, work.lookups) == (1, 10_000)
    assert text.count('<a class="to-cell"') == 10_000  # (parsing 6 MB back would take longer than the render)
    # every cell marked: the folded row's 25 and the 10,000 members of it
    cells = re.findall(r'<td id="ck0-[^"]*" class="([^"]*)"', text)
    assert len(cells) == 25 + 10_000 and all(c.endswith(" mark mark-error") for c in cells)


def test_colours_and_abbreviations() -> None:
    assert dtype_colours("float32") != dtype_colours("float16") != dtype_colours("bfloat16")
    assert dtype_colours("float8_e4m3fn") == dtype_colours("float8_e5m2")
    assert [dtype_abbrev(d) for d in ("float32", "bfloat16", "float8_e4m3fn", "int64", "uint8", "bool")] == [
        "f32",
        "bf16",
        "f8e4",
        "i64",
        "u8",
        "bool",
    ]
