"""The steps of finish() after the drain: stop the writer, spill to the spool, close the sinks,
and report what was not delivered. Each is bounded; none is a reason to skip the next."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

import anyio

from .._durable.spool import Spool
from .._runtime.abandon import call_abandonable
from .._runtime.lifecycle import STOP_GRACE, Lifecycle, close_grace
from .._security import describe, logger
from .._stats import SessionStats
from ..sinks._base import Sink
from .buffer import Buffer, Marker
from .writer import Writer

__all__ = ["after_drain", "close_sinks", "close_spool", "flush_until", "report_finish", "stop_writer"]


async def flush_until(
    buffer: Buffer, writer: Writer | None, wake: Callable[[], None], deadline: float | None
) -> bool:
    """Close open steps and wait until everything queued is resolved by every sink (or the
    writer stops, or `deadline` passes: then False)."""
    buffer.close_steps()
    marker = Marker(len(buffer.sinks))
    buffer.push_item(marker)
    wake()
    timeout = None if deadline is None else max(0.0, deadline - anyio.current_time())
    assert writer is not None
    with anyio.move_on_after(timeout):
        # A finish() on another task stops the writer, after which the marker never arrives.
        async with anyio.create_task_group() as tg:

            async def until_stopped() -> None:
                await writer.stopped.wait()
                tg.cancel_scope.cancel()

            tg.start_soon(until_stopped)
            await marker.done.wait()
            tg.cancel_scope.cancel()
    return marker.done.is_set()


async def stop_writer(writer: Writer) -> None:
    """Cancel the writer; a sink call that ignores its cancel is left running on its own."""
    assert writer.scope is not None
    writer.scope.cancel()
    with anyio.move_on_after(STOP_GRACE):
        await writer.stopped.wait()
    if not writer.stopped.is_set():
        logger.error(
            "asynctrace: %s still running %.0fs after finish() cancelled it; "
            "finish() goes on without it and leaves that call running. A sink's write "
            "must be cancellable: use async I/O, or a thread it may abandon",
            writer.still_running(),
            STOP_GRACE,
        )
        writer.abandon()
        await writer.stopped.wait()


async def close_spool(spool: Spool | None, buffer: Buffer) -> None:
    """Whatever is still queued goes to the spool (durability="writer" had not written it yet),
    so a later session or `asynctrace recover` delivers it; then the spool is closed."""
    if spool is None:
        return
    spool.stage(buffer.undispatched_records())
    try:
        await anyio.to_thread.run_sync(spool.close)
    except Exception as exc:  # never a reason to leave the sinks' runs open
        logger.error("asynctrace: closing the spool in %s failed: %s", spool.directory, describe(exc))


async def after_drain(
    life: Lifecycle,
    writer: Writer,
    until_queued: Callable[[int | None, float | None], Awaitable[bool]],
    spool: Spool | None,
    buffer: Buffer,
) -> float:
    """Stop the writer, remove the hooks, spill to the spool; returns the time to close the sinks."""
    await stop_writer(writer)
    writer.drop_unsent_metrics()
    if life.hooks is not None:
        life.hooks.uninstall()
    # Callers waiting for room were woken when the buffer closed, and rows log_rollouts
    # is still decoding cannot be queued any more: each holds a ticket until it has
    # counted its samples as "closed" (and acknowledged them in the spool). Wait for
    # that before the spool is closed and the final count is taken; bounded all the same.
    await until_queued(None, 1.0)
    await close_spool(spool, buffer)
    # Closing gets what is left of the deadline, and at least a short grace, so a
    # slow drain can never skip finishing the runs the sinks opened.
    return max(life.deadline - anyio.current_time(), close_grace(life.budget))


async def close_sinks(sinks: Sequence[Sink], names: Sequence[str], budget: float) -> bool:
    """Close every sink at once, each within `budget` seconds; whether every one closed cleanly
    (a close that failed or ran out of time may have left something for `asynctrace recover`,
    such as a `ParquetSink`'s journal)."""
    failed: list[str] = []
    async with anyio.create_task_group() as tg:
        for sink, name in zip(sinks, names, strict=True):
            tg.start_soon(_close_sink, sink, name, budget, failed)
    return not failed


async def _close_sink(sink: Sink, name: str, budget: float, failed: list[str]) -> None:
    with anyio.move_on_after(budget) as scope:
        try:
            # A close that ignores its cancel is left running on its own at the deadline.
            await call_abandonable(sink.close, grace=0.0)
        except Exception as exc:
            failed.append(name)
            logger.error("asynctrace: closing sink %r failed: %s", name, describe(exc))
    if scope.cancelled_caught:
        failed.append(name)
        logger.error("asynctrace: closing sink %r did not finish within %.1fs", name, budget)


def report_finish(stats: SessionStats, spool: Spool | None, drained: bool, budget: float) -> None:
    """Warn about what finish() leaves undelivered or lost (capping is not a loss)."""
    if spool is not None and stats.pending:
        logger.warning(
            "asynctrace: %d undelivered records stay in the spool in %s; the next session "
            "on it (or `asynctrace recover`) delivers them",
            spool.unresolved(),
            spool.directory,
        )
    if not drained:
        logger.warning(
            "asynctrace: finish() reached its %.1fs deadline with %d samples undelivered (%s)",
            budget,
            stats.pending,
            stats.summary(),
        )
    elif stats.pending:
        # Drained in time, yet something is unresolved: not the deadline's doing.
        logger.warning(
            "asynctrace: finish() ended with %d samples undelivered (%s)", stats.pending, stats.summary()
        )
    elif stats.failed or stats.dropped_total - stats.dropped.get("capped", 0):
        logger.warning("asynctrace: session finished with losses: %s", stats.summary())
