"""`asynctrace view` in Chromium over archives full of XSS payloads and agentic groups of 16: no script
runs and nothing is refused by the Content-Security-Policy on any page, no request fails (the
favicon included), and a group of 16 is on one screen at 1400 pixels."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest

pytest.importorskip("duckdb")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from . import _agentic, _archive, _hostile
from .test_browser import ARGS, CHROMIUM, _playwright

# Elements and attributes a payload would have made: none may exist in a page's live DOM.
_ACTIVE = """() => [...document.querySelectorAll('*')].flatMap(e =>
    ['SCRIPT', 'IMG', 'IFRAME', 'OBJECT', 'EMBED'].includes(e.tagName) ? [e.tagName]
    : [...e.attributes].filter(a => a.name.startsWith('on') || a.name === 'style')
        .map(a => e.tagName + '@' + a.name))"""


@dataclass
class Watched:
    """What the browser reported while a test ran: dialogs (a payload's alert), console errors
    (a CSP refusal, a failed load) and uncaught page errors, failed responses."""

    dialogs: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)

    def clear(self) -> None:
        self.dialogs.clear()
        self.errors.clear()
        self.failed.clear()


@pytest.fixture(scope="module")
def browser(
    hostile_archive: Path, agentic_archive: tuple[Path, Path]
) -> Iterator[tuple[Any, Watched, str, str]]:
    """One Chromium, 1400 px wide, and the viewer over the hostile and the agentic archive."""
    sync_playwright = _playwright()
    hostile, agentic = hostile_archive, agentic_archive[0]
    watched = Watched()
    with (
        _archive.served(hostile, watch=_hostile.WATCH) as bad,
        _archive.served(agentic) as good,
        tempfile.TemporaryDirectory(prefix="asynctrace-chromium-") as profile,
        sync_playwright() as pw,
    ):
        context = pw.chromium.launch_persistent_context(
            profile,
            executable_path=CHROMIUM,
            args=ARGS,
            headless=True,
            viewport={"width": 1400, "height": 900},
        )
        try:
            page = context.new_page()
            page.set_default_timeout(10_000)
            page.on("dialog", lambda d: (watched.dialogs.append(d.message), d.dismiss()))
            page.on("console", lambda m: watched.errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: watched.errors.append(str(e)))
            page.on(
                "response",
                lambda r: watched.failed.append(f"{r.status} {r.url}") if r.status >= 400 else None,
            )
            yield page, watched, bad, good
        finally:
            context.close()


def test_no_script_runs_on_any_page_of_a_hostile_archive(browser: tuple[Any, Watched, str, str]) -> None:
    """Every kind of page over payloads in every field: no alert, no CSP refusal or error in the
    console, no script, image or event handler in the live page, no failed request."""
    page, watched, base, _ = browser
    watched.clear()
    start = ["/", "/record?" + urlencode({"id": f"{_hostile.payload('id')}0"}), "/find?q=hostile+role"]
    todo, kinds = list(start), {p.split("?")[0] for p in start}
    for path in todo:  # the first page of each kind (path) reached, in order
        page.goto(base + path)
        page.wait_for_load_state("load")
        for link in page.locator("a[href]").all():  # hovering reaches any handler an attribute got
            if link.is_visible():
                link.hover()
                break
        assert page.evaluate(_ACTIVE) == [], path
        for href in page.eval_on_selector_all("a[href]", "els => els.map(e => e.getAttribute('href'))"):
            if href.startswith("/") and href.split("?")[0] not in kinds:
                kinds.add(href.split("?")[0])
                todo.append(href)
    assert kinds >= {"/", "/step", "/group", "/prompt", "/record", "/tokens", "/find"}
    assert (watched.dialogs, watched.errors, watched.failed) == ([], [], [])


def test_a_group_of_16_is_on_one_screen_at_1400_pixels(browser: tuple[Any, Watched, str, str]) -> None:
    """All 16 members in the strip on the first screen, no horizontal scrolling, and a click on the
    worst member brings its card into view."""
    page, watched, _, base = browser
    watched.clear()
    page.goto(base + "/group?" + urlencode({"split": "train", "step": 2, "group": "w2-tools"}))
    members = page.locator("svg.members a.member")
    assert members.count() == _agentic.MEMBERS
    for i in range(_agentic.MEMBERS):
        box = members.nth(i).bounding_box()
        assert box is not None and box["x"] >= 0 and box["x"] + box["width"] <= 1400, i
        assert box["y"] + box["height"] <= 900, i
    assert page.evaluate("document.documentElement.scrollWidth") <= 1400
    cards = page.locator("article.completion")
    assert cards.count() == _agentic.MEMBERS
    assert all(
        cards.nth(i).bounding_box()["x"] + cards.nth(i).bounding_box()["width"] <= 1400 for i in range(16)
    )
    members.nth(_agentic.MEMBERS - 1).click()
    assert page.url.endswith("#m15")
    card = page.locator("#m15").bounding_box()
    assert card is not None and 0 <= card["y"] < 900
    assert "truncated" in (page.locator("#m15").get_attribute("class") or "")
    assert (watched.dialogs, watched.errors, watched.failed) == ([], [], [])
