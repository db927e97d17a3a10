"""An attached W&B run never holds up the event loop: W&B's blocking calls run off it, each
awaited with a deadline, whatever the trainer or its wandb-core service do meanwhile."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import anyio
import psutil
import pytest

import asynctrace as at
from asynctrace._runtime.lifecycle import finish_bound
from tests._util import sample
from tests.sinks._wandb_env import offline_wandb, service, ticking, trainer_run
from tests.sinks._wandb_log import table_rows

pytestmark = pytest.mark.anyio

__all__ = ["offline_wandb"]

# The longest the 1 ms ticker may wait: far under W&B's 30 s `Run.step`, well over a busy CI's jitter.
STALL = 0.5
# What a flush or finish may take past its bound on a loaded machine.
SLACK = 1.5


def _stop(core: psutil.Process) -> None:
    """SIGSTOP `core` and wait until it is stopped (it may answer a last request meanwhile)."""
    core.send_signal(signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while core.status() != psutil.STATUS_STOPPED:
        assert time.monotonic() < deadline, "wandb-core did not stop"
        time.sleep(0.001)


async def _log_three_steps(s: at.TraceSession, run: Any) -> None:
    """The issue's trainer: 5 rows for each of 3 steps, and its own `run.log` after the first two."""
    for step in range(3):
        await s.log_samples([sample(i, step=step) for i in range(5)], step=step)
        # Handed over, in the trainer's open step: a flush does not wait for them.
        assert await s.flush(timeout=5)
        if step < 2:
            await anyio.to_thread.run_sync(lambda: run.log({"trainer/loss": 0.0}))


@pytest.mark.parametrize("tiered", [False, True], ids=["sink", "selected"])
async def test_the_trainer_finishing_its_run_first_holds_up_nothing(
    offline_wandb: Path, tiered: bool
) -> None:
    """The trainer logs three steps, finishes its run, then the session flushes and finishes:
    each returns within its bound, a 1 ms ticker on the loop is never held up past 0.5 s, and
    the 15 rows, which W&B wrote at the run's finish, count as written (also with the sink
    wrapped in `Selected`, which asks it whether rows wait on the trainer)."""
    run = await trainer_run(offline_wandb, "finished-first")
    sink: at.Sink = at.WandbSink(attach=run)
    if tiered:
        sink = at.sinks.Selected(sink, max_traces_per_step=5)
    s = at.TraceSession("p", run="finished-first", sinks=[sink])
    async with s, ticking() as ticker:
        await _log_three_steps(s, run)
        await anyio.to_thread.run_sync(run.finish)
        started = time.monotonic()
        flushed = await s.flush(timeout=5)
        flush_took = time.monotonic() - started
        started = time.monotonic()
        stats = await s.finish(timeout=5)
        finish_took = time.monotonic() - started
    assert flush_took < 5 + SLACK and finish_took < finish_bound(5) + SLACK, (flush_took, finish_took)
    assert ticker.worst < STALL, f"the event loop was held up for {ticker.worst:.2f}s"
    assert flushed and stats.check() and stats.written == 15 and stats.pending == 0, stats.summary()
    ids = [row["id"] for row in table_rows(Path(run.dir), "train/traces-incr")]
    assert len(ids) == len(set(ids)) == 15


async def test_a_stopped_service_holds_up_nothing(offline_wandb: Path, tmp_path: Path) -> None:
    """The trainer logs three steps, then its wandb-core is stopped (SIGSTOP): flush and finish
    return within their bounds, the loop is never held up past 0.5 s, and the last step's rows,
    which W&B had not written, stay pending in the spool, never written."""
    run = await trainer_run(offline_wandb, "stopped")
    core = service()
    s = at.TraceSession("p", run="stopped", sinks=[at.WandbSink(attach=run)], spool_dir=tmp_path / "spool")
    try:
        async with s, ticking() as ticker:
            await _log_three_steps(s, run)
            with anyio.fail_after(30):  # the two steps the trainer moved on from
                while s.stats().written < 10:
                    await anyio.sleep(0.01)
            await anyio.to_thread.run_sync(_stop, core)
            try:
                started = time.monotonic()
                flushed = await s.flush(timeout=1)
                flush_took = time.monotonic() - started
                started = time.monotonic()
                stats = await s.finish(timeout=1)
                finish_took = time.monotonic() - started
            finally:
                core.send_signal(signal.SIGCONT)
            assert flush_took < 1 + SLACK and finish_took < finish_bound(1) + SLACK, (flush_took, finish_took)
        assert ticker.worst < STALL, f"the event loop was held up for {ticker.worst:.2f}s"
        assert not flushed
        assert stats.check() and (stats.written, stats.failed, stats.pending) == (10, 0, 5), stats.summary()
        assert stats.spool is not None and stats.spool.appended - stats.spool.acknowledged == 5, stats.spool
    finally:
        await anyio.to_thread.run_sync(run.finish)
