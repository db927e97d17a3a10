"""The writer: a dispatcher that batches the buffer, and one lane per sink that writes with retries
(`lane_writing.LaneWriting`).

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

from .._records.types import MetricsItem
from .._runtime.abandon import spawn_detached, wait_first
from ..sinks._base import Sink
from .buffer import Batch, Buffer
from .group_metrics import GroupMetrics
from .health import Health
from .lane import Lane, selection_for
from .lane_writing import LaneWriting
from .retry import RetryPolicy
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
        self.writing = LaneWriting(buffer, retry, on_room)

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
                    tg.start_soon(self.writing.run, lane)
                    # Idle unless the sink confirms later (it may say so only once open).
                    tg.start_soon(lane.confirms.run, functools.partial(self.writing.warn_failed, lane))
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

    def still_running(self) -> str:
        """What has not ended (after a cancel: what ignores it): the sinks' names, quoted."""
        names = [repr(lane.sink.name) for lane in self._lanes if not lane.done]
        return ", ".join(names) or "the writer's dispatcher"
