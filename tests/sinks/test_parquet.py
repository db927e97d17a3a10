"""ParquetSink against real pyarrow (and DuckDB reading the archive back): the contract, complete
files only, roll-over, unique names, recovery after SIGKILL and no duplicates after a spool replay."""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import duckdb
import orjson
import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import asynctrace as at
from asynctrace._records.types import TraceRecord
from asynctrace._runtime.lifecycle import finish_bound
from asynctrace.sinks._parquet_sidecar import SIDECAR_FOLDER
from tests._util import sample
from tests.sinks._contract import CONTRACT, RETRY, Backend, run_contract

pytestmark = pytest.mark.anyio
# Tests whose work is a child process's or the sink's threads': one event loop is enough (the
# contract runs on both).
ONE_BACKEND = pytest.mark.parametrize("anyio_backend", ["asyncio"])

ROOT = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def read_only(directory: Path) -> Iterator[None]:
    """No file can be created in `directory` while inside (root ignores modes: it gets the immutable flag)."""
    if os.geteuid() == 0:
        subprocess.run(["chattr", "+i", str(directory)], check=True)
        try:
            yield
        finally:
            subprocess.run(["chattr", "-i", str(directory)], check=True)
    else:
        mode = directory.stat().st_mode
        directory.chmod(0o555)
        try:
            yield
        finally:
            directory.chmod(mode)


@contextlib.contextmanager
def stopped_writers() -> Iterator[None]:
    """Inside: every ParquetSink writer process this process starts is stopped (SIGSTOP) as soon
    as it is seen, before it says it is ready; after: killed."""
    stopped: dict[int, psutil.Process] = {}
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.002):
            for process in _writer_processes():
                if process.pid not in stopped:
                    with contextlib.suppress(psutil.Error):
                        process.suspend()
                        stopped[process.pid] = process

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()
        for process in stopped.values():
            with contextlib.suppress(psutil.Error):
                process.kill()


class ParquetBackend(Backend):
    """A directory of Parquet files; faults: a read-only directory (transient), a file where the
    directory was (permanent), a writer process stopped before it is ready (a hang: the sink
    never opens; once open, a write never waits for the writer process)."""

    def __init__(self, root: Path) -> None:
        self.dir = root / "archive"
        self.dir.mkdir()
        self._stems = itertools.count()
        self.stem = ""

    def make_sink(self) -> at.Sink:
        self.stem = f"contract-{next(self._stems)}"
        # Eight records a file: every batch of the contract ends in a new file.
        return at.ParquetSink(self.dir, max_records=8, stem=self.stem)

    def read_ids(self) -> list[str]:
        ids: list[str] = pq.read_table(self.dir).column("id").to_pylist()
        return ids

    @contextlib.contextmanager
    def transient_fault(self) -> Iterator[None]:
        with read_only(self.dir):
            yield

    @contextlib.contextmanager
    def permanent_fault(self) -> Iterator[None]:
        moved = self.dir.with_name("moved")
        os.rename(self.dir, moved)
        self.dir.write_bytes(b"a file where the archive directory was")
        try:
            yield
        finally:
            self.dir.unlink()
            os.rename(moved, self.dir)

    @contextlib.contextmanager
    def hang(self) -> Iterator[None]:
        with stopped_writers():
            yield


@pytest.mark.parametrize("point", CONTRACT)
async def test_contract(point: str, tmp_path: Path) -> None:
    """The Parquet sink keeps the sink contract (see tests/sinks/_contract.py)."""
    await run_contract(point, ParquetBackend(tmp_path))


def _leftover(path: Path) -> bool:
    """A hidden entry the sink leaves (a journal, a temporary), not its sidecars' folder."""
    return path.name.startswith(".") and path.name != SIDECAR_FOLDER


def _files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.parquet"))


async def test_duckdb_fetches_whole_rows_with_their_timestamps(tmp_path: Path) -> None:
    """`SELECT *` on the archive, fetched as Python values (DuckDB converts the UTC timestamp
    column through pytz, which the parquet extra installs), gives aware submission times."""
    memory = at.testing.MemorySink("memory")
    async with at.TraceSession("p", run="r", sinks=[at.ParquetSink(tmp_path), memory]) as s:
        await s.log_samples([sample(i) for i in range(3)], step=0)
    rows = duckdb.sql(f"SELECT * FROM '{tmp_path}/*.parquet' ORDER BY id").fetchall()
    columns = [c[0] for c in duckdb.sql(f"SELECT * FROM '{tmp_path}/*.parquet'").description]
    stamps = {r[columns.index("id")]: r[columns.index("timestamp")] for r in rows}
    assert len(stamps) == 3
    for record in memory.records:
        stamp = stamps[record.id]
        assert stamp.utcoffset() is not None and stamp.timestamp() == pytest.approx(
            record.timestamp, abs=1e-5
        )


@ONE_BACKEND
async def test_duckdb_reads_every_record_with_typed_columns(tmp_path: Path) -> None:
    """DuckDB reads the directory back: one row per record under the id other sinks got, typed columns."""
    memory = at.testing.MemorySink("memory")
    sink = at.ParquetSink(tmp_path, max_records=10)
    async with at.TraceSession("p", run="r", sinks=[sink, memory], batch_size=7) as s:
        for step in range(3):
            await s.log_samples(
                [
                    sample(i, step=step, advantage=i - 2.5, policy_version=step, stop_reason="length")
                    for i in range(9)
                ],
                step=step,
            )
        await s.log_samples([{"prompt": "q", "response": "a", "reward": "n/a"}], step=3, split="eval")
    rows = duckdb.sql(
        f"SELECT id, step, split, key, reward, advantage, policy_version, stop_reason, metadata, messages "
        f"FROM read_parquet('{tmp_path}/*.parquet') ORDER BY step, id"
    ).fetchall()
    by_id = {r.id: r for r in memory.records}
    assert len(rows) == len(by_id) == 28
    for rid, step, split, key, reward, advantage, version, stop, metadata, messages in rows:
        record = by_id[rid]
        assert (step, split, key) == (record.step, record.split, record.key)
        got = record.sample
        assert orjson.loads(metadata) == got.metadata and orjson.loads(messages) == got.messages
        if split == "eval":
            # A reward that is not a number stays in metadata, and its column is null.
            assert reward is None and advantage is None and version is None and stop is None
        else:
            assert reward == got.metadata["reward"] and advantage == got.metadata["advantage"]
            assert version == step and stop == "length"
    assert duckdb.sql(f"SELECT count(DISTINCT id) FROM '{tmp_path}/*.parquet'").fetchall() == [(28,)]
    assert pq.read_schema(_files(tmp_path)[0]) == pq.read_schema(_files(tmp_path)[-1])


@ONE_BACKEND
async def test_files_roll_over_by_records_and_by_bytes(tmp_path: Path) -> None:
    """A file ends at the first batch boundary past max_records or max_bytes; names never collide."""
    # The sink decides where a file ends, not its converter: the in-process one saves four
    # writer-process starts (test_files_are_the_same_with_the_writer_in_a_thread ties the two).
    by_count = tmp_path / "count"
    sink = at.ParquetSink(by_count, max_records=10, process=False)
    async with at.TraceSession("p", run="r", sinks=[sink], batch_size=5) as s:
        for step in range(5):
            await s.log_samples([sample(i, step=step) for i in range(5)], step=step)
            assert await s.flush(timeout=30)
    counts = [pq.ParquetFile(p).metadata.num_rows for p in _files(by_count)]
    assert counts == [10, 10, 5], counts
    assert sink.paths == _files(by_count)
    assert pq.ParquetFile(sink.paths[0]).metadata.row_group(0).column(0).compression == "ZSTD"

    by_bytes = tmp_path / "bytes"
    big = "x" * 1000
    sink = at.ParquetSink(by_bytes, max_bytes=3000, process=False)
    async with at.TraceSession("p", run="r", sinks=[sink], batch_size=1) as s:
        for i in range(7):
            await s.log_samples([sample(i, note=big)], step=0)
            assert await s.flush(timeout=30)
    assert [pq.ParquetFile(p).metadata.num_rows for p in _files(by_bytes)] == [3, 3, 1]

    # Two more sessions of the same run in the same directory: new names, nothing overwritten.
    for _ in range(2):
        sink = at.ParquetSink(by_count, max_records=10, process=False)
        async with at.TraceSession("p", run="r", sinks=[sink]) as s:
            await s.log_samples([sample(i) for i in range(3)], step=0)
    assert len(_files(by_count)) == 5
    assert pq.read_table(by_count).num_rows == 31
    assert not [p for p in by_count.iterdir() if _leftover(p)], "no journal or temporary left"


def _run_child(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tests.sinks._parquet_child", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )


def _record(rid: str, *, replayed: bool = False) -> TraceRecord:
    payload = orjson.dumps({"messages": [{"role": "user", "content": rid}], "metadata": {"reward": 1.0}})
    return TraceRecord(rid, 0, "train", "train/traces", payload, time.time(), replayed=replayed)


@ONE_BACKEND
async def test_replayed_records_already_archived_are_skipped(tmp_path: Path) -> None:
    """A record replayed from a spool is written only if no file (or the journal) holds its id yet."""
    # The sink skips what its files hold: no writer process is needed to show it.
    first = at.ParquetSink(tmp_path, max_records=4, process=False)
    first.bind("p", "r")
    await first.open()
    await first.write([_record(f"s1-{i}") for i in range(6)])
    await first.close()

    again = at.ParquetSink(tmp_path, max_records=4, process=False)
    again.bind("p", "r")
    await again.open()
    await again.write([_record(f"s1-{i}", replayed=True) for i in range(3, 9)])
    await again.write([_record("s1-9"), _record("s1-9", replayed=True)])
    await again.close()
    ids = pq.read_table(tmp_path).column("id").to_pylist()
    assert sorted(ids) == sorted(f"s1-{i}" for i in range(10)), ids
    assert again.duplicates_skipped == 4


@ONE_BACKEND
async def test_a_full_disk_fails_the_write_without_a_partial_file(tmp_path: Path) -> None:
    """A write the file-size limit refuses (EFBIG, as a full disk's ENOSPC) leaves no file, and the
    retried batch lands once."""
    done = _run_child("disk-full", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["refused", "27", "True"], done.stdout


def _child_until_killed(directory: Path, spool: Path, *, files: int, logged: int) -> int:
    """Run the logging child until the archive has `files` files and it logged `logged` samples;
    SIGKILL it there and return how many samples it had logged."""
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.sinks._parquet_child", "trainer", str(directory), str(spool)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    seen = 0
    deadline = time.monotonic() + 120
    try:
        assert child.stdout is not None
        for line in child.stdout:
            seen = int(line.split()[1])
            if seen >= logged and len(_files(directory)) >= files:
                break
            assert time.monotonic() < deadline, "the child did not write its files in time"
        else:
            raise AssertionError(f"the child stopped: {child.stderr.read() if child.stderr else ''}")
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    return seen


@ONE_BACKEND
async def test_sigkill_leaves_only_whole_files_and_a_replay_adds_no_duplicate(tmp_path: Path) -> None:
    """A trainer killed mid-run leaves only complete Parquet files; the next session recovers its
    journal and replays its spool, and the archive then holds every logged sample exactly once."""
    archive, spool = tmp_path / "archive", tmp_path / "spool"
    logged = _child_until_killed(archive, spool, files=3, logged=200)
    for path in _files(archive):
        # Every file present reads back whole: its footer is there and every row decodes.
        table = pq.read_table(path)
        assert table.num_rows == pq.ParquetFile(path).metadata.num_rows > 0
    sink = at.ParquetSink(archive, max_records=1000)
    async with at.TraceSession("p", run="killed", sinks=[sink], spool_dir=spool) as s:
        pass
    assert s.stats().check(), s.stats().summary()
    ids = pq.read_table(archive).column("id").to_pylist()
    assert len(ids) == len(set(ids)), "a record appears twice in the archive"
    assert len(ids) >= logged, f"{len(ids)} archived, {logged} logged"
    assert {i.rpartition("-")[0] for i in ids} == {ids[0].rpartition("-")[0]}, "only the child's records"
    assert not [p for p in archive.iterdir() if _leftover(p)], "journal and temporaries are gone"


@ONE_BACKEND
async def test_a_killed_sinks_journal_becomes_a_file(tmp_path: Path) -> None:
    """Records a killed sink had counted as written (in its journal, no file yet) are in the archive
    once the next sink opens the directory."""
    done = _run_child("killed-after-write", str(tmp_path))
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert not _files(tmp_path) and len(list(tmp_path.glob(".*.journal"))) == 1
    sink = at.ParquetSink(tmp_path)
    async with at.TraceSession("p", run="next", sinks=[sink]):
        pass
    assert sink.recovered == 30
    assert sorted(pq.read_table(tmp_path).column("id").to_pylist()) == sorted(f"k-{i}" for i in range(30))
    assert not [p for p in tmp_path.glob(".*") if _leftover(p)]


@ONE_BACKEND
async def test_a_live_sinks_journal_is_not_taken(tmp_path: Path) -> None:
    """A second sink in the same directory leaves a running sink's journal alone."""
    first = at.ParquetSink(tmp_path, max_records=100)
    first.bind("p", "r")
    await first.open()
    await first.write([_record(f"a-{i}") for i in range(5)])
    second = at.ParquetSink(tmp_path)
    second.bind("p", "r")
    await second.open()
    assert second.recovered == 0 and not _files(tmp_path)
    await second.close()
    await first.close()
    assert pq.read_table(tmp_path).num_rows == 5


def test_missing_pyarrow_names_the_extra_and_import_stays_light() -> None:
    """`import asynctrace` never imports pyarrow; without it, ParquetSink names the extra."""
    code = (
        "import sys\n"
        "import asynctrace\n"
        "assert 'pyarrow' not in sys.modules, 'import asynctrace imported pyarrow'\n"
        "sys.modules['pyarrow'] = None\n"
        "try:\n"
        "    asynctrace.ParquetSink('x')\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert 'pip install "asynctrace[parquet]"' in done.stdout


def test_bad_arguments_are_named() -> None:
    """Sizes below 1 and a stem that is not a plain name are refused with the argument's name."""
    with pytest.raises(ValueError, match="max_records"):
        at.ParquetSink("x", max_records=0)
    with pytest.raises(ValueError, match="stem"):
        at.ParquetSink("x", stem="../escape")
    assert isinstance(at.sinks.ParquetSink("x"), at.Sink)
    assert pa.__version__


async def test_one_query_follows_a_watched_prompt_across_policy_versions(tmp_path: Path) -> None:
    """With a cap of 1 and a watch list, the watched prompt is archived at every step, and the
    DuckDB query docs/choosing.md gives returns it once per step with its policy version."""
    # What the session keeps is checked here, not the converter: the in-process one does.
    async with at.TraceSession(
        "p",
        run="r",
        sinks=[at.ParquetSink(tmp_path, process=False)],
        max_traces_per_step=1,
        watch=at.Watch(ids=["gsm8k-0042"], max_per_step=4),
        health_metrics=False,
    ) as s:
        for step in range(4):
            batch = [sample(i, step=step, prompt_id=f"gsm8k-{i:04d}", policy_version=step) for i in range(60)]
            await s.log_samples(batch, step=step)
    rows = duckdb.sql(
        f"SELECT step, policy_version, reward, messages FROM '{tmp_path}/*.parquet' "
        "WHERE json_extract_string(metadata, '$.prompt_id') = 'gsm8k-0042' ORDER BY step"
    ).fetchall()
    assert [(step, version, reward) for step, version, reward, _ in rows] == [(k, k, 42.0) for k in range(4)]
    assert all("question 42 of step" in messages for *_, messages in rows)
    st = s.stats()
    assert st.written == 8 and st.dropped == {"capped": 4 * 59 - 4} and st.check(), st.summary()


def _stream_until_killed(directory: Path, name: str, delay: float) -> int:
    """Run the streaming child and SIGKILL it `delay` seconds after it starts (before its sink is
    open, while it recovers the journals earlier kills left, or while it writes); how many records
    it had written."""
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.sinks._parquet_child", "stream", str(directory), name],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    assert child.stdout is not None
    os.set_blocking(child.stdout.fileno(), False)
    written = 0
    buffered = b""
    killed_at = time.monotonic() + delay
    try:
        while time.monotonic() < killed_at:
            time.sleep(0.005)
            buffered += child.stdout.read() or b""
            *lines, buffered = buffered.split(b"\n")
            written = max([written, *(int(line.split()[1]) for line in lines if line.startswith(b"WRITTEN"))])
            assert child.poll() is None, "the child stopped by itself"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    return written


def test_sigkill_at_random_points_leaves_whole_files_without_duplicates(tmp_path: Path) -> None:
    """Sinks killed at random points (mid-write, mid-file, mid-recovery of the last one's journal)
    leave only whole files; once the next sink recovers, every written record is there exactly once."""
    seed = int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    written = {}
    for run in range(4):
        name = f"kill{run}"
        written[name] = _stream_until_killed(tmp_path, name, rng.uniform(0.5, 4.0))
        for path in _files(tmp_path):
            assert pq.read_table(path).num_rows == pq.ParquetFile(path).metadata.num_rows > 0, seed
    sink = at.ParquetSink(tmp_path)
    sink.bind("p", "check")
    anyio.run(sink.open)
    anyio.run(sink.close)
    ids = pq.read_table(tmp_path).column("id").to_pylist() if _files(tmp_path) else []
    assert len(ids) == len(set(ids)), f"a record appears twice (seed {seed})"
    for name, count in written.items():
        held = {i for i in ids if i.rpartition("-")[0] == name}
        missing = {f"{name}-{i}" for i in range(count)} - held
        assert not missing, f"seed {seed}: {len(missing)} written records of {name} lost"
    assert not [p for p in tmp_path.iterdir() if _leftover(p)], f"leftovers (seed {seed})"


async def test_files_are_the_same_with_the_writer_in_a_thread(tmp_path: Path) -> None:
    """``process=False`` writes the same files as the writer process does."""
    records = [_record(f"t-{i}") for i in range(25)] + [_record('odd"id-1')]
    tables = []
    for process in (True, False):
        directory = tmp_path / str(process)
        sink = at.ParquetSink(directory, max_records=10, stem="same", process=process)
        await sink.open()
        for start in range(0, len(records), 4):
            await sink.write(records[start : start + 4])
        await sink.close()
        assert [pq.ParquetFile(p).metadata.num_rows for p in _files(directory)] == [12, 12, 2]
        tables.append(pq.read_table(directory))
    assert tables[0].equals(tables[1])


def _writer_processes() -> list[psutil.Process]:
    """This process's ParquetSink writer processes that are running (not exited)."""
    found = []
    for p in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):  # exited meanwhile, or not reaped yet
            if "asynctrace.sinks._parquet_worker" in " ".join(p.cmdline()):
                found.append(p)
    return found


@ONE_BACKEND
async def test_a_killed_writer_process_is_replaced_without_loss(tmp_path: Path) -> None:
    """The writer process killed mid-run (as the OOM killer would): the writes do not notice (the
    journal holds them), and a new writer process makes the open file again from the journal;
    nothing is lost or written twice."""
    memory = at.testing.MemorySink("memory")
    sink = at.ParquetSink(tmp_path, max_records=50)
    async with at.TraceSession("p", run="r", sinks=[sink, memory], retry=RETRY, batch_size=10) as s:
        await s.log_samples([sample(i) for i in range(30)], step=0)
        assert await s.flush(timeout=60)
        (writer,) = _writer_processes()
        writer.kill()
        writer.wait(30)
        await s.log_samples([sample(i) for i in range(40)], step=1)
        assert await s.flush(timeout=60)
    st = s.stats()
    assert st.check() and st.written == 70 and st.failed == 0 and st.retries == 0, st.summary()
    ids = pq.read_table(tmp_path).column("id").to_pylist()
    assert sorted(ids) == sorted(r.id for r in memory.records)
    assert [pq.ParquetFile(p).metadata.num_rows for p in _files(tmp_path)] == [50, 20]
    assert not _writer_processes(), "the writer process ends with its sink"


@ONE_BACKEND
async def test_one_large_batch_reaches_the_writer_process_whole(tmp_path: Path) -> None:
    """A batch whose layout is larger than the socket's buffer (30 000 records) lands whole."""
    sink = at.ParquetSink(tmp_path, stem="large")
    await sink.open()
    await sink.write([_record(f"big-{i}") for i in range(30_000)])
    await sink.close()
    ids = pq.read_table(tmp_path).column("id").to_pylist()
    assert sorted(ids) == sorted(f"big-{i}" for i in range(30_000))


def _unlocked(path: Path, within: float = 10.0) -> bool:
    """Whether `path` can be locked (no live sink holds it) within `within` seconds."""
    deadline = time.monotonic() + within
    while True:
        with open(path, "rb") as f:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True  # closing `f` lets go of it again
            except BlockingIOError:
                if time.monotonic() > deadline:
                    return False
        time.sleep(0.02)


def _ended(pid: int, within: float = 10.0) -> bool:
    """Whether process `pid` exits within `within` seconds (a zombie nobody reaps has exited)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.02)
    return False


def test_a_forked_child_keeps_neither_the_journal_nor_the_writer_of_a_killed_trainer(tmp_path: Path) -> None:
    """A child forked by the trainer (a DataLoader worker) holds no copy of the journal, so when
    the trainer is SIGKILLed its journal is recovered at once and its writer process exits, while
    the child lives on."""
    trainer = subprocess.Popen(
        [sys.executable, "-m", "tests.sinks._parquet_child", "fork-then-killed", str(tmp_path)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    printed: dict[str, int] = {}
    try:
        assert trainer.stdout is not None
        while len(printed) < 3 and (line := trainer.stdout.readline()):
            name, value = line.split()
            printed[name] = int(value)
        assert trainer.wait(60) == -signal.SIGKILL and len(printed) == 3, printed
        holder = psutil.Process(printed["HOLDER"])
        (journal,) = tmp_path.glob(".*.journal")
        assert _unlocked(journal, within=0.5), "the journal stays locked while the child lives"
        assert _ended(printed["WRITER"]), "the writer process waits on the child's copy of its socket"
        assert printed["HOLDS"] == 0, "the child has the journal open"
        assert holder.is_running(), "the child was to outlive the trainer"
        assert at.ParquetSink(tmp_path).finalize_journals() == 30
        ids = pq.read_table(tmp_path).column("id").to_pylist()
        assert len(ids) == len(set(ids)) == 30
    finally:
        trainer.kill()
        for pid in (printed.get("HOLDER"), printed.get("WRITER")):
            if pid is not None:
                with contextlib.suppress(psutil.NoSuchProcess):
                    psutil.Process(pid).kill()


async def test_a_close_past_its_deadline_leaves_the_journal_to_recover(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A writer process that stops answering (SIGSTOP) holds the last file past finish()'s
    deadline: finish() returns on time with honest counts, the writer is killed, the journal is let
    go of, and `recover` on the spool turns it into a file holding every record once."""
    from asynctrace._recover import recover

    archive, spool = tmp_path / "archive", tmp_path / "spool"
    memory = at.testing.MemorySink("memory")
    sink = at.ParquetSink(archive)
    try:
        async with at.TraceSession("p", run="r", sinks=[sink, memory], spool_dir=spool) as s:
            await s.log_samples([sample(i) for i in range(50)], step=0)
            assert await s.flush(timeout=60)
            (writer,) = _writer_processes()
            writer.suspend()
            started = time.monotonic()
            with caplog.at_level(logging.ERROR, logger="asynctrace"):
                stats = await s.finish(timeout=0.5)
            assert time.monotonic() - started < finish_bound(0.5) + 5.0
        assert stats.check() and stats.written == 50 and stats.sinks[sink.name].written == 50, stats
        (journal,) = archive.glob(".*.journal")
        assert f"writer process is killed; records not in a file by then stay in {journal}" in caplog.text
        assert _ended(writer.pid), "the stopped writer process is left running"
        assert _unlocked(journal), "the journal stays locked in this process"
        report = await recover(spool, progress=False)
        assert report.finalized == 50, report
        ids = pq.read_table(archive).column("id").to_pylist()
        assert sorted(ids) == sorted(r.id for r in memory.records)
        assert not [p for p in archive.iterdir() if _leftover(p)]
        assert not list(spool.glob("setup-*.json"))
    finally:
        for process in _writer_processes():
            process.kill()


async def test_a_close_given_up_on_behind_a_stopped_writer_lets_go_of_the_journals(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """With the writer process stopped, writes still return at once (the 10th record ends a file
    it cannot make); a close cut short by its caller kills the writer, and the journals, with
    every written record, are left unlocked to the next sink."""
    sink = at.ParquetSink(tmp_path, max_records=10)
    sink.bind("p", "r")
    try:
        await sink.open()
        await sink.write([_record(f"w-{i}") for i in range(5)])
        (writer,) = _writer_processes()
        writer.suspend()
        with anyio.fail_after(1.0):
            await sink.write([_record(f"x-{i}") for i in range(5)])
            await sink.write([_record(f"y-{i}") for i in range(3)])
        with caplog.at_level(logging.ERROR, logger="asynctrace"), anyio.move_on_after(0.5) as scope:
            await sink.close()
        assert scope.cancelled_caught
        assert "closing was given up on; its writer process is killed" in caplog.text
        assert _ended(writer.pid), "the stopped writer process is left running"
        journals = sorted(tmp_path.glob(".*.journal"))
        assert len(journals) == 2 and all(_unlocked(j) for j in journals), "a journal stays locked"
        assert at.ParquetSink(tmp_path).finalize_journals() == 13
        want = [f"{name}-{i}" for name, n in (("w", 5), ("x", 5), ("y", 3)) for i in range(n)]
        assert sorted(pq.read_table(tmp_path).column("id").to_pylist()) == sorted(want)
        assert [pq.ParquetFile(p).metadata.num_rows for p in _files(tmp_path)] == [10, 3]
    finally:
        for process in _writer_processes():
            process.kill()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_write_after_the_writer_process_was_killed_lands_in_the_last_file(tmp_path: Path) -> None:
    """A write that comes after its writer process was killed counts as written at once, and
    closing makes the file from the journal with every record, and nothing else."""
    sink = at.ParquetSink(tmp_path)
    sink.bind("p", "r")
    await sink.open()
    await sink.write([_record(f"w-{i}") for i in range(5)])
    (writer,) = _writer_processes()
    writer.kill()
    writer.wait(30)
    await sink.write([_record(f"x-{i}") for i in range(5)])
    await sink.close()
    want = [f"w-{i}" for i in range(5)] + [f"x-{i}" for i in range(5)]
    assert sorted(pq.read_table(tmp_path).column("id").to_pylist()) == want
    assert sink.paths == _files(tmp_path)
    assert not [p for p in tmp_path.iterdir() if _leftover(p)]
    assert not _writer_processes()
