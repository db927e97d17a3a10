"""JsonlSink and ConsoleSink: line format, rotation, truncation, metrics."""

from __future__ import annotations

import contextlib
import io
import os
import select
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import orjson
import pytest

import asynctrace as at
from tests._util import sample

pytestmark = pytest.mark.anyio


async def test_jsonl_lines_hold_record_fields_and_sample(tmp_path: Path) -> None:
    """Each JSONL line holds id, step, split, key, timestamp and the sample as submitted."""
    sink = at.JsonlSink(tmp_path / "traces.jsonl")
    async with at.TraceSession("p", sinks=[sink]) as s:
        await s.log_samples([sample(i) for i in range(3)], step=7, split="eval")
        await s.log_metrics({"reward/mean": 0.5}, step=7)
    lines = [orjson.loads(line) for line in (tmp_path / "traces.jsonl").read_bytes().splitlines()]
    traces = [line for line in lines if "sample" in line]
    assert [t["sample"]["metadata"]["uid"] for t in traces] == ["0:0", "0:1", "0:2"]
    assert all(t["step"] == 7 and t["split"] == "eval" and t["key"] == "eval/traces" for t in traces)
    assert len({t["id"] for t in traces}) == 3 and all(isinstance(t["timestamp"], float) for t in traces)
    assert traces[0]["sample"]["messages"][0] == {"role": "user", "content": "question 0 of step 0"}
    assert {"step": 7, "metrics": {"reward/mean": 0.5}} in lines


async def test_jsonl_rotates_every_n_records(tmp_path: Path) -> None:
    """rotate_every=N starts a new numbered file every N records, none lost or repeated."""
    sink = at.JsonlSink(tmp_path / "t.jsonl", rotate_every=4)
    # health_metrics=False: only trace lines, so the counts below are the records'.
    async with at.TraceSession("p", sinks=[sink], batch_size=3, health_metrics=False) as s:
        for step in range(5):
            await s.log_samples([sample(i, step=step) for i in range(2)], step=step)
    files = sorted(tmp_path.glob("t.*.jsonl"))
    assert [f.name for f in files] == ["t.00000.jsonl", "t.00001.jsonl", "t.00002.jsonl"]
    counts = [len(f.read_bytes().splitlines()) for f in files]
    assert counts == [4, 4, 2]
    ids = [orjson.loads(line)["id"] for f in files for line in f.read_bytes().splitlines()]
    assert len(set(ids)) == 10


async def test_console_sink_is_readable_and_truncated() -> None:
    """ConsoleSink prints a header per trace and clips long messages to max_chars."""
    out = io.StringIO()
    async with at.TraceSession("p", sinks=[at.ConsoleSink(out, max_chars=200)]) as s:
        await s.log_samples([{"prompt": "short question", "response": "z" * 5000, "reward": 1.0}], step=2)
    text = out.getvalue()
    assert "train/traces step 2" in text and "short question" in text
    assert "more chars]" in text and len(text) < 1000


async def test_jsonl_escapes_unusual_ids_and_names(tmp_path: Path) -> None:
    """Record ids, splits and keys that need JSON escaping still give valid lines."""
    from asynctrace._records.types import TraceRecord

    sink = at.JsonlSink(tmp_path / "odd.jsonl")
    await sink.open()
    ids = ['a"b', "c\\d", "é-1", "plain-2"]
    await sink.write([TraceRecord(i, 1, 'sp"lit', "k\\ey", b'{"messages":[]}', 1.5) for i in ids])
    await sink.close()
    lines = [orjson.loads(line) for line in (tmp_path / "odd.jsonl").read_bytes().splitlines()]
    assert [line["id"] for line in lines] == ids
    assert all(line["split"] == 'sp"lit' and line["key"] == "k\\ey" for line in lines)


async def test_jsonl_fsync_covers_every_file_a_batch_touches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With fsync and rotation, a file rolled away from in the middle of a batch is synced too."""
    import os

    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(Path(os.readlink(f"/proc/self/fd/{fd}")).name)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    sink = at.JsonlSink(tmp_path / "t.jsonl", rotate_every=4, fsync=True)
    async with at.TraceSession("p", sinks=[sink], batch_size=10) as s:
        await s.log_samples([sample(i) for i in range(10)], step=0)
    assert [p.name for p in sink.paths] == ["t.00000.jsonl", "t.00001.jsonl", "t.00002.jsonl"]
    assert set(synced) == {"t.00000.jsonl", "t.00001.jsonl", "t.00002.jsonl"}


async def test_jsonl_rotation_goes_on_after_the_files_of_an_earlier_session(tmp_path: Path) -> None:
    """A session reusing a rotated path starts after the files already there; none exceeds N lines."""
    for attempt in range(2):
        sink = at.JsonlSink(tmp_path / "run.jsonl", rotate_every=2)
        async with at.TraceSession("p", sinks=[sink], health_metrics=False) as s:
            await s.log_samples([sample(i, step=attempt) for i in range(3)], step=attempt)
    files = sorted(tmp_path.glob("run.*.jsonl"))
    assert [f.name for f in files] == [f"run.{i:05d}.jsonl" for i in range(4)]
    assert [len(f.read_bytes().splitlines()) for f in files] == [2, 1, 2, 1]
    assert [p.name for p in sink.paths] == ["run.00002.jsonl", "run.00003.jsonl"]


class _StalledFifo:
    """A FIFO whose consumer reads nothing (or does not even open it) until `release`.

    A watchdog releases it after `watchdog` seconds, so code that ignores its deadlines makes
    a test fail instead of hanging it.
    """

    def __init__(self, path: Path, *, open_reader: bool, watchdog: float = 8.0) -> None:
        os.mkfifo(path)
        self.path = path
        self.eof = threading.Event()  # every writer closed the FIFO after the release
        self._reader = os.open(path, os.O_RDONLY | os.O_NONBLOCK) if open_reader else None
        self._drainer = threading.Thread(target=self._drain, daemon=True)
        self._released = threading.Event()
        self._timer = threading.Timer(watchdog, self.release)
        self._timer.daemon = True
        self._timer.start()

    def release(self) -> None:
        if not self._released.is_set():
            self._released.set()
            self._drainer.start()

    def _drain(self) -> None:
        fd = self._reader if self._reader is not None else os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        started = time.monotonic()
        try:
            while time.monotonic() - started < 5.0:
                select.select([fd], [], [], 0.05)
                try:
                    data = os.read(fd, 1 << 16)
                except BlockingIOError:
                    continue  # a writer holds it open, with nothing to read yet
                if not data and time.monotonic() - started > 0.5:
                    self.eof.set()
                    return
        finally:
            os.close(fd)

    def close(self) -> None:
        self._timer.cancel()
        self.release()
        self._drainer.join(6.0)


@contextlib.contextmanager
def _stalled_fifo(path: Path, *, open_reader: bool) -> Iterator[_StalledFifo]:
    fifo = _StalledFifo(path, open_reader=open_reader)
    try:
        yield fifo
    finally:
        fifo.close()


async def test_jsonl_close_does_not_wait_for_a_write_stuck_on_a_blocking_file(tmp_path: Path) -> None:
    """A write stuck on a file nobody drains (a FIFO, a hung mount) is given up at its attempt
    timeout, finish keeps its deadline, and the file is closed once the write comes back."""
    policy = at.RetryPolicy(max_attempts=1, attempt_timeout=0.3)
    with _stalled_fifo(tmp_path / "traces.jsonl", open_reader=True) as fifo:
        session = at.TraceSession(
            "p", sinks=[at.JsonlSink(fifo.path)], retry=policy, finish_timeout=1.0, flush_interval=0.01
        )
        async with session:
            # Far more than a pipe holds: the write blocks until someone reads.
            await session.log_samples([sample(i, note="x" * 2000) for i in range(100)], step=0)
            with anyio.fail_after(5):
                while session.stats().failed < 100:
                    await anyio.sleep(0.02)
            started = time.monotonic()
            stats = await session.finish(timeout=1.0)
            took = time.monotonic() - started
        assert took < 1.5, f"finish(timeout=1.0) took {took:.1f}s"
        assert stats.failed == 100 and stats.pending == 0 and stats.check()
        fifo.release()
        assert await anyio.to_thread.run_sync(fifo.eof.wait, 6.0), "the sink never closed the file"


async def test_jsonl_open_of_a_blocking_file_keeps_the_attempt_timeout_and_finish_deadline(
    tmp_path: Path,
) -> None:
    """Opening a file that blocks (a FIFO without a reader) is given up at the attempt timeout,
    and finish keeps its deadline."""
    policy = at.RetryPolicy(max_attempts=1, attempt_timeout=0.3)
    with _stalled_fifo(tmp_path / "traces.jsonl", open_reader=False) as fifo:
        session = at.TraceSession(
            "p", sinks=[at.JsonlSink(fifo.path)], retry=policy, finish_timeout=1.0, flush_interval=0.01
        )
        started = time.monotonic()
        async with session:
            await session.log_samples([sample(0)], step=0)
            stats = await session.finish(timeout=1.0)
        took = time.monotonic() - started
        assert took < 2.0, f"the session took {took:.1f}s"
        assert stats.failed == 1 and stats.pending == 0 and stats.check()


async def test_console_sink_writes_to_a_stream_that_cannot_encode_its_marks() -> None:
    """On an ASCII stream the sink uses ASCII marks and replaces what the stream cannot encode."""
    raw = io.BytesIO()
    out = io.TextIOWrapper(raw, encoding="ascii", write_through=True)
    sink = at.ConsoleSink(out, max_chars=200)
    async with at.TraceSession("p", sinks=[sink]) as s:
        await s.log_samples([{"prompt": "caf\u00e9?", "response": "z" * 500, "reward": 1.0}], step=2)
        await s.log_metrics({"reward/mean": 0.5}, step=2)
    stats = s.stats()
    assert stats.written == 1 and stats.sinks["console"].failed == 0
    assert stats.sinks["console"].metrics_failed == 0
    text = raw.getvalue().decode("ascii")
    assert "-- train/traces step 2" in text and "caf??" in text
    assert "... [" in text and "-- metrics step 2: reward/mean=0.5" in text


async def test_jsonl_writes_nothing_after_close_from_attempts_given_up_on(tmp_path: Path) -> None:
    """Retries of a write stuck on a blocking file queue behind it; once the sink is closed they
    write nothing when the file drains: the batch is in the file once, not once per attempt."""
    path = tmp_path / "traces.jsonl"
    os.mkfifo(path)
    got: list[bytes] = []
    drain = threading.Event()

    def reader() -> None:
        with open(path, "rb") as f:
            drain.wait(10)
            got.append(f.read())

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    sink = at.JsonlSink(path)
    await sink.open()
    record = at.TraceRecord("rec-1", 0, "train", "train/traces", orjson.dumps({"x": "y" * 200_000}), 0.0)
    for _ in range(3):  # three attempts, each given up at its timeout (the file blocks)
        with anyio.move_on_after(0.3) as scope:
            await sink.write([record])
        assert scope.cancelled_caught
    await sink.close()
    drain.set()
    await anyio.to_thread.run_sync(thread.join, 10)
    assert got and got[0].count(b'"id":"rec-1"') == 1


_BLOCKED_JSONL_CHILD = """
import os, sys
import anyio
import asynctrace as at

path, backend, stage = sys.argv[1], sys.argv[2], sys.argv[3]
if stage == "write":
    # A reader that never reads: opening succeeds, and the write blocks once the pipe is full.
    reader = os.open(path, os.O_RDONLY | os.O_NONBLOCK)

async def main():
    policy = at.RetryPolicy(max_attempts=1, attempt_timeout=0.3)
    sink = at.JsonlSink(path)
    async with at.TraceSession("p", sinks=[sink], retry=policy, finish_timeout=0.5,
                               flush_interval=0.01) as s:
        await s.log_samples([{"prompt": "q", "response": "x" * 2000} for _ in range(100)], step=0)
    print("finished", s.stats().pending + s.stats().failed, flush=True)

anyio.run(main, backend=backend)
"""


@pytest.mark.parametrize("stage", ["open", "write"])
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_async_session_on_a_blocked_jsonl_file_lets_the_process_exit(
    tmp_path: Path, backend: str, stage: str
) -> None:
    """An async session whose JSONL file blocks for good (a FIFO nobody opens, or nobody reads)
    finishes within its deadline and the interpreter then exits: the abandoned file call is on a
    thread the interpreter does not wait for."""
    import subprocess
    import sys

    from tests.faults import _harness

    path = tmp_path / "traces.jsonl"
    os.mkfifo(path)
    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-c", _BLOCKED_JSONL_CHILD, str(path), backend, stage],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=_harness.env(),
    )
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    took = time.monotonic() - started
    assert proc.returncode == 0, err.decode()[-2000:]
    assert out.split() == [b"finished", b"100"]
    # Start-up and finish(0.5) take a few seconds even on a loaded machine; a process the
    # abandoned call held would never have exited at all.
    assert took < 30, f"the process took {took:.1f}s to exit"


async def test_jsonl_on_a_blocked_file_keeps_a_few_threads_not_one_per_attempt(tmp_path: Path) -> None:
    """Writes to a file that blocks for good each fail at their attempt timeout, and the calls
    left behind are capped: a few threads stay blocked, not one more for every attempt."""
    policy = at.RetryPolicy(max_attempts=1, attempt_timeout=0.05)
    with _stalled_fifo(tmp_path / "traces.jsonl", open_reader=True) as fifo:
        fifo._timer.cancel()  # released below, once the threads are counted
        before = threading.active_count()
        session = at.TraceSession(
            "p", sinks=[at.JsonlSink(fifo.path)], retry=policy, batch_size=1, flush_interval=0.01
        )
        async with session:
            # Each write is far more than a pipe holds: the first blocks, the rest queue behind it.
            for i in range(40):
                await session.log_samples([sample(i, note="x" * 100_000)], step=0)
            with anyio.fail_after(30):
                while session.stats().failed < 40:
                    await anyio.sleep(0.02)
            blocked = threading.active_count() - before
            fifo.release()
        assert session.stats().check()
    assert blocked <= 10, f"{blocked} threads were left blocked on the file"
