"""finish() always runs: exceptions and cancellations in the body never orphan a Trackio run."""

from __future__ import annotations

import functools
from typing import Any

import anyio
import pytest
import trio
import trio.testing

import asynctrace as at
from asynctrace._runtime.lifecycle import STOP_GRACE, finish_bound
from tests._util import read_traces, sample

pytestmark = pytest.mark.anyio

# Trackio runs in a thread (`process=False`) where a test checks the run in Trackio, not the
# writer process (a process start costs ~1.5 CPU-s); the cancellation test keeps the process, so
# a cancelled body is still seen draining through the writer's pipes.


class TrainingCrash(RuntimeError):
    pass


async def test_exception_in_body_propagates_and_run_is_finished(project: str) -> None:
    """An exception in `async with` propagates; earlier traces are in Trackio; the run is finished."""
    sink = at.TrackioSink(process=False)
    with pytest.raises(TrainingCrash):
        async with at.TraceSession(project, run="crash", sinks=[sink]) as session:
            await session.log_samples([sample(i) for i in range(5)], step=0)
            await session.log_samples([sample(i, step=1) for i in range(3)], step=1)
            raise TrainingCrash("loss is nan")
    assert sink.finished
    stats = session.stats()
    assert stats.written == 8 and stats.pending == 0 and stats.check()
    rows = read_traces(project, "crash")
    assert sorted((r["step"], r["metadata"]["uid"]) for r in rows) == sorted(
        [(0, f"0:{i}") for i in range(5)] + [(1, f"1:{i}") for i in range(3)]
    )


async def test_cancellation_in_body_still_drains_and_finishes(project: str) -> None:
    """A cancellation inside `async with` still drains what was logged and finishes the run."""
    sink = at.TrackioSink()
    with anyio.move_on_after(0.5) as scope:
        async with at.TraceSession(project, run="cancelled", sinks=[sink], flush_interval=10.0) as session:
            await session.log_samples([sample(i) for i in range(7)], step=3)
            await anyio.sleep_forever()
    assert scope.cancelled_caught
    assert sink.finished
    assert session.stats().written == 7
    assert len(read_traces(project, "cancelled")) == 7


async def test_sync_body_exception_finishes_run(project: str) -> None:
    """The blocking `with` form finishes the run and keeps the traces when its body raises."""
    sink = at.TrackioSink(process=False)

    def body() -> None:
        with at.TraceSession(project, run="sync-crash", sinks=[sink]) as s:
            s.log_samples([sample(i) for i in range(4)], step=0)
            raise TrainingCrash("boom")

    with pytest.raises(TrainingCrash):
        await anyio.to_thread.run_sync(body)
    assert sink.finished
    assert len(read_traces(project, "sync-crash")) == 4


async def test_finish_is_idempotent_and_closed_session_rejects() -> None:
    """finish() twice returns the same stats; log_samples after finish raises; nowait counts 'closed'."""
    mem = at.testing.MemorySink()
    async with at.TraceSession("p", sinks=[mem]) as session:
        await session.log_samples([sample(0)], step=0)
        first = await session.finish()
        second = await session.finish()
        assert first == second and first.written == 1
        with pytest.raises(at.SessionClosedError):
            await session.log_samples([sample(1)], step=0)
        assert session.log_samples_nowait([sample(2)], step=0) == 0
    assert session.stats().dropped == {"closed": 1}
    assert session.stats().check()
    assert mem.closed


async def test_unopened_session_raises_clear_error() -> None:
    """Using a session before opening it raises SessionClosedError naming the fix."""
    session = at.TraceSession("p", sinks=[at.testing.MemorySink()])
    with pytest.raises(at.SessionClosedError, match="not open"):
        await session.log_samples([sample(0)], step=0)


async def test_metrics_reach_trackio(project: str) -> None:
    """log_metrics values are stored in the Trackio run next to the traces."""
    async with at.TraceSession(project, run="m", sinks=[at.TrackioSink(process=False)]) as session:
        await session.log_metrics({"reward/mean": 0.25}, step=4)
        await session.log_samples([sample(0)], step=4)
    from trackio.sqlite_storage import SQLiteStorage

    logs = SQLiteStorage.get_logs(project, "m")
    assert any(row.get("reward/mean") == 0.25 and row.get("step") == 4 for row in logs)


async def test_flush_racing_finish_returns_when_the_writer_stops() -> None:
    """A flush() waiting while another task's finish() gives up on a hanging sink returns False
    when the writer stops, instead of waiting forever."""
    async with at.TraceSession("p", sinks=[at.testing.MemorySink(hang=True)], flush_interval=0.01) as s:
        await s.log_samples([sample(0)], step=0)
        result: list[bool] = []

        async def flusher() -> None:
            result.append(await s.flush())

        async with anyio.create_task_group() as tg:
            tg.start_soon(flusher)
            await anyio.sleep(0.1)
            with anyio.fail_after(10):
                await s.finish(timeout=0.3)
                with anyio.fail_after(2):
                    while not result:
                        await anyio.sleep(0.01)
    assert result == [False] and s.stats().pending == 1


class _LoopBlockingSink(at.Sink):
    """Breaks the sink contract: blocks the session's event loop thread inside write()."""

    name = "blocking"

    def __init__(self) -> None:
        import threading

        self.entered = threading.Event()
        self.release = threading.Event()

    async def write(self, records: object) -> None:
        self.entered.set()
        self.release.wait(30)


def test_sync_finish_keeps_its_deadline_when_the_loop_thread_is_blocked() -> None:
    """The blocking form's finish(timeout=1) returns within its bound and reports the record as
    pending, even when a misbehaving sink blocks the loop thread for much longer."""
    import time

    sink = _LoopBlockingSink()
    s = at.TraceSession("p", sinks=[sink], flush_interval=0.01).start()
    try:
        s.log_samples([sample(0)], step=0)
        assert sink.entered.wait(10)
        started = time.monotonic()
        stats = s.finish(timeout=1.0)
        took = time.monotonic() - started
        assert took < 7.0 and stats.pending == 1  # the bound: 1 + 2 + 1 + 1 s
    finally:
        sink.release.set()


def test_sync_finish_from_a_second_thread_waits_for_the_first() -> None:
    """Two threads finishing a blocking session both get the final stats, after the sinks closed."""
    import threading

    mem = at.testing.MemorySink(delay=0.5)
    s = at.TraceSession("p", sinks=[mem], flush_interval=0.01, finish_timeout=10).start()
    s.log_samples([sample(i) for i in range(3)], step=0)
    first = threading.Thread(target=s.finish)
    first.start()
    try:
        import time

        time.sleep(0.1)
        stats = s.finish()
        assert stats.written == 3 and stats.pending == 0 and mem.closed
    finally:
        first.join(20)


_FORKER = """
import os, sys, time
import asynctrace as at

sink = at.testing.MemorySink()
with at.TraceSession("p", run="r", sinks=[sink]) as s:
    s.log_samples([{"prompt": "q", "response": "parent"}], step=0)
    pid = os.fork()
    if pid == 0:
        for call in (s.log_samples_nowait, s.log_samples):
            try:
                call([{"prompt": "q", "response": "child"}], step=0)
                print("child logged", flush=True)
            except at.SessionClosedError as exc:
                print("child refused:", exc, flush=True)
        sys.exit(0)  # unwinds the with block: finish() must not wait for the parent's loop
    _, status = os.waitpid(pid, 0)
    print("child exit", os.waitstatus_to_exitcode(status), flush=True)
    s.log_samples([{"prompt": "q", "response": "parent again"}], step=1)
print("parent wrote", sorted(r.step for r in sink.records), s.stats().check(), flush=True)
"""


def test_forked_child_cannot_log_through_its_parents_session(tmp_path: object) -> None:
    """A child forked inside a blocking session gets a clear error when it logs through the
    parent's session and exits without hanging; the parent's session goes on unharmed."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", _FORKER], capture_output=True, text=True, timeout=60, cwd=str(tmp_path)
    )
    out = proc.stdout.splitlines()
    assert proc.returncode == 0, proc.stderr
    refusals = [line for line in out if line.startswith("child refused:")]
    assert len(refusals) == 2 and "forked" in refusals[0] and "child logged" not in out
    assert "child exit 0" in out
    assert out[-1] == "parent wrote [0, 1] True"


def test_sync_session_accepts_an_infinite_timeout() -> None:
    """finish_timeout=inf and flush(timeout=inf) on the blocking form wait as long as it takes
    (an infinite bound is no bound), instead of failing on a wait's largest timeout."""
    mem = at.testing.MemorySink(delay=0.2)
    with at.TraceSession("p", sinks=[mem], finish_timeout=float("inf"), flush_interval=0.01) as s:
        s.log_samples([sample(0)], step=0)
        assert s.flush(timeout=float("inf"))
    assert s.stats().written == 1 and mem.closed


async def test_finish_counts_rows_still_being_decoded_as_closed_in_its_own_stats() -> None:
    """Rows log_rollouts is decoding when finish() runs are "closed" in the stats finish() returns,
    not left pending (with a false deadline warning) there and closed later."""
    import threading
    import time

    from asynctrace import rollouts

    tok = rollouts.toy_tokenizer()
    decoding = threading.Event()

    class SlowTokenizer:
        def batch_decode(self, seqs: Any, **kwargs: Any) -> list[str]:
            decoding.set()
            time.sleep(0.5)
            return list(tok.decode_batch(seqs, skip_special_tokens=False))

    rows = [tok.encode(f"problem {i} answer {i}").ids[:6] for i in range(4)]
    session = at.TraceSession("p", sinks=[at.testing.MemorySink()])
    async with session, anyio.create_task_group() as tg:
        tg.start_soon(functools.partial(session.log_rollouts, rows, tokenizer=SlowTokenizer(), step=0))
        with anyio.fail_after(10):
            while not decoding.is_set():  # finish only while the rows are being decoded
                await anyio.sleep(0.01)
        final = await session.finish(timeout=1)
    assert final.pending == 0 and final.dropped == {"closed": 4} and final == session.stats()


def test_flush_waits_for_a_blocking_call_between_admitting_and_waiting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A flush() that starts just after a blocking log_samples admitted part of its samples, and
    before that call starts waiting for room for the rest, still covers the rest."""
    import threading
    import time

    from asynctrace._engine import buffer as _buffer

    admitted = threading.Event()
    real_admit = _buffer.Buffer.admit

    def admit_then_pause(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = real_admit(self, *args, **kwargs)
        if threading.current_thread().name == "producer":
            admitted.set()
            time.sleep(0.2)  # preempted right after admitting
        return out

    monkeypatch.setattr(_buffer.Buffer, "admit", admit_then_pause)
    mem = at.testing.MemorySink(delay=0.1)
    with at.TraceSession("p", sinks=[mem], on_full="block", queue_size=2, batch_size=2) as s:
        producer = threading.Thread(
            target=lambda: s.log_samples([sample(i) for i in range(4)], step=0), name="producer"
        )
        producer.start()
        assert admitted.wait(5)
        assert s.flush(timeout=10)
        written = len(mem.records)
        producer.join(10)
    assert written == 4


class _Uncancellable(at.Sink):
    """Breaks the sink contract: its write keeps running for `hold` seconds after a cancel."""

    name = "stubborn"

    def __init__(self, hold: float) -> None:
        self.hold = hold
        self.began = False

    async def write(self, records: Any) -> None:
        self.began = True
        with anyio.CancelScope(shield=True):
            await anyio.sleep(self.hold)


async def test_finish_names_a_sink_that_ignores_cancellation(caplog: pytest.LogCaptureFixture) -> None:
    """When a sink's write outlives finish()'s cancel, finish() says which sink holds it up."""
    sink = _Uncancellable(hold=STOP_GRACE + 1.5)
    async with at.TraceSession("p", sinks=[sink], flush_interval=0.01, finish_timeout=0.2) as s:
        await s.log_samples([sample(0)], step=0)
        with anyio.fail_after(10):
            while not sink.began:  # finish only once the write has begun
                await anyio.sleep(0.01)
    assert "'stubborn' still running" in caplog.text
    assert s.stats().check()


class _Stubborn(at.Sink):
    """Breaks the sink contract: its write (or its close) ignores its cancel for `hold` seconds,
    or until `release` is set."""

    name = "stubborn"

    def __init__(self, hold: float, *, in_close: bool = False) -> None:
        self.hold = hold
        self.in_close = in_close
        self.began = False
        self.release: anyio.Event | None = None
        self.ended = False

    async def began_holding(self) -> None:
        while not self.began:
            await anyio.sleep(0.01)

    async def _hold(self) -> None:
        self.release = anyio.Event()
        self.began = True
        with anyio.CancelScope(shield=True), anyio.move_on_after(self.hold):
            await self.release.wait()
        self.ended = True

    async def write(self, records: Any) -> None:
        if not self.in_close:
            await self._hold()

    async def close(self) -> None:
        if self.in_close:
            await self._hold()


def _mock_clock() -> Any:
    """trio with a clock that jumps ahead whenever every task waits: deadlines take no real time."""
    clock = trio.testing.MockClock(autojump_threshold=0)
    return pytest.param(("trio", {"clock": clock}), id="trio-mockclock")


@pytest.mark.parametrize("anyio_backend", [_mock_clock()])
async def test_finish_keeps_its_bound_when_a_write_ignores_cancellation(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """finish(1) returns (and the `async with` block exits) within finish_bound(1) when a sink's
    write ignores its cancel for a minute: the write is left running, named in an error, and its
    record is pending."""
    sink = _Stubborn(hold=60.0)
    async with at.TraceSession("p", sinks=[sink], batch_size=1, finish_timeout=1.0) as s:
        await s.log_samples([sample(0)], step=0)
        await sink.began_holding()
        started = anyio.current_time()
        stats = await s.finish(timeout=1.0)
    took = anyio.current_time() - started
    assert took <= finish_bound(1.0), f"finish(1) took {took:.1f}s"
    assert not sink.ended and stats.pending == 1 and stats.check()
    assert "'stubborn' still running" in caplog.text and "goes on without it" in caplog.text


@pytest.mark.parametrize("anyio_backend", [_mock_clock()])
async def test_finish_keeps_its_bound_when_a_close_ignores_cancellation() -> None:
    """A sink's close() that ignores its cancel is left running at the close deadline: finish(1)
    returns within finish_bound(1), with what was written counted."""
    sink = _Stubborn(hold=60.0, in_close=True)
    async with at.TraceSession("p", sinks=[sink], batch_size=1, finish_timeout=1.0) as s:
        await s.log_samples([sample(0)], step=0)
        started = anyio.current_time()
        stats = await s.finish(timeout=1.0)
    took = anyio.current_time() - started
    assert took <= finish_bound(1.0), f"finish(1) took {took:.1f}s"
    assert not sink.ended and stats.written == 1 and stats.check()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_finish_keeps_its_bound_on_asyncio_when_a_write_ignores_cancellation() -> None:
    """On asyncio too, finish(0.2) returns within its bound (about 2.4 s) while a sink's write
    ignores its cancel for half a minute; the abandoned write ends when released."""
    import time

    sink = _Stubborn(hold=30.0)
    try:
        async with at.TraceSession("p", sinks=[sink], batch_size=1, finish_timeout=0.2) as s:
            await s.log_samples([sample(0)], step=0)
            await sink.began_holding()
            started = time.monotonic()
            stats = await s.finish(timeout=0.2)
        took = time.monotonic() - started
        # The bound is 2.4 s; the slack is for a loaded machine, far below the write's 30 s.
        assert took < finish_bound(0.2) + 5.0, f"finish(0.2) took {took:.1f}s"
        assert stats.pending == 1 and stats.check()
    finally:
        if sink.release is not None:
            sink.release.set()
    with anyio.fail_after(5):
        while not sink.ended:
            await anyio.sleep(0.01)


class _HangsUntilReleased(at.Sink):
    """A sink whose write waits, cancellably, until the test sets `release`."""

    name = "memory"

    def __init__(self) -> None:
        self.release = anyio.Event()

    async def write(self, records: Any) -> None:
        await self.release.wait()


async def test_a_second_finish_keeps_its_own_deadline() -> None:
    """A finish(timeout) while another finish() is under way waits for it only within its own
    bound, then returns the stats as they are (what the first has not delivered is pending)."""
    import time

    sink = _HangsUntilReleased()
    async with at.TraceSession("p", sinks=[sink], finish_timeout=6.0) as s:
        await s.log_samples([sample(0)], step=0)
        async with anyio.create_task_group() as tg:
            tg.start_soon(s.finish, 6.0)
            await anyio.sleep(0.05)
            started = time.monotonic()
            stats = await s.finish(timeout=0.2)
            took = time.monotonic() - started
            # Measured: the write may end now, so the first finish need not wait out its 6 s.
            sink.release.set()
    assert took < 4.5 and stats.pending == 1  # its bound: 0.2 + 2 + 0.2 s; the first takes 6 s


def _in_another_loop(fn: Any) -> dict[str, Any]:
    """Run `fn` (an async function) on a fresh event loop in a new thread; its result or error."""
    import threading

    out: dict[str, Any] = {}

    def worker() -> None:
        try:
            out["result"] = anyio.run(fn)
        except BaseException as exc:  # handed to the test
            out["error"] = exc

    thread = threading.Thread(target=worker)
    thread.start()
    out["thread"] = thread
    return out


async def test_flush_and_finish_from_another_event_loop_raise_at_once() -> None:
    """flush()/finish() awaited on another thread's event loop raise a clear error instead of
    breaking the session's writer; the session then finishes normally."""
    sink = at.testing.MemorySink()
    async with at.TraceSession("p", sinks=[sink], finish_timeout=5.0) as s:
        await s.log_samples([sample(0)], step=0)
        for call in (s.flush, s.finish):
            out = _in_another_loop(call)
            while out["thread"].is_alive():
                await anyio.sleep(0.01)
            assert isinstance(out.get("error"), at.AsyncTraceError), out
            assert "event loop that opened the session" in str(out["error"])
        assert await s.flush(timeout=5)
    assert len(sink.records) == 1 and sink.closed


async def test_cancelling_log_samples_awaited_on_another_loop_takes_effect() -> None:
    """A log_samples awaited on another thread's loop, waiting for room, is cancelled by its own
    cancel scope and counts its sample as "cancelled", as on the session's own loop."""
    import time

    async with at.TraceSession(
        "p", sinks=[at.testing.MemorySink(hang=True)], queue_size=1, on_full="block", finish_timeout=0.5
    ) as s:
        await s.log_samples([sample(0)], step=0)  # takes the only place, for good

        async def blocked() -> float:
            started = time.monotonic()
            with anyio.move_on_after(0.3):
                await s.log_samples([sample(1)], step=0)
            return time.monotonic() - started

        out = _in_another_loop(blocked)
        deadline = time.monotonic() + 3.0
        while out["thread"].is_alive() and time.monotonic() < deadline:
            await anyio.sleep(0.01)
        assert not out["thread"].is_alive() and out["result"] < 1.5, out
        # The worker thread that waited for room notices the cancel at its next look (0.25 s).
        while s.stats().dropped.get("cancelled") != 1 and time.monotonic() < deadline + 2.0:
            await anyio.sleep(0.01)
        assert s.stats().dropped.get("cancelled") == 1 and s.stats().check()
