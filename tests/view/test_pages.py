"""`asynctrace view` over HTTP: every view against an archive written by the real sinks, each number
shown checked against a DuckDB query on the files."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest

duckdb = pytest.importorskip("duckdb")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from . import _archive  # noqa: E402
from ._html import Page, get  # noqa: E402


@pytest.fixture(scope="module")
def archive(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return _archive.write(tmp_path_factory.mktemp("view"))


@pytest.fixture(scope="module")
def base(archive: tuple[Path, Path]) -> Iterator[str]:
    with _archive.served(archive[0], watch=("p-alpha", "p-unknown")) as url:
        yield url


@pytest.fixture(scope="module")
def files(archive: tuple[Path, Path]) -> str:
    return str(archive[0] / "*.parquet")


def q(sql: str, **params: Any) -> list[tuple[Any, ...]]:
    return duckdb.execute(sql, params).fetchall()


def f4(value: float | None) -> str:
    return "—" if value is None else f"{value:.4f}"


def test_overview_numbers_equal_a_duckdb_query(base: str, files: str) -> None:
    """Per step and split: samples, reward mean/std, groups, zero-signal groups, spread, truncation,
    length and lag as a query of the files gives them."""
    expected = q(
        f"""
        WITH r AS (SELECT *, json_extract_string(metadata, '$.group_uid') AS g,
                          coalesce(json_extract(metadata, '$.response_len')::BIGINT, list_sum(loss_mask)) AS n
                   FROM '{files}'),
        groups AS (SELECT split, step, g, stddev_pop(reward) AS s FROM r GROUP BY ALL)
        SELECT split, step, count(*), avg(reward), stddev_pop(reward),
               (SELECT count(*) FROM groups WHERE groups.split = r.split AND groups.step = r.step),
               (SELECT count(*) FROM groups WHERE groups.split = r.split AND groups.step = r.step AND s = 0),
               (SELECT avg(s) FROM groups WHERE groups.split = r.split AND groups.step = r.step),
               avg((stop_reason = 'length')::INT), avg(n),
               avg(step - policy_version), max(step - policy_version)
        FROM r GROUP BY split, step ORDER BY split, step
        """
    )
    page = get(base, "/")
    assert page.status == 200
    shown = [b for b in page.blocks if "data-step" in b.attrs and b.tag == "tr"]
    assert len(shown) == len(expected) == _archive.STEPS + 2
    got = {(b.attrs["data-split"], b.values["step"]): b.values for b in shown}
    for split, step, n, mean, std, groups, zero, spread, trunc, length, lag, lag_max in expected:
        row = got[(split, str(step))]
        assert row["samples"] == str(n)
        assert row["reward_mean"] == f4(mean)
        assert row["reward_std"] == f4(std)
        assert row["groups"] == str(groups)
        assert row["zero_signal"] == str(zero)
        assert row["mean_spread"] == f4(spread)
        assert row["truncated"] == f"{100 * trunc:.1f}%"
        assert row["length_mean"] == f"{length:.1f}"
        assert row["lag_mean"] == f"{lag:.2f}"
        assert row["lag_max"] == str(lag_max)
    # The flat prompt is a zero-signal group at every training step, and nowhere else.
    assert [int(r[6]) for r in expected if r[0] == "train"] == [1] * _archive.STEPS
    assert page.assets == ["/static/view.css", "/static/favicon.svg"]  # nothing fetched from elsewhere
    assert get(base, "/static/view.css").status == 200
    assert '<svg class="chart"' in page.html


def test_overview_links_steps_and_watched_prompts(base: str) -> None:
    """Each step links to its groups; the watch list's prompts link to their histories."""
    page = get(base, "/")
    assert "/step?split=train&step=3" in page.links
    assert "/step?split=eval&step=0" in page.links
    assert "/prompt?id=p-alpha" in page.links
    watched = page.html.split('class="prompts watched"')[1].split("</ul>")[0]
    assert "p-alpha" in watched and "5 steps, 28 samples" in watched  # train and eval
    assert "p-unknown" in watched and "not in the archive" in watched and "id=p-unknown" not in watched


@pytest.mark.parametrize("order", ["spread", "-spread", "mean", "-mean"])
def test_step_ranks_groups_as_a_query_does(base: str, files: str, order: str) -> None:
    """A step's groups, ranked by spread or mean either way, with their numbers; zero spread marked."""
    column = "stddev_pop(reward)" if order.endswith("spread") else "avg(reward)"
    direction = "ASC" if order.startswith("-") else "DESC"
    expected = q(
        f"""
        SELECT json_extract_string(metadata, '$.group_uid') AS g, count(*), avg(reward), stddev_pop(reward),
               count(*) FILTER (WHERE stop_reason = 'length'),
               any_value(json_extract_string(metadata, '$.prompt_id'))
        FROM '{files}' WHERE step = 2 AND split = 'train'
        GROUP BY g ORDER BY {column} {direction}, g {direction}
        """
    )
    page = get(base, "/step?" + urlencode({"split": "train", "step": 2, "order": order}))
    rows = [b for b in page.blocks if "data-group" in b.attrs]
    assert [b.attrs["data-group"] for b in rows] == [r[0] for r in expected]
    for block, (_, n, mean, std, trunc, prompt) in zip(rows, expected, strict=True):
        assert block.values["samples"] == str(n)
        assert block.values["reward_mean"] == f4(mean)
        assert block.values["spread"] == f4(std)
        assert block.values["truncated"] == str(trunc)
        assert block.values["prompt_id"] == prompt
        assert ("zero" in block.classes) == (std == 0)
        assert (block.values["signal"] == "zero spread") == (std == 0)
        assert block.values["text"] == f"user: Question of {prompt}: what is 6 * 7?"


def _group(base: str, step: int, prompt: str, split: str = "train") -> Page:
    return get(
        base, "/group?" + urlencode({"split": split, "step": step, "group": f"{split}-{step}-{prompt}"})
    )


def test_group_shows_completions_side_by_side(base: str, files: str) -> None:
    """A group's completions with text, reward, advantage, stop reason and length, best first."""
    expected = q(
        f"""
        SELECT id, reward, advantage, stop_reason,
               coalesce(json_extract(metadata, '$.response_len')::BIGINT, list_sum(loss_mask)),
               policy_version, json_extract_string(messages, '$[1].content')
        FROM '{files}' WHERE step = 3 AND json_extract_string(metadata, '$.group_uid') = 'train-3-p-gamma'
        ORDER BY reward DESC, id
        """
    )
    page = _group(base, 3, "p-gamma")
    cards = [b for b in page.blocks if b.tag == "article"]
    assert [c.attrs["data-id"] for c in cards] == [r[0] for r in expected]
    for card, (_, reward, advantage, stop, length, version, text) in zip(cards, expected, strict=True):
        assert card.values == {
            "reward": f4(reward),
            "advantage": f4(advantage),
            "stop_reason": stop,
            "length": str(length),
            "policy_version": str(version),
        }
        assert f'<pre class="text">{text}</pre>' in page.html
    assert ["truncated" in c.classes for c in cards] == [r[3] == "length" for r in expected]
    assert any(r[3] == "length" for r in expected)
    assert page.values["spread"] == f4(
        q(
            f"SELECT stddev_pop(reward) FROM '{files}' WHERE id IN "
            f"({', '.join(repr(r[0]) for r in expected)})"
        )[0][0]
    )
    assert "zero spread" not in page.html
    assert page.html.count('class="tokens-link"') == len(expected)


def test_zero_spread_group_is_marked(base: str) -> None:
    """A group whose completions all got one reward says it gives no signal."""
    page = _group(base, 1, _archive.FLAT)
    assert page.values["spread"] == "0.0000"
    assert "zero spread: every completion got the same reward" in page.html
    assert "tokens-link" not in page.html


def test_prompt_history_follows_one_prompt_across_steps(base: str, files: str) -> None:
    """Reward per step, completions by policy version and a diff of consecutive steps' completions."""
    expected = q(
        f"""
        SELECT step, count(*), avg(reward), min(reward), max(reward), stddev_pop(reward),
               array_to_string(list_sort(list(DISTINCT policy_version)), ', ')
        FROM '{files}' WHERE json_extract_string(metadata, '$.prompt_id') = 'p-alpha' AND split = 'train'
        GROUP BY step ORDER BY step
        """
    )
    page = get(base, "/prompt?id=p-alpha&split=train")
    rows = page.rows("data-step")
    assert list(rows) == [str(r[0]) for r in expected]
    for step, n, mean, low, high, std, versions in expected:
        assert rows[str(step)] == {
            "step": str(step),
            "samples": str(n),
            "reward_mean": f4(mean),
            "reward_min": f4(low),
            "reward_max": f4(high),
            "spread": f4(std),
            "versions": versions,
        }
    by_version = {
        r[0]: r[1:]
        for r in q(
            f"""SELECT policy_version, count(*), count(DISTINCT step), avg(reward), max(reward), min(reward)
                FROM '{files}'
                WHERE json_extract_string(metadata, '$.prompt_id') = 'p-alpha' AND split = 'train'
                GROUP BY 1"""
        )
    }
    sections = [b for b in page.blocks if "data-version" in b.attrs]
    assert [int(s.attrs["data-version"]) for s in sections] == sorted(by_version, reverse=True)
    for version, (n, steps_seen, mean, best, worst) in by_version.items():
        html = page.html.split(f'data-version="{version}">')[1].split("</section>")[0]
        assert f"{n} completions at {steps_seen} steps, reward mean {f4(mean)}" in html
        # The best and the worst of the version side by side, best first.
        shown = [part.split("</dd>")[0] for part in html.split('<dd data-k="reward">')[1:]]
        assert shown == ([f4(best), f4(worst)] if n > 1 else [f4(best)])
    # One diff per pair of consecutive steps: the best completion of each, word by word.
    assert page.html.count('<section class="diff"') == _archive.STEPS - 1
    first = page.html.split("step 0 → step 1")[1].split("</section>")[0]
    assert (
        "Step <del>0</del><ins>1</ins> work: 6 * 7 = <del>33.</del><ins>42.</ins> "
        "The answer is <del>33.</del><ins>42.</ins>" in first
    )
    assert "/group?split=train&step=0&group=train-0-p-alpha" in page.links
    assert "/prompt?id=p-alpha&split=eval" in page.links  # the same prompt in the other split


def test_tokens_show_logprobs_advantages_and_mask(base: str, files: str) -> None:
    """One span per token with its values; the counts and log-prob figures as the columns give them."""
    record_id, ids, mask, logprobs, advantages = q(
        f"""SELECT id, token_ids, loss_mask, logprobs, advantages FROM '{files}'
            WHERE step = 4 AND json_extract_string(metadata, '$.prompt_id') = 'p-gamma' AND split = 'train'
            ORDER BY id DESC LIMIT 1"""
    )[0]
    page = get(base, "/tokens?" + urlencode({"id": record_id}))
    assert page.status == 200
    assert len(re.findall(r'<span class="t [^"]*" id="t\d+"', page.html)) == len(ids)
    trained = [lp for lp, m in zip(logprobs, mask, strict=True) if m]
    assert page.values["tokens"] == str(len(ids))
    assert page.values["in_loss"] == str(sum(mask))
    assert page.values["mean_logprob"] == f4(sum(trained) / len(trained))
    assert page.values["min_logprob"] == f4(min(trained))
    last = len(ids) - 1
    assert (
        f"token {last} · id {ids[last]} · logprob {logprobs[last]:.4f} · "
        f"adv {advantages[last]:.4f} · in the loss" in page.html
    )
    assert "token 0 · id" in page.html and 'not in the loss">' in page.html
    # Coloured by the loss mask: its tokens in the loss, and no other.
    masked = get(base, "/tokens?" + urlencode({"id": record_id, "signal": "loss_mask"}))
    shades = re.findall(r'<span class="t (m[01])[^"]*" id="t\d+"', masked.html)
    assert shades == [f"m{m}" for m in mask]


def test_tokens_of_a_record_without_them_is_not_found(base: str, files: str) -> None:
    """A record with no token fields answers 404 with the reason."""
    record_id = q(f"SELECT id FROM '{files}' WHERE token_ids IS NULL LIMIT 1")[0][0]
    page = get(base, "/tokens?" + urlencode({"id": record_id}))
    assert page.status == 404 and "no token fields archived" in page.html


def test_find_by_id_text_and_reward_range(base: str, files: str) -> None:
    """The id a tracker shows leads to the record; text and reward searches list what a query finds."""
    record_id = q(f"SELECT id FROM '{files}' WHERE step = 2 ORDER BY id LIMIT 1")[0][0]
    page = get(base, "/find?" + urlencode({"id": record_id}))
    assert page.status == 303 and page.location == "/record?" + urlencode({"id": record_id})
    record = get(base, page.location)
    assert record.status == 200 and record_id in record.html and "its prompt history" in record.html

    assert get(base, "/find?" + urlencode({"q": "6 * 7 = (4"})).status == 200  # a literal, not a pattern
    found = get(base, "/find?q=AT+LENGTH")
    expected = q(f"SELECT id FROM '{files}' WHERE contains(lower(messages), 'at length') ORDER BY step, id")
    assert [b.attrs["data-id"] for b in found.blocks if "data-id" in b.attrs] == [r[0] for r in expected]

    ranged = get(base, "/find?" + urlencode({"low": 0.5, "high": 1.0, "split": "train"}))
    expected = q(
        f"SELECT id, reward FROM '{files}' WHERE reward BETWEEN 0.5 AND 1.0 AND split = 'train' "
        "ORDER BY step, id"
    )
    rows = ranged.rows("data-id")
    assert list(rows) == [r[0] for r in expected]
    assert [v["reward"] for v in rows.values()] == [f4(r[1]) for r in expected]


def test_bad_and_unknown_requests_say_what_is_wrong(base: str) -> None:
    """A malformed parameter is a 400 naming it; an unknown id, group or prompt a 404."""
    assert get(base, "/step?step=x").status == 400
    assert "step: expected an integer" in get(base, "/step?step=x").html
    assert get(base, "/step?step=2&order=best").status == 400
    assert get(base, "/step?step=99999999999999999999").status == 400
    assert "limit: expected an integer from 1" in get(base, "/step?step=2&limit=0").html
    assert get(base, "/find?low=abc").status == 400
    assert get(base, "/group?step=1").status == 400
    assert get(base, "/step?step=99").status == 404
    assert get(base, "/group?step=1&group=nope").status == 404
    assert get(base, "/prompt?id=nope").status == 404
    missing = get(base, "/record?id=%3Cscript%3E")
    assert missing.status == 404 and "<script>" not in missing.html and "&lt;script&gt;" in missing.html


def test_every_link_on_every_view_answers(base: str) -> None:
    """Following the links from overview through a step, a group, a prompt and tokens: each is a
    shareable URL that answers 200 on its own."""
    seen: set[str] = set()
    todo = ["/", "/step?split=train&step=4", "/group?split=train&step=4&group=train-4-p-gamma"]
    while todo:
        path = todo.pop()
        if path in seen or len(seen) > 80:
            continue
        seen.add(path)
        page = get(base, path)
        assert page.status == 200, path
        todo += [
            link for link in page.links if (link.startswith("/") and "step=" not in link) or "step=4" in link
        ]
    assert any(p.startswith("/tokens") for p in seen) and any(p.startswith("/prompt") for p in seen)


def test_jsonl_archive_shows_the_same_numbers(archive: tuple[Path, Path]) -> None:
    """A JsonlSink file of the same records gives the same overview, groups and tokens."""
    with _archive.served(archive[0]) as parquet, _archive.served(archive[1]) as jsonl:
        for path in ("/", "/step?split=train&step=2&order=-mean", "/prompt?id=p-alpha"):
            a, b = get(parquet, path), get(jsonl, path)
            assert a.status == b.status == 200
            assert [x.values for x in a.blocks] == [x.values for x in b.blocks], path
        group = "/group?split=train&step=3&group=train-3-p-gamma"
        cards = [b for b in get(parquet, group).blocks if b.tag == "article"]
        assert [c.values for c in cards] == [c.values for c in get(jsonl, group).blocks if c.tag == "article"]
        tokens = "/tokens?" + urlencode({"id": cards[0].attrs["data-id"]})
        assert get(parquet, tokens).values == get(jsonl, tokens).values
        assert get(jsonl, tokens).values["tokens"] != ""


def test_new_files_of_a_running_trainer_are_picked_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file a sink finishes after the viewer started shows up on the next page."""
    from asynctrace.view import _archive as archive_module

    monkeypatch.setattr(archive_module, "_RESCAN_SECONDS", 0.0)
    first = tmp_path / "first"
    parquet, _ = _archive.write(first)
    with _archive.served(parquet) as base:
        before = get(base, "/")
        second = tmp_path / "second"
        more, _ = _archive.write(second)
        for path in more.glob("*.parquet"):
            path.rename(parquet / ("z" + path.name))
        after = get(base, "/")
    total = lambda page: sum(int(b.values["samples"]) for b in page.blocks if "data-step" in b.attrs)  # noqa: E731
    assert total(after) == 2 * total(before)


def test_missing_extra_is_named(archive: tuple[Path, Path]) -> None:
    """Without a package of the view extra, `asynctrace view` exits 1 naming it and the extra."""
    code = (
        "import sys; sys.modules['uvicorn'] = None; from asynctrace.cli import main; "
        f"main(['view', {str(archive[0])!r}])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert 'asynctrace view needs uvicorn: pip install "asynctrace[view]"' in out.stderr


def test_importing_asynctrace_leaves_the_viewer_unloaded() -> None:
    """`import asynctrace` (and its CLI) imports neither DuckDB nor the web server."""
    code = (
        "import sys, asynctrace, asynctrace.cli, asynctrace.view; "
        "print(sorted(m for m in ('duckdb', 'starlette', 'uvicorn') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"


def test_cli_serves_and_refuses_what_it_cannot_read(archive: tuple[Path, Path], tmp_path: Path) -> None:
    """`asynctrace view DIR --port 0` prints its URL and serves, keeping the index in its cache; a
    path that is no archive exits 1."""
    bare = _archive.without_sidecars(archive[0], tmp_path / "bare")  # its index is the viewer's to keep
    cmd = [sys.executable, "-m", "asynctrace", "view", str(bare), "--port", "0", "--watch", "p-beta"]
    env = dict(os.environ, ASYNCTRACE_VIEW_CACHE=str(tmp_path / "cache"))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("asynctrace view: http://127.0.0.1:"), line + (
            proc.stderr.read() if proc.stderr else ""
        )
        url = line.split()[2].rstrip("/")
        page = _archive.ready(url)
        assert page.status == 200 and "/prompt?id=p-beta" in page.links
        # The index is kept once the pages are ready, beside them.
        deadline = time.monotonic() + 20
        while len(list((tmp_path / "cache").glob("*.parquet"))) < len(list(archive[0].glob("*.parquet"))):
            assert time.monotonic() < deadline, "the index was not kept"
            time.sleep(0.05)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    (tmp_path / "notes.txt").write_text("x")
    bad = subprocess.run(
        [sys.executable, "-m", "asynctrace", "view", str(tmp_path / "notes.txt")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 1 and "expected a directory of .parquet files or a .jsonl file" in bad.stderr


def test_a_kept_index_is_read_instead_of_the_files(
    archive: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second start with the same cache reads each file's index from it, and shows the same pages."""
    from asynctrace.view import _archive as archive_module

    cache = tmp_path / "cache"
    bare = _archive.without_sidecars(archive[0], tmp_path / "bare")
    with _archive.served(bare, cache=cache) as first:
        pages = {path: get(first, path) for path in ("/", "/step?step=3", "/prompt?id=p-gamma")}
    assert len(list(cache.glob("*.parquet"))) == 2

    def no_indexing(*args: Any) -> str:
        raise AssertionError("indexed the files again")

    monkeypatch.setattr(archive_module.Archive, "_index_select", no_indexing)
    with _archive.served(bare, cache=cache) as second:
        for path, page in pages.items():
            assert [b.values for b in get(second, path).blocks] == [b.values for b in page.blocks], path


def test_pages_say_indexing_until_the_archive_is_read(
    archive: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server answers from its start: "indexing" (503, reloading) until the index is built,
    then the page; an archive that cannot be read is said on every page."""
    from asynctrace.view import _app
    from asynctrace.view import _archive as archive_module

    release = threading.Event()
    real_load = archive_module.Archive.load

    def slow_load(self: Any, keep: bool = True) -> None:
        assert release.wait(20)
        real_load(self, keep)

    monkeypatch.setattr(archive_module.Archive, "load", slow_load)
    store = archive_module.Archive(archive[0])
    app = _app.build_app(store, loading=_app.Loading(store))
    with _archive.serving(app) as base:
        waiting = get(base, "/")
        assert waiting.status == 503 and "Indexing the archive" in waiting.html
        assert '<meta http-equiv="refresh" content="1">' in waiting.html
        release.set()
        assert _archive.ready(base).status == 200

    def failing_load(self: Any, keep: bool = True) -> None:
        raise OSError("disk on fire")

    monkeypatch.setattr(archive_module.Archive, "load", failing_load)
    broken = _app.Loading(store)
    assert broken.done.wait(10)
    with _archive.serving(_app.build_app(store, loading=broken)) as base:
        page = get(base, "/step?step=1")
        assert page.status == 500 and "the archive could not be read: disk on fire" in page.html


def test_the_docs_snippets_run_as_written(
    archive: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/view.md's Python: the archive setup it recommends, and an embedded app that serves."""
    import re
    import shutil

    text = (Path(__file__).parents[2] / "docs" / "view.md").read_text()
    setup, embed = re.findall(r"```python\n(.*?)```", text, re.S)
    shutil.copytree(archive[0], tmp_path / "archive")
    monkeypatch.chdir(tmp_path)
    names: dict[str, Any] = {}
    exec(setup, names)
    assert [type(s).__name__ for s in names["session"].sinks] == ["ParquetSink", "Selected"]
    exec(embed, names)
    with _archive.serving(names["app"]) as base:
        page = get(base, "/")
    assert page.status == 200 and 'gsm8k-0042 <span class="muted">not in the archive' in page.html


def test_files_of_another_kind_are_left_out_and_named(archive: tuple[Path, Path], tmp_path: Path) -> None:
    """A file that is not Parquet, or not of the archive's schema, is named on the overview with
    the reason, and the rest of the archive is shown."""
    import shutil

    directory = tmp_path / "archive"
    shutil.copytree(archive[0], directory)
    (directory / "notes.parquet").write_bytes(b"not parquet at all")
    duckdb.execute(f"COPY (SELECT 1 AS step, 'x' AS id) TO '{directory / 'other.parquet'}' (FORMAT parquet)")
    with _archive.served(directory) as base, _archive.served(archive[0]) as plain:
        page, reference = get(base, "/"), get(plain, "/")
        found = get(base, "/find?q=at+length")
    assert page.status == 200
    assert [b.values for b in page.blocks] == [b.values for b in reference.blocks]
    assert "notes.parquet</code>: not a Parquet file DuckDB can read" in page.html
    assert "other.parquet</code>: not a ParquetSink file: no column " in page.html
    assert found.status == 200 and len(found.rows("data-id")) == _archive.STEPS * _archive.GROUP


def test_a_jsonl_line_cut_short_is_skipped(archive: tuple[Path, Path], tmp_path: Path) -> None:
    """A JSONL file still being written (its last line cut short) shows every whole line."""
    path = tmp_path / "run.jsonl"
    whole = archive[1].read_bytes()
    path.write_bytes(whole + whole.splitlines(keepends=True)[0][:40])
    with _archive.served(path) as base, _archive.served(archive[1]) as reference:
        assert [b.values for b in get(base, "/").blocks] == [b.values for b in get(reference, "/").blocks]


def test_a_file_gone_after_indexing_is_an_error_page(archive: tuple[Path, Path], tmp_path: Path) -> None:
    """Texts read from a file removed since the start: a 500 page naming the error, the rest served."""
    import shutil

    directory = tmp_path / "archive"
    shutil.copytree(archive[0], directory)
    with _archive.served(directory) as base:
        for path in directory.glob("*.parquet"):
            path.unlink()
        page = get(base, "/group?split=train&step=1&group=train-1-p-alpha")
        assert page.status == 500 and "this page could not be made: IOException" in page.html
        assert get(base, "/").status == 200  # the overview needs only the index


def test_prompt_history_reads_the_texts_of_its_latest_versions_and_steps_only(
    archive: tuple[Path, Path], files: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long history reads the texts of the latest versions' best and worst and the latest steps'
    best only, and counts the older versions, so its cost does not grow with the run."""
    from asynctrace.view import _browse, _groups
    from asynctrace.view._archive import Archive
    from asynctrace.view._model import prompt_steps

    for module in (_browse, _groups):
        monkeypatch.setattr(module, "HISTORY_VERSIONS", 2)
        monkeypatch.setattr(module, "HISTORY_DIFFS", 2)
    rows = q(
        f"""
        SELECT id, step, policy_version, reward FROM '{files}'
        WHERE json_extract_string(metadata, '$.prompt_id') = 'p-alpha' AND split = 'train'
        ORDER BY policy_version DESC, step DESC, reward DESC, id
        """
    )
    versions = sorted({r[2] for r in rows}, reverse=True)
    steps = sorted({r[1] for r in rows}, reverse=True)
    assert len(versions) > 2 and len(steps) > 3  # else nothing is left out
    expected = set()
    for step in steps[:3]:
        expected.add(max((r for r in rows if r[1] == step), key=lambda r: r[3])[0])
    for version in versions[:2]:
        of = [r for r in rows if r[2] == version]
        expected |= {max(of, key=lambda r: r[3])[0], min(of, key=lambda r: r[3])[0]}

    viewed = Archive(archive[0])
    viewed.load(keep=False)
    viewed.complete_tokens()
    completions, _ = viewed.prompt_history("p-alpha", "train")
    assert len(completions) == len(rows)
    assert {c.id for c in completions if c.loaded} == expected
    html = _groups.prompt_page(
        "p-alpha", "train", ["train"], prompt_steps(completions), completions, archive="a"
    )
    shown = [int(v) for v in re.findall(r'<section class="version" data-version="(-?\d+)"', html)]
    assert shown == versions[:2]
    assert f"{len(versions) - 2} older policy versions" in html
    assert html.count('<section class="diff"') == 2


def test_a_record_is_found_by_its_place_once_ids_are_indexed(archive: tuple[Path, Path]) -> None:
    """Table `ids` leads every record id to its own row, the filter on places holds few others,
    and an id the archive lacks to none."""
    from asynctrace.view._archive import Archive

    viewed = Archive(archive[0])
    viewed.load(keep=False)
    with viewed._query() as con:
        assert viewed.located(con, ["anything"]) == "true"  # before `ids`: the id column decides
    viewed.index_ids()
    with viewed._query() as con:
        every = [r[0] for r in con.execute("SELECT id FROM idx").fetchall()]
        assert len(every) > 10
        for record in every:
            where = viewed.located(con, [record])
            assert con.execute(f"SELECT id FROM idx WHERE {where} AND id = $i", {"i": record}).fetchall() == [
                (record,)
            ]
            assert con.execute(f"SELECT count(*) FROM idx WHERE {where}").fetchall()[0][0] <= 2
        some = every[::3]
        where = viewed.located(con, some)
        found = con.execute(f"SELECT id FROM idx WHERE {where} AND id IN (SELECT unnest($s))", {"s": some})
        assert sorted(r[0] for r in found.fetchall()) == sorted(some)
        assert viewed.located(con, ["no such record"]) == "false"
    assert viewed.record(every[0]) is not None and viewed.record("no such record") is None


def test_a_start_removes_the_index_folders_of_viewers_that_are_gone(
    archive: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A viewer killed before its end leaves its index database; the next start removes it, and
    leaves the folder of a process that still runs."""
    import tempfile

    from asynctrace.view._archive import Archive

    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead, running = (
        tmp_path / f"asynctrace-view-{int(gone.stdout)}-x",
        tmp_path / f"asynctrace-view-{os.getpid()}-y",
    )
    for folder in (dead, running):
        folder.mkdir()
        (folder / "index.duckdb").write_bytes(b"left")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    viewed = Archive(archive[0])
    assert not dead.exists() and running.exists()
    ours = [p for p in tmp_path.glob("asynctrace-view-*") if p != running]
    assert len(ours) == 1 and (ours[0] / "index.duckdb").exists()
    del viewed
    import gc

    gc.collect()
    assert not ours[0].exists()  # its own folder goes with it
