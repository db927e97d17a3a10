"""Trackio's database held locked by another connection: retries wait it out and lose nothing."""

from __future__ import annotations

import sqlite3
import threading
import time

import anyio
import pytest

import asynctrace as at
from tests._util import sample
from tests.faults import _harness as h

pytestmark = pytest.mark.anyio

LOCK_SECONDS = 4.0


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # the behaviour under test is the writer process's, not the event loop's


def _hold_exclusive_lock(db: str, seconds: float, locked: threading.Event) -> None:
    conn = sqlite3.connect(db, timeout=0, isolation_level=None)
    try:
        conn.execute("BEGIN EXCLUSIVE")
        locked.set()
        time.sleep(seconds)
        conn.execute("ROLLBACK")
    finally:
        conn.close()


async def test_database_locked_longer_than_an_attempt_is_retried_until_written(project: str) -> None:
    """A lock held for 4 s, with 0.5 s attempts: writes are retried, then all land once."""
    from trackio.sqlite_storage import SQLiteStorage

    # Trackio itself waits up to 30 s for a lock; the short attempt timeout makes the lock
    # outlast several attempts, so it is the retries that have to get the records through.
    policy = at.RetryPolicy(max_attempts=40, initial_backoff=0.05, max_backoff=0.2, attempt_timeout=0.5)
    async with at.TraceSession(project, run="r", retry=policy, flush_interval=0.05) as session:
        await session.log_samples([sample(i) for i in range(10)], step=0)
        assert await session.flush(timeout=60)
        locked = threading.Event()
        holder = threading.Thread(
            target=_hold_exclusive_lock,
            args=(str(SQLiteStorage.get_project_db_path(project)), LOCK_SECONDS, locked),
        )
        holder.start()
        await anyio.to_thread.run_sync(locked.wait)
        started = time.monotonic()
        for step in range(1, 6):
            await session.log_samples([sample(i, step=step) for i in range(40)], step=step)
        assert await session.flush(timeout=60)
        waited = time.monotonic() - started
        await anyio.to_thread.run_sync(holder.join)
    stats = session.stats()
    assert stats.written == 210 and stats.failed == 0 and stats.check()
    assert stats.retries >= 3, stats.summary()
    assert waited >= LOCK_SECONDS - 0.5
    uids = h.trackio_uids(project, "r")
    assert len(uids) == 210 and max(uids.values()) == 1
