"""The viewer's text index: a search by text that reads only the blocks holding its words finds
exactly what a case-insensitive expression over every message finds."""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

import anyio
import pytest

duckdb = pytest.importorskip("duckdb")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

import asynctrace as at  # noqa: E402
from asynctrace.view import _archive as archive_module  # noqa: E402
from asynctrace.view import _search as search_module  # noqa: E402
from asynctrace.view import _text  # noqa: E402
from asynctrace.view._archive import Archive  # noqa: E402
from asynctrace.view._text import Term, terms  # noqa: E402

from ._archive import without_sidecars  # noqa: E402

# Texts with what a tokenizer can get wrong: case, punctuation, digits, JSON escapes, the two
# non-ASCII letters that match ASCII ones in any case (long s, Kelvin sign), other scripts.
_PIECES = (
    "The answer is 42.", "the ANSWER: forty-two", "\u017ftop here, Kelvin \u212a is 1K",
    "\u03a3\u03af\u03c3\u03c5\u03c6\u03bf\u03c2 \u03c2 \u03c3 \u03a3",
    'a "quoted" word', "line one\nline two\ttab", "x*y=z (4+2)", "naïve café", "émigré", "C++ & Rust",
    "step_12 step-12 step12", "zebra crossing", "crossing zebras", "ok", "ok!", "üBER über",
)  # fmt: skip
STEPS = 12
PER_STEP = 9


def _message(rng: random.Random) -> str:
    return " ".join(rng.choice(_PIECES) for _ in range(rng.randint(1, 3)))


def _write(directory: Path, seed: int, steps: range) -> None:
    rng = random.Random(seed)

    async def main() -> None:
        # In-process writer: the files are what is read here; tests/sinks/ test the writer process.
        async with at.TraceSession(
            "text", run="r", sinks=[at.ParquetSink(directory, process=False)], health_metrics=False
        ) as session:
            for step in steps:
                batch = [
                    at.Sample(
                        messages=[
                            {"role": "user", "content": _message(rng)},
                            {"role": "assistant", "content": _message(rng)},
                        ],
                        metadata={"reward": rng.random(), "prompt_id": f"p{i % 3}"},
                    )
                    for i in range(PER_STEP)
                ]
                await session.log_samples(batch, step=step)

    anyio.run(main)


@pytest.fixture
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks of 4 rows, so that a small archive has many and a search reads several batches."""
    monkeypatch.setattr(_text, "BLOCK", 4)
    monkeypatch.setattr(archive_module, "BLOCK", 4)
    monkeypatch.setattr(search_module, "BLOCK", 4)
    monkeypatch.setattr(search_module, "_SEARCH_FIRST_ROWS", 8)
    monkeypatch.setattr(search_module, "_SEARCH_BATCH_ROWS", 32)


@pytest.fixture(scope="module")
def directory(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two files of a run, as a restarted trainer leaves them."""
    root = tmp_path_factory.mktemp("text") / "archive"
    _write(root, 1, range(STEPS // 2))
    _write(root, 2, range(STEPS // 2, STEPS))
    return root


def _truth(directory: Path, text: str, limit: int) -> list[str]:
    """What an expression over every message finds (the search's meaning), by step and id."""
    rows = duckdb.execute(
        "SELECT id FROM read_parquet($f) WHERE regexp_matches(messages, $p) ORDER BY step, id LIMIT $n",
        {"f": str(directory / "*.parquet"), "p": "(?i)" + re.escape(text), "n": limit},
    ).fetchall()
    return [r[0] for r in rows]


def _queries(directory: Path, count: int) -> list[str]:
    """Substrings of the archive's messages as stored, in changed case too, and texts found nowhere."""
    rng = random.Random(0)
    stored = [
        r[0]
        for r in duckdb.execute(
            "SELECT messages FROM read_parquet($f)", {"f": str(directory / "*.parquet")}
        ).fetchall()
    ]
    out = [
        "zebra crossing",
        "ZEBRA",
        "ebra cro",
        "stop",
        "STOP",
        "k is 1k",
        "\u03c3",
        "\u03c2",
        "über",
        "ÜBER",
        "?!",
        " ",
        "nowhere at all",
    ]
    while len(out) < count:
        text = rng.choice(stored)
        start = rng.randrange(len(text))
        piece = text[start : start + rng.randint(1, 14)]
        out.append(piece.swapcase() if rng.random() < 0.3 else piece)
    return out


def test_terms_say_where_words_must_start_and_end() -> None:
    """A query's runs of word characters, lowered, and whether a separator bounds each."""
    assert terms("ebra cross") == [Term("ebra", False, True), Term("cross", True, False)]
    assert terms(" The answer: 42.") == [
        Term("the", True, True),
        Term("answer", True, True),
        Term("42", True, True),
    ]
    assert terms("\u017ftop \u212a") == [Term("stop", False, True), Term("k", True, False)]
    assert terms("?! \u03c3") == []  # nothing the index can narrow: every message is read


@pytest.mark.usefixtures("small_blocks")
def test_an_indexed_search_finds_what_every_message_holds(directory: Path, tmp_path: Path) -> None:
    """For substrings of the stored messages (any case) and texts found nowhere, the search
    through the text index returns exactly the expression's first hits over every message, as
    does the search without the index."""
    archive = Archive(directory, cache=tmp_path / "cache")
    archive.load()  # with the text index
    assert archive.text_indexed == {0, 1}
    blocks = archive._con.execute("SELECT count(DISTINCT (src, blk)) FROM words").fetchone()
    assert blocks is not None and blocks[0] == 2 * ((STEPS // 2 * PER_STEP + 3) // 4)
    for text in _queries(directory, 120):
        for limit in (5, 100):
            expected = _truth(directory, text, limit)
            assert [c.id for c in archive.find(text=text, limit=limit)] == expected, text
    bare = Archive(directory, cache=None)
    bare.load(keep=False)  # no text index: every message is read
    assert bare.text_indexed == set()
    for text in ("ebra cro", "\u017ftop", "k is 1k"):
        assert [c.id for c in bare.find(text=text, limit=5)] == _truth(directory, text, 5)


@pytest.mark.usefixtures("small_blocks")
def test_a_search_with_a_reward_range_and_a_split_keeps_both(directory: Path) -> None:
    """The typed conditions apply together with the text, in the blocks read."""
    archive = Archive(directory)
    archive.load()
    found = archive.find(text="zebra", low=0.25, high=0.75, split="train", limit=100)
    expected = duckdb.execute(
        "SELECT id FROM read_parquet($f) WHERE regexp_matches(messages, '(?i)zebra') "
        "AND reward BETWEEN 0.25 AND 0.75 AND split = 'train' ORDER BY step, id",
        {"f": str(directory / "*.parquet")},
    ).fetchall()
    assert [c.id for c in found] == [r[0] for r in expected] and found


def test_a_kept_text_index_is_read_instead_of_the_files(
    directory: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The words of each file are kept in the cache; the next start reads them, not the messages."""
    directory = without_sidecars(directory, tmp_path / "bare")
    first = Archive(directory, cache=tmp_path / "cache")
    first.load()
    assert len(list((tmp_path / "cache" / "text-1").glob("*.parquet"))) == 2

    def no_reading(relation: str) -> str:
        raise AssertionError("the messages were read again")

    monkeypatch.setattr("asynctrace.view._index.words_sql", no_reading)
    again = Archive(directory, cache=tmp_path / "cache")
    again.load()
    assert again.text_indexed == {0, 1}
    assert [c.id for c in again.find(text="Kelvin")] == _truth(directory, "Kelvin", 100)


def test_a_file_without_its_text_index_yet_is_read_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file a running trainer adds is searched (whole) before its words are indexed."""
    monkeypatch.setattr(archive_module, "_RESCAN_SECONDS", 0.0)
    root = tmp_path / "archive"
    _write(root, 3, range(2))
    archive = Archive(root)
    archive.load()
    started: list[Any] = []
    monkeypatch.setattr(Archive, "index_text_soon", lambda self: started.append(self))
    _write(root, 4, range(2, 4))
    found = archive.find(text="ok")
    assert len(archive.files) == 2 and archive.text_indexed == {0} and started == [archive]
    assert [c.id for c in found] == _truth(root, "ok", 100) and {c.step for c in found} & {2, 3}
