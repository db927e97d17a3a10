"""The per-file summaries the index sidecars carry in their footers (each step's overview figures,
each prompt's counts) and the index queried where the sidecars lie: what the viewer would compute
from the files, or ignored."""

from __future__ import annotations

import math
import shutil
from dataclasses import astuple
from pathlib import Path
from typing import Any

import anyio
import orjson
import pytest

duckdb = pytest.importorskip("duckdb")
pq = pytest.importorskip("pyarrow.parquet")

import asynctrace as at  # noqa: E402
from asynctrace.sinks._parquet_sidecar import (  # noqa: E402
    SIDECAR_KEY,
    SIDECAR_VERSION,
    sidecar_path,
    write_sidecar,
)
from asynctrace.sinks._parquet_summary import SUMMARY_KEY  # noqa: E402
from asynctrace.view._archive import Archive  # noqa: E402
from asynctrace.view._browse import frequent_sql, overview_sql  # noqa: E402
from asynctrace.view._partials import FileSummary, parse_summary  # noqa: E402
from asynctrace.view._sidecar import Sidecars  # noqa: E402
from asynctrace.view._summary import merge_summaries  # noqa: E402

from . import _archive  # noqa: E402
from ._archive import without_sidecars  # noqa: E402

# Records a file: small enough that most steps lie in two files.
_PER_FILE = 7


def _write_straddling(directory: Path, stragglers: bool = False) -> list[Path]:
    """A run of 6 steps of 3 groups of 4 (rewards that tie in some groups, a prompt at several
    steps), in files of `_PER_FILE` records, so that groups and steps span files; its sidecars.
    With `stragglers`, a record of the step before the last comes in the middle of each step
    (an asynchronous trainer's late rollout): steps that files hold away from their edges."""

    async def main() -> None:
        sink = at.ParquetSink(directory, process=False, max_records=_PER_FILE)
        async with at.TraceSession(
            "summary", run="r", sinks=[sink], health_metrics=False, batch_size=2
        ) as session:
            for step in range(6):
                batch = []
                for g in range(3):
                    for i in range(4):
                        batch.append(
                            at.Sample(
                                messages=[
                                    {"role": "user", "content": f"q{g}"},
                                    {"role": "assistant", "content": "a"},
                                ],
                                metadata={
                                    "prompt_id": f"p{(g + step) % 4}",
                                    "group_uid": f"{step}-{g}",
                                    "reward": 0.1 if g == 1 else (i * 0.3 + step) % 1.0,
                                    "policy_version": step - i % 3,
                                    "stop_reason": "length" if i == 3 else "stop",
                                    "response_len": 10 * i + step,
                                },
                            )
                        )
                # Half a group a call: a file ends after a call, so groups and steps span files.
                for half in range(0, len(batch), 2):
                    await session.log_samples(batch[half : half + 2], step=step)
                    assert await session.flush(timeout=30)
                if step % 2:
                    await session.log_samples(batch[:3], step=step, split="eval")
                    assert await session.flush(timeout=30)
                if stragglers and step >= 2:
                    late = at.Sample(
                        messages=[
                            {"role": "user", "content": "q0"},
                            {"role": "assistant", "content": "late"},
                        ],
                        metadata={"prompt_id": f"p{step % 4}", "group_uid": f"{step - 2}-0", "reward": 0.7},
                    )
                    await session.log_samples([late], step=step - 2)
                    assert await session.flush(timeout=30)

    anyio.run(main)
    files = sorted(directory.glob("*.parquet"))
    assert len(files) > 6 and all(write_sidecar(f) for f in files)
    return files


def _same(got: list[tuple[Any, ...]], want: list[tuple[Any, ...]]) -> None:
    assert len(got) == len(want)
    for a_row, b_row in zip(got, want, strict=True):
        for a, b in zip(a_row, b_row, strict=True):
            assert a == b or (isinstance(a, float) and isinstance(b, float) and math.isclose(a, b)), (
                a_row,
                b_row,
            )


def _summary_of(file: Path) -> FileSummary:
    """The summary its index sidecar's footer carries."""
    found = parse_summary(pq.read_schema(sidecar_path(file, "index")).metadata[SUMMARY_KEY])
    assert found is not None
    return found


def test_each_files_summary_is_what_the_viewer_computes_from_its_rows(tmp_path: Path) -> None:
    """A file's summary gives the overview of its own records, and their prompts' counts."""
    files = _write_straddling(tmp_path / "run")
    con = duckdb.connect()
    for f in files:
        index = str(sidecar_path(f, "index"))
        alone = merge_summaries(con, [(Sidecars(index, index), _summary_of(f))])
        relation = f"read_parquet('{index}')"
        _same([astuple(r) for r in alone.overview], con.execute(overview_sql(relation)).fetchall())
        counts = con.execute(
            f"SELECT prompt, count(DISTINCT step), count(*) FROM {relation} WHERE prompt IS NOT NULL "
            "GROUP BY prompt ORDER BY prompt"
        ).fetchall()
        assert alone.prompts is not None and sorted((p, *c) for p, c in alone.prompts.items()) == counts


@pytest.mark.parametrize("stragglers", [False, True])
def test_merged_summaries_equal_the_overview_of_steps_that_span_files(
    stragglers: bool, tmp_path: Path
) -> None:
    """Steps and groups split between files (and, with stragglers, steps a file holds away from
    its edges): the merged overview, frequent prompts and prompt counts are those of the files
    read whole."""
    directory = tmp_path / "run"
    files = _write_straddling(directory, stragglers)
    summaries = [_summary_of(f) for f in files]
    at_edges = [{p.step for p in s.steps} <= s.edges for s in summaries]
    assert all(at_edges) != stragglers, "the test would not see the steps it is about"
    summary = Archive(directory).sidecar_summary()
    assert summary is not None and summary.prompts is not None
    bare = Archive(without_sidecars(directory, tmp_path / "bare"))
    bare.build()
    assert not bare.sidecars
    _same([astuple(r) for r in summary.overview], [astuple(r) for r in bare.overview()])
    assert any(r.zero_signal for r in summary.overview), "no tied group: the test would not see one"
    assert summary.frequent == bare.frequent_prompts(50)
    assert summary.prompts == bare.prompt_counts(sorted(summary.prompts))
    assert set(summary.prompts) == {f"p{k}" for k in range(4)}


def test_pages_from_sidecars_where_they_lie_equal_those_from_the_files(tmp_path: Path) -> None:
    """Nothing of a sidecar is copied into the index, and its questions answer as the files do."""
    directory = tmp_path / "run"
    _write_straddling(directory)
    held = Archive(directory)
    held.load()
    assert len(held.sidecars) == len(held.files)
    copied = held._con.execute("SELECT count(*) FROM idx_rows").fetchone()
    assert copied == (0,)
    bare = Archive(without_sidecars(directory, tmp_path / "bare"))
    bare.load()
    con = held._con
    # Sums over rows read in another order may differ in their last bits: compared as floats.
    _same(con.execute(overview_sql("idx")).fetchall(), bare._con.execute(overview_sql("idx")).fetchall())
    assert con.execute(frequent_sql("pidx")).fetchall() == bare._con.execute(frequent_sql("idx")).fetchall()
    _same(
        [astuple(g) for g in held.step_groups("train", 3)], [astuple(g) for g in bare.step_groups("train", 3)]
    )
    assert held.prompt_history("p1", "train") == bare.prompt_history("p1", "train")
    assert held.group("train", 2, "2-1") == bare.group("train", 2, "2-1")
    some = bare.group("train", 4, "4-2")[0].id
    assert held.record(some) == bare.record(some)
    assert held.names("p2") == bare.names("p2") and held.names(some) == bare.names(some)
    # A search reads each hit's index row at its place, in the file's own sidecar.
    held.index_text()
    found = held.find(text="q1", limit=5)
    assert found and found == bare.find(text="q1", limit=5)


def test_a_question_by_prompt_reads_only_the_files_that_hold_the_prompt(tmp_path: Path) -> None:
    """After a first open, a prompt's history, counts and names read the by-prompt sidecars of
    the files whose summaries count that prompt, and answer as the files read whole do."""
    directory = tmp_path / "run"
    files = _write_straddling(directory, stragglers=True)
    opened = Archive(directory)
    assert opened.sidecar_summary() is not None
    opened.load(keep=False)
    bare = Archive(without_sidecars(directory, tmp_path / "bare"))
    bare.load()
    for prompt in [f"p{k}" for k in range(4)] + ["no such prompt"]:
        with opened._lock:
            relation = opened.prompt_relation([prompt])
        holding = {f.name for f in files if prompt in _summary_of(f).prompts.prompts}
        named = {f.name for f in files if str(sidecar_path(f, "byprompt")) in relation}
        assert named == holding and len(holding) < len(files), (prompt, sorted(named))
        assert opened.prompt_history(prompt, "train") == bare.prompt_history(prompt, "train")
        assert opened.prompt_counts([prompt]) == bare.prompt_counts([prompt])
        assert opened.names(prompt) == bare.names(prompt)


def _foreign(path: Path) -> None:
    """The sidecar of the same kind of another file (its size and rows are not this file's)."""
    others = sorted(p for p in path.parent.glob("*" + path.name.split(".parquet.", 1)[1]) if p != path)
    shutil.copyfile(others[0], path)


def _retyped(path: Path) -> None:
    """Its third column of another type, its footer's note kept."""
    table = pq.read_table(path)
    metadata = table.schema.metadata
    table = table.set_column(2, table.schema.field(2).name, table.column(2).cast("float64"))
    pq.write_table(table.replace_schema_metadata(metadata), path)


def _old_version(path: Path) -> None:
    table = pq.read_table(path)
    metadata = table.schema.metadata
    note = metadata[SIDECAR_KEY].replace(b'"version":%d' % SIDECAR_VERSION, b'"version":2')
    assert note != metadata[SIDECAR_KEY]
    pq.write_table(table.replace_schema_metadata({**metadata, SIDECAR_KEY: note}), path)


def _with_summary(path: Path, summary: bytes | None) -> None:
    """Its footer's summary replaced (None: taken out), all else kept."""
    table = pq.read_table(path)
    metadata = {k: v for k, v in table.schema.metadata.items() if k != SUMMARY_KEY}
    if summary is not None:
        metadata[SUMMARY_KEY] = summary
    pq.write_table(table.replace_schema_metadata(metadata), path)


def _summary_unreadable(path: Path) -> None:
    _with_summary(path, b'{"steps": {"split": ["train"')


def _summary_missing(path: Path) -> None:
    _with_summary(path, None)


def _summary_retyped(path: Path) -> None:
    """A count as text, the rest as written."""
    body = orjson.loads(pq.read_schema(path).metadata[SUMMARY_KEY])
    body["steps"]["samples"][0] = "12"
    _with_summary(path, orjson.dumps(body))


def _summary_negative(path: Path) -> None:
    """A group of minus three rewards, the rest as written."""
    body = orjson.loads(pq.read_schema(path).metadata[SUMMARY_KEY])
    assert body["groups"]["n"], "no group at the file's edges: the spoil would not be seen"
    body["groups"]["n"][0] = -3
    _with_summary(path, orjson.dumps(body))


def _summary_shortened(path: Path) -> None:
    """One column a value shorter than the others of its table."""
    body = orjson.loads(pq.read_schema(path).metadata[SUMMARY_KEY])
    body["prompts"]["samples"].pop()
    _with_summary(path, orjson.dumps(body))


def _damaged_pages(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    footer = int.from_bytes(raw[-8:-4], "little") + 8
    for k in range(4, len(raw) - footer):
        raw[k] = 0xA5
    path.write_bytes(bytes(raw))


_FOOTERS = [_foreign, _retyped, _old_version]
_SUMMARIES = [_summary_unreadable, _summary_missing, _summary_retyped, _summary_negative, _summary_shortened]


@pytest.mark.parametrize(
    ("kind", "spoil"),
    [("index", s) for s in [*_FOOTERS, _damaged_pages, *_SUMMARIES]]
    + [("byprompt", s) for s in [*_FOOTERS, _damaged_pages]],
)
def test_a_damaged_or_foreign_summary_is_ignored(kind: str, spoil: Any, tmp_path: Path) -> None:
    """An index sidecar (or its summary, or a by-prompt index) of another file, type, version,
    or damaged: what fails is not used, and the overview and pages are the files' own."""
    directory = tmp_path / "run"
    files = _write_straddling(directory)
    bare = Archive(without_sidecars(directory, tmp_path / "bare"))
    bare.load()
    spoil(sidecar_path(files[1], kind))
    opened = Archive(directory)
    summary = opened.sidecar_summary()
    opened.load()
    if kind == "index" and spoil is not _damaged_pages:
        assert summary is None  # every file's summary or none: the index is read for the overview
    else:  # a footer the first open reads is whole: its summary is right
        assert summary is not None
        _same([astuple(r) for r in summary.overview], [astuple(r) for r in bare.overview()])
    if spoil in _SUMMARIES:  # the index rows are still the file's own: queried where they lie
        assert 1 in opened.sidecars
    elif spoil is _damaged_pages or kind == "index":
        # Its footer fails, or its rows are read whole after the overview: the file is read.
        assert 1 not in opened.sidecars and len(opened.sidecars) == len(files) - 1
    else:  # a by-prompt index that fails: its file's index rows are read in row order instead
        assert opened.sidecars[1].by_prompt == opened.sidecars[1].by_row
        assert all(s.by_prompt != s.by_row for src, s in opened.sidecars.items() if src != 1)
    _same([astuple(r) for r in opened.overview()], [astuple(r) for r in bare.overview()])
    assert opened.frequent_prompts(50) == bare.frequent_prompts(50)
    assert opened.prompt_history("p3", "train") == bare.prompt_history("p3", "train")


def test_the_sidecars_of_the_view_tests_archive_summarise_it(tmp_path: Path) -> None:
    """The view tests' archive (two sessions, train and eval, token fields): its summary is its
    overview."""
    directory = _archive.write(tmp_path)[0]
    assert all(write_sidecar(f) for f in directory.glob("*.parquet"))
    summary = Archive(directory).sidecar_summary()
    assert summary is not None
    bare = Archive(without_sidecars(directory, tmp_path / "bare"))
    bare.build()
    _same([astuple(r) for r in summary.overview], [astuple(r) for r in bare.overview()])
    assert summary.frequent == bare.frequent_prompts(50)


def _first_open_with_damaged_byprompt(files: list[Path]) -> tuple[Archive, str]:
    """A server's first open of `files`' folder whose second file's by-prompt sidecar is damaged
    past its footer (what the summaries do not read, and a prompt's history does), and a prompt
    id of that file."""
    import orjson

    _damaged_pages(sidecar_path(files[1], "byprompt"))
    prompt = orjson.loads(pq.read_table(files[1], columns=["metadata"]).column(0)[0].as_py())["prompt_id"]
    opened = Archive(files[1].parent)
    assert opened.sidecar_summary() is not None
    opened.load(keep=False)
    opened.complete_tokens()
    assert 1 in opened.sidecars
    return opened, str(prompt)


def test_a_first_open_reads_a_damaged_sidecar_s_file_once_a_query_meets_it(tmp_path: Path) -> None:
    """A server's first open does not read its sidecars whole: the first page whose query meets
    one damaged past its footer fails, its file is read instead, and that page asked again is
    the files' own."""
    directory = tmp_path / "run"
    files = _write_straddling(directory)
    bare = Archive(without_sidecars(directory, tmp_path / "bare"))
    bare.load()
    opened, prompt = _first_open_with_damaged_byprompt(files)
    _same([astuple(r) for r in opened.overview()], [astuple(r) for r in bare.overview()])
    with pytest.raises(duckdb.Error):
        opened.prompt_history(prompt, "train")
    assert 1 not in opened.sidecars and len(opened.sidecars) == len(files) - 1
    assert opened.prompt_history(prompt, "train") == bare.prompt_history(prompt, "train")
    _same(
        [astuple(g) for g in opened.step_groups("train", 3)],
        [astuple(g) for g in bare.step_groups("train", 3)],
    )


def test_a_page_whose_query_meets_a_damaged_sidecar_is_answered_the_first_time(tmp_path: Path) -> None:
    """The server asks a page's question again once a damaged sidecar met by it has its file
    read: the first answer is the page, not an error, and the same as the one after it."""
    from asynctrace.view import _app

    from ._html import get

    opened, prompt = _first_open_with_damaged_byprompt(_write_straddling(tmp_path / "run"))
    with _archive.serving(_app.build_app(opened)) as base:
        first = get(base, f"/prompt?id={prompt}&split=train")
        assert first.status == 200, first.html
        assert 1 not in opened.sidecars
        assert get(base, f"/prompt?id={prompt}&split=train").html == first.html
