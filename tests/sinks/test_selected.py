"""Tiered capture: a `Selected` sink keeps its own per-step selection, counted exactly per sink."""

from __future__ import annotations

import random
from collections import Counter

import anyio
import orjson
import pytest

import asynctrace as at
from asynctrace.sinks import Selected
from tests._util import sample

pytestmark = pytest.mark.anyio


async def _until(predicate: object, timeout: float = 10.0) -> None:
    """Wait (bounded) until `predicate()` is true: the writer works on its own task."""
    assert callable(predicate)
    with anyio.fail_after(timeout):
        while not predicate():
            await anyio.sleep(0.005)


def _rewards(sink: at.testing.MemorySink, step: int) -> list[float]:
    return sorted(r.sample.metadata["reward"] for r in sink.steps().get(step, []))


async def test_archive_gets_everything_and_the_tracker_its_top_bottom() -> None:
    """Every sample reaches the archive once; the selected sink gets exactly the top/bottom k
    of each step, whose ids all find the same records in the archive."""
    archive, tracker = at.testing.MemorySink("archive"), at.testing.MemorySink("tracker")
    rng = random.Random(7)
    async with at.TraceSession(
        "p", sinks=[archive, Selected(tracker, max_traces_per_step=4, sampler="top_bottom")], batch_size=16
    ) as s:
        for step in range(5):
            rewards = [float(x) for x in range(40)]
            rng.shuffle(rewards)
            for chunk in range(0, 40, 7):
                await s.log_samples(
                    [sample(i, reward=r, step=step) for i, r in enumerate(rewards[chunk : chunk + 7])],
                    step=step,
                )
    assert len(archive.records) == 200 and len({r.id for r in archive.records}) == 200
    for step in range(5):
        assert _rewards(tracker, step) == [0.0, 1.0, 38.0, 39.0]
    by_id = {r.id: r for r in archive.records}
    assert all(by_id[r.id].payload == r.payload for r in tracker.records)
    st = s.stats()
    assert st.written == 200 and st.pending == 0 and st.check()
    assert st.sinks["archive"].written == 200 and st.sinks["archive"].skipped == {}
    assert st.sinks["tracker"].written == 20
    assert st.sinks["tracker"].skipped == {"capped": 180} and st.sinks["tracker"].held == 0


async def test_held_records_are_pending_until_their_step_closes() -> None:
    """While a sink's selection holds records of an open step they stay pending (and held for
    that sink); the invariant holds at every snapshot."""
    archive, tracker = at.testing.MemorySink("archive"), at.testing.MemorySink("tracker")
    async with at.TraceSession(
        "p",
        sinks=[archive, Selected(tracker, max_traces_per_step=3, sampler="top_bottom")],
        flush_interval=0.01,
        step_timeout=None,
    ) as s:
        await s.log_samples([sample(i, step=0) for i in range(10)], step=0)
        # The archive's lane may finish before the tracker's has passed over the capped seven.
        await _until(lambda: len(archive.records) == 10 and s.stats().written == 7)
        st = s.stats()
        assert st.check() and st.pending == 3 and st.written == 7
        assert st.sinks["tracker"].held == 3 and st.sinks["tracker"].skipped == {"capped": 7}
        assert tracker.records == []
        assert await s.flush(timeout=10)
        st = s.stats()
        assert st.check() and st.pending == 0 and st.written == 10 and st.sinks["tracker"].held == 0
        assert _rewards(tracker, 0) == [0.0, 8.0, 9.0]


async def test_steps_close_max_open_steps_behind_the_newest() -> None:
    """Without a flush, a step's selection is written once a step max_open_steps + 1 ahead arrives."""
    tracker = at.testing.MemorySink("tracker")
    async with at.TraceSession(
        "p",
        sinks=[at.testing.MemorySink(), Selected(tracker, max_traces_per_step=2, sampler="top_bottom")],
        flush_interval=0.01,
        max_open_steps=1,
        step_timeout=None,
    ) as s:
        for step in range(4):
            await s.log_samples([sample(i, step=step) for i in range(5)], step=step)
        await _until(lambda: set(tracker.steps()) == {0, 1})
        st = s.stats()
        assert st.sinks["tracker"].held == 4 and st.check()
    assert set(tracker.steps()) == {0, 1, 2, 3}


async def test_an_idle_step_closes_after_step_timeout() -> None:
    """A step that sees no record for step_timeout seconds is written without a flush."""
    tracker = at.testing.MemorySink("tracker")
    async with at.TraceSession(
        "p",
        sinks=[Selected(tracker, max_traces_per_step=2, sampler="top_bottom")],
        flush_interval=0.01,
        step_timeout=0.05,
    ) as s:
        await s.log_samples([sample(i, step=3) for i in range(6)], step=3)
        await _until(lambda: len(tracker.records) == 2)
        assert s.stats().sinks["tracker"].held == 0 and s.stats().pending == 0


async def test_late_records_after_a_flush_are_skipped_as_late_for_that_sink_only() -> None:
    """A flush closes the sink's steps: later samples of a closed step reach the archive and
    are counted "late" for the selecting sink, not dropped from the session."""
    archive, tracker = at.testing.MemorySink("archive"), at.testing.MemorySink("tracker")
    async with at.TraceSession(
        "p",
        sinks=[archive, Selected(tracker, max_traces_per_step=5, sampler="top_bottom")],
        step_timeout=None,
    ) as s:
        await s.log_samples([sample(i) for i in range(3)], step=0)
        await s.flush()
        await s.log_samples([sample(i) for i in range(3, 6)], step=0)
    st = s.stats()
    assert len(archive.records) == 6 and len(tracker.records) == 3
    assert st.written == 6 and st.dropped == {} and st.check()
    assert st.sinks["tracker"].skipped == {"late": 3}


async def test_first_sampler_passes_at_once_and_holds_nothing() -> None:
    """A non-holding sampler writes its first k of a step at once and caps the rest."""
    tracker = at.testing.MemorySink("tracker")
    async with at.TraceSession(
        "p", sinks=[at.testing.MemorySink(), Selected(tracker, max_traces_per_step=3)], flush_interval=0.01
    ) as s:
        await s.log_samples([sample(i) for i in range(10)], step=0)
        # The other sink's lane may still be writing when the tracker's three are in.
        await _until(lambda: len(tracker.records) == 3 and s.stats().pending == 0)
        assert s.stats().sinks["tracker"].held == 0
    assert [r.sample.metadata["uid"] for r in tracker.records] == ["0:0", "0:1", "0:2"]


async def test_a_failing_selected_sink_fails_only_what_it_was_to_write() -> None:
    """What a selecting sink fails for good is failed for the session; what it left out is
    written (the archive holds it): exact accounting per record."""
    archive = at.testing.MemorySink("archive")
    broken = at.testing.MemorySink("broken", fail_permanently=True)
    async with at.TraceSession(
        "p", sinks=[archive, Selected(broken, max_traces_per_step=2, sampler="top_bottom")], batch_size=4
    ) as s:
        for step in range(3):
            await s.log_samples([sample(i, step=step) for i in range(9)], step=step)
    st = s.stats()
    assert len(archive.records) == 27
    assert st.failed == 6 and st.written == 21 and st.pending == 0 and st.check()
    assert st.sinks["broken"].failed == 6 and st.sinks["broken"].skipped == {"capped": 21}


async def test_unscored_records_are_skipped_by_a_ranking_selection() -> None:
    """A record without a score cannot be ranked by a sink's top_bottom: that sink counts it
    as "unscored"; the archive still gets it."""
    archive, tracker = at.testing.MemorySink("archive"), at.testing.MemorySink("tracker")
    async with at.TraceSession(
        "p", sinks=[archive, Selected(tracker, max_traces_per_step=4, sampler="top_bottom")]
    ) as s:
        await s.log_samples([{"prompt": "q", "response": "no reward"}, sample(1), sample(2)], step=0)
    st = s.stats()
    assert len(archive.records) == 3 and len(tracker.records) == 2
    assert st.sinks["tracker"].skipped == {"unscored": 1} and st.written == 3 and st.check()


async def test_selection_on_top_of_the_session_cap() -> None:
    """The session's cap applies first (counted as dropped), then the sink's own selection."""
    archive, tracker = at.testing.MemorySink("archive"), at.testing.MemorySink("tracker")
    async with at.TraceSession(
        "p",
        sinks=[archive, Selected(tracker, max_traces_per_step=2, sampler="top_bottom")],
        max_traces_per_step=6,
        sampler="top_bottom",
    ) as s:
        await s.log_samples([sample(i) for i in range(20)], step=0)
    st = s.stats()
    assert sorted(r.sample.metadata["reward"] for r in archive.records) == [0, 1, 2, 17, 18, 19]
    assert _rewards(tracker, 0) == [0.0, 19.0]
    assert st.dropped == {"capped": 14} and st.sinks["tracker"].skipped == {"capped": 4} and st.check()


async def test_spool_acknowledges_held_records_only_once_decided(tmp_path: object) -> None:
    """With a spool, a record a sink's selection still holds is not acknowledged; at finish
    every record is acknowledged and nothing is left to replay."""
    archive, tracker = at.testing.MemorySink("archive"), at.testing.MemorySink("tracker")
    async with at.TraceSession(
        "p",
        sinks=[archive, Selected(tracker, max_traces_per_step=2, sampler="top_bottom")],
        spool_dir=str(tmp_path),
        flush_interval=0.01,
        step_timeout=None,
    ) as s:
        await s.log_samples([sample(i) for i in range(8)], step=0)
        await _until(lambda: len(archive.records) == 8 and getattr(s.stats().spool, "acknowledged", 0) == 6)
        spool = s.stats().spool
        assert spool is not None and spool.appended == 8 and spool.acknowledged == 6
    spool = s.stats().spool
    assert spool is not None and spool.acknowledged == 8 and s.stats().pending == 0


async def test_jsonl_archive_finds_every_id_the_tracker_shows(tmp_path: object) -> None:
    """The lookup docs/sinks.md shows: an id from the selected sink finds its line in the archive."""
    path = f"{tmp_path}/archive.jsonl"
    tracker = at.testing.MemorySink("tracker")
    async with at.TraceSession(
        "p", sinks=[at.JsonlSink(path), Selected(tracker, max_traces_per_step=4, sampler="top_bottom")]
    ) as s:
        for step in range(3):
            await s.log_samples([sample(i, step=step, reward=float(i % 11)) for i in range(30)], step=step)
    with open(path, "rb") as f:
        lines = [orjson.loads(line) for line in f]
    archive = {row["id"]: row for row in lines if "id" in row}
    assert len(archive) == 90
    for r in tracker.records:
        assert archive[r.id]["step"] == r.step
        assert archive[r.id]["sample"]["metadata"]["reward"] == r.sample.metadata["reward"]
    assert Counter(r.step for r in tracker.records) == {0: 4, 1: 4, 2: 4}


def test_selected_checks_its_arguments() -> None:
    """Bad arguments get a clear ValueError naming what was wrong."""
    with pytest.raises(ValueError, match="max_traces_per_step must be a positive int"):
        Selected(at.testing.MemorySink(), max_traces_per_step=0)
    with pytest.raises(ValueError, match="sampler must be"):
        Selected(at.testing.MemorySink(), max_traces_per_step=2, sampler="best")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"wraps an asynctrace\.Sink"):
        Selected("trackio", max_traces_per_step=2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="Selected already"):
        Selected(Selected(at.testing.MemorySink(), max_traces_per_step=2), max_traces_per_step=1)


async def test_jsonl_archive_and_trackio_top_bottom_16(project: str, tmp_path: object) -> None:
    """Real Trackio storage holds exactly the top/bottom 16 of each step, each one also in the
    JSONL archive (same sample), which holds every sample exactly once."""
    from tests._util import read_traces

    path = f"{tmp_path}/archive.jsonl"
    rng = random.Random(1)
    async with at.TraceSession(
        project,
        run="tiered",
        # Trackio in a thread: the test checks its store, not the writer process (~1.5 CPU-s a start).
        sinks=[
            at.JsonlSink(path),
            Selected(at.TrackioSink(process=False), max_traces_per_step=16, sampler="top_bottom"),
        ],
    ) as s:
        for step in range(3):
            await s.log_samples([sample(i, step=step, reward=rng.random()) for i in range(100)], step=step)
    with open(path, "rb") as f:
        rows = [row for line in f if "id" in (row := orjson.loads(line))]
    assert len(rows) == 300 and len({row["id"] for row in rows}) == 300
    by_uid = {row["sample"]["metadata"]["uid"]: row for row in rows}
    traces = read_traces(project, "tiered")
    assert Counter(t["step"] for t in traces) == {0: 16, 1: 16, 2: 16}
    for step in range(3):
        rewards = sorted(row["sample"]["metadata"]["reward"] for row in rows if row["step"] == step)
        shown = sorted(t["metadata"]["reward"] for t in traces if t["step"] == step)
        assert shown == rewards[:8] + rewards[-8:]
    for t in traces:
        archived = by_uid[t["metadata"]["uid"]]
        assert archived["step"] == t["step"] and archived["sample"]["messages"] == t["messages"]
    st = s.stats()
    assert st.sinks["trackio"].skipped == {"capped": 252} and st.written == 300 and st.check()
