"""A group on one screen: every member's reward, advantage, length and stop reason in one strip at the
top, each linking to its card; a step's page filters its groups and moves to the next step; a
prompt's history links every group of the prompt at every step."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlencode

import pytest

duckdb = pytest.importorskip("duckdb")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from . import _agentic, _archive  # noqa: E402
from ._html import get  # noqa: E402
from ._tree import parse  # noqa: E402


@pytest.fixture(scope="module")
def archive(agentic_archive: tuple[Path, Path]) -> tuple[Path, Path]:
    return agentic_archive


@pytest.fixture(scope="module")
def base(archive: tuple[Path, Path]) -> Iterator[str]:
    with _archive.served(archive[0]) as url:
        yield url


def test_prompt_history_links_every_group_at_every_step(base: str) -> None:
    """A prompt sampled in two groups at one step links both (and each answers)."""
    page = get(base, "/prompt?" + urlencode({"id": _agentic.TWICE, "split": "train"}))
    assert page.status == 200
    groups = {
        (s, g)
        for s, g in ((3, "w3-g6"), (5, "w5-g6"), (5, "w7-g6"))
        if "/group?" + urlencode({"split": "train", "step": s, "group": g}) in page.links
    }
    assert groups == {(3, "w3-g6"), (5, "w5-g6"), (5, "w7-g6")}
    rows = parse(page.html).all("tr", data_step="5")
    assert [a.text() for a in rows[0].all("a", "group")] == ["w5-g6", "w7-g6"]
    for link in (link for link in page.links if link.startswith("/group")):
        assert get(base, link).status == 200, link


def test_group_strip_shows_every_member_at_a_glance(base: str, archive: tuple[Path, Path]) -> None:
    """One column per member, best reward first, each linking to its card and telling its reward,
    advantage, length and stop reason; losers drawn as plainly as winners, truncation marked."""
    expected = duckdb.execute(
        f"""SELECT id, reward, advantage, json_extract(metadata, '$.response_len')::INT, stop_reason
            FROM '{archive[0]}/*.parquet' WHERE json_extract_string(metadata, '$.group_uid') = 'w2-tools'
            ORDER BY reward DESC, id"""
    ).fetchall()
    page = get(base, "/group?" + urlencode({"split": "train", "step": 2, "group": "w2-tools"}))
    root = parse(page.html)
    strip = root.one("svg", "members")
    members = strip.all("a", "member")
    assert len(members) == len(expected) == _agentic.MEMBERS
    cards = root.all("article", "completion")
    assert [c.attrs["data-id"] for c in cards] == [r[0] for r in expected]
    for i, (member, card, (record, reward, advantage, length, stop)) in enumerate(
        zip(members, cards, expected, strict=True)
    ):
        assert member.attrs["href"] == f"#{card.attrs['id']}"
        tip = member.one("title").text()
        numbers = f"reward {reward:.4g}, advantage {advantage:.4g}, length {length}, stop reason {stop}"
        assert tip == f"{record}: {numbers}"
        bar = next(r for r in member.all("rect") if "fill" in r.attrs)
        assert bar.attrs["fill"] == ("#16a34a" if advantage > 0 else "#dc2626"), i
        assert ("stroke" in bar.attrs) == (stop == "length")
        assert ("truncated" in card.classes) == (stop == "length")
        assert ("loss" if advantage < 0 else "gain") in card.classes
    assert root.one(None, data_k="truncated").text() == "1"


def test_step_filters_keep_the_groups_they_name(base: str) -> None:
    """Zero spread, truncated, advantage above or below zero, tool calls: each keeps exactly its
    groups, together they combine, the counts say how many of how many; a bad sign is a 400."""

    def shown(**query: str) -> list[str]:
        page = get(base, "/step?" + urlencode({"split": "train", "step": 5, **query}))
        assert page.status == 200, query
        return sorted(b.attrs["data-group"] for b in page.blocks if "data-group" in b.attrs)

    every = ["w5-down", "w5-flat", "w5-g6", "w5-tools", "w5-up", "w7-g6"]
    assert shown() == every
    assert shown(zero="1") == ["w5-flat"]
    assert shown(truncated="1") == ["w5-down", "w5-tools"]
    assert shown(adv="pos") == ["w5-up"]
    assert shown(adv="neg") == ["w5-down"]
    assert shown(tools="1") == ["w5-tools"]
    assert shown(tools="1", truncated="1") == ["w5-tools"]
    assert shown(tools="1", zero="1") == []
    page = get(base, "/step?split=train&step=5&truncated=1")
    assert page.values["shown"] == "2 of 6 groups"
    # The filters stay on as the page is ranked another way or moved to the step before.
    assert "/step?split=train&step=5&order=-mean&truncated=1" in page.links
    assert "/step?split=train&step=4&order=spread&truncated=1" in page.links
    assert get(base, "/step?split=train&step=5&adv=up").status == 400


def test_step_page_moves_to_the_step_before_and_after(base: str) -> None:
    """Previous and next step of the same split; none past either end."""
    middle = parse(get(base, "/step?split=train&step=2").html)
    assert middle.one("a", "prev").attrs["href"] == "/step?split=train&step=1&order=spread"
    assert middle.one("a", "next").attrs["href"] == "/step?split=train&step=3&order=spread"
    first, last = (
        parse(get(base, "/step?split=train&step=0").html),
        parse(get(base, "/step?split=eval&step=5").html),
    )
    assert first.all("a", "prev") == [] and first.one("a", "next").attrs["href"].endswith(
        "step=1&order=spread"
    )
    assert (
        last.one("a", "prev").attrs["href"] == "/step?split=eval&step=0&order=spread"
        and last.all("a", "next") == []
    )
