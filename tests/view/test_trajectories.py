"""Agentic trajectories in `asynctrace view`: every turn as it happened (text, each tool call with its
function and pretty-printed arguments, each tool result with its role), on the record page and for
every member of a group, with the group's shared prompt shown once."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlencode

import pytest

duckdb = pytest.importorskip("duckdb")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from . import _agentic, _archive  # noqa: E402
from ._html import get  # noqa: E402
from ._tree import ShownTurn, parse  # noqa: E402
from ._tree import turns as shown_turns  # noqa: E402


@pytest.fixture(scope="module")
def archive(agentic_archive: tuple[Path, Path]) -> tuple[Path, Path]:
    return agentic_archive


@pytest.fixture(scope="module", params=["parquet", "jsonl"])
def base(request: pytest.FixtureRequest, archive: tuple[Path, Path]) -> Iterator[str]:
    with _archive.served(archive[0] if request.param == "parquet" else archive[1]) as url:
        yield url


def _ids(archive: tuple[Path, Path], step: int) -> list[str]:
    """The record ids of the tool-calling group at `step`, member 0 first."""
    rows = duckdb.execute(
        f"SELECT id, json_extract_string(messages, '$[4].content') FROM '{archive[0]}/*.parquet' "
        "WHERE json_extract_string(metadata, '$.group_uid') = $g",
        {"g": f"w{step}-tools"},
    ).fetchall()
    by_answer = {text: record for record, text in rows}
    return [by_answer[f"It will be sunny: {20 + i} degrees."] for i in range(_agentic.MEMBERS)]


def expected(i: int, first: int = 0) -> list[ShownTurn]:
    """Member i's turns as the page must show them, from the `first`-th."""
    arguments = json.dumps({"city": "Paris", "day": i}, indent=2)
    every = [
        ShownTurn(0, "system", _agentic.SYSTEM["content"], (), ""),
        ShownTurn(1, "user", _agentic.USER["content"], (), ""),
        ShownTurn(
            2,
            "assistant",
            f"I will look it up ({i})." if i % 2 == 0 else "",
            ((f"lookup_{i}", arguments),),
            "",
        ),
        ShownTurn(3, "tool", f"sunny, {20 + i} degrees", (), f"lookup_{i} · answers call-{i}"),
        ShownTurn(4, "assistant", f"It will be sunny: {20 + i} degrees.", (), ""),
    ]
    return every[first:]


def test_record_page_shows_every_turn_with_its_tool_calls(base: str, archive: tuple[Path, Path]) -> None:
    """A tool-call turn without text shows its function and arguments (not "None"), a turn with
    both text and calls both, the tool's result its role, tool and call; prompt and completion apart."""
    ids = _ids(archive, 2)
    for i in (0, 1):
        page = get(base, "/record?" + urlencode({"id": ids[i]}))
        assert page.status == 200
        root = parse(page.html)
        prompt, completion = root.one("section", "prompt"), root.one("section", "completion-turns")
        assert shown_turns(prompt) == expected(i)[:2]
        assert shown_turns(completion) == expected(i, 2)
        assert ">None<" not in page.html


def test_group_page_shows_the_shared_prompt_once_and_every_members_turns(
    base: str, archive: tuple[Path, Path]
) -> None:
    """The group's prompt is what all 16 members share (system and user); each member's card shows
    its own tool call, the tool's result and its answer, none of them in the prompt block."""
    ids = _ids(archive, 3)
    page = get(base, "/group?" + urlencode({"split": "train", "step": 3, "group": "w3-tools"}))
    assert page.status == 200
    root = parse(page.html)
    assert shown_turns(root.one("section", "shared")) == expected(0)[:2]
    cards = {a.attrs["data-id"]: a for a in root.all("article", "completion")}
    assert len(cards) == _agentic.MEMBERS
    for i, record in enumerate(ids):
        assert shown_turns(cards[record]) == expected(i, 2), i


def test_prompt_history_cards_show_the_turns_after_the_prompt(base: str) -> None:
    """The best and worst of each policy version show their tool calls, and the prompt block the
    prompt only; the step-to-step diff compares the whole trajectories."""
    page = get(base, "/prompt?" + urlencode({"id": "p-tools", "split": "train"}))
    root = parse(page.html)
    assert shown_turns(root.one("section", "prompt")) == expected(0)[:2]
    cards = root.all("article", "completion")
    assert cards and all(len(shown_turns(c)) == 3 and shown_turns(c)[0].calls for c in cards)
    diffs = root.all("section", "diff")
    assert len(diffs) == _agentic.STEPS - 1 and all("→ lookup_" in d.text() for d in diffs)


def test_turns_read_every_form_of_tool_call() -> None:
    """OpenAI's calls (arguments a JSON string), flat calls, the older `function_call`, Anthropic's
    tool_use and tool_result parts, unparseable arguments and values of the wrong type: each read,
    none lost, nothing raised."""
    from asynctrace.view._turns import split_messages, turns

    messages = [
        {"role": "assistant", "content": None, "tool_calls": [{"name": "flat", "arguments": {"a": 1}}]},
        {"role": "assistant", "content": "", "function_call": {"name": "old", "arguments": '{"b": 2}'}},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "let me see"},
                {"type": "tool_use", "id": "t1", "name": "seek", "input": {"q": "x"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "found"}]}
            ],
        },
        {"role": "assistant", "tool_calls": [{"function": {"name": "broken", "arguments": "{not json"}}, 7]},
        {"role": 3, "content": {"odd": True}, "name": ["n"]},
        "not a message",
    ]
    shown = turns(messages)
    assert [(c.name, c.arguments) for c in shown[0].calls] == [("flat", '{\n  "a": 1\n}')]
    assert [(c.name, c.arguments) for c in shown[1].calls] == [("old", '{\n  "b": 2\n}')]
    assert shown[2].text == "let me see" and [(c.name, c.id) for c in shown[2].calls] == [("seek", "t1")]
    assert shown[3].text == "found"
    assert [(c.name, c.arguments) for c in shown[4].calls] == [("broken", "{not json"), ("?", "7")]
    assert (shown[5].role, shown[5].text, shown[5].name) == ("3", '{"odd":true}', '["n"]')
    assert (shown[6].role, shown[6].text) == ("?", "not a message")
    prompt, completion = split_messages(_agentic.trajectory(1))
    assert prompt == f"system: {_agentic.SYSTEM['content']}\n\nuser: {_agentic.USER['content']}"
    assert 'assistant: → lookup_1({ "city": "Paris", "day": 1 })' in completion
    assert "tool: sunny, 21 degrees" in completion


def test_the_shared_prompt_stops_where_members_differ_or_act() -> None:
    """Members with different system prompts share less; identical first actions stay each member's."""
    from asynctrace.view._turns import shared_length

    a, b = _agentic.trajectory(0), _agentic.trajectory(0)
    assert shared_length([a, b]) == 2  # identical trajectories: the actions are still each one's
    other = [{"role": "system", "content": "another"}, *a[1:]]
    assert shared_length([a, other]) == 0
    assert shared_length([a]) == 2 and shared_length([]) == 0
