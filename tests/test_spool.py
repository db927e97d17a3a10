"""The write-ahead spool: what it holds, when it lets go, and what a new session replays from it."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path
from typing import Any

import anyio
import pytest

import asynctrace as at
from asynctrace._durable import segments
from tests._util import read_traces, sample, stuck_spool_session

pytestmark = pytest.mark.anyio


def _segment_files(spool: Path) -> list[Path]:
    return sorted(spool.glob("seg-*.jsonl"))


def _unresolved_ids(spool: Path, kind: str = "seg") -> list[str]:
    return [r.id for f in segments.scan_dir(spool).files if f.kind == kind for r in f.unresolved]


async def _leave_pending(
    project: str, spool: Path, steps: int, durability: str = "enqueue", **kw: object
) -> None:
    """Log `steps` x 10 samples through a sink that never answers, so all of it stays in the spool."""
    async with at.TraceSession(
        project,
        run="r",
        sinks=[at.testing.MemorySink(hang=True)],
        spool_dir=spool,
        durability=durability,  # type: ignore[arg-type]
        finish_timeout=0.2,
        **kw,  # type: ignore[arg-type]
    ) as s:
        for step in range(steps):
            await s.log_samples([sample(i, step=step) for i in range(10)], step=step)
    assert s.stats().pending == steps * 10


@pytest.mark.parametrize("durability", ["writer", "enqueue"])
async def test_clean_run_acknowledges_everything_and_deletes_its_segments(
    tmp_path: Path, durability: str
) -> None:
    """After a clean finish every record is acknowledged and no segment is left behind."""
    sink = at.testing.MemorySink()
    spool = tmp_path / "spool"
    async with at.TraceSession(
        "p",
        run="r",
        sinks=[sink],
        spool_dir=spool,
        durability=durability,
        batch_size=16,  # type: ignore[arg-type]
    ) as s:
        for step in range(6):
            await s.log_samples([sample(i, step=step) for i in range(25)], step=step)
    st = s.stats()
    assert st.written == 150 and st.check()
    assert st.spool is not None and st.spool.appended == st.spool.acknowledged == 150
    assert st.spool.segments == 0 and not _segment_files(spool)
    assert len(sink.records) == 150


async def test_enqueue_spools_before_log_samples_returns(tmp_path: Path) -> None:
    """With durability="enqueue", accepted records are on disk as soon as log_samples returns."""
    spool = tmp_path / "spool"
    async with stuck_spool_session(spool) as s:
        await s.log_samples([sample(i) for i in range(7)], step=0)
        on_disk = _unresolved_ids(spool)
        assert len(on_disk) == 7
        s.log_samples_nowait([sample(i, step=1) for i in range(3)], step=1)
        assert len(_unresolved_ids(spool)) == 10


async def test_writer_mode_spools_batches_and_spills_the_queue_at_finish(tmp_path: Path) -> None:
    """With durability="writer", what was still queued at the finish deadline goes to the spool too."""
    spool = tmp_path / "spool"
    async with at.TraceSession(
        "p",
        run="r",
        sinks=[at.testing.MemorySink(hang=True)],
        spool_dir=spool,
        durability="writer",
        finish_timeout=0.2,
        batch_size=5,
        flush_interval=30.0,
    ) as s:
        await s.log_samples([sample(i) for i in range(12)], step=0)
        await anyio.sleep(0.05)
        # Two full batches were dispatched (and spooled); the last 2 records wait in memory.
        assert len(_unresolved_ids(spool)) == 10
    assert len(_unresolved_ids(spool)) == 12


async def test_restart_replays_unacknowledged_records_first_and_counts_them(tmp_path: Path) -> None:
    """A session on a spool left by a killed one delivers those records before its own, once each."""
    spool = tmp_path / "spool"
    await _leave_pending("p", spool, steps=3)
    sink = at.testing.MemorySink()
    async with at.TraceSession("p", run="r", sinks=[sink], spool_dir=spool) as s:
        await s.log_samples([sample(i, step=9) for i in range(5)], step=9)
    st = s.stats()
    assert st.replayed == 30 and st.submitted == 35 and st.written == 35 and st.check()
    assert [r.step for r in sink.records[:30]] == [0] * 10 + [1] * 10 + [2] * 10
    assert all(r.replayed for r in sink.records[:30]) and not any(r.replayed for r in sink.records[30:])
    assert len({r.id for r in sink.records}) == 35
    assert not _segment_files(spool)


async def test_replay_false_leaves_the_spool_alone(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """replay=False delivers nothing old, warns, and keeps the old records for later."""
    spool = tmp_path / "spool"
    await _leave_pending("p", spool, steps=2)
    sink = at.testing.MemorySink()
    async with at.TraceSession("p", run="r", sinks=[sink], spool_dir=spool, replay=False) as s:
        await s.log_samples([sample(0, step=5)], step=5)
    assert s.stats().replayed == 0 and len(sink.records) == 1
    assert "replay=False leaves 20 unacknowledged records" in caplog.text
    assert len(_unresolved_ids(spool)) == 20


async def test_records_of_another_run_are_left_for_recover(
    tmp_path: Path, project: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A session replays only its own run's records and names `asynctrace recover` for the others."""
    from asynctrace._recover import recover

    spool = tmp_path / "spool"
    await _leave_pending(project, spool, steps=2)
    sink = at.testing.MemorySink()
    async with at.TraceSession(project, run="other", sinks=[sink], spool_dir=spool) as s:
        pass
    assert s.stats().replayed == 0 and not sink.records
    assert "asynctrace recover" in caplog.text and f"{project}/r (20)" in caplog.text
    report = await recover(spool, progress=False)
    assert report.ok and report.replayed == 20
    assert len(read_traces(project, "r")) == 20 and not _segment_files(spool)


async def test_recover_into_another_project_and_run(tmp_path: Path, project: str) -> None:
    """`recover --project/--run` sends the records elsewhere than where they were logged."""
    from asynctrace._recover import recover

    spool = tmp_path / "spool"
    await _leave_pending("somewhere", spool, steps=1)
    report = await recover(spool, project=project, run="moved", progress=False)
    assert report.ok and [(g.source, g.target) for g in report.groups] == [
        (("somewhere", "r"), (project, "moved"))
    ]
    assert len(read_traces(project, "moved")) == 10
    assert any("somewhere/r -> " in line for line in report.lines())


async def test_drops_in_enqueue_mode_are_acknowledged_not_replayed(tmp_path: Path) -> None:
    """Capped, evicted and queue-full drops resolve their spooled records; nothing comes back later."""
    spool = tmp_path / "spool"
    sink = at.testing.MemorySink()
    async with at.TraceSession(
        "p",
        run="r",
        sinks=[sink],
        spool_dir=spool,
        durability="enqueue",
        max_traces_per_step=3,
        sampler="top_bottom",
    ) as s:
        for step in range(4):
            await s.log_samples([sample(i, step=step) for i in range(20)], step=step)
    st = s.stats()
    assert st.written == 12 and st.dropped == {"capped": 68} and st.check()
    assert not _segment_files(spool)


async def test_dead_letters_keep_failed_records_with_the_error_and_recover_retries_them(
    tmp_path: Path, project: str
) -> None:
    """Records a sink failed for good go to a dead-letter file; recover --dead-letters retries them."""
    from asynctrace._recover import recover

    spool = tmp_path / "spool"
    policy = at.RetryPolicy(max_attempts=2, initial_backoff=0.001, max_backoff=0.01)
    async with at.TraceSession(
        project,
        run="r",
        sinks=[at.testing.MemorySink(fail_times=100)],
        spool_dir=spool,
        retry=policy,
    ) as s:
        await s.log_samples([sample(i) for i in range(8)], step=0)
    st = s.stats()
    assert st.failed == 8 and st.spool is not None and st.spool.dead_letters == 8
    (dead,) = [f for f in segments.scan_dir(spool).files if f.kind == "dead"]
    assert len(dead.unresolved) == 8
    assert dead.unresolved[0].error is not None and "transient failure" in dead.unresolved[0].error
    assert dead.unresolved[0].sinks == ["memory"]
    assert not _unresolved_ids(spool)  # resolved in the segments: failed is an outcome

    plain = await recover(spool, progress=False)
    assert plain.replayed == 0 and plain.dead_letters_left == 8
    report = await recover(spool, dead_letters=True, progress=False)
    assert report.ok and report.replayed == 8 and report.dead_letters_left == 0
    assert len(read_traces(project, "r")) == 8
    assert not list(spool.glob("*.jsonl"))


async def test_spool_files_are_private(tmp_path: Path) -> None:
    """The spool directory is 0700 (made so if it was not) and its files 0600."""
    spool = tmp_path / "spool"
    spool.mkdir(mode=0o755)
    os.chmod(spool, 0o755)
    sink = at.testing.MemorySink(hang=True)
    async with at.TraceSession(
        "p",
        run="r",
        sinks=[sink],
        spool_dir=spool,
        finish_timeout=0.1,
        flush_interval=0.01,
    ) as s:
        await s.log_samples([sample(0)], step=0)
        # The writer spools a batch before it hands it to the sink.
        with anyio.fail_after(10):
            while not sink.attempts:
                await anyio.sleep(0.01)
    assert stat.S_IMODE(spool.stat().st_mode) == 0o700
    files = list(spool.iterdir())
    assert files and all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)


async def test_one_spool_directory_one_session(tmp_path: Path) -> None:
    """A second session on a spool directory in use is refused with a clear error."""
    spool = tmp_path / "spool"
    async with at.TraceSession("p", run="r", sinks=[at.testing.MemorySink()], spool_dir=spool):
        with pytest.raises(at.SpoolError, match="in use by another session"):
            async with at.TraceSession("p", run="r", sinks=[at.testing.MemorySink()], spool_dir=spool):
                pass
    async with at.TraceSession("p", run="r", sinks=[at.testing.MemorySink()], spool_dir=spool):
        pass  # released at finish


async def test_nowait_from_threads_in_enqueue_mode(tmp_path: Path) -> None:
    """log_samples_nowait from many threads spools every accepted record, and all are acknowledged."""
    spool = tmp_path / "spool"
    sink = at.testing.MemorySink()
    async with at.TraceSession("p", run="r", sinks=[sink], spool_dir=spool, durability="enqueue") as s:

        def worker(t: int) -> None:
            for step in range(20):
                s.log_samples_nowait([sample(i, step=step, t=t) for i in range(5)], step=step)

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        await anyio.to_thread.run_sync(lambda: [th.join() for th in threads])
    st = s.stats()
    assert st.written == 400 and st.check() and st.spool is not None
    assert st.spool.appended == st.spool.acknowledged == 400 and not _segment_files(spool)


async def test_sync_session_with_spool(tmp_path: Path) -> None:
    """The blocking form spools and replays like the async one."""
    spool = tmp_path / "spool"
    await _leave_pending("p", spool, steps=1, durability="writer", flush_interval=0.01)
    sink = at.testing.MemorySink()

    def body() -> at.SessionStats:
        with at.TraceSession("p", run="r", sinks=[sink], spool_dir=spool, durability="enqueue") as s:
            s.log_samples([sample(i, step=3) for i in range(4)], step=3)
        return s.stats()

    st = await anyio.to_thread.run_sync(body)
    assert st.replayed == 10 and st.written == 14 and st.check()


@pytest.mark.parametrize("durability", ["enqueue", "writer"])
@pytest.mark.parametrize("on_full", ["drop_oldest", "drop_newest", "block"])
async def test_queue_full_drops_leave_nothing_behind(tmp_path: Path, on_full: str, durability: str) -> None:
    """Records spooled and then dropped for room (under "writer", evicted from dispatched
    batches by drop_oldest) are resolved too: a clean finish leaves no segment."""
    spool = tmp_path / "spool"
    sink = at.testing.MemorySink(delay=0.05)
    async with at.TraceSession(
        "p",
        run="r",
        sinks=[sink],
        spool_dir=spool,
        durability=durability,  # type: ignore[arg-type]
        queue_size=8,
        batch_size=4,
        on_full=on_full,  # type: ignore[arg-type]
    ) as s:
        for step in range(5):
            await s.log_samples([sample(i, step=step) for i in range(10)], step=step, timeout=0.01)
    st = s.stats()
    assert st.check() and st.pending == 0 and st.dropped.get("queue_full", 0) > 0
    assert st.written == len(sink.records) == 50 - st.dropped_total
    assert not _segment_files(spool)


def test_enqueue_waits_for_a_commit_that_took_its_records(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """durability="enqueue": when another thread's commit took a caller's staged records and is
    still writing them, the caller's log_samples returns only once they are on disk."""
    import time

    from asynctrace._durable import files as files_module
    from asynctrace._engine import buffer as _buffer

    spool = tmp_path / "spool"
    append, admit = files_module.SpoolFiles.append, _buffer.Buffer.admit

    def slow_append(self: Any, f: Any, data: bytes) -> Any:
        if b"uid-" in data:
            time.sleep(0.3)  # a slow disk
        return append(self, f, data)

    def paused_admit(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = admit(self, *args, **kwargs)
        if threading.current_thread().name == "B":
            time.sleep(0.05)  # B is descheduled right after staging; A's commit takes B's record
        return out

    monkeypatch.setattr(files_module.SpoolFiles, "append", slow_append)
    monkeypatch.setattr(_buffer.Buffer, "admit", paused_admit)

    def on_disk(uid: str) -> bool:
        return any(uid.encode() in p.read_bytes() for p in spool.glob("seg-*.jsonl"))

    seen: dict[str, bool] = {}
    with at.TraceSession(
        "p",
        run="r",
        sinks=[at.testing.MemorySink(delay=5)],
        spool_dir=spool,
        durability="enqueue",
        flush_interval=60,
        finish_timeout=0.1,
    ) as s:

        def a() -> None:
            time.sleep(0.02)
            s.log_samples([{"prompt": "a", "response": "uid-A"}], step=0)

        def b() -> None:
            s.log_samples([{"prompt": "b", "response": "uid-B"}], step=0)
            seen["B"] = on_disk("uid-B")

        threads = [threading.Thread(target=b, name="B"), threading.Thread(target=a, name="A")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert seen == {"B": True}


def _sleep_until(event: Any) -> None:
    event.wait(30)


def test_forked_child_does_not_keep_the_spool_locked_after_finish(tmp_path: Path) -> None:
    """A process forked while a session holds the spool (a DataLoader worker, say) and still
    alive after finish() does not keep the directory locked against the next session."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    spool = tmp_path / "spool"
    release = ctx.Event()
    with at.TraceSession("p", run="r", sinks=[at.testing.MemorySink()], spool_dir=spool):
        child = ctx.Process(target=_sleep_until, args=(release,), daemon=True)
        child.start()
    try:
        with at.TraceSession("p", run="r2", sinks=[at.testing.MemorySink()], spool_dir=spool) as s:
            s.log_samples([sample(0)], step=0)
        assert s.stats().written == 1
    finally:
        release.set()
        child.join(10)


_CRASHER = """
import os, signal, sys, time
import asynctrace as at

s = at.TraceSession("p", run="r", sinks=[at.testing.MemorySink()], spool_dir=sys.argv[1])
s.__enter__()
pid = os.fork()
if pid == 0:
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(null, 2)
    time.sleep(30)
    os._exit(0)
print(pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_forked_child_does_not_keep_a_dead_sessions_spool_locked(tmp_path: Path) -> None:
    """When the session's process is killed and a child it forked lives on, the next session
    can still open the spool directory."""
    import signal
    import subprocess
    import sys

    spool = tmp_path / "spool"
    proc = subprocess.run(
        [sys.executable, "-c", _CRASHER, str(spool)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    orphan = int(proc.stdout.split()[0])
    try:
        with at.TraceSession("p", run="r", sinks=[at.testing.MemorySink()], spool_dir=spool) as s:
            s.log_samples([sample(0)], step=0)
        assert s.stats().written == 1
    finally:
        os.kill(orphan, signal.SIGKILL)
