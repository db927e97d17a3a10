"""The token page over HTTP: a completion's text cut into its tokens, a window at a time, each token's
values as the archive holds them, its lists leading to their tokens' windows, and hostile text
shown as text."""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import anyio
import numpy as np
import pytest

duckdb = pytest.importorskip("duckdb")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

import asynctrace as at  # noqa: E402
from asynctrace.rollouts import decode_rollouts, toy_tokenizer  # noqa: E402
from asynctrace.rollouts._bytelevel import byte_table  # noqa: E402
from asynctrace.rollouts._text import tokenizer_decode  # noqa: E402
from asynctrace.view._token_data import WINDOW  # noqa: E402

from . import _archive  # noqa: E402
from ._html import get  # noqa: E402

HOSTILE = "\"><img src=x onerror=alert(1)> <script>alert('x')</script> &amp; </span>"
FIELDS = ("token_ids", "loss_mask", "logprobs", "ref_logprobs", "entropy", "advantages", "text_ends")


class Token:
    def __init__(self, attrs: dict[str, str]) -> None:
        self.position = int(attrs["id"][1:])
        self.classes = attrs.get("class", "").split()
        self.title = attrs.get("title", "")
        self.text = ""


class _Tokens(HTMLParser):
    """The token spans of a page (class "t"), with their text, and the role marks among them."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens: list[Token] = []
        self.roles: list[tuple[int, str]] = []
        self._open: Token | str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "span" and "t" in a.get("class", "").split() and "id" in a:
            self._open = Token(a)
            self.tokens.append(self._open)
        elif tag == "span" and a.get("class") == "role":
            self._open = "role"

    def handle_endtag(self, tag: str) -> None:
        if tag == "span":
            self._open = None

    def handle_data(self, data: str) -> None:
        if isinstance(self._open, Token):
            self._open.text += data
        elif self._open == "role":
            self.roles.append((len(self.tokens), data))


def _tokens(html: str) -> _Tokens:
    parser = _Tokens()
    parser.feed(html)
    return parser


def _conversation(tokenizer: Any) -> tuple[list[int], list[int], list[tuple[str, str]]]:
    """A multi-turn conversation of about 2,500 tokens: hostile text, CJK, and an emoji written one
    byte a token (three tokens with no text of their own, then the emoji)."""
    table = byte_table(tokenizer, lambda check: tokenizer_decode(tokenizer, check))
    assert table is not None
    single = {piece[0]: i for i, piece in reversed(list(enumerate(table.pieces))) if len(piece) == 1}
    words = ["The", "answer", "is", "391", "café", "你好", "let", "me", "compute", "\n", HOSTILE]
    body = " ".join(words[(i * 7) % len(words)] for i in range(900))
    turns = [
        ("user", f"Question {HOSTILE}: what is 17 * 23?"),
        ("assistant", body),
        ("tool", "391 <b>bold</b>"),
        ("assistant", "So the answer is 391"),
    ]
    ids: list[int] = []
    mask: list[int] = []
    for role, text in turns:
        piece = tokenizer.encode(text).ids
        if role == "assistant" and text.startswith("So"):
            piece += [single[b] for b in " 🙂".encode()]
        ids += piece
        mask += [int(role == "assistant")] * len(piece)
    return ids, mask, turns


def _samples(tokenizer: Any) -> list[at.Sample]:
    ids, mask, _ = _conversation(tokenizer)
    n = len(ids)
    logprobs = [-((i * 37) % 101) / 20 for i in range(n)]
    ref = [lp + (0.9 if i == 1500 else ((i * 13) % 7 - 3) / 1000) for i, lp in enumerate(logprobs)]
    (long,) = decode_rollouts(
        [ids],
        tokenizer=tokenizer,
        loss_mask=[mask],
        rewards=[1.0],
        metadata={"group_uid": ["g-long"], "prompt_id": ["p-long"]},
        token_fields={
            "token_ids": [ids],
            "loss_mask": [mask],
            "logprobs": [logprobs],
            "ref_logprobs": [ref],
            "entropy": [[(i % 11) / 4 for i in range(n)]],
            "advantages": [[0.5 if i % 2 else -0.25 for i in range(n)]],
        },
    )
    by_ids = at.Sample(
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": "an answer"}],
        metadata={"group_uid": "g-ids", "reward": 0.0},
        tokens={"token_ids": [5, 6, 7], "loss_mask": [0, 1, 1], "logprobs": [0.0, -1.5, -0.25]},
    )
    role = "<img src=x onerror=alert(2)>"
    hostile = at.Sample(
        [{"role": role, "content": HOSTILE}],
        metadata={"group_uid": "g-hostile", "reward": 0.5},
        tokens={"token_ids": [1, 2], "text_ends": [3, len(HOSTILE)], "logprobs": [-1.0, -2.0]},
    )
    return [long, by_ids, hostile]


@pytest.fixture(scope="module")
def archive(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The three records through a real session, into a Parquet archive and a JSONL file."""
    root = tmp_path_factory.mktemp("tokens")
    parquet, jsonl = root / "archive", root / "run.jsonl"
    samples = _samples(toy_tokenizer())

    async def main() -> None:
        # In-process writer: the files are what is read here; tests/sinks/ test the writer process.
        sinks = [at.ParquetSink(parquet, process=False), at.JsonlSink(jsonl)]
        async with at.TraceSession("tokens", run="r", sinks=sinks, health_metrics=False) as session:
            await session.log_samples(samples, step=3)

    anyio.run(main)
    return parquet, jsonl


@pytest.fixture(scope="module")
def base(archive: tuple[Path, Path]) -> Iterator[str]:
    with _archive.served(archive[0]) as url:
        yield url


def _row(archive: tuple[Path, Path], group: str) -> dict[str, Any]:
    """The record of `group` as DuckDB reads it from the Parquet files."""
    names = ", ".join(FIELDS)
    con = duckdb.connect()
    row = con.execute(
        f"SELECT id, messages, {names} FROM '{archive[0]}/*.parquet' "
        "WHERE json_extract_string(metadata, '$.group_uid') = ?",
        [group],
    ).fetchone()
    assert row is not None
    return dict(zip(("id", "messages", *FIELDS), row, strict=True))


def _page(base: str, record_id: str, **params: Any) -> Any:
    return get(base, "/tokens?" + urlencode({"id": record_id, **params}))


def test_the_page_is_windowed_and_its_spans_are_the_completions_text(
    base: str, archive: tuple[Path, Path]
) -> None:
    """A window of WINDOW tokens a page, each a span with its position; the windows one after
    another, through their "next" links, are every token once, and their texts are the record's
    messages joined, each turn's role marked where it starts."""
    row = _row(archive, "g-long")
    count = len(row["token_ids"])
    assert count > 2 * WINDOW
    path = "/tokens?" + urlencode({"id": row["id"]})
    spans: list[Token] = []
    roles: list[tuple[int, str]] = []
    while path:
        page = get(base, path)
        assert page.status == 200
        found = _tokens(page.html)
        first = len(spans)
        assert [t.position for t in found.tokens] == list(range(first, min(count, first + WINDOW)))
        assert (
            f'data-start="{first}" data-stop="{first + len(found.tokens)}" data-count="{count}"' in page.html
        )
        spans += found.tokens
        roles += [(first + at_, role) for at_, role in found.roles]
        path = next(
            (link for link in page.links if "start=" in link and link.endswith(f"start={len(spans)}")), ""
        )
        if len(spans) < count:
            assert path, "no link to the next window"
    assert len(spans) == count
    messages = __import__("json").loads(row["messages"])
    assert "".join(t.text for t in spans) == "".join(m["content"] for m in messages)
    assert (
        [role for _, role in roles]
        == [m["role"] for m in messages]
        == ["user", "assistant", "tool", "assistant"]
    )
    ends = row["text_ends"]
    assert [len(t.text) for t in spans] == [b - a for a, b in zip([0, *ends], ends, strict=False)]
    # The emoji written one byte a token: three tokens with no text of their own, then the emoji.
    assert [t.text for t in spans[-4:]] == ["", "", "", "🙂"]
    assert all("nil" in t.classes for t in spans[-4:-1]) and "no text of its own" in spans[-2].title
    # Tokens outside the loss (the prompt, the tool's output) are marked so.
    assert [("out" not in t.classes) for t in spans] == [bool(m) for m in row["loss_mask"]]


def _value(title: str, name: str) -> float | None:
    found = re.search(rf"(?:^| · ){re.escape(name)} (-?[\d.]+|inf)(?: ·|$)", title)
    return None if found is None else float(found.group(1))


def test_each_tokens_values_are_the_archives(base: str, archive: tuple[Path, Path]) -> None:
    """Every token's tooltip holds its id and its values as the archive holds them (four decimals),
    with the two log-probs' difference and ratio; the figures are those of the tokens in the loss."""
    row = _row(archive, "g-long")
    page = _page(base, row["id"], start=WINDOW)
    tokens = _tokens(page.html).tokens
    for token in tokens:
        i = token.position
        assert f"token {i} · id {row['token_ids'][i]} · " in token.title
        for name, field in (
            ("logprob", "logprobs"),
            ("ref", "ref_logprobs"),
            ("entropy", "entropy"),
            ("adv", "advantages"),
        ):
            assert _value(token.title, name) == float(f"{row[field][i]:.4f}"), (i, name)
        difference = np.float64(row["ref_logprobs"][i]) - np.float64(row["logprobs"][i])
        assert _value(token.title, "diff") == float(f"{difference:.4f}")
        assert _value(token.title, "ratio") == float(f"{math.exp(difference):.4f}")
        assert ("in the loss" in token.title) == bool(row["loss_mask"][i])
    loss = np.asarray(row["loss_mask"]) != 0
    logprobs = np.asarray(row["logprobs"], dtype=np.float64)[loss]
    difference = (
        np.asarray(row["ref_logprobs"], dtype=np.float64) - np.asarray(row["logprobs"], dtype=np.float64)
    )[loss]
    assert page.values["tokens"] == str(len(row["token_ids"]))
    assert page.values["in_loss"] == str(int(loss.sum()))
    assert page.values["mean_logprob"] == f"{logprobs.mean():.4f}"
    assert page.values["min_logprob"] == f"{logprobs.min():.4f}"
    assert page.values["mean_abs_difference"] == f"{np.abs(difference).mean():.4f}"
    assert page.values["max_abs_difference"] == f"{np.abs(difference).max():.4f}"


def test_the_lists_lead_to_their_tokens_windows(base: str, archive: tuple[Path, Path]) -> None:
    """The tokens in the loss where the two log-probs disagree most come first, most first, then the
    lowest log-probs, lowest first; each links to the window that holds it, marked as its target."""
    row = _row(archive, "g-long")
    page = _page(base, row["id"])
    loss = np.asarray(row["loss_mask"]) != 0
    logprobs = np.asarray(row["logprobs"], dtype=np.float64)
    difference = np.asarray(row["ref_logprobs"], dtype=np.float64) - logprobs
    disagree = [
        int(i)
        for i in re.findall(
            r'<li data-i="(\d+)"', page.html.split('<ol class="disagree">')[1].split("</ol>")[0]
        )
    ]
    lowest = [
        int(i)
        for i in re.findall(
            r'<li data-i="(\d+)"', page.html.split('<ol class="lowest">')[1].split("</ol>")[0]
        )
    ]
    assert page.html.index('class="disagree"') < page.html.index('class="lowest"')
    in_loss = np.flatnonzero(loss)
    assert disagree[0] == 1500 and disagree == sorted(in_loss, key=lambda i: (-abs(difference[i]), i))[:20]
    assert lowest == sorted(in_loss, key=lambda i: (logprobs[i], i))[:20]
    for i in (disagree[0], lowest[-1]):
        link = next(link for link in page.links if link.endswith(f"at={i}#t{i}"))
        target = get(base, link.split("#")[0])
        window = [t.position for t in _tokens(target.html).tokens]
        assert target.status == 200 and i in window and window[0] == i - i % WINDOW


def test_each_signal_colours_the_tokens(base: str, archive: tuple[Path, Path]) -> None:
    """The loss mask colours exactly the tokens in the loss; the difference colours by its sign;
    every window of the map links to that window; a bad signal or position says what is wrong."""
    row = _row(archive, "g-long")
    masked = _tokens(_page(base, row["id"], signal="loss_mask").html).tokens
    assert [("m1" in t.classes) for t in masked] == [bool(m) for m in row["loss_mask"][:WINDOW]]
    page = _page(base, row["id"], signal="difference", start=1500)
    for token in _tokens(page.html).tokens:
        difference = float(
            np.float64(row["ref_logprobs"][token.position]) - np.float64(row["logprobs"][token.position])
        )
        shade = next(c for c in token.classes if re.fullmatch(r"[pn]\d|z", c))
        assert shade[0] == ("z" if abs(difference) < 0.01 else "p" if difference > 0 else "n")
    windows = [link for link in page.links if "signal=difference&start=" in link]
    count = len(row["token_ids"])
    assert {int(link.rsplit("=", 1)[1]) for link in windows} == set(range(0, count, WINDOW))
    assert _page(base, row["id"], signal="nope").status == 400
    assert _page(base, row["id"], start="x").status == 400
    assert _page(base, row["id"], start=count).status == 404
    assert get(base, "/tokens").status == 400
    assert get(base, "/static/tokens.css").status == 200


def test_a_record_without_text_ends_shows_its_tokens_by_id(base: str, archive: tuple[Path, Path]) -> None:
    """Tokens given without text_ends are shown by their ids, with their values, and a note why."""
    row = _row(archive, "g-ids")
    page = _page(base, row["id"])
    tokens = _tokens(page.html).tokens
    assert page.status == 200 and "no <code>text_ends</code>" in page.html
    assert [t.text for t in tokens] == ["5", "6", "7"]
    assert [_value(t.title, "logprob") for t in tokens] == [0.0, -1.5, -0.25]
    assert page.values["mean_logprob"] == "-0.8750" and page.values["in_loss"] == "2"


def test_hostile_text_is_shown_as_text(base: str, archive: tuple[Path, Path]) -> None:
    """Token text and roles that look like markup are escaped: the page holds no element they
    would make, and each span shows its characters as they were."""
    for group in ("g-hostile", "g-long"):
        page = _page(base, _row(archive, group)["id"])
        assert page.status == 200
        assert "<img src=x" not in page.html and "<script>alert" not in page.html
        assert "<b>bold" not in page.html
    found = _tokens(page.html)
    assert HOSTILE in "".join(t.text for t in found.tokens)
    hostile = _tokens(_page(base, _row(archive, "g-hostile")["id"]).html)
    assert [t.text for t in hostile.tokens] == [HOSTILE[:3], HOSTILE[3:]]
    assert hostile.roles == [(0, "<img src=x onerror=alert(2)>")]


def test_a_jsonl_archive_gives_the_same_page(archive: tuple[Path, Path]) -> None:
    """The JsonlSink file of the same records gives each window the same tokens and values."""
    record_id = _row(archive, "g-long")["id"]
    with _archive.served(archive[0]) as parquet, _archive.served(archive[1]) as jsonl:
        for params in ({}, {"start": WINDOW, "signal": "entropy"}):
            a, b = _page(parquet, record_id, **params), _page(jsonl, record_id, **params)
            assert a.status == b.status == 200
            assert a.values == b.values
            assert [(t.text, t.title, t.classes) for t in _tokens(a.html).tokens] == [
                (t.text, t.title, t.classes) for t in _tokens(b.html).tokens
            ]


def test_damaged_token_values_are_left_out_not_trusted(archive: tuple[Path, Path], tmp_path: Path) -> None:
    """A JSONL line whose log-probs are not base64, whose text_ends run past its text and whose
    ids are negative: the page shows what is sound (the other fields, the tokens by id) and says
    why, and a record of a damaged line does not stop the others."""
    import json

    lines = archive[1].read_text().splitlines()
    record = json.loads(lines[1])  # g-ids: three tokens
    tokens = record["sample"]["tokens"]
    tokens["logprobs"]["b64"] = "not base64!"
    tokens["text_ends"] = {"dtype": "int32", "b64": "AQAAAP///38CAAAA"}  # 1, 2**31 - 1, 2
    tokens["token_ids"] = {"dtype": "int32", "b64": "/////wYAAAAHAAAA"}  # -1, 6, 7
    damaged = tmp_path / "damaged.jsonl"
    damaged.write_text("\n".join([lines[0], json.dumps(record), "{not json", *lines[2:]]) + "\n")
    with _archive.served(damaged) as base:
        page = _page(base, record["id"])
        assert page.status == 200 and "no <code>text_ends</code>" in page.html
        assert [t.text for t in _tokens(page.html).tokens] == ["?", "6", "7"]
        assert "mean_logprob" not in page.values  # the log-probs that are not base64: left out
        assert _page(base, _row(archive, "g-long")["id"]).status == 200


def test_a_record_is_read_once_for_its_windows(archive: tuple[Path, Path]) -> None:
    """The page reads a record from the archive once, for all its windows and signals; the last
    few records are kept, fewer when they are long."""
    from asynctrace.view._archive import Archive
    from asynctrace.view._token_data import Recent

    store = Archive(archive[0])
    store.load(keep=False)
    store.complete_tokens()
    reads: list[str] = []

    def load(record_id: str) -> Any:
        reads.append(record_id)
        return store.tokens(record_id)

    recent = Recent(load, size=lambda fields: len(fields["token_ids"]), kept=2, tokens=2_000)
    long, ids, hostile = (_row(archive, g)["id"] for g in ("g-long", "g-ids", "g-hostile"))
    for record_id in (long, long, ids, hostile, ids, long, long):
        assert recent.get(record_id) is not None
    # The long record (over 2,000 tokens) is kept alone; the two short ones together; the long
    # one again pushes both out.
    assert reads == [long, ids, hostile, long]
    assert recent.get("no such record") is None


def test_nulls_inside_a_parquet_files_lists_are_no_values(archive: tuple[Path, Path], tmp_path: Path) -> None:
    """A Parquet file of another writer, with nulls inside its token lists: a null log-prob is no
    value and a null id no id, in an otherwise whole page."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(next(archive[0].glob("*.parquet")))
    rows = table.to_pylist()
    row = next(r for r in rows if r["token_ids"] == [5, 6, 7])
    row["token_ids"], row["logprobs"] = [5, None, 7], [None, -1.5, -0.25]
    (tmp_path / "other").mkdir()
    pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), tmp_path / "other" / "run.parquet")
    with _archive.served(tmp_path / "other") as base:
        page = _page(base, row["id"])
    tokens = _tokens(page.html).tokens
    assert page.status == 200 and [t.text for t in tokens] == ["5", "?", "7"]
    assert [_value(t.title, "logprob") for t in tokens] == [None, -1.5, -0.25]
    assert page.values["mean_logprob"] == "-0.8750"
