"""The bounded buffer under a slow sink: block waits and never drops, drop policies never wait."""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Sequence

import anyio
import pytest

import asynctrace as at
from tests._util import sample

pytestmark = pytest.mark.anyio

N = 120


class Ticker:
    """Counts event-loop turns; a call that never yields leaves the count unchanged."""

    def __init__(self) -> None:
        self.turns = 0

    async def run(self) -> None:
        while True:
            self.turns += 1
            await anyio.lowlevel.checkpoint()


def _slow(name: str = "slow") -> at.testing.MemorySink:
    return at.testing.MemorySink(name, delay=0.01)


async def test_block_never_drops_and_waits() -> None:
    """on_full='block' with a slow sink writes every sample and makes the caller wait."""
    sink = _slow()
    ticker = Ticker()
    waited = 0
    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker.run)
        async with at.TraceSession("p", sinks=[sink], queue_size=8, batch_size=4, on_full="block") as s:
            for i in range(N):
                before = ticker.turns
                assert await s.log_samples([sample(i)], step=0) == 1
                waited += ticker.turns != before
                st = s.stats()
                assert st.queue_depth <= 8 and st.check()
        tg.cancel_scope.cancel()
    stats = s.stats()
    assert stats.written == N and stats.dropped == {} and stats.check()
    assert [r.sample.metadata["uid"] for r in sink.records] == [f"0:{i}" for i in range(N)]
    assert waited > 0


@pytest.mark.parametrize("policy", ["drop_newest", "drop_oldest"])
async def test_drop_policies_never_wait_for_a_stuck_sink(policy: str) -> None:
    """Behind a sink that never returns, the drop policies still return at once and count drops."""
    stuck = at.testing.MemorySink("stuck", hang=True)
    async with at.TraceSession(
        "p",
        sinks=[stuck],
        queue_size=8,
        batch_size=4,
        on_full=policy,
        finish_timeout=0.5,  # type: ignore[arg-type]
    ) as s:
        with anyio.fail_after(5):  # any wait for room would last forever
            accepted = sum([await s.log_samples([sample(i)], step=0) for i in range(N)])
        st = s.stats()
        assert st.queue_depth == 8 and st.dropped["queue_full"] == N - 8 and st.check()
        assert accepted == (8 if policy == "drop_newest" else N)


@pytest.mark.parametrize("policy", ["drop_newest", "drop_oldest"])
async def test_drop_policies_count_exactly_behind_a_slow_sink(policy: str) -> None:
    """Behind a slow sink the drop policies drop and count exactly; nothing is lost unaccounted."""
    sink = _slow()
    accepted = 0
    async with at.TraceSession("p", sinks=[sink], queue_size=8, batch_size=4, on_full=policy) as s:  # type: ignore[arg-type]
        for i in range(N):
            accepted += await s.log_samples([sample(i)], step=0)
            assert s.stats().queue_depth <= 8
    stats = s.stats()
    dropped = stats.dropped.get("queue_full", 0)
    assert dropped > 0
    assert stats.written == len(sink.records)
    assert stats.written + dropped == N and stats.pending == 0 and stats.check()
    uids = [int(r.sample.metadata["uid"].split(":")[1]) for r in sink.records]
    assert uids == sorted(uids)
    if policy == "drop_newest":
        assert accepted == stats.written
        assert uids[:8] == list(range(8))  # the first ones were never displaced
    else:
        assert accepted == N  # every call was accepted; older ones were displaced later
        assert uids[-1] == N - 1  # the newest always survives


async def test_byte_bound_is_enforced() -> None:
    """max_queue_bytes bounds the encoded bytes held, whatever the record count."""
    sink = _slow()
    big = "x" * 10_000
    async with at.TraceSession(
        "p", sinks=[sink], max_queue_bytes=35_000, queue_size=1000, on_full="drop_newest", batch_size=1
    ) as s:
        for i in range(20):
            await s.log_samples([sample(i, pad=big)], step=0)
            assert s.stats().queue_bytes <= 35_000
    st = s.stats()
    assert st.dropped["queue_full"] > 0 and st.written + st.dropped["queue_full"] == 20


async def test_oversized_sample_is_a_record_error() -> None:
    """A sample larger than the whole byte bound is refused with a RecordError naming its size."""
    async with at.TraceSession("p", sinks=[at.testing.MemorySink()], max_queue_bytes=1000) as s:
        with pytest.raises(at.RecordError, match=r"sample 1: encodes to .* bytes"):
            await s.log_samples([sample(0), sample(1, pad="y" * 2000)], step=0)


async def test_nowait_from_threads_never_blocks() -> None:
    """log_samples_nowait from plain threads never blocks under 'block'; overflow counts as queue_full."""
    sink = _slow()
    async with at.TraceSession("p", sinks=[sink], queue_size=16, on_full="block") as s:
        results: list[int] = []

        def worker(t: int) -> None:
            results.extend(s.log_samples_nowait([sample(t * 100 + i)], step=0) for i in range(100))

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
        with anyio.fail_after(5):
            for t in threads:
                t.start()
            await anyio.to_thread.run_sync(lambda: [t.join() for t in threads])
    st = s.stats()
    assert sum(results) == st.written
    assert st.written + st.dropped["queue_full"] == 400 and st.check()


async def test_blocking_timeout_drops_the_rest() -> None:
    """log_samples(timeout=...) under 'block' gives up at the deadline; the rest count as queue_full."""
    sink = at.testing.MemorySink(hang=True)
    async with at.TraceSession(
        "p", sinks=[sink], queue_size=2, batch_size=1, on_full="block", finish_timeout=0.5
    ) as s:
        with anyio.fail_after(5):
            n = await s.log_samples([sample(i) for i in range(5)], step=0, timeout=0.2)
        assert n == 2
        assert s.stats().dropped == {"queue_full": 3}


async def test_drop_oldest_keeps_the_newest_behind_a_slow_sink() -> None:
    """Behind a slow sink, drop_oldest evicts from batches no sink has started, so the newest survive."""
    sink = at.testing.MemorySink("slow", delay=0.05)
    async with at.TraceSession("p", sinks=[sink], queue_size=40, batch_size=4, on_full="drop_oldest") as s:
        for i in range(400):
            await s.log_samples([sample(i)], step=0)
            if i % 50 == 0:
                await anyio.sleep(0.01)
    st = s.stats()
    uids = [int(r.sample.metadata["uid"].split(":")[1]) for r in sink.records]
    assert st.check() and st.written == len(uids) and st.written + st.dropped["queue_full"] == 400
    # Everything still buffered at the end was among the newest: the last 36 all survive.
    assert set(range(400 - 36, 400)) <= set(uids)


async def test_a_caller_that_awaits_nothing_else_does_not_starve_the_writer() -> None:
    """A tight loop of log_samples under drop_newest still lets the writer drain between calls."""
    sink = at.testing.MemorySink()
    async with at.TraceSession("p", sinks=[sink], queue_size=64, batch_size=16, on_full="drop_newest") as s:
        for i in range(2000):
            await s.log_samples([sample(i)], step=0)
        during = len(sink.records)
    assert during > 64 * 4  # far more than one buffer's worth was written while the loop ran
    assert s.stats().check()


@pytest.mark.parametrize("bound", ["records", "bytes"])
async def test_a_bound_smaller_than_a_batch_drains_without_waiting_for_the_timer(bound: str) -> None:
    """With room for fewer records than a batch, batches go out as the bound half fills, not on the timer."""
    sink = at.testing.MemorySink()
    limits = {"queue_size": 8} if bound == "records" else {"max_queue_bytes": 8 * 150}
    async with at.TraceSession(
        "p", sinks=[sink], batch_size=256, flush_interval=30.0, on_full="drop_newest", **limits
    ) as s:
        for i in range(2000):
            await s.log_samples([sample(i)], step=0)
        during = len(sink.records)
    st = s.stats()
    assert st.check() and st.written + st.dropped.get("queue_full", 0) == 2000
    # The timer never fired (30 s), yet most records were written while the loop ran.
    assert during > 1000, (during, st.summary())


class _GatedSink(at.Sink):
    """Holds its first write until released; records the size of every write."""

    name = "gated"

    def __init__(self) -> None:
        self.release = anyio.Event()
        self.sizes: list[int] = []

    async def write(self, records: Sequence[at.TraceRecord]) -> None:
        await self.release.wait()
        self.sizes.append(len(records))


async def test_a_sink_that_fell_behind_gets_fewer_writes_of_at_most_batch_size() -> None:
    """Small batches that piled up behind a busy sink reach it in fewer writes, none of more
    than batch_size records (the contract's bound on one write); every record once."""
    sink = _GatedSink()
    async with at.TraceSession("p", sinks=[sink], batch_size=10, flush_interval=0.01) as s:
        for step in range(10):
            # Each call's 4 samples go out as their own batch when the timer fires.
            await s.log_samples([sample(i, step=step) for i in range(4)], step=step)
            await anyio.sleep(0.03)
        sink.release.set()
    assert sum(sink.sizes) == 40
    assert 4 < max(sink.sizes) <= 10


class _Counting(at.Sink):
    """Counts what it is given and keeps nothing."""

    name = "counting"

    def __init__(self) -> None:
        self.n = 0

    async def write(self, records: Sequence[at.TraceRecord]) -> None:
        self.n += len(records)


async def test_drop_oldest_does_not_keep_written_batches_alive() -> None:
    """Under drop_oldest, batches a sink has written are forgotten: after 20 MB went through a
    session that never filled up, almost none of it is still held in memory."""
    import gc
    import tracemalloc

    sink = _Counting()
    tracemalloc.start()
    try:
        async with at.TraceSession("p", sinks=[sink], on_full="drop_oldest", flush_interval=0.01) as s:
            base = tracemalloc.get_traced_memory()[0]
            for step in range(40):
                await s.log_samples([{"prompt": "q", "response": "x" * 10_000} for _ in range(50)], step=step)
                await anyio.sleep(0)
            assert await s.flush(timeout=10)
            gc.collect()
            held = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert sink.n == 2000 and s.stats().dropped == {}
    assert held < 4 * 2**20, f"{held / 2**20:.1f} MiB still held after flush"


class _FinishingSink(at.Sink):
    """On its first write, waits for a thread to block for room, then starts finish() so that it
    begins just as this write frees the room."""

    name = "finishing"

    def __init__(self) -> None:
        self.session: at.TraceSession | None = None
        self.records: list[at.TraceRecord] = []
        self.final: at.SessionStats | None = None

    async def write(self, records: Sequence[at.TraceRecord]) -> None:
        session = self.session
        if session is not None and not self.records:
            while session._engine.buffer.room.waiting == 0:
                await anyio.sleep(0.005)
            go = anyio.Event()

            async def finisher() -> None:
                await go.wait()  # wakes first, in the same turn as this write
                self.final = await session.finish(5.0)

            assert session._tg is not None
            session._tg.start_soon(finisher)
            await anyio.sleep(0.02)
            go.set()
            await anyio.sleep(0)
        self.records.extend(records)


def test_a_thread_waiting_for_room_when_finish_begins_counts_its_samples_closed() -> None:
    """A blocking log_samples still waiting for room when finish() begins gives its samples up as
    "closed" even if room frees at that moment, and finish()'s own stats already show it."""
    sink = _FinishingSink()
    session = at.TraceSession(
        "p", sinks=[sink], queue_size=1, on_full="block", batch_size=1, flush_interval=0.01
    )
    sink.session = session
    result: dict[str, int] = {}
    with session as s:

        def worker() -> None:
            result["accepted"] = s.log_samples([sample(0), sample(1)], step=0)

        t = threading.Thread(target=worker)
        t.start()
        t.join(10)
    final = sink.final
    assert final is not None and final.check()
    assert final.pending == 0 and final.written == 1 and final.dropped == {"closed": 1}
    assert result["accepted"] == 1 and session.stats() == final


async def test_flush_waits_for_samples_still_waiting_for_room() -> None:
    """flush() covers samples submitted before it that were still waiting for room under block."""
    sink = at.testing.MemorySink(delay=0.1)
    async with (
        at.TraceSession(
            "p", sinks=[sink], queue_size=2, on_full="block", batch_size=2, flush_interval=0.01
        ) as s,
        anyio.create_task_group() as tg,
    ):
        tg.start_soon(functools.partial(s.log_samples, [sample(i) for i in range(6)], step=0))
        await anyio.sleep(0.05)
        assert s.stats().pending == 6
        assert await s.flush(timeout=10)
        assert s.stats().written == 6 and len(sink.records) == 6


async def test_nowait_under_block_drops_only_what_does_not_fit() -> None:
    """log_samples_nowait under on_full="block" behaves as drop_newest: a later smaller sample
    that fits is kept."""
    results = {}
    for policy in ("block", "drop_newest"):
        async with at.TraceSession(
            "p",
            sinks=[at.testing.MemorySink(hang=True)],
            max_queue_bytes=1000,
            on_full=policy,
            finish_timeout=0.1,
        ) as s:  # type: ignore[arg-type]
            s.log_samples_nowait([{"prompt": "q", "response": "x" * 600}], step=0)
            results[policy] = s.log_samples_nowait(
                [{"prompt": "q", "response": "y" * 600}, {"prompt": "q", "response": "z"}], step=0
            )
    assert results == {"block": 1, "drop_newest": 1}


class _Timed(at.Sink):
    """Notes when each record reaches it (monotonic seconds)."""

    name = "timed"

    def __init__(self) -> None:
        self.seen: dict[str, float] = {}

    async def write(self, records: Sequence[at.TraceRecord]) -> None:
        now = anyio.current_time()
        for r in records:
            self.seen[r.sample.metadata["uid"]] = now


async def test_a_record_after_a_metrics_item_waits_at_most_flush_interval() -> None:
    """A record queued after a metrics item reaches the sink within flush_interval of its own
    submission: the metrics item sends the records before it on, and the timer restarts."""
    sink = _Timed()
    async with at.TraceSession("p", sinks=[sink], flush_interval=1.0, finish_timeout=10) as s:
        await s.log_samples([sample(0)], step=0)
        await anyio.sleep(0.2)
        await s.log_metrics({"m": 1.0}, step=0)
        await anyio.sleep(0.3)
        submitted = anyio.current_time()
        await s.log_samples([sample(1)], step=0)
        with anyio.fail_after(5):
            while len(sink.seen) < 2:
                await anyio.sleep(0.01)
    waited = sink.seen["0:1"] - submitted
    assert waited < 1.0 + 0.25, waited


def _sized(i: int, nbytes: int) -> dict[str, object]:
    """`sample(i)` padded so that it encodes to exactly `nbytes` bytes."""
    from asynctrace._records.encode import encode_sample

    base = len(encode_sample(sample(i, pad=""), 0)[0])
    return sample(i, pad="x" * (nbytes - base))


async def test_drop_oldest_evicts_nothing_for_a_record_that_could_never_fit() -> None:
    """A record larger than all the room eviction could free is dropped alone: drop_oldest does
    not first evict older records for it (two losses where one would do)."""
    stuck = at.testing.MemorySink("stuck", hang=True)
    async with at.TraceSession(
        "p", sinks=[stuck], batch_size=4, max_queue_bytes=4000, on_full="drop_oldest", finish_timeout=0.3
    ) as s:
        await s.log_samples([sample(i) for i in range(4)], step=0)  # a full batch: the sink starts it
        with anyio.fail_after(5):
            while stuck.attempts == 0:
                await anyio.sleep(0.005)
        pinned = s.stats().queue_bytes  # held by the write that never returns: out of eviction's reach
        await s.log_samples([sample(4), sample(5)], step=0)  # queued: evictable
        assert await s.log_samples([_sized(6, 4000 - pinned + 1)], step=0) == 0
        st = s.stats()
        assert st.dropped == {"queue_full": 1} and st.queue_depth == 6 and st.check()
        # One that fits once every evictable record is gone still gets in, evicting them.
        assert await s.log_samples([_sized(7, 4000 - pinned)], step=0) == 1
        st = s.stats()
        assert st.dropped == {"queue_full": 3} and st.queue_depth == 5 and st.check()


async def _one_call_that_waits(n: int) -> float:
    """CPU seconds one log_samples call of `n` small samples takes behind a bound of 64."""
    sink = _Counting()
    items = [{"prompt": "q", "response": "a"} for _ in range(n)]
    async with at.TraceSession("p", sinks=[sink], queue_size=64, batch_size=32) as s:
        # CPU time, not wall time: other processes on the machine do not count.
        start = time.process_time()
        assert await s.log_samples(items, step=0) == n
        took = time.process_time() - start
    assert sink.n == n
    return took


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the buffer's work, whatever the loop
async def test_one_huge_call_that_waits_for_room_takes_time_linear_in_its_size() -> None:
    """A single log_samples call far larger than the bound waits for room over a thousand
    times; what is still waiting is not copied on each pass, so four times the samples take
    about four times as long (a copy per pass made it quadratic: over twelve times)."""
    small = await _one_call_that_waits(20_000)
    large = await _one_call_that_waits(80_000)
    assert large / small < 7, (small, large)


async def test_drop_oldest_from_a_busy_loop_still_lets_the_sink_write() -> None:
    """log_samples_nowait from the event loop, yielding once every 20 calls, under drop_oldest:
    batches handed to an idle sink are out of eviction's reach, so the sink writes about as
    much as under drop_newest (it used to find every batch emptied before it could start it)."""
    written = {}
    for policy in ("drop_newest", "drop_oldest"):
        sink = at.testing.MemorySink(delay=0.005)
        async with at.TraceSession(
            "p", sinks=[sink], queue_size=100, batch_size=8, on_full=policy, finish_timeout=5
        ) as s:
            for i in range(20_000):
                s.log_samples_nowait(sample(i), step=0)
                if i % 20 == 19:
                    await anyio.sleep(0)
            written[policy] = len(sink.records)
        assert s.stats().check()
    assert written["drop_newest"] > 100
    assert written["drop_oldest"] > written["drop_newest"] / 2, written
