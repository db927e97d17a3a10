"""ParquetSink under faults, with real processes and signals: a writer process stopped then resumed
or killed before the last file, sessions opening on one directory at once, a damaged journal line
(at the next sink's open and in `asynctrace recover`), and recovery leaving alone the files it did
not write."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import anyio
import orjson
import pyarrow.parquet as pq
import pytest

import asynctrace as at
from asynctrace.sinks._parquet_rows import journal_lines
from asynctrace.sinks._parquet_sidecar import SIDECAR_FOLDER
from tests._util import sample
from tests.faults import _harness as h
from tests.sinks.test_parquet import _files, _record, _run_child, _writer_processes

pytestmark = pytest.mark.anyio


def _ids(directory: Path) -> list[str]:
    """Every id the archive's files hold (duplicates kept)."""
    return pq.read_table(directory).column("id").to_pylist() if _files(directory) else []


def _hidden(directory: Path) -> list[str]:
    """The hidden entries the sink leaves (journals, temporaries), not its sidecars' folder."""
    return sorted(p.name for p in directory.iterdir() if p.name.startswith(".") and p.name != SIDECAR_FOLDER)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_stopped_then_resumed_writer_counts_and_archives_each_batch_once(tmp_path: Path) -> None:
    """A writer process stopped (SIGSTOP) while a batch rolls a file: the write does not wait for
    it (the batch is written once in the journal), and once resumed the file holds every record
    once; nothing is counted failed."""
    memory = at.testing.MemorySink("memory")
    sink = at.ParquetSink(tmp_path, max_records=20)
    retry = at.RetryPolicy(max_attempts=3, attempt_timeout=1.0, initial_backoff=0.05, max_backoff=0.1)
    async with at.TraceSession("p", run="r", sinks=[sink, memory], retry=retry, batch_size=10) as s:
        await s.log_samples([sample(i) for i in range(10)], step=0)
        assert await s.flush(timeout=60)
        (writer,) = _writer_processes()
        writer.suspend()
        try:
            started = time.monotonic()
            await s.log_samples([sample(i, step=1) for i in range(10)], step=1)
            flushed = await s.flush(timeout=10)
            waited = time.monotonic() - started
        finally:
            writer.resume()
        assert flushed and waited < 1.0, f"the write waited {waited:.1f}s for a stopped writer process"
    st = s.stats()
    assert st.check() and st.written == 20 and st.failed == 0, st.summary()
    ids = _ids(tmp_path)
    assert sorted(ids) == sorted(r.id for r in memory.records), f"{len(ids)} rows for 20 records"
    assert not _hidden(tmp_path)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_stopped_writer_holds_a_bounded_number_of_journals(tmp_path: Path) -> None:
    """Files end every record while the writer process is stopped: at most 16 journals wait for
    it (then the open file grows past its bound), every write returns, and once resumed each
    record is in a file once."""
    sink = at.ParquetSink(tmp_path, max_records=1)
    sink.bind("p", "r")
    await sink.open()
    (writer,) = _writer_processes()
    writer.suspend()
    try:
        with anyio.fail_after(10):
            for i in range(40):
                await sink.write([_record(f"b-{i}")])
        assert len(list(tmp_path.glob(".*.journal"))) == 17
    finally:
        writer.resume()
    await sink.close()
    assert sorted(_ids(tmp_path)) == sorted(f"b-{i}" for i in range(40))
    assert not _hidden(tmp_path)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_journal_removed_under_a_live_sink_still_becomes_its_file(tmp_path: Path) -> None:
    """A journal whose name is removed while its sink runs (a cleaner, a mistaken `rm`), before
    the file maker reached it: the sink still makes its file from the journal it holds open."""
    sink = at.ParquetSink(tmp_path, max_records=5)
    sink.bind("p", "r")
    await sink.open()
    (writer,) = _writer_processes()
    writer.suspend()  # the maker waits on the first file, the second journal is not read yet
    try:
        await sink.write([_record(f"a-{i}") for i in range(5)])
        await sink.write([_record(f"b-{i}") for i in range(3)])
        (second,) = [p for p in tmp_path.glob(".*.journal") if p.name.endswith("-00001.journal")]
        second.unlink()
    finally:
        writer.resume()
    await sink.close()
    want = [f"a-{i}" for i in range(5)] + [f"b-{i}" for i in range(3)]
    assert sorted(_ids(tmp_path)) == want
    assert not _hidden(tmp_path)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_writer_killed_after_the_last_write_still_makes_the_last_file(tmp_path: Path) -> None:
    """The writer process SIGKILLed (as the OOM killer would) after the last write: leaving the
    session still ends the last file, with every written record, and no journal stays."""
    memory = at.testing.MemorySink("memory")
    sink = at.ParquetSink(tmp_path)
    async with at.TraceSession("p", run="r", sinks=[sink, memory]) as s:
        await s.log_samples([sample(i) for i in range(20)], step=0)
        assert await s.flush(timeout=60)
        (writer,) = _writer_processes()
        writer.kill()
        writer.wait(30)
    st = s.stats()
    assert st.check() and st.written == 20 and st.failed == 0, st.summary()
    assert sorted(_ids(tmp_path)) == sorted(r.id for r in memory.records)
    assert not _hidden(tmp_path) and not _writer_processes()


async def _sessions_at_once(directory: Path, count: int, process: bool) -> list[at.SessionStats]:
    """`count` sessions opening on `directory` in one task group, five records each."""
    stats: list[at.SessionStats] = []

    async def one(rank: int) -> None:
        sink = at.ParquetSink(directory, process=process)
        async with at.TraceSession("p", run=f"rank{rank}", sinks=[sink], health_metrics=False) as s:
            await s.log_samples([sample(i, step=rank) for i in range(5)], step=rank)
        stats.append(s.stats())

    async with anyio.create_task_group() as tg:
        for rank in range(count):
            tg.start_soon(one, rank)
    return stats


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_sessions_opening_on_one_directory_at_once_keep_every_record(tmp_path: Path) -> None:
    """Sixteen sessions (ranks) opening ParquetSinks on one archive directory at once, round after
    round: no sink takes another's journal or refuses to open, and every record is archived once."""
    rounds, count = 8, 16
    for r in range(rounds):
        stats = await _sessions_at_once(tmp_path, count, process=False)
        failed = [st.summary() for st in stats if not (st.check() and st.written == 5 and st.failed == 0)]
        assert not failed, f"round {r}: {failed[0]}"
        ids = _ids(tmp_path)
        assert len(ids) == len(set(ids)) == 5 * count * (r + 1), f"round {r}: {len(ids)} rows"
    assert not _hidden(tmp_path)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_sessions_with_writer_processes_opening_at_once_keep_every_record(tmp_path: Path) -> None:
    """The same with each sink's writer process (the default): four sessions at once."""
    stats = await _sessions_at_once(tmp_path, 4, process=True)
    failed = [st.summary() for st in stats if not (st.check() and st.written == 5 and st.failed == 0)]
    assert not failed, failed[0]
    ids = _ids(tmp_path)
    assert len(ids) == len(set(ids)) == 20
    assert not _hidden(tmp_path)


# Damaged journal lines, by the record they replace: not JSON, without the sample, a field of the
# wrong type.
DAMAGE = {
    "bad json": lambda rid, line: line[:40] + b"\x00 not json",
    "no sample": lambda rid, line: orjson.dumps(
        {"id": rid, "step": 0, "split": "train", "key": "k", "timestamp": 1.0}
    ),
    "wrong type": lambda rid, line: orjson.dumps(
        {"id": rid, "step": "0", "split": "train", "key": "k", "timestamp": 1.0, "sample": {}}
    ),
}


def _damage(journal: Path, rids: list[str]) -> None:
    """Replace the journal lines of records `rids` by damaged ones, one of each kind of `DAMAGE`."""
    lines = journal.read_bytes().split(b"\n")
    for rid, damage in zip(rids, DAMAGE.values(), strict=True):
        (at_line,) = [i for i, line in enumerate(lines) if f'"id":"{rid}"'.encode() in line]
        lines[at_line] = damage(rid, lines[at_line])
    journal.write_bytes(b"\n".join(lines))


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_damaged_lines_in_a_dead_journal_are_skipped_counted_and_named(tmp_path: Path) -> None:
    """A killed sink's journal with three damaged lines (not JSON, no sample, a field of the wrong
    type): the next sink on the directory opens and writes as usual, recovers the other 97
    records into a file, and names the journal and the lines it skipped."""
    done = _run_child("killed-after-write", str(tmp_path), "100")
    assert done.returncode == -signal.SIGKILL, done.stderr
    (journal,) = tmp_path.glob(".*.journal")
    lost = ["k-10", "k-50", "k-90"]
    _damage(journal, lost)
    memory = at.testing.MemorySink("memory")
    sink = at.ParquetSink(tmp_path)
    async with at.TraceSession("p", run="next", sinks=[sink, memory]) as s:
        await s.log_samples([sample(i) for i in range(10)], step=0)
    st = s.stats()
    assert st.check() and st.written == 10 and st.failed == 0, st.summary()
    assert sink.recovered == 97
    assert [(d.path, d.lines, d.error) for d in sink.damaged_journals] == [(journal, 3, None)]
    want = {f"k-{i}" for i in range(100)} - set(lost) | {r.id for r in memory.records}
    assert sorted(_ids(tmp_path)) == sorted(want)
    assert not _hidden(tmp_path)


def test_a_journal_line_with_a_time_out_of_range_is_skipped_not_the_whole_journal(tmp_path: Path) -> None:
    """A killed sink's journal with lines whose timestamps no 64-bit microsecond column holds
    (1e300, -1e300 s): those two are skipped and counted, the other 28 records become a file,
    and no journal is left behind."""
    done = _run_child("killed-after-write", str(tmp_path), "30")
    assert done.returncode == -signal.SIGKILL, done.stderr
    (journal,) = tmp_path.glob(".*.journal")
    lines = journal.read_bytes().split(b"\n")
    for rid, when in (("k-3", 1e300), ("k-17", -1e300)):
        (at_line,) = [i for i, line in enumerate(lines) if f'"id":"{rid}"'.encode() in line]
        lines[at_line] = orjson.dumps({**orjson.loads(lines[at_line]), "timestamp": when})
    journal.write_bytes(b"\n".join(lines))
    sink = at.ParquetSink(tmp_path, process=False)
    anyio.run(sink.open)
    anyio.run(sink.close)
    assert sink.recovered == 28
    assert [(d.path, d.lines, d.error) for d in sink.damaged_journals] == [(journal, 2, None)]
    assert sorted(_ids(tmp_path)) == sorted(f"k-{i}" for i in range(30) if i not in (3, 17))
    assert not _hidden(tmp_path)


def _open_and_close(directory: Path) -> at.ParquetSink:
    sink = at.ParquetSink(directory, process=False)
    anyio.run(sink.open)
    anyio.run(sink.close)
    return sink


def test_a_file_under_a_dead_journals_name_goes_with_it_only_when_it_holds_its_records(
    tmp_path: Path,
) -> None:
    """A killed sink's journal whose file name is taken by a file that is not its own (another
    writer's Parquet file) is left, named, and the file untouched; once that file is gone the
    journal becomes its file; and that journal back in place (a kill after the file was named,
    before the journal was removed) only goes, adding no row twice."""
    archive = tmp_path / "archive"
    done = _run_child("killed-after-write", str(archive), "30")
    assert done.returncode == -signal.SIGKILL, done.stderr
    (journal,) = archive.glob(".*.journal")
    kept = journal.read_bytes()
    final = archive / (journal.name[1:].removesuffix(".journal") + ".parquet")
    other = tmp_path / "other"
    foreign = at.ParquetSink(other, stem="o", process=False)
    anyio.run(foreign.open)
    anyio.run(foreign.write, [_record(f"other-{i}") for i in range(3)])
    anyio.run(foreign.close)
    (made,) = other.glob("o-*.parquet")
    final.write_bytes(made.read_bytes())
    planted = final.read_bytes()

    first = _open_and_close(archive)
    assert first.recovered == 0 and journal.exists() and final.read_bytes() == planted
    ((path, lines_lost, error),) = first.damaged_journals
    assert path == journal and lines_lost == 0 and "does not hold this journal's records" in (error or "")

    final.unlink()
    assert _open_and_close(archive).recovered == 30 and not journal.exists()
    assert sorted(_ids(archive)) == sorted(f"k-{i}" for i in range(30))

    journal.write_bytes(kept)
    again = _open_and_close(archive)
    assert again.recovered == 0 and not again.damaged_journals and not journal.exists()
    assert sorted(_ids(archive)) == sorted(f"k-{i}" for i in range(30))


_KILLED_AFTER_FLUSH = """
import os, signal, sys
import asynctrace as at

archive, spool, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
with at.TraceSession("p", run="r", sinks=[at.sinks.ParquetSink(archive)], spool_dir=spool) as s:
    s.log_samples([{"prompt": f"q{i}", "response": "a", "uid": f"0:{i}"} for i in range(count)], step=0)
    assert s.flush(timeout=60)
    assert s.stats().written == count
    os.kill(os.getpid(), signal.SIGKILL)  # everything acknowledged: only the journal holds them
"""


def _killed_after_flush(archive: Path, spool: Path, count: int) -> Path:
    """A session with a spool and a ParquetSink, SIGKILLed once `count` samples are written: its
    setup stays in the spool and its records in the journal it returns."""
    child = subprocess.run(
        [sys.executable, "-c", _KILLED_AFTER_FLUSH, str(archive), str(spool), str(count)],
        env=h.env(), cwd=h.ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert child.returncode == -signal.SIGKILL, child.stderr
    (journal,) = archive.glob(".*.journal")
    return journal


def _uids(archive: Path) -> list[str]:
    return [orjson.loads(m)["uid"] for m in pq.read_table(archive).column("metadata").to_pylist()]


def _foreign_files(archive: Path, elsewhere: Path) -> dict[Path, bytes]:
    """Plant in `archive` hidden files asynctrace did not write there: journal-shaped lines
    without a journal header, another program's temporary and text, and a link to a dead sink's
    journal in `elsewhere`, under the name it has there. What each holds, by path."""
    lines, _ = journal_lines([_record(f"other-{i}") for i in range(3)])
    foreign = {
        archive / ".notes.journal": lines,
        archive / ".notes-00000.parquet.tmp": b"PAR1 someone else's file",
        archive / ".draft-00000.journal": b"plain text\n",
    }
    for path, data in foreign.items():
        path.write_bytes(data)
    sink = at.ParquetSink(elsewhere, stem="outside", process=False)
    anyio.run(sink.open)
    anyio.run(sink.write, [_record(f"out-{i}") for i in range(4)])
    (live,) = elsewhere.glob(".*.journal")
    copy = elsewhere / "dead.journal"  # what the sink had written, its lock not held
    copy.write_bytes(live.read_bytes())
    anyio.run(sink.close)
    (archive / live.name).symlink_to(copy)
    return {**foreign, copy: copy.read_bytes()}


def test_recover_skips_damaged_journal_lines_and_touches_no_file_it_did_not_write(tmp_path: Path) -> None:
    """`asynctrace recover` on a spool whose session's journal has damaged lines (not JSON, no
    sample, a field of the wrong type), in a directory that also holds hidden files of other
    programs named alike and a link to a journal elsewhere: the other 97 records become a file,
    the summary names the journal and the lines lost, the exit status is 1 (records were lost,
    not a traceback or "spool unusable"), and no other file is read, converted or deleted."""
    archive, spool, elsewhere = tmp_path / "archive", tmp_path / "spool", tmp_path / "elsewhere"
    journal = _killed_after_flush(archive, spool, 100)
    ids = {orjson.loads(line)["sample"]["metadata"]["uid"]: orjson.loads(line)["id"]
           for line in journal.read_bytes().splitlines()[1:]}  # fmt: skip
    _damage(journal, [ids[f"0:{i}"] for i in (10, 50, 90)])
    foreign = _foreign_files(archive, elsewhere)
    result = h.recover(str(spool))
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    said = f"{journal}: 3 damaged journal lines skipped (their records are lost)"
    assert said in result.stdout, result.stdout
    assert "97 rows of killed Parquet sinks' journals written as Parquet files" in result.stdout
    assert sorted(_uids(archive)) == sorted(f"0:{i}" for i in range(100) if i not in (10, 50, 90))
    for path, data in foreign.items():
        assert path.read_bytes() == data, f"{path.name} was touched"
    links = [p for p in archive.iterdir() if p.is_symlink()]
    assert [os.readlink(p) for p in links] == [str(elsewhere / "dead.journal")], "the link was touched"
    assert sorted(_hidden(archive)) == sorted(p.name for p in [*foreign, *links] if p.parent == archive)


_KILLED_WITH_A_HUNG_SINK = """
import os, signal, sys, time
import asynctrace as at

archive, spool, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
sinks = [at.ParquetSink(archive), at.testing.MemorySink("memory", hang=True)]
with at.TraceSession("p", run="r", sinks=sinks, spool_dir=spool) as s:
    s.log_samples([{"prompt": f"q{i}", "response": "a", "uid": f"0:{i}"} for i in range(count)], step=0)
    deadline = time.monotonic() + 60
    while s.stats().sinks["parquet"].written < count:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    os.kill(os.getpid(), signal.SIGKILL)  # the records stay in the spool: the other sink has none
"""


def test_recover_that_replays_names_the_damaged_lines_its_sink_found_at_open(tmp_path: Path) -> None:
    """A killed session whose other sink hung leaves its records in the spool and its Parquet
    journal damaged: recover replays them, its ParquetSink turns the journal into a file at open,
    and the summary still names the journal and the lines lost, with exit status 1 (and says once
    why the in-memory sink gets nothing)."""
    archive, spool = tmp_path / "archive", tmp_path / "spool"
    child = subprocess.run(
        [sys.executable, "-c", _KILLED_WITH_A_HUNG_SINK, str(archive), str(spool), "50"],
        env=h.env(), cwd=h.ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert child.returncode == -signal.SIGKILL, child.stderr
    (journal,) = archive.glob(".*.journal")
    ids = [orjson.loads(line)["id"] for line in journal.read_bytes().splitlines()[1:]]
    _damage(journal, ids[5:8])
    result = h.recover(str(spool))
    assert "p/r: 50 replayed" in result.stdout, result.stdout
    said = f"{journal}: 3 damaged journal lines skipped (their records are lost)"
    assert said in result.stdout, result.stdout
    assert result.returncode == 1, result.stdout + result.stderr
    assert len(_ids(archive)) == 47 and not _hidden(archive)
    unmade = "  sink 'memory' cannot be made outside the trainer, so it gets nothing: "
    unmade += "its recovery_args() is None"
    assert unmade in result.stdout.splitlines(), result.stdout
