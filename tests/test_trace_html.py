"""``trace --format html`` shows the trace (issue 29, item 9): every module, every operation and the activation bytes,
in scan's page, checked against the JSON report of the same trace (the contract), on real traces of small models."""

from __future__ import annotations

import json
import re
import shutil
from html import unescape
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from dtypeaudit.render import OutputFormat
from dtypeaudit.render.humanize import human_bytes
from dtypeaudit.render.trace import renderer_for
from dtypeaudit.trace import trace, trace_module

from . import trace_zoo as zoo
from .helpers import run_cli
from .test_html_browser import CHROMEDRIVER, CHROMIUM, browser, check_accessibility, load  # noqa: F401 (browser: scan's page fixture)

ZOO = str(Path(__file__).with_name("trace_zoo.py"))


def _rows(page: str, region: str) -> list[tuple[str, list[str]]]:
    """The (row class, cell texts) of the table in the region the heading ``region`` labels."""
    m = re.search(rf'aria-labelledby="{region}"><table[^>]*>.*?<tbody>(.*?)</tbody></table>', page, re.S)
    assert m, f"no table for {region}"
    rows = re.findall(r'<tr(?: class="([^"]*)")?>(.*?)</tr>', m.group(1), re.S)
    return [(cls, [unescape(c) for c in re.findall(r"<td[^>]*>(.*?)</td>", body, re.S)]) for cls, body in rows]


def _dtypes(items: list[str]) -> str:
    return ", ".join(items) if items else "-"


def _check_against_json(report: Any) -> str:
    page = renderer_for(OutputFormat.html)(report)
    doc = json.loads(renderer_for(OutputFormat.json)(report))
    (c,) = doc["checkpoints"]
    t = c["trace"]
    # every module, its dtypes and activation bytes, and the findings on it
    findings: dict[str, list[str]] = {}
    for f in c["findings"]:
        if f["tensor"]:
            findings.setdefault(f["tensor"], []).append(f"{f['severity']}: {f['rule']}")
    want = [
        [
            m["module"] or "(root)",
            m["type"],
            str(m["calls"]),
            _dtypes(m["inputs"]),
            _dtypes(m["compute"]),
            _dtypes(m["outputs"]),
            ", ".join(f"{human_bytes(b)} {d}" for d, b in m["activation_bytes"].items()) or "-",
            "; ".join(findings.get(m["module"] or "(root)", [])),
        ]
        for m in t["modules"]
    ]
    assert [cells for _, cells in _rows(page, "ck0-mh")] == want
    # every operation, in order, with its dtypes and bytes; the failing ones marked and saying so
    ops = _rows(page, "ck0-oh")
    assert len(ops) == t["ops_total"] == len(t["ops"])
    for (cls, cells), o in zip(ops, t["ops"], strict=True):
        name = ".".join(o["op"].split(".")[:2])
        shown = [str(o["index"]), o["phase"], o["module"] or "(root)", name, _dtypes(o["inputs"]), _dtypes(o["outputs"])]
        assert cells[:7] == [*shown, f"{o['nbytes']:,}"]
        assert (cls == "sev-error") == ("error" in o) == cells[7].startswith("FAILS: ")
    # activations by dtype: each figure, exact and in human units
    total = sum(a["nbytes"] for a in t["activations"])
    assert total > 0 and f"Activations by dtype ({human_bytes(total)})" in page
    for a in t["activations"]:
        assert f"{a['dtype']}: {human_bytes(a['nbytes'])} ({a['nbytes']:,} bytes, {a['share']:.1%})</li>" in page
    # scan's page around it: the parameters' map and findings
    assert "<h1>dtypeaudit trace</h1>" in page and "<h3>Dtype map</h3>" in page
    for f in c["findings"]:
        assert f"<code>{f['rule']}</code>" in page
    return page


def test_html_of_a_failing_cnn_trace_with_backward() -> None:
    report = trace(f"{ZOO}:cnn_fp32_bias", inputs=["2x3x8x8:float16"], backward=True)
    page = _check_against_json(report)
    assert "backward" in {cells[1] for _, cells in _rows(page, "ck0-oh")}
    assert any(cells[0] == "fc" and "error: runtime-dtype-error" in cells[7] for _, cells in _rows(page, "ck0-mh"))


def test_html_of_a_transformer_trace_lists_each_layer() -> None:
    report = trace_module(zoo.transformer("bf16-embedding"), inputs=["2x8:int64"])
    page = _check_against_json(report)
    modules = [cells[0] for _, cells in _rows(page, "ck0-mh")]
    assert {"blocks.0", "blocks.1"} <= set(modules)  # listed one by one, not folded


def test_the_command_writes_it(tmp_path: Path) -> None:
    out = tmp_path / "trace.html"
    proc = run_cli("trace", f"{ZOO}:cnn_fp32_bias", "--input", "2x3x8x8:float16", "-f", "html", "-o", str(out))
    assert proc.returncode == 1, proc.stderr
    page = out.read_text()
    assert 'aria-labelledby="ck0-oh"' in page and "aten.addmm" in page


# -- in a browser: axe finds nothing, as on scan's pages -----------------------------------------------------------------


@pytest.mark.skipif(not (shutil.which(CHROMIUM) and shutil.which(CHROMEDRIVER)), reason="Chromium is not installed")
def test_trace_page_in_a_browser(browser: Any, tmp_path: Path) -> None:  # noqa: F811 (the fixture)
    report = trace(f"{ZOO}:cnn_fp32_bias", inputs=["2x3x8x8:float16"], backward=True)
    console = load(browser, renderer_for(OutputFormat.html)(report), tmp_path / "trace.html")
    assert [m for m in console if m["level"] in ("SEVERE", "WARNING")] == []
    assert browser.find_element("css selector", '[aria-labelledby="ck0-oh"] tbody tr').is_displayed()
    check_accessibility(browser)
