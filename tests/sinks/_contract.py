"""The behaviour every sink shows against its real backend: exact accounting, retries, permanent errors,
and a hanging backend bounded by finish's deadline.

A sink's test module subclasses `Backend` with the real package's own ways to fail (a read-only
directory, a locked database, a stopped service process) and calls `run_contract` from one test per
contract point, so each sink is held to the same checks:

    @pytest.mark.parametrize("point", CONTRACT)
    async def test_contract(point: str, tmp_path: Path) -> None:
        '''The Parquet sink keeps the sink contract (see tests/sinks/_contract.py).'''
        await run_contract(point, ParquetBackend(tmp_path))
"""

from __future__ import annotations

import abc
import contextlib
import time

import anyio

import asynctrace as at
from asynctrace._runtime.lifecycle import finish_bound
from tests._util import sample

__all__ = ["CONTRACT", "Backend", "run_contract"]

CONTRACT = ("round_trip", "transient", "permanent", "hang")

# Quick retries, so the transient and permanent points end in seconds; the attempt timeout is long
# enough for a real backend's first call (a service starting) on a loaded two-core machine.
RETRY = at.RetryPolicy(max_attempts=40, initial_backoff=0.05, max_backoff=0.2, attempt_timeout=30.0)
# Seconds a test waits for something the backend must do by itself.
PATIENCE = 60.0


class Backend(abc.ABC):
    """One real backend behind one sink, with ways to make it fail for real."""

    @abc.abstractmethod
    def make_sink(self) -> at.Sink:
        """A fresh sink writing to this backend."""

    @abc.abstractmethod
    def read_ids(self) -> list[str]:
        """Every record id the backend holds, read back through the backend's own API (after finish)."""

    @abc.abstractmethod
    def transient_fault(self) -> contextlib.AbstractContextManager[None]:
        """Inside: the backend's writes fail; after: they succeed again."""

    @abc.abstractmethod
    def permanent_fault(self) -> contextlib.AbstractContextManager[None]:
        """Inside: the sink's writes fail in a way it reports as `PermanentSinkError`."""

    @abc.abstractmethod
    def hang(self) -> contextlib.AbstractContextManager[None]:
        """Inside: the backend's calls block and do not return."""


async def _until(predicate: object, what: str) -> None:
    with anyio.fail_after(PATIENCE):
        while not predicate():  # type: ignore[operator]
            await anyio.sleep(0.02)
    assert predicate(), what  # type: ignore[operator]


async def _round_trip(backend: Backend) -> None:
    memory = at.testing.MemorySink("memory")
    sink = backend.make_sink()
    async with at.TraceSession("contract", run="r", sinks=[sink, memory], retry=RETRY, batch_size=16) as s:
        for step in range(3):
            await s.log_samples([sample(i) for i in range(20)], step=step)
            await s.log_samples([sample(i) for i in range(5)], step=step, split="eval")
    st = s.stats()
    assert st.check() and st.written == 75 and st.failed == 0, st.summary()
    assert st.sinks[sink.name].written == 75
    ids = [r.id for r in memory.records]
    held = backend.read_ids()
    assert sorted(held) == sorted(ids), "the backend must hold every record once, under the id others got"


async def _transient(backend: Backend) -> None:
    memory = at.testing.MemorySink("memory")
    sink = backend.make_sink()
    async with at.TraceSession("contract", run="r", sinks=[sink, memory], retry=RETRY, batch_size=8) as s:
        await s.log_samples([sample(i) for i in range(8)], step=0)
        assert await s.flush(timeout=PATIENCE)
        with backend.transient_fault():
            await s.log_samples([sample(i) for i in range(8)], step=1)
            await _until(lambda: s.stats().sinks[sink.name].retries > 0, "a failed write must be retried")
        assert await s.flush(timeout=PATIENCE)
    st = s.stats()
    assert st.check() and st.written == 16 and st.failed == 0, st.summary()
    assert st.sinks[sink.name].retries >= 1
    assert sorted(backend.read_ids()) == sorted(r.id for r in memory.records)


async def _permanent(backend: Backend) -> None:
    memory = at.testing.MemorySink("memory")
    sink = backend.make_sink()
    async with at.TraceSession("contract", run="r", sinks=[sink, memory], retry=RETRY, batch_size=8) as s:
        await s.log_samples([sample(i) for i in range(8)], step=0)
        assert await s.flush(timeout=PATIENCE)
        with backend.permanent_fault():
            await s.log_samples([sample(i) for i in range(8)], step=1)
            await _until(lambda: s.stats().sinks[sink.name].failed == 8, "a permanent error fails the batch")
    st = s.stats()
    sink_st = st.sinks[sink.name]
    assert st.check(), st.summary()
    assert sink_st.written == 8 and sink_st.failed == 8 and sink_st.last_error
    assert st.sinks["memory"].written == 16, "a failing sink must not hold up the others"


async def _hang(backend: Backend) -> None:
    memory = at.testing.MemorySink("memory")
    sink = backend.make_sink()
    budget = 2.0
    with backend.hang():
        started = time.monotonic()
        async with at.TraceSession(
            "contract", run="r", sinks=[sink, memory], retry=RETRY, batch_size=8, finish_timeout=budget
        ) as s:
            await s.log_samples([sample(i) for i in range(8)], step=0)
            await _until(lambda: s.stats().sinks["memory"].written == 8, "the healthy sink is not held up")
            stats = await s.finish(timeout=budget)
        elapsed = time.monotonic() - started
    assert elapsed < finish_bound(budget) + 5.0, f"finish took {elapsed:.1f}s with a hung backend"
    assert stats.check(), stats.summary()
    assert stats.sinks[sink.name].written < 8 and stats.sinks["memory"].written == 8, stats


async def run_contract(point: str, backend: Backend) -> None:
    """Check one contract point (one of `CONTRACT`) against a real backend."""
    checks = {"round_trip": _round_trip, "transient": _transient, "permanent": _permanent, "hang": _hang}
    await checks[point](backend)
