"""The report in a real headless browser (Debian's chromium, driven by playwright): it
loads offline with no error, asks for nothing over the network, and draws every chart."""

import gzip
import shutil
from pathlib import Path

import pytest

from autopar.core.plan import Plan
from autopar.report import write_report

pytestmark = pytest.mark.pinned_torch_only

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
if CHROMIUM is None:
    pytest.skip("no chromium on this machine (apt-get install chromium)", allow_module_level=True)

GOLDEN = Path(__file__).resolve().parent.parent / "golden"


def test_report_renders_in_a_browser_offline_with_every_chart(tmp_path):
    plan = Plan.from_json(gzip.open(GOLDEN / "gpt-4-h100-mem0.25-nofold.json.gz").read().decode())
    page_path = tmp_path / "report.html"
    write_report(plan, page_path)
    errors: list[str] = []
    requests: list[str] = []
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1440, "height": 900})
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("request", lambda r: requests.append(r.url))
            page.goto(page_path.as_uri())
            page.wait_for_load_state("load")
            assert page.title().startswith("autopar plan")
            for section in ("summary", "placements", "cost", "timeline", "memory", "solver",
                            "warnings"):  # fmt: skip
                assert page.locator(f"section#{section}").is_visible(), section
            counts = page.evaluate(
                """() => ({
                    cost: document.querySelectorAll('#cost-chart rect').length,
                    emitted: document.querySelectorAll('#timeline-emitted rect.span').length,
                    overlapped: document.querySelectorAll('#timeline-overlapped rect.span').length,
                    areas: document.querySelectorAll('#memory-chart polygon.area').length,
                    budget: document.querySelectorAll('#budget-line').length,
                    rows: document.querySelectorAll('#placements tbody tr').length,
                })"""
            )
            assert counts["cost"] >= 3 and counts["emitted"] > 2 and counts["overlapped"] > 2
            assert counts["areas"] >= 3 and counts["budget"] == 1 and counts["rows"] > 5
            for chart in ("#cost-chart", "#timeline-emitted", "#memory-chart"):
                box = page.locator(chart).bounding_box()
                assert box is not None and box["width"] > 500 and box["height"] > 50, chart
            # a bar's tooltip names what it holds
            title = page.locator("#timeline-emitted rect.span title").first.text_content()
            assert title and " ms from " in title
            shot = tmp_path / "report.png"
            page.screenshot(path=str(shot), full_page=True)
            assert shot.stat().st_size > 20_000
        finally:
            browser.close()
    assert not errors, errors
    assert requests == [page_path.as_uri()], requests  # the page itself, nothing else
