"""The bounded buffer under a slow sink: block waits and never drops, drop policies never wait."""

from __future__ import annotations

import threading
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
