"""Retries, permanent failures and hanging sinks: counted, isolated and bounded by deadlines."""

from __future__ import annotations

import itertools
import time

import anyio
import pytest

import asynctrace as at
from tests._util import read_traces, sample

pytestmark = pytest.mark.anyio

FAST = at.RetryPolicy(max_attempts=5, initial_backoff=0.01, max_backoff=0.05, attempt_timeout=2.0)
# For counting retries exactly: Trackio's first write (importing Trackio, opening its store) can
# take longer than FAST's 2 s on a loaded machine, and a timed-out attempt is a retry too.
# Trackio runs in a thread (`process=False`): these tests check what reaches its store, not the
# writer process (a process start costs ~1.5 CPU-s).
PATIENT = at.RetryPolicy(max_attempts=5, initial_backoff=0.01, max_backoff=0.05, attempt_timeout=60.0)


async def test_transient_failures_are_retried_until_written(project: str) -> None:
    """A sink failing its first 3 attempts gets everything written, and the retries are counted."""
    flaky = at.testing.MemorySink("flaky", fail_times=3)
    trackio = at.TrackioSink(process=False)
    async with at.TraceSession(project, run="r", sinks=[flaky, trackio], retry=PATIENT, batch_size=1000) as s:
        await s.log_samples([sample(i) for i in range(50)], step=0)
    st = s.stats()
    assert st.written == 50 and st.failed == 0 and st.check()
    assert st.sinks["flaky"].retries == 3 and st.sinks["flaky"].written == 50
    assert st.retries == 3
    assert flaky.attempts == 4 and len(flaky.records) == 50
    assert len(read_traces(project, "r")) == 50


async def test_retries_exhausted_counts_failed() -> None:
    """A sink that fails more often than max_attempts has its records counted as failed."""
    flaky = at.testing.MemorySink("flaky", fail_times=100)
    policy = at.RetryPolicy(max_attempts=3, initial_backoff=0.001, max_backoff=0.01)
    async with at.TraceSession("p", sinks=[flaky], retry=policy, batch_size=10) as s:
        await s.log_samples([sample(i) for i in range(10)], step=0)
    st = s.stats()
    assert st.failed == 10 and st.written == 0 and st.check()
    assert flaky.attempts == 3 and st.sinks["flaky"].retries == 2
    assert "transient failure" in (st.sinks["flaky"].last_error or "")


async def test_permanent_error_not_retried_other_sinks_unaffected(project: str) -> None:
    """PermanentSinkError is not retried and counts as failed; the other sinks still get everything."""
    broken = at.testing.MemorySink("broken", fail_permanently=True)
    good = at.testing.MemorySink("good")
    trackio = at.TrackioSink(process=False)
    async with at.TraceSession(
        project, run="r", sinks=[broken, good, trackio], retry=PATIENT, batch_size=8
    ) as s:
        for step in range(3):
            await s.log_samples([sample(i, step=step) for i in range(8)], step=step)
            await s.flush()
    st = s.stats()
    assert broken.attempts == 3  # one per batch: never retried
    assert st.sinks["broken"].failed == 24 and st.sinks["broken"].retries == 0
    assert st.sinks["good"].written == 24 and st.sinks["trackio"].written == 24
    assert st.failed == 24 and st.written == 0 and st.check()
    assert len(good.records) == 24
    assert len(read_traces(project, "r")) == 24


async def test_hanging_sink_finish_deadline_reports_pending() -> None:
    """With a sink that hangs, finish(timeout=1) returns in about a second and reports what is pending."""
    hung = at.testing.MemorySink("hung", hang=True)
    good = at.testing.MemorySink("good")
    async with at.TraceSession("p", sinks=[hung, good], retry=FAST, batch_size=5) as s:
        await s.log_samples([sample(i) for i in range(12)], step=0)
        with anyio.fail_after(3):
            assert await s.flush(timeout=0.3) is False
        started = time.monotonic()
        stats = await s.finish(timeout=1)
        elapsed = time.monotonic() - started
    assert elapsed < 2.5
    assert stats.pending == 12 and stats.written == 0 and stats.check()
    # The healthy sink was not held up by the hanging one.
    assert len(good.records) == 12 and stats.sinks["good"].written == 12


async def test_attempt_timeout_turns_a_hang_into_a_retry() -> None:
    """A write hanging past attempt_timeout is abandoned and retried; exhausted, it counts as failed."""
    hung = at.testing.MemorySink("hung", hang=True)
    policy = at.RetryPolicy(max_attempts=2, initial_backoff=0.01, max_backoff=0.01, attempt_timeout=0.1)
    async with at.TraceSession("p", sinks=[hung], retry=policy) as s:
        await s.log_samples([sample(i) for i in range(3)], step=0)
        with anyio.fail_after(5):
            assert await s.flush()
    st = s.stats()
    assert st.failed == 3 and st.retries == 1 and hung.attempts == 2
    assert "TimeoutError" in (st.sinks["hung"].last_error or "")


class _FailingOpen(at.Sink):
    name = "no-open"

    async def open(self) -> None:
        raise at.PermanentSinkError("no credentials")

    async def write(self, records: object) -> None:  # pragma: no cover - never reached
        raise AssertionError("write on a sink that never opened")


async def test_sink_that_cannot_open_counts_failed() -> None:
    """A sink whose open() fails for good has its records counted as failed, and the session goes on."""
    good = at.testing.MemorySink("good")
    async with at.TraceSession("p", sinks=[_FailingOpen(), good], retry=FAST) as s:
        await s.log_samples([sample(i) for i in range(4)], step=0)
    st = s.stats()
    assert st.sinks["no-open"].failed == 4 and "no credentials" in (st.sinks["no-open"].last_error or "")
    assert len(good.records) == 4 and st.check()


async def test_backoff_doubles_from_initial_and_stops_at_max_attempts() -> None:
    """call_with_retry waits initial*2**k (+ jitter below initial) between its max_attempts attempts."""
    from asynctrace._engine.retry import call_with_retry

    policy = at.RetryPolicy(max_attempts=4, initial_backoff=0.2, max_backoff=0.6, attempt_timeout=1.0)
    starts: list[float] = []
    retried: list[BaseException | None] = []

    async def always_fails() -> None:
        starts.append(time.monotonic())
        raise OSError(f"attempt {len(starts)}")

    with pytest.raises(OSError, match="attempt 4"):
        await call_with_retry(policy, always_fails, retried.append)
    assert len(starts) == 4 and len(retried) == 3
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    # 0.2, 0.4, then 0.8 clipped to max_backoff=0.6; each plus jitter in [0, 0.2]. The waits are
    # long enough that a loaded machine's late wake-up (allowed: 0.15 s) cannot blur them.
    for gap, base in zip(gaps, (0.2, 0.4, 0.6), strict=True):
        assert base * 0.95 <= gap <= base + 0.2 + 0.15, gaps


async def test_a_permanent_error_on_the_first_attempt_is_not_retried() -> None:
    """PermanentSinkError and cancellation skip the retrier entirely."""
    from asynctrace._engine.retry import call_with_retry

    calls = 0

    async def permanent() -> None:
        nonlocal calls
        calls += 1
        raise at.PermanentSinkError("no")

    with pytest.raises(at.PermanentSinkError):
        await call_with_retry(FAST, permanent, lambda e: pytest.fail("retried"))
    assert calls == 1
