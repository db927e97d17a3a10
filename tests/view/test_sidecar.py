"""The sink's sidecars: written beside each file, read by the viewer instead of the file, and
ignored (the file read instead) when missing, damaged, hostile or of another file."""

from __future__ import annotations

import contextlib
import math
import os
import shutil
from collections.abc import Callable
from dataclasses import astuple
from pathlib import Path
from typing import Any

import psutil
import pytest

duckdb = pytest.importorskip("duckdb")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pq = pytest.importorskip("pyarrow.parquet")

from asynctrace.sinks._parquet_sidecar import (  # noqa: E402
    SIDECAR_FOLDER,
    SIDECAR_KEY,
    SIDECAR_VERSION,
    index_path,
    words_path,
    write_sidecar,
)
from asynctrace.view import _pages  # noqa: E402
from asynctrace.view._archive import Archive  # noqa: E402

from . import _archive  # noqa: E402
from ._archive import without_sidecars  # noqa: E402


def with_sidecars(directory: Path) -> list[Path]:
    """Make the sidecars of every file of `directory`, as a sink that names its files while it
    runs does (the files a closing sink names get none); the files that got them."""
    return [f for f in sorted(directory.glob("*.parquet")) if write_sidecar(f)]


@pytest.fixture(scope="module")
def archive(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    written = _archive.write(tmp_path_factory.mktemp("sidecar"))
    assert with_sidecars(written[0])
    return written


def _index(archive: Archive) -> list[tuple[Any, ...]]:
    rows: list[tuple[Any, ...]] = archive._con.execute("SELECT * FROM idx ORDER BY src, rn").fetchall()
    return rows


def _words(archive: Archive) -> list[tuple[Any, ...]]:
    rows: list[tuple[Any, ...]] = archive._con.execute("SELECT * FROM words ORDER BY ALL").fetchall()
    return rows


def _read(directory: Path) -> Archive:
    archive = Archive(directory)
    archive.build()
    archive.index_text()
    return archive


def _forbid_reading(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make reading an archive file for its index or words fail the test."""

    def no_reading(*args: Any) -> str:
        raise AssertionError("the file was read, not its sidecar")

    monkeypatch.setattr("asynctrace.view._index.Index._index_select", no_reading)
    monkeypatch.setattr("asynctrace.view._index.words_sql", no_reading)


@pytest.mark.parametrize("which", ["archive", "agentic_archive", "hostile_archive"])
def test_sidecars_give_the_viewer_what_it_reads_from_the_files(
    which: str, request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ParquetSink file's sidecars hold the index and words read from the file itself (token
    fields, tool calls, a payload in every field)."""
    found = request.getfixturevalue(which)
    source = found[0] if isinstance(found, tuple) else found
    directory = tmp_path / "copy"
    shutil.copytree(source, directory, symlinks=True)
    files = with_sidecars(directory)
    if which == "hostile_archive":
        assert len(files) == len(list(directory.glob("*.parquet"))) - 1  # all but one that is no Parquet
    assert files and all(index_path(f).is_file() and words_path(f).is_file() for f in files)
    from_files = _read(without_sidecars(directory, tmp_path / "bare"))
    expected_index, expected_words = _index(from_files), _words(from_files)
    _forbid_reading(monkeypatch)
    from_sidecars = _read(directory)
    assert _index(from_sidecars) == expected_index
    assert _words(from_sidecars) == expected_words


def test_the_overview_of_a_first_open_comes_from_the_sidecars(archive: tuple[Path, Path]) -> None:
    """The overview answered from the sidecars before the index is read holds the index's figures."""
    summary = Archive(archive[0]).sidecar_summary()
    assert summary is not None
    indexed = Archive(archive[0])
    indexed.build()
    assert summary.frequent == indexed.frequent_prompts(50)
    rows = indexed.overview()
    assert len(summary.overview) == len(rows)
    for got, want in zip(summary.overview, rows, strict=True):
        for a, b in zip(astuple(got), astuple(want), strict=True):
            assert a == b or (isinstance(a, float) and isinstance(b, float) and math.isclose(a, b)), (
                got,
                want,
            )


def _garbage(path: Path, other: Path) -> None:
    path.write_bytes(b"PAR1 not a parquet file PAR1")


def _of_another_file(path: Path, other: Path) -> None:
    shutil.copyfile(other, path)  # the other file's sidecar: its size and rows are not this file's


def _a_link(path: Path, other: Path) -> None:
    target = path.with_name("elsewhere.parquet")
    os.replace(path, target)
    path.symlink_to(target)


def _another_version(path: Path, other: Path) -> None:
    table = pq.read_table(path)
    note = table.schema.metadata[SIDECAR_KEY].replace(b'"version":%d' % SIDECAR_VERSION, b'"version":99')
    assert note != table.schema.metadata[SIDECAR_KEY]
    pq.write_table(table.replace_schema_metadata({SIDECAR_KEY: note}), path)


def _another_column(path: Path, other: Path) -> None:
    table = pq.read_table(path)
    metadata = table.schema.metadata
    table = table.append_column("extra", table.column(0))
    pq.write_table(table.replace_schema_metadata(metadata), path)


def _damaged_pages(path: Path, other: Path) -> None:
    """Its footer intact, the bytes of its column chunks overwritten."""
    raw = bytearray(path.read_bytes())
    footer = int.from_bytes(raw[-8:-4], "little") + 8
    for k in range(4, len(raw) - footer):
        raw[k] = 0xA5
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize(
    "spoil", [_garbage, _of_another_file, _a_link, _another_version, _another_column, _damaged_pages]
)
@pytest.mark.parametrize("kind", ["index", "words"])
def test_a_damaged_or_hostile_sidecar_is_ignored_and_the_file_read(
    spoil: Callable[[Path, Path], None], kind: str, archive: tuple[Path, Path], tmp_path: Path
) -> None:
    """A sidecar that is garbage, of another file, a link, of another version or schema, or
    damaged past its footer is not used: the index and words are those of the files."""
    bare = without_sidecars(archive[0], tmp_path / "bare")
    expected = _read(bare)
    directory = tmp_path / "spoiled"
    shutil.copytree(archive[0], directory)
    files = sorted(directory.glob("*.parquet"))
    path_of = index_path if kind == "index" else words_path
    spoil(path_of(files[0]), path_of(files[1]))
    got = _read(directory)
    assert _index(got) == _index(expected)
    assert _words(got) == _words(expected)
    assert not got.skipped and not got.left_out


def test_a_sidecar_folder_that_is_a_link_is_not_followed(archive: tuple[Path, Path], tmp_path: Path) -> None:
    """Sidecars are read only from the archive's own folder, never through a link to another."""
    directory = without_sidecars(archive[0], tmp_path / "linked")
    (directory / SIDECAR_FOLDER).symlink_to(archive[0] / SIDECAR_FOLDER)
    got = _read(directory)
    assert got.sidecar_summary() is None
    assert _index(got) == _index(_read(without_sidecars(archive[0], tmp_path / "bare")))


def test_the_sink_writes_no_sidecar_it_cannot_hold_exactly(tmp_path: Path) -> None:
    """A prompt id that is neither a string nor an integer (the viewer reads a float as DuckDB
    prints it) leaves the file without sidecars, and the viewer reads it."""
    import pyarrow as pa

    path = tmp_path / "run-00000.parquet"
    pq.write_table(
        pa.table(
            {
                "id": ["a"],
                "step": pa.array([0], pa.int64()),
                "split": ["train"],
                "messages": ["[]"],
                "metadata": ['{"prompt_id": 1.5}'],
                "reward": [1.0],
                "advantage": [0.0],
                "policy_version": pa.array([0], pa.int64()),
                "stop_reason": ["stop"],
            }
        ),
        path,
    )
    assert not write_sidecar(path)
    assert not index_path(path).exists() and not words_path(path).exists()


def test_the_find_page_says_while_the_text_index_is_being_built() -> None:
    """Until every file's words are in, the find page says how many are and what that costs."""
    partial = _pages.find_page(None, archive="a", query={}, splits=["train"], limit=100, text_index=(3, 10))
    assert 'data-k="text-index"' in partial and "3 of 10 files" in partial
    whole = _pages.find_page(None, archive="a", query={}, splits=["train"], limit=100, text_index=(10, 10))
    assert 'data-k="text-index"' not in whole


def test_a_first_open_takes_the_overview_from_the_sidecars_not_the_index_again(
    archive: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The overview answered from the sidecars is the index's once it is built over the same
    files: not asked of the index again."""
    opened = Archive(archive[0])
    summary = opened.sidecar_summary()
    assert summary is not None

    def no_query(relation: str) -> str:
        raise AssertionError("the overview was asked of the index again")

    monkeypatch.setattr("asynctrace.view._browse.overview_sql", no_query)
    opened.load(keep=False)
    assert opened.overview() == summary.overview
    assert opened.frequent_prompts(50) == summary.frequent


def test_words_that_need_no_message_read_are_indexed_first(
    archive: tuple[Path, Path], tmp_path: Path
) -> None:
    """`index_text(kept_only=True)` takes the sidecars' words, and leaves a file without them
    for the full pass that reads its messages."""
    with_sidecars = Archive(archive[0])
    with_sidecars.build()
    with_sidecars.index_text(kept_only=True)
    assert with_sidecars.text_progress() == (2, 2)
    bare = Archive(without_sidecars(archive[0], tmp_path / "bare"))
    bare.build()
    bare.index_text(kept_only=True)
    assert bare.text_progress() == (0, 2)
    bare.index_text()
    assert bare.text_progress() == (2, 2)


def _sidecar_children() -> list[psutil.Process]:
    """This process's running sidecar makers."""
    found = []
    for p in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if "asynctrace.sinks._parquet_sidecar" in " ".join(p.cmdline()):
                found.append(p)
    return found


async def _until(check: Callable[[], bool], seconds: float = 60.0) -> None:
    import anyio

    with anyio.fail_after(seconds):
        while not check():
            await anyio.sleep(0.02)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_sink_with_its_writer_process_writes_sidecars_the_viewer_takes(tmp_path: Path) -> None:
    """With a writer process (the default), each file named while the sink runs gets its
    sidecars, made in a process of their own, which pass the viewer's checks; the file named
    at the close gets none (the viewer reads it)."""
    import asynctrace as at

    directory = tmp_path / "archive"
    sink = at.ParquetSink(directory, max_records=16)
    async with at.TraceSession("sidecar", run="r", sinks=[sink], health_metrics=False) as session:
        for step in range(5):  # 12 a step: a file rolls past 16 records, twice while it runs
            await session.log_samples(_archive.samples(step, "train"), step=step)
            assert await session.flush(timeout=60)  # a write a step
        named = lambda: sorted(directory.glob("*.parquet"))  # noqa: E731
        await _until(lambda: len(named()) >= 2 and all(index_path(f).is_file() for f in named()))
        rolled = named()
        await _until(lambda: all(words_path(f).is_file() for f in rolled) and not _sidecar_children())
    files = sorted(directory.glob("*.parquet"))
    last = sorted(set(files) - set(rolled))
    assert len(last) == 1 and not index_path(last[0]).exists(), "the close waited for a sidecar"
    files = rolled
    opened = Archive(directory)
    con = opened._con
    from asynctrace.view._sidecar import index_sidecars, words_sidecar

    assert sorted(index_sidecars(con, [str(f) for f in files])) == [str(f) for f in files]
    assert all(words_sidecar(con, str(f)) is not None for f in files)
    assert not [p for p in (directory / SIDECAR_FOLDER).iterdir() if p.name.startswith(".")]


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_close_does_not_wait_for_a_stopped_sidecar_maker(tmp_path: Path) -> None:
    """A sidecar maker stopped (SIGSTOP) when the session closes: the close returns at once,
    counts every record written and none failed, kills the maker and leaves no temporary."""
    import time

    import asynctrace as at

    directory = tmp_path / "archive"
    sink = at.ParquetSink(directory, max_records=16)
    async with at.TraceSession("sidecar", run="r", sinks=[sink], health_metrics=False) as session:
        for step in range(2):  # 12 a step: the file rolls past 16 records, once
            await session.log_samples(_archive.samples(step, "train"), step=step)
            assert await session.flush(timeout=60)  # a write a step
        # The first file rolls at its 16th record; its maker runs for a python start and
        # pyarrow's import at least, far longer than this poll's step.
        await _until(lambda: bool(_sidecar_children()) or any(directory.glob(f"{SIDECAR_FOLDER}/*")))
        children = _sidecar_children()
        assert children, "the maker ended before it could be stopped"
        for child in children:
            child.suspend()
        started = time.monotonic()
    took = time.monotonic() - started
    stats = session.stats()
    assert stats.check() and stats.failed == 0 and stats.written == stats.submitted, stats.summary()
    assert took < 5.0, f"the close took {took:.1f}s"
    for child in children:
        assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE
    assert not [p for p in (directory / SIDECAR_FOLDER).glob(".*")], "a temporary was left"
    ids = pq.read_table(directory).column("id").to_pylist()
    assert len(ids) == len(set(ids)) == stats.written
