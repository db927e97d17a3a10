"""The overview of a run with more steps than one page of its tables: every step reachable by
the pages' links and by the step box; the charts keep every step, drawn thinned past their width."""

from __future__ import annotations

import html
import re
from collections.abc import Iterator

import anyio
import pytest

pytest.importorskip("duckdb")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

import asynctrace as at
from asynctrace.view._pages import PAGE_STEPS
from asynctrace.view._svg import line_chart

from . import _archive
from ._html import Page, get

STEPS = 2 * PAGE_STEPS + 37  # three pages, the oldest partly full
EVAL_EVERY = 50


def _samples(step: int, split: str) -> list[at.Sample]:
    return [
        at.Sample(
            messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": f"a{i}"}],
            metadata={
                "prompt_id": "p",
                "group_uid": f"{split}-{step}",
                "reward": float(i),
                "response_len": 1,
            },
        )
        for i in range(2)
    ]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("paging") / "archive"

    async def main() -> None:
        sink = at.ParquetSink(root, process=False)
        async with at.TraceSession("paging", run="r", sinks=[sink], health_metrics=False) as session:
            for step in range(STEPS):
                await session.log_samples(_samples(step, "train"), step=step)
                if step % EVAL_EVERY == 0:
                    await session.log_samples(_samples(step, "eval"), step=step, split="eval")
        assert session.stats().check()

    anyio.run(main)
    with _archive.served(root) as url:
        _archive.ready(url)
        yield url


def _table(page: Page, split: str) -> list[int]:
    """The steps of `split` in the page's tables, in their order."""
    return [
        int(b.attrs["data-step"]) for b in page.blocks if b.tag == "tr" and b.attrs.get("data-split") == split
    ]


def _move(page: Page, name: str) -> str | None:
    """The address of the pager's link `name` (older, newer, first, latest), if shown."""
    found = re.search(rf'<a class="{name}" href="([^"]*)"', page.html)
    return html.unescape(found.group(1)) if found else None


def test_every_step_is_on_one_page_reached_by_older_links(base: str) -> None:
    """From the latest page, "older" links walk every step once, a page at most `PAGE_STEPS` steps."""
    seen: list[int] = []
    address: str | None = "/"
    pages = 0
    while address is not None:
        page = get(base, address)
        assert page.status == 200
        pages += 1
        steps = _table(page, "train")
        assert 0 < len(steps) <= PAGE_STEPS and steps == sorted(steps)
        assert page.values["page"] == str(pages) and page.values["pages"] == "3"
        assert page.values["steps"] == f"{STEPS:,}"  # the header counts the run, not the page
        # eval's steps show on the page of the same steps as train's
        assert _table(page, "eval") == [s for s in steps if s % EVAL_EVERY == 0]
        for step in (steps[0], steps[-1]):
            assert f"/step?split=train&step={step}" in page.links
        seen = steps + seen
        address = _move(page, "older")
    assert seen == list(range(STEPS))
    assert pages == 3
    assert _table(get(base, "/"), "train") == list(range(STEPS - PAGE_STEPS, STEPS))


def test_pager_links_go_where_they_say(base: str) -> None:
    """Page 2 links to page 3 (older), page 1 (newer, latest) and page 3 (first); a step's link answers."""
    page = get(base, "/?page=2")
    assert _move(page, "older") == "/?page=3"
    assert _move(page, "newer") == "/"
    assert _move(page, "latest") == "/"
    assert _move(page, "first") == "/?page=3"
    first = get(base, "/")
    assert _move(first, "newer") is None and _move(first, "latest") is None
    last = get(base, "/?page=3")
    assert _move(last, "older") is None and _move(last, "first") is None
    assert _table(last, "train") == list(range(STEPS - 2 * PAGE_STEPS))
    step = _table(page, "train")[0]
    assert get(base, f"/step?split=train&step={step}").status == 200


@pytest.mark.parametrize(
    ("step", "holding"),
    [(0, 0), (STEPS - PAGE_STEPS - 1, STEPS - PAGE_STEPS - 1), (STEPS - 1, STEPS - 1), (10**12, STEPS - 1)],
)
def test_the_step_box_opens_the_page_of_that_step(base: str, step: int, holding: int) -> None:
    """`/?step=N` shows the page holding step N (the latest page for a step after the last)."""
    page = get(base, f"/?step={step}")
    assert page.status == 200
    assert holding in _table(page, "train")
    assert '<form class="jump" action="/" method="get"><input name="step"' in page.html


def test_pages_out_of_range_are_refused(base: str) -> None:
    """A page past the last is not found; page 0 or a word is a bad request."""
    assert get(base, "/?page=4").status == 404
    assert get(base, "/?page=0").status == 400
    assert get(base, "/?step=x").status == 400


def test_charts_link_every_step(base: str) -> None:
    """Below the chart's width in points, each chart links every step, whichever the table's page."""
    page = get(base, "/?page=3")
    linked = {int(m) for m in re.findall(r'href="/step\?split=train&amp;step=(\d+)"><circle', page.html)}
    assert linked == set(range(STEPS))


def test_a_long_series_is_thinned_to_its_lows_and_highs() -> None:
    """Past one point a pixel, a chart draws fewer marks, each a real point, spikes kept."""
    values: list[tuple[int, float | None]] = [(x, float(x % 7)) for x in range(20_000)]
    values[12_345] = (12_345, 1000.0)
    values[777] = (777, -1000.0)
    svg = line_chart([("mean", values)], title="t", link=lambda x: f"/step?step={x}")
    marks = re.findall(r"<title>mean at step (\d+): ([^<]*)</title>", svg)
    assert 0 < len(marks) <= 250 * 2 + 2  # a low and a high a column (2 of 500 pixels), the ends
    assert ("12345", "1000") in marks and ("777", "-1000") in marks
    assert all(float(y) == (values[int(x)][1]) for x, y in marks)
    shown = [int(x) for x, _ in marks]
    assert shown == sorted(shown) and shown[0] == 0 and shown[-1] == 19_999
