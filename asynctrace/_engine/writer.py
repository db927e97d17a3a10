"""The writer: a dispatcher that batches the buffer, and one lane per sink that writes with retries.

Every lane has its own inbox, so a slow or hanging sink never holds up the others; a batch
keeps its buffer room until every sink is done with it, so a stuck sink fills the buffer and
the session's `on_full` policy decides, instead of memory growing without bound.

The writer runs as a task of its own, outside the session's task group (`spawn_detached`),
behind a stand-in task in that group: a lane waits for a sink call that ignores its
cancellation, so a sink never has two calls at once, until `finish()` gives up on the writer
(`Writer.abandon`). Then the stand-in ends, nothing waits for the writer any more, and the
stubborn call goes on alone, holding up nothing.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import anyio
import anyio.lowlevel

from .._records.types import MetricsItem, TraceRecord
from .._runtime.abandon import spawn_detached, wait_first
from .._security import describe, logger
from .._select.lane import Picked
from ..sinks._base import Sink
from .buffer import Batch, Buffer, Marker
from .group_metrics import GroupMetrics
from .health import Health
from .lane import Lane, selection_for
from .retry import RetryPolicy, call_with_retry
from .wakeup import Signal

if TYPE_CHECKING:
    from .._durable.segments import TierState


__all__ = ["Writer"]


class Writer:
    """Owns the dispatcher and the sink lanes; runs inside the session's task group."""

    def __init__(
        self,
        buffer: Buffer,
        sinks: Sequence[Sink],
        *,
        retry: RetryPolicy,
        flush_interval: float,
        step_timeout: float | None,
        on_room: Callable[[], None],
        max_open_steps: int = 2,
        sink_step_timeout: float | None = None,
        health_interval: float | None = None,
        groups: GroupMetrics | None = None,
    ) -> None:
        self.buffer = buffer
        self.sinks = list(sinks)
        self.retry = retry
        self.flush_interval = flush_interval
        self.step_timeout = step_timeout
        self.on_room = on_room
        # The session's step-closing rules, which `Selected` sinks' selections follow too.
        self.max_open_steps = max_open_steps
        self.sink_step_timeout = sink_step_timeout
        # The session's health as run metrics (see health.py), and the idle steps of its group metrics.
        self.health = Health(health_interval, buffer.clock()) if health_interval is not None else None
        self.groups = groups
        self.signal: Signal | None = None
        self.scope: anyio.CancelScope | None = None
        self.stopped = anyio.Event()
        # Set by finish() when a sink call ignored the writer's cancel for STOP_GRACE seconds.
        self.abandoned: anyio.Event | None = None
        self._lanes: list[Lane] = []

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Stand in for the writer in the session's task group until it ends or is abandoned;
        its errors are raised here, as if it ran in this task."""
        self.abandoned = abandoned = anyio.Event()
        started = anyio.Event()
        ended = anyio.Event()
        errors: list[BaseException] = []

        async def writer() -> None:
            try:
                await self._run(started)
            except BaseException as exc:  # raised by the stand-in (nobody, once abandoned)
                errors.append(exc)
            finally:
                ended.set()
                self.stopped.set()

        spawn_detached(writer)
        # Shielded from the caller's cancellation: a cancelled training loop must still be
        # drained by finish(), which is the only thing that stops the writer.
        with anyio.CancelScope(shield=True):
            await wait_first(started, ended)
            if not errors:
                task_status.started()
                await wait_first(ended, abandoned)
        if errors:
            raise errors.pop()

    async def _run(self, started: anyio.Event) -> None:
        with anyio.CancelScope(shield=True) as self.scope:
            self.signal = Signal()
            steps = (self.max_open_steps, self.sink_step_timeout)
            self._lanes = [Lane(i, s, selection_for(s, *steps)) for i, s in enumerate(self.sinks)]
            async with anyio.create_task_group() as tg:
                for lane in self._lanes:
                    tg.start_soon(self._run_lane, lane)
                    # Idle unless the sink confirms later (it may say so only once open).
                    tg.start_soon(lane.confirms.run, functools.partial(self._warn_failed, lane))
                tg.start_soon(self._dispatch)
                started.set()

    def final_health(self) -> bool:
        """Queue the health metrics once more (finish, after the drain); False when they are off."""
        if self.health is None:
            return False
        item = self.health.item(self.buffer.snapshot(), self.buffer.clock(), final=True)
        assert item is not None
        self.buffer.push_item(item)
        self.wake()
        return True

    def _health_tick(self, now: float) -> None:
        """Every health interval: close idle group steps, and log the health if it changed."""
        health = self.health
        items = self.groups.close_idle(now) if self.groups is not None else []
        snapshot = health.item(self.buffer.snapshot(), now) if health is not None else None
        # Straight to the lanes, not through the buffer's queue: a control item there would send
        # the records queued before it at once, ahead of batch_size and flush_interval.
        for lane in self._lanes:
            lane.inbox.extend(items)
            if snapshot is not None and lane.health is None:
                # A lane still holding the last snapshot (a stuck sink) gets no other: each
                # one says all the previous did, and a stuck sink's backlog stays bounded.
                lane.health = snapshot
                lane.inbox.append(snapshot)
            if lane.inbox:
                lane.signal.set()

    def drop_unsent_metrics(self) -> None:
        """After the writer stopped: what each lane had not written of `log_metrics` is counted
        dropped for its sink (see `Lane.drop_unsent_metrics`)."""
        for lane in self._lanes:
            lane.drop_unsent_metrics(self.buffer)

    def wake(self) -> None:
        if self.signal is not None:
            self.signal.set()

    def prime_tiers(self, state: TierState) -> None:
        """Before a replay: what each `Selected` sink (by its name in the session) had written of
        each step and which steps it had closed, so its selection keeps at most k a step in all."""
        for lane in self._lanes:
            lane.prime(state, self.buffer.ledger.sink_names[lane.index])

    def abandon(self) -> None:
        """Stop waiting for a writer that ignores its cancel (a sink call does): it goes on alone."""
        if self.abandoned is not None:
            self.abandoned.set()
        self.stopped.set()

    # -- dispatcher ------------------------------------------------------------------------

    def _due_in(self, now: float) -> float | None:
        """Seconds until a batch must go out; 0 when one is ready, None when idle."""
        buf = self.buffer
        with buf.lock:
            if buf.control_items or buf.undispatched >= buf.batch_size or (buf.undispatched and buf.pressed):
                return 0.0
            if buf.undispatched and buf.first_undispatched_at is not None:
                return max(0.0, buf.first_undispatched_at + self.flush_interval - now)
            return None

    async def _dispatch(self) -> None:
        assert self.signal is not None
        idle_check = self.step_timeout
        check_every = min(idle_check, 1.0) if idle_check is not None else None
        next_check = self.buffer.clock() + check_every if check_every is not None else None
        health = self.health
        tick_every = health.interval if health is not None else None
        if self.groups is not None and self.groups.step_timeout is not None:
            idle_every = min(self.groups.step_timeout, 1.0)
            tick_every = idle_every if tick_every is None else min(tick_every, idle_every)
        next_tick = self.buffer.clock() + tick_every if tick_every is not None else None
        while True:
            now = self.buffer.clock()
            if next_check is not None and check_every is not None and now >= next_check:
                self.buffer.close_steps(idle_only=True)
                next_check = now + check_every
            if next_tick is not None and tick_every is not None and now >= next_tick:
                self._health_tick(now)
                next_tick = now + tick_every
            due = self._due_in(now)
            if due == 0.0:
                item = self.buffer.take()
                if item is not None:
                    # Shielded: once taken, a batch reaches the spool and the lanes even if
                    # finish() stops the writer meanwhile (this takes milliseconds).
                    with anyio.CancelScope(shield=True):
                        if health is not None:
                            if isinstance(item, Batch):
                                health.note_steps([r.step for r in item.records])
                            elif isinstance(item, MetricsItem):
                                health.note_steps((item.step,))
                        if isinstance(item, Batch):
                            if self.buffer.journal is not None:
                                await self.buffer.journal.dispatching(item.records)
                            # Only a batch that waits behind a busy sink is drop_oldest's to
                            # evict from. One that idle sinks start at their next turn stays
                            # out of reach: a producer that gets the loop first would empty
                            # every batch before any sink saw it, and nothing would be written.
                            if not all(lane.idle and not lane.inbox for lane in self._lanes):
                                self.buffer.dispatched(item)
                        takers = item.lanes if isinstance(item, MetricsItem) else None
                        for lane in self._lanes:
                            if takers is None or lane.index in takers:
                                lane.inbox.append(item)
                                lane.signal.set()
                # Give callers on this loop a turn between batches.
                await anyio.lowlevel.checkpoint()
                continue
            for at in (next_check, next_tick):
                if at is not None:
                    until = max(0.0, at - now)
                    due = until if due is None else min(due, until)
            await self.signal.wait(due)

    # -- lanes -----------------------------------------------------------------------------

    def _retry_counter(self, lane: Lane) -> Callable[[BaseException | None], None]:
        def on_retry(exc: BaseException | None) -> None:
            self.buffer.note_retries(lane.index, 1)
            logger.debug(
                "asynctrace: retrying sink %r after %s", lane.sink.name, describe(exc) if exc else "?"
            )

        return on_retry

    def still_running(self) -> str:
        """What has not ended (after a cancel: what ignores it): the sinks' names, quoted."""
        names = [repr(lane.sink.name) for lane in self._lanes if not lane.done]
        return ", ".join(names) or "the writer's dispatcher"

    async def _run_lane(self, lane: Lane) -> None:
        try:
            await self._lane_loop(lane)
        finally:
            lane.done = True

    async def _lane_loop(self, lane: Lane) -> None:
        on_retry = self._retry_counter(lane)
        try:
            await call_with_retry(self.retry, lane.sink.open, on_retry)
        except Exception as exc:
            lane.dead = describe(exc)
            logger.error(
                "asynctrace: sink %r could not be opened (%s); its records are counted as failed",
                lane.sink.name,
                lane.dead,
            )
        batch_size = self.buffer.batch_size
        while True:
            if not lane.inbox:
                lane.idle = True
                try:
                    await lane.signal.wait(lane.idle_check_in(self.buffer.clock))
                finally:
                    lane.idle = False
                await self._close_idle(lane, on_retry)
                continue
            item = lane.inbox.popleft()
            if isinstance(item, Marker):
                if lane.selection is not None and lane.dead is None:
                    # A flush closes the steps a sink's selection holds, as it closes the session's.
                    await self._write_picked(lane, [], [lane.selection.close_all()], on_retry)
                await lane.confirms.until_confirmed()
                item.arrive()
                continue
            if isinstance(item, MetricsItem):
                if item is lane.health:
                    lane.health = None
                if await lane.write_metrics(item, self.buffer, self.retry, on_retry):
                    self.on_room()
                continue
            # A sink that fell behind gets what piled up in fewer, larger writes, each of at
            # most batch_size records (the contract's bound on one sink write).
            batches: list[Batch] = [item]
            n = len(item.records)
            while lane.inbox:
                nxt = lane.inbox[0]
                if not isinstance(nxt, Batch) or n + len(nxt.records) > batch_size:
                    break
                lane.inbox.popleft()
                batches.append(nxt)
                n += len(nxt.records)
            await self._write_batches(lane, batches, on_retry)
            await self._close_idle(lane, on_retry)

    async def _close_idle(self, lane: Lane, on_retry: Callable[[BaseException | None], None]) -> None:
        selection = lane.selection
        if selection is None or not selection.holding or selection.step_timeout is None:
            return
        now = self.buffer.clock()
        if now < lane.next_idle_check:
            return
        lane.next_idle_check = now + min(selection.step_timeout, 1.0)
        picked = selection.close_idle(now)
        if picked.released:
            await self._write_picked(lane, [], [picked], on_retry)

    async def _write_batches(
        self, lane: Lane, batches: list[Batch], on_retry: Callable[[BaseException | None], None]
    ) -> None:
        self.buffer.start(batches)
        if lane.dead is None and any(r.sinks_done is not None for b in batches for r in b.records):
            # Replayed records this sink had dealt with before the kill are not sent again.
            await self._write_replayed(lane, batches, on_retry)
            return
        if lane.selection is not None and lane.dead is None:
            now = self.buffer.clock()
            picks = [lane.selection.offer(b.records, now) for b in batches]
            await self._write_picked(lane, batches, picks, on_retry)
            return
        error = lane.dead
        ok = error is None
        records: list[TraceRecord] = []
        if ok and any(b.records for b in batches):
            records = batches[0].records if len(batches) == 1 else [r for b in batches for r in b.records]
            try:
                await call_with_retry(self.retry, lambda: lane.sink.write(records), on_retry)
            except Exception as exc:
                ok = False
                error = describe(exc)
                self._warn_failed(lane, len(records), error)

        def settle(failed: set[int], late_error: str | None) -> None:
            good = ok and not failed
            freed = False
            for batch in batches:
                freed |= self.buffer.resolve(batch, lane.index, good, 0, error if not ok else late_error)
            self._resolved(freed)

        lane.confirms.settle(records if ok else [], settle)

    async def _write_replayed(
        self, lane: Lane, batches: list[Batch], on_retry: Callable[[BaseException | None], None]
    ) -> None:
        """Batches holding replayed records: the sink (or its selection) gets only those it had
        not dealt with; the others are counted `skipped["earlier"]` for it."""
        name = self.buffer.ledger.sink_names[lane.index]
        now = self.buffer.clock()
        picks = []
        for b in batches:
            fresh = [r for r in b.records if r.sinks_done is None or name not in r.sinks_done]
            earlier = len(b.records) - len(fresh)
            pick = lane.selection.offer(fresh, now) if lane.selection is not None else Picked(write=fresh)
            if earlier:
                pick.skipped["earlier"] += earlier
            picks.append(pick)
        await self._write_picked(lane, batches, picks, on_retry)

    def _warn_failed(self, lane: Lane, n: int, error: str) -> None:
        logger.warning(
            "asynctrace: sink %r failed to write %d records for good: %s", lane.sink.name, n, error
        )

    def _resolved(self, freed: bool) -> None:
        """A lane resolved records: what the spool was told goes to disk (a sink's own
        acknowledgement too, so that a kill while another sink lags does not resend them)."""
        if freed:
            self.on_room()
        if self.buffer.journal is not None and (freed or self.buffer.journal.spool.has_staged):
            self.buffer.journal.acknowledge()

    async def _write_picked(
        self,
        lane: Lane,
        batches: list[Batch],
        picks: list[Picked],
        on_retry: Callable[[BaseException | None], None],
    ) -> None:
        """Write what a sink's selection picked: released records of closed steps and the
        batches' records it passes on, in slices of at most batch_size (the contract's bound on
        one write); then resolve the batches and what the selection had held."""
        released = [r for p in picks for r in p.released]
        records = [r for p in picks for r in (*p.released, *p.write)]
        failed: set[int] = set()
        error: str | None = None
        size = self.buffer.batch_size
        for i in range(0, len(records), size):
            chunk = records[i : i + size]
            try:
                await call_with_retry(self.retry, lambda c=chunk: lane.sink.write(c), on_retry)  # type: ignore[misc]
            except Exception as exc:
                error = describe(exc)
                failed.update(id(r) for r in chunk)
                self._warn_failed(lane, len(chunk), error)

        def settle(lost: set[int], late_error: str | None) -> None:
            failed.update(lost)
            why = error or late_error
            lane.note_tier(self.buffer.journal, self.buffer.ledger.sink_names[lane.index], records, failed)
            freed = False
            for batch, pick in zip(batches, picks, strict=False):
                pick.failed = [r for r in pick.write if id(r) in failed] if failed else []
                freed |= self.buffer.resolve(batch, lane.index, True, 0, why, pick)
            # After the batches: a record held by one of them and released by a later one is
            # registered as held before it is resolved.
            buffer = self.buffer
            if failed:
                buffer.resolve_held(lane.index, [r for r in released if id(r) in failed], "failed", why)
                buffer.resolve_held(lane.index, [r for r in released if id(r) not in failed], "written", None)
            else:
                buffer.resolve_held(lane.index, released, "written", None)
            buffer.resolve_held(lane.index, [r for p in picks for r in p.evicted], "capped", None)
            self._resolved(freed)

        lane.confirms.settle([r for r in records if id(r) not in failed], settle)
