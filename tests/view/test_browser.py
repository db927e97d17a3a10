"""`asynctrace view` in a real browser: the system's Chromium, driven by Playwright, clicks from the
overview to a step, a group, the prompt's history and a completion's tokens."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("duckdb")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from . import _archive

# The browser the project uses (scripts/screenshots.py): Debian's chromium package, never a download.
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def _playwright() -> Any:
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(
            f"no Chromium at {CHROMIUM}: install it (Debian: apt-get install -y chromium) to run this test"
        )
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip('Playwright is not installed: pip install -e ".[dev]"')
    return sync_playwright


@pytest.fixture(scope="module")
def browser_page(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, str]]:
    sync_playwright = _playwright()
    parquet, _ = _archive.write(tmp_path_factory.mktemp("browser"))
    with (
        _archive.served(parquet, watch=("p-alpha",)) as base,
        tempfile.TemporaryDirectory(prefix="asynctrace-chromium-") as profile,
        sync_playwright() as pw,
    ):
        context = pw.chromium.launch_persistent_context(
            profile,
            executable_path=CHROMIUM,
            args=ARGS,
            headless=True,
            viewport={"width": 1280, "height": 900},
        )
        # Offline: any request that leaves the viewer's own address fails the test below.
        outside: list[str] = []
        context.on("request", lambda r: None if r.url.startswith(base) else outside.append(r.url))
        try:
            page = context.new_page()
            page.set_default_timeout(10_000)
            yield page, base
            assert outside == []
        finally:
            context.close()


def test_click_from_overview_to_tokens(browser_page: tuple[Any, str]) -> None:
    """Overview → step → group → prompt history → tokens, each page showing what it should."""
    page, base = browser_page
    page.goto(base + "/")
    page.wait_for_selector("table.steps")
    assert page.locator("table.steps tbody tr").count() == _archive.STEPS + 2
    assert page.locator("svg.chart").count() == 8  # four charts per split
    assert page.locator("ul.watched a", has_text="p-alpha").count() == 1

    page.click('tr[data-split="train"][data-step="4"] td[data-k="step"] a')
    page.wait_for_selector("table.groups")
    assert page.url == base + "/step?split=train&step=4"
    assert page.locator("table.groups tr[data-group]").count() == len(_archive.PROMPTS)
    flat = page.locator(f'tr[data-group="train-4-{_archive.FLAT}"]')
    assert "zero spread" in flat.inner_text()

    page.click(f'tr[data-group="train-4-{_archive.TOKENS}"] td[data-k="group"] a')
    page.wait_for_selector("article.completion")
    assert page.locator("article.completion").count() == _archive.GROUP
    assert page.locator("article.completion.truncated").count() == 1
    assert page.locator("div.members").bounding_box()["width"] > 600  # side by side, not stacked

    page.click("a.history")
    page.wait_for_selector("table.history")
    assert page.locator("h1").inner_text() == f"Prompt {_archive.TOKENS} (train)"
    assert page.locator("table.history tr[data-step]").count() == _archive.STEPS
    assert page.locator("section.diff").count() == _archive.STEPS - 1
    assert page.locator("section.diff ins").count() > 0

    page.locator("a.tokens-link").first.click()
    page.wait_for_selector("div.tk")
    spans = page.locator("div.tk span.t").count()
    assert spans > 0 and page.locator('dd[data-k="tokens"]').inner_text() == str(spans)
    page.locator("p.signals a", has_text="advantages").click()  # coloured by another signal
    page.locator("p.signals a.on", has_text="advantages").wait_for()
    assert page.locator("div.tk span.t").count() == spans


def test_find_by_id_and_text(browser_page: tuple[Any, str]) -> None:
    """The header's find box opens a record by its id; a text search lists matching records."""
    page, base = browser_page
    page.goto(base + "/step?split=train&step=2")
    page.click(f'tr[data-group="train-2-{_archive.FLAT}"] td[data-k="group"] a')
    record_id = page.locator("article.completion").first.get_attribute("data-id")
    page.fill('header input[name="id"]', record_id)
    page.press('header input[name="id"]', "Enter")
    page.wait_for_selector("table.meta")
    assert page.locator("h1").inner_text() == f"Record {record_id}"
    page.goto(base + "/find")
    page.fill('form.search input[name="q"]', "at length")
    page.click("form.search button")
    page.wait_for_selector("table.found")
    assert page.locator("table.found tr[data-id]").count() == _archive.STEPS * _archive.GROUP
