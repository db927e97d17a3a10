"""finish() always runs: exceptions and cancellations in the body never orphan a Trackio run."""

from __future__ import annotations

import anyio
import pytest

import asynctrace as at
from tests._util import read_traces, sample

pytestmark = pytest.mark.anyio


class TrainingCrash(RuntimeError):
    pass


async def test_exception_in_body_propagates_and_run_is_finished(project: str) -> None:
    """An exception in `async with` propagates; earlier traces are in Trackio; the run is finished."""
    sink = at.TrackioSink()
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
    sink = at.TrackioSink()

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
    async with at.TraceSession(project, run="m", sinks=[at.TrackioSink()]) as session:
        await session.log_metrics({"reward/mean": 0.25}, step=4)
        await session.log_samples([sample(0)], step=4)
    from trackio.sqlite_storage import SQLiteStorage

    logs = SQLiteStorage.get_logs(project, "m")
    assert any(row.get("reward/mean") == 0.25 and row.get("step") == 4 for row in logs)
