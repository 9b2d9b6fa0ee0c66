"""The HTML report in a real browser: headless Chromium (Debian's ``chromium`` and ``chromium-driver``) via Selenium.

Pages for a small CNN, a transformers GPT-2, a Llama-2-7B layout (its real 291 names and shapes) and 10,000
tensors. Each page must load with no console error; every tensor of the report must be in the DOM (its map cell
and its row, paging through the table); every finding must link to a cell that shows its tensor; every cell's
computed colour must be its dtype's; sorting, search and folding must work from the keyboard too; and axe-core
(shipped by the axe-selenium-python package) must find no accessibility violation. Screenshots go to
``$DTYPEAUDIT_ARTIFACTS`` (default tests/artifacts/).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dtypeaudit.diff import diff
from dtypeaudit.formats import read_checkpoint
from dtypeaudit.inventory import Report
from dtypeaudit.render.html import dtype_colours, render, render_diff

from .models import TwoConvNet
from .test_render_html import many_tensors_report, scan_report, write_cnn, write_gpt2, write_llama_7b_header

CHROMIUM = os.environ.get("DTYPEAUDIT_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("DTYPEAUDIT_CHROMEDRIVER", "/usr/bin/chromedriver")
ARTIFACTS = Path(os.environ.get("DTYPEAUDIT_ARTIFACTS", Path(__file__).parent / "artifacts"))

pytestmark = pytest.mark.skipif(
    not (shutil.which(CHROMIUM) and shutil.which(CHROMEDRIVER)),
    reason=f"Chromium is not installed ({CHROMIUM} and {CHROMEDRIVER}; on Debian: apt-get install chromium chromium-driver)",
)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def load(driver: Any, text: str, path: Path) -> list[dict[str, Any]]:
    """Open the page from a file, as a user opens a saved report; returns the console's messages."""
    path.write_text(text, encoding="utf-8")
    driver.get_log("browser")  # drop what an earlier page said
    driver.set_window_size(1400, 1000)
    driver.get(path.as_uri())
    return list(driver.get_log("browser"))


def screenshot(driver: Any, name: str, *, full: bool = True) -> Path:
    """The page from its top into the artifacts directory: whole (up to 6000 px tall), or one 1400x1000 screen."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    driver.execute_script(
        "location.hash = ''; document.querySelectorAll('.flash').forEach(function (e) { e.classList.remove('flash'); });"
        "window.scrollTo(0, 0);"
    )
    height = driver.execute_script("return document.documentElement.scrollHeight") if full else 1000
    driver.set_window_size(1400, min(max(height, 600), 6000))
    out = ARTIFACTS / f"{name}.png"
    driver.save_screenshot(str(out))
    driver.set_window_size(1400, 1000)
    return out


def rgb(hex_colour: str) -> str:
    r, g, b = (int(hex_colour[i : i + 2], 16) for i in (1, 3, 5))
    return f"rgb({r}, {g}, {b})"


CELLS_JS = """
return Array.from(document.querySelectorAll('[data-names]')).map(function (c) {
  var s = getComputedStyle(c);
  return {id: c.id, names: c.getAttribute('data-names').split('\\n'), dtype: c.getAttribute('data-dtype'),
          bg: s.backgroundColor, fg: s.color};
});
"""

TABLE_JS = """
var next = document.getElementById('next'), rows = [], pages = 0;
for (;;) {
  pages++;
  document.querySelectorAll('#tensors tbody tr').forEach(function (r) { rows.push(r.getAttribute('data-name')); });
  if (next.disabled) break;
  next.click();
}
while (!document.getElementById('prev').disabled) document.getElementById('prev').click();
return [rows, pages];
"""


def check_report_page(driver: Any, report: Report, console: list[dict[str, Any]]) -> None:
    """The contract every scan page keeps in the browser."""
    assert [m for m in console if m["level"] in ("SEVERE", "WARNING")] == []
    cells = driver.execute_script(CELLS_JS)
    # colours follow dtypes, on every cell, folded or not
    for c in cells:
        background, text = dtype_colours(c["dtype"])
        assert (c["bg"], c["fg"]) == (rgb(background), rgb(text)), c
    # every tensor: a single cell of its checkpoint's map, and a row of the table (paging through it)
    for n, ck in enumerate(report.checkpoints):
        single = sorted(c["names"][0] for c in cells if c["id"].startswith(f"ck{n}-") and len(c["names"]) == 1)
        assert single == sorted(t.name for t in ck.tensors)
    rows, pages = driver.execute_script(TABLE_JS)
    assert sorted(rows) == sorted(t.name for ck in report.checkpoints for t in ck.tensors)
    assert pages == max(1, -(-len(rows) // 100))
    # every finding on a tensor links to a visible cell that shows it; following the link lands there
    by_id = {c["id"]: c for c in cells}
    for n, ck in enumerate(report.checkpoints):
        for k, f in enumerate(ck.findings):
            targets = {t.name for t in ck.tensors if f.tensor and (t.name == f.tensor or t.name.startswith(f.tensor + "."))}
            links = driver.find_elements("css selector", f"#ck{n}-f{k} a.to-cell")
            if not targets:
                assert links == []
                continue
            (link,) = links
            cell_id = link.get_attribute("data-cell")
            assert targets & set(by_id[cell_id]["names"]), (f, by_id[cell_id])
            link.click()
            assert driver.execute_script("return location.hash") == f"#{cell_id}"
            target = driver.find_element("css selector", ":target")
            assert target.get_attribute("id") == cell_id and target.is_displayed()
            assert "mark" in target.get_attribute("class").split()


def check_accessibility(driver: Any) -> None:
    """axe-core's rules (contrast, labels, landmarks, table headers, ARIA ...) find nothing."""
    from axe_selenium_python import Axe

    axe = Axe(driver)
    axe.inject()
    results = axe.run()
    violations = [(v["id"], v["help"], [n["target"] for n in v["nodes"]][:5]) for v in results["violations"]]
    assert violations == []
    assert len(results["passes"]) > 10  # it really ran


# -- pages ----------------------------------------------------------------------------------------------------------


def test_cnn_page(browser: Any, tmp_path: Path) -> None:
    report = scan_report(write_cnn(tmp_path / "cnn.pt"))
    assert "module-dtype-mix" in [f.rule for f in report.findings if f.severity == "error"]
    console = load(browser, render(report), tmp_path / "cnn.html")
    check_report_page(browser, report, console)
    check_accessibility(browser)
    screenshot(browser, "html-report-cnn")


# The issue asks CI to load the CNN, GPT-2 and Llama-shaped pages in a browser: these run by default.
def test_gpt2_page(browser: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from selenium.webdriver.common.keys import Keys

    monkeypatch.chdir(tmp_path)  # the page names the checkpoint as the user typed it: gpt2
    write_gpt2(tmp_path / "gpt2")
    report = scan_report(Path("gpt2"))
    console = load(browser, render(report), tmp_path / "gpt2.html")
    check_report_page(browser, report, console)
    check_accessibility(browser)
    screenshot(browser, "html-report-gpt2", full=False)  # docs/images/html-report-gpt2.png is this one
    # folded layers open from the keyboard
    fold = browser.find_element("css selector", "button.fold")
    group = fold.get_attribute("data-group")
    members = browser.find_elements("css selector", f'tr.member[data-group="{group}"]')
    assert fold.text.startswith("layers 0") and len(members) == 5 and not any(m.is_displayed() for m in members)
    fold.send_keys(Keys.ENTER)
    assert fold.get_attribute("aria-expanded") == "true" and all(m.is_displayed() for m in members)
    fold.send_keys(Keys.SPACE)
    assert not any(m.is_displayed() for m in members)
    # search: the rows are exactly the matching tensors, and the status says how many
    search = browser.find_element("id", "search")
    search.send_keys("c_attn")
    expected = sorted(t.name for t in report.checkpoints[0].tensors if "c_attn" in t.name)
    shown = [r.get_attribute("data-name") for r in browser.find_elements("css selector", "#tensors tbody tr")]
    assert sorted(shown) == expected and len(expected) == 24
    assert browser.find_element("id", "status").text.startswith(f"tensors 1\u2013{len(expected)} of {len(expected)} matching")
    # sort by bytes, ascending then descending
    search.send_keys(Keys.CONTROL, "a", Keys.DELETE)
    sort = browser.find_element("css selector", 'button.sort[data-key="bytes"]')
    sort.click()
    sizes = [int(c.text) for c in browser.find_elements("css selector", "#tensors tbody td.num")]
    smallest = sorted(t.nbytes for t in report.checkpoints[0].tensors)[:100]
    assert sizes == smallest
    sort.click()
    sizes = [int(c.text) for c in browser.find_elements("css selector", "#tensors tbody td.num")]
    assert sizes == sorted((t.nbytes for t in report.checkpoints[0].tensors), reverse=True)[:100]
    assert sort.find_element("xpath", "..").get_attribute("aria-sort") == "descending"


def test_llama_7b_page_fits_one_screen(browser: Any, tmp_path: Path) -> None:
    report = scan_report(write_llama_7b_header(tmp_path / "model.safetensors"), preset=None)
    console = load(browser, render(report), tmp_path / "llama.html")
    check_report_page(browser, report, console)
    check_accessibility(browser)
    screenshot(browser, "html-report-llama-7b")
    # 32 layers in three rows: the whole grid is shorter than one 1000-pixel screen
    grid = browser.find_element("css selector", "table.map:not(.loose)")
    assert grid.size["height"] < 400, grid.size
    assert len(grid.find_elements("css selector", "tbody tr.group")) == 3


@pytest.mark.slow  # paging through 100 pages of the table
def test_ten_thousand_tensors_stay_responsive(browser: Any, tmp_path: Path) -> None:
    report = many_tensors_report()
    console = load(browser, render(report), tmp_path / "10k.html")
    loaded_ms = browser.execute_script("var t = performance.timing; return t.loadEventEnd - t.navigationStart")
    assert loaded_ms < 5000, loaded_ms
    check_report_page(browser, report, console)
    timings = browser.execute_script(
        """
        document.querySelector('button.sort[data-key="name"]').click();
        var second = Array.from(document.querySelectorAll('#tensors tbody tr')).slice(24, 27)
          .map(function (r) { return r.getAttribute('data-name'); });
        var search = document.getElementById('search'), t0 = performance.now();
        search.value = 'block7.'; search.dispatchEvent(new Event('input'));
        var t1 = performance.now(), matched = document.getElementById('status').textContent;
        search.value = ''; search.dispatchEvent(new Event('input'));
        var t2 = performance.now();
        document.querySelector('button.sort[data-key="name"]').click();
        var t3 = performance.now(), first = document.querySelector('#tensors tbody tr').getAttribute('data-name');
        return {search: t1 - t0, clear: t2 - t1, sort: t3 - t2, matched: matched, first: first, second: second};
        """
    )
    assert timings["matched"].startswith("tensors 1\u2013100 of 400 matching (10000 in all)"), timings
    # names sort in natural order, layer 2 before layer 10, and the second click reverses
    assert timings["second"] == ["model.layers.0.block24.weight", "model.layers.1.block0.weight", "model.layers.1.block1.weight"]
    assert timings["first"] == "model.layers.399.block24.weight"
    assert max(timings["search"], timings["clear"], timings["sort"]) < 500, timings
    screenshot(browser, "html-report-10k")


def test_two_checkpoints_and_a_diff(browser: Any, tmp_path: Path) -> None:
    import torch

    write_cnn(tmp_path / "a.pt")
    torch.manual_seed(1)
    torch.save(TwoConvNet().state_dict(), tmp_path / "b.pt")
    report = scan_report(tmp_path)
    console = load(browser, render(report), tmp_path / "two.html")
    check_report_page(browser, report, console)
    check_accessibility(browser)
    # the diff: both maps side by side, each change linked to its marked cells
    d = diff(read_checkpoint(str(tmp_path / "b.pt")), read_checkpoint(str(tmp_path / "a.pt")))
    console = load(browser, render_diff(d), tmp_path / "diff.html")
    assert [m for m in console if m["level"] in ("SEVERE", "WARNING")] == []
    check_accessibility(browser)
    sides = browser.find_elements("css selector", "section.side")
    assert len(sides) == 2 and sides[0].location["y"] == sides[1].location["y"] and sides[0].location["x"] < sides[1].location["x"]
    links = browser.find_elements("css selector", "li.change a.to-cell")
    assert len(links) == 2 * len(d.changed) and d.changed
    for link in links:
        link.click()
        target = browser.find_element("css selector", ":target")
        assert "mark-changed" in target.get_attribute("class").split() and target.is_displayed()
    screenshot(browser, "html-diff-cnn")
