"""The two ways TrackioSink writes locally, on real Trackio storage: Trackio's private bulk commit
where it is found as expected, else Trackio's public API, each batch read back before it counts
as written. Each path keeps the whole sink contract; the choice is made by what is found."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import shutil
import sqlite3
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import orjson
import psutil
import pytest

import asynctrace as at
from asynctrace.sinks._trackio_store import find_bulk_log
from asynctrace.sinks._trackio_writer import TrackioWriter, WriteItem
from tests._util import read_traces, sample
from tests.sinks._contract import CONTRACT, RETRY, Backend, run_contract
from tests.sinks._trackio_public import change_bulk_log, change_bulk_log_in_children, changed_env
from tests.sinks.test_written_means import _killed_after_ack

FALLBACK = "writing to Trackio through its public API"


def _set_immutable(path: Path, on: bool) -> bool:
    """Make `path` refuse writes, even root's (`chattr +i`), or clear that; False where impossible."""
    if os.geteuid() != 0:
        path.chmod(0o444 if on else 0o644)
        return True
    if shutil.which("chattr") is None:
        return False
    flag = "+i" if on else "-i"
    return subprocess.run(["chattr", flag, str(path)], capture_output=True, timeout=30).returncode == 0


class TrackioBackend(Backend):
    """A Trackio project in the tests' TRACKIO_DIR. Faults: its database file made immutable (a
    volume remounted read-only for a while: every write fails at once, reads go on), a file that is
    not a database in its place (permanent), a lock another connection holds (a hang)."""

    def __init__(self) -> None:
        self.project = f"c-{uuid.uuid4().hex[:10]}"
        self.sink: at.TrackioSink | None = None

    @property
    def db(self) -> Path:
        from trackio.sqlite_storage import SQLiteStorage

        return Path(SQLiteStorage.get_project_db_path(self.project))

    def make_sink(self) -> at.Sink:
        self.sink = at.TrackioSink(self.project, "r")
        return self.sink

    def read_ids(self) -> list[str]:
        return [t["metadata"]["asynctrace_id"] for t in read_traces(self.project, "r")]

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        from trackio.sqlite_storage import SQLiteStorage

        SQLiteStorage.init_db(self.project)  # the database exists (in WAL mode) to be held
        # Writers wait for it (Trackio's busy timeout is 30 s, then "database is locked").
        holder = sqlite3.connect(self.db, isolation_level=None, timeout=1.0, check_same_thread=False)
        try:
            holder.execute("BEGIN EXCLUSIVE")
            yield
        finally:
            holder.rollback()
            holder.close()

    @contextlib.contextmanager
    def transient_fault(self) -> Iterator[None]:
        if not _set_immutable(self.db, True):
            with self._locked():
                yield
            return
        try:
            yield
        finally:
            assert _set_immutable(self.db, False), "could not make the database writable again"

    @contextlib.contextmanager
    def permanent_fault(self) -> Iterator[None]:
        # The database file replaced by one that is not a database: no retry can mend it.
        aside = self.db.with_name(f"{self.db.name}.aside")
        self.db.rename(aside)
        self.db.write_bytes(b"this is not an SQLite database\n" * 256)
        try:
            yield
        finally:
            for leftover in (self.db, Path(f"{self.db}-wal"), Path(f"{self.db}-shm")):
                leftover.unlink(missing_ok=True)
            aside.rename(self.db)

    def hang(self) -> contextlib.AbstractContextManager[None]:
        return self._locked()


def _writers() -> list[psutil.Process]:
    """This process's Trackio writer processes."""
    return [p for p in psutil.Process().children() if "_trackio_worker" in " ".join(p.cmdline())]


async def _writers_ended(before: set[int]) -> None:
    """Wait for the Trackio writer processes this process started since `before` to end (killing
    them after 30 s), while the event loop that started them can still reap them. After the hang,
    finish() gave up on the sink's writer; once the lock is gone it finishes what it was sent and
    ends on its own. A writer an earlier test left (one xdist worker runs many modules) is not
    this test's to wait for."""
    writers = [p for p in _writers() if p.pid not in before]
    with anyio.move_on_after(30):
        while any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in writers):
            await anyio.sleep(0.05)
    for p in writers:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    with anyio.fail_after(10):
        while any(p.is_running() for p in writers):
            await anyio.sleep(0.05)


def _ignore_log_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    """Trackio's bulk commit keeps its signature but stores under log ids of its own."""
    from trackio.sqlite_storage import SQLiteStorage

    real = SQLiteStorage.bulk_log

    def ignores_log_ids(
        *,
        project: str,
        run: str,
        run_id: str | None = None,
        metrics_list: list[dict[str, Any]],
        steps: list[int] | None = None,
        log_ids: list[str] | None = None,
        timestamps: list[str] | None = None,
        config: dict[str, Any] | None = None,
        space_id: str | None = None,
    ) -> None:
        real(project=project, run=run, run_id=run_id, metrics_list=metrics_list, steps=steps,
             timestamps=timestamps, config=config, space_id=space_id)  # fmt: skip

    monkeypatch.setattr(SQLiteStorage, "bulk_log", staticmethod(ignores_log_ids))


def _items(prefix: str, n: int, *, replayed: bool = False) -> list[WriteItem]:
    payload = orjson.dumps({"messages": [{"role": "user", "content": "q"}]})
    return [WriteItem(f"{prefix}-{i}", 0, "train/traces", payload, replayed, 1.7e9) for i in range(n)]


def _open_writer(project: str) -> TrackioWriter:
    writer = TrackioWriter(project, "r", seal_writes=True)
    with contextlib.redirect_stdout(io.StringIO()):
        writer.open()
    return writer


@pytest.fixture
def anyio_backend() -> str:
    # The sink talks to its writer process the same way on either loop (tests/sinks/test_trackio_process.py
    # runs both); the contract, on real storage, runs once, on asyncio.
    return "asyncio"


@pytest.mark.anyio
@pytest.mark.parametrize("path", ["private", "public"])
@pytest.mark.parametrize("point", CONTRACT)
async def test_contract(
    point: str, path: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The Trackio sink keeps the sink contract (see tests/sinks/_contract.py) on each path: the
    public one where the writer process finds Trackio's bulk commit changed, saying so once."""
    if path == "public":
        change_bulk_log_in_children(monkeypatch)
    backend = TrackioBackend()
    before = {p.pid for p in _writers()}
    with caplog.at_level(logging.WARNING, logger="asynctrace"):
        await run_contract(point, backend)
    if point == "hang":
        await _writers_ended(before)
    told = [r.getMessage() for r in caplog.records if FALLBACK in r.getMessage()]
    assert backend.sink is not None
    if point != "hang":  # a hung database holds up the writer's open: it never says how it writes
        assert backend.sink.trackio_path == path
        assert len(told) == (path == "public"), told
    if told:
        assert "SQLiteStorage.bulk_log takes no keyword project" in told[0]


def test_the_private_commit_is_found_as_expected() -> None:
    """The installed Trackio's bulk commit takes what the private path passes."""
    found = find_bulk_log()
    assert found.bulk_log is not None and found.reason is None


def test_a_missing_or_changed_private_commit_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without `SQLiteStorage.bulk_log`, or with one that lacks a keyword the sink passes or
    needs another argument, the detection says why, naming what is missing."""
    from trackio.sqlite_storage import SQLiteStorage

    with monkeypatch.context() as m:
        m.delattr(SQLiteStorage, "bulk_log")
        assert find_bulk_log() == (None, "this Trackio has no SQLiteStorage.bulk_log")

    def without_log_ids(
        project: str, run: str, run_id: str, metrics_list: Any, steps: Any, timestamps: Any, config: Any
    ) -> None:
        raise AssertionError("never called")

    def with_another(
        *,
        entries: Any,
        project: str,
        run: str,
        run_id: str,
        metrics_list: Any,
        steps: Any,
        log_ids: Any,
        timestamps: Any,
        config: Any,
    ) -> None:
        raise AssertionError("never called")

    monkeypatch.setattr(SQLiteStorage, "bulk_log", staticmethod(without_log_ids))
    assert find_bulk_log().reason == "SQLiteStorage.bulk_log takes no keyword log_ids"
    monkeypatch.setattr(SQLiteStorage, "bulk_log", staticmethod(with_another))
    assert find_bulk_log().reason == "SQLiteStorage.bulk_log requires entries as well"
    change_bulk_log(monkeypatch)
    assert find_bulk_log().bulk_log is None


@pytest.mark.anyio
async def test_a_private_commit_that_ignores_log_ids_is_left_after_its_first_write(
    project: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A bulk commit found as expected but not keeping the log ids it is given (so a retried
    write would add rows) is caught by reading the first write back: the sink says so once and
    goes on through the public API, with every record stored exactly once (`process=False`,
    where the public path waits for Trackio's own thread instead of finishing the run)."""
    _ignore_log_ids(monkeypatch)
    memory = at.testing.MemorySink("memory")
    sink = at.TrackioSink(process=False)
    with caplog.at_level(logging.WARNING, logger="asynctrace"):
        async with at.TraceSession(project, run="r", sinks=[sink, memory], batch_size=8, retry=RETRY) as s:
            for step in range(3):
                await s.log_samples([sample(i, step=step) for i in range(8)], step=step)
                assert await s.flush(timeout=60)
                assert sink.trackio_path == "public"
    stats = s.stats()
    assert stats.check() and stats.written == 24 and stats.failed == 0, stats.summary()
    told = [r.getMessage() for r in caplog.records if FALLBACK in r.getMessage()]
    assert len(told) == 1 and "bulk_log did not store 8 of the 8 traces" in told[0], told
    stored = [t["metadata"]["asynctrace_id"] for t in read_traces(project, "r")]
    assert sorted(stored) == sorted(r.id for r in memory.records)


def test_a_replay_after_a_commit_that_ignored_log_ids_adds_no_copy(
    project: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the bulk commit stored a batch under log ids of its own, a replay of that batch
    (which looks records up by log id on the private path) finds them all the same, through the
    public path the first write's check switched to, and writes nothing again."""
    _ignore_log_ids(monkeypatch)
    writer = _open_writer(project)
    assert writer.path == "private"
    assert writer.write(_items("abc", 5)) == 0
    assert writer.path == "public" and "did not store 5 of the 5" in (writer.fallback or "")
    assert writer.write(_items("abc", 5, replayed=True)) == 5
    with contextlib.redirect_stdout(io.StringIO()):
        writer.finish()
    assert sorted(t["metadata"]["asynctrace_id"] for t in read_traces(project, "r")) == sorted(
        f"abc-{i}" for i in range(5)
    )


@pytest.mark.parametrize("path", ["private", "public"])
def test_a_damaged_database_fails_a_write_permanently(
    project: str, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A project database that is no longer an SQLite database fails the write at once with
    PermanentSinkError naming it (no retry can mend the file), on either path."""
    if path == "public":
        change_bulk_log(monkeypatch)
    writer = _open_writer(project)
    assert writer.path == path
    writer.write(_items("abc", 2))
    from trackio.sqlite_storage import SQLiteStorage

    db = Path(SQLiteStorage.get_project_db_path(project))
    db.write_bytes(b"this is not an SQLite database\n" * 256)
    with pytest.raises(at.PermanentSinkError, match="damaged"):
        writer.write(_items("def", 2))


@pytest.mark.parametrize("path", ["private", "public"])
def test_rows_of_other_types_in_the_database_are_not_ours_and_break_no_write(
    project: str, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Trace rows of the run that another writer (or an edited file) stored with a log id or a
    metadata that is a BLOB, or a trace index that is text, are none of the sink's: a replay
    reading the run back skips what it holds and writes the rest, on either path."""
    if path == "public":
        change_bulk_log(monkeypatch)
    writer = _open_writer(project)
    assert writer.path == path
    assert writer.write(_items("abc", 2)) == 0
    from trackio.sqlite_storage import SQLiteStorage

    with contextlib.closing(sqlite3.connect(SQLiteStorage.get_project_db_path(project))) as conn, conn:
        columns = [row[1] for row in conn.execute("PRAGMA table_info(traces)")]
        (row,) = conn.execute("SELECT * FROM traces WHERE run_id = ? LIMIT 1", [writer.run.id]).fetchall()
        odd = [
            {"log_id": b"0000000-at-abc-0", "metadata": b'{"asynctrace_id": 1}'},
            {"log_id": "0000000-at-abc-0", "trace_index": "x", "metadata": "{}"},
        ]
        for i, changed in enumerate(odd):
            values = dict(zip(columns, row, strict=True)) | changed | {"id": f"odd-{i}"}
            marks = ", ".join("?" * len(values))
            conn.execute(f"INSERT INTO traces ({', '.join(values)}) VALUES ({marks})", list(values.values()))
    assert writer.write(_items("abc", 3, replayed=True)) == 2
    with contextlib.redirect_stdout(io.StringIO()):
        writer.finish()
    stored = [t["metadata"].get("asynctrace_id") for t in read_traces(project, "r")]
    assert sorted(i for i in stored if isinstance(i, str)) == ["abc-0", "abc-1", "abc-2"]


def test_the_public_path_refuses_trackio_s_jsonl_fragments(
    project: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where Trackio would store `run.log` as JSONL fragments, which the read-back cannot see,
    the public path fails at open, permanently, saying what to set."""
    change_bulk_log(monkeypatch)
    monkeypatch.setenv("TRACKIO_STORAGE_MODE", "jsonl")
    writer = TrackioWriter(project, "r")
    with contextlib.redirect_stdout(io.StringIO()), pytest.raises(at.PermanentSinkError) as info:
        writer.open()
    assert "TRACKIO_STORAGE_MODE=sqlite" in str(info.value) and "bulk_log" in str(info.value)
    with contextlib.redirect_stdout(io.StringIO()):
        writer.finish()


def test_public_path_written_means_committed_in_the_database(project: str) -> None:
    """Public path: every record acknowledged is a committed trace of the project's database
    when the trainer is SIGKILLed right after the acknowledgement."""
    ids = _killed_after_ack("trackio", project, {"PYTHONPATH": changed_env()["PYTHONPATH"]})
    stored = [t["metadata"]["asynctrace_id"] for t in read_traces(project, "acked")]
    assert sorted(stored) == sorted(ids)
