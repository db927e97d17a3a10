"""One sink's lane in the writer: its inbox, its metrics writes, its own selection, its tier
notes to the spool.

A `Selected` sink's lane holds that sink's per-step selection and tells the spool what it wrote
of each step and which steps it closed; every lane owns the queue of writes its sink confirms
later (confirm.py).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from .._records.types import MetricsItem, TraceRecord
from .._security import describe, logger
from .._select.lane import LaneSelection
from .._stats import MetricsDropReason
from ..sinks._base import Sink
from ..sinks._selected import Selected
from .buffer import Batch, Buffer, Marker
from .confirm import ConfirmQueue
from .retry import RetryPolicy, call_with_retry
from .wakeup import Signal

if TYPE_CHECKING:
    from .._durable.journal import Journal
    from .._durable.segments import TierState

__all__ = ["Lane", "selection_for"]


def selection_for(sink: Sink, max_open_steps: int, step_timeout: float | None) -> LaneSelection | None:
    """A `Selected` sink's own selection, closing steps by the session's rules; None for others."""
    if not isinstance(sink, Selected):
        return None
    return LaneSelection(
        sink.max_traces_per_step,
        sink.sampler,
        max_open_steps=max_open_steps,
        step_timeout=step_timeout,
    )


class Lane:
    """What the writer keeps for one sink; the writer's lane task works through it."""

    def __init__(self, index: int, sink: Sink, selection: LaneSelection | None = None) -> None:
        self.index = index
        self.sink = sink
        # A `Selected` sink's own per-step selection (see _select/lane.py).
        self.selection = selection
        self.next_idle_check = 0.0
        self.inbox: deque[Batch | Marker | MetricsItem] = deque()
        self.signal = Signal()
        self.dead: str | None = None
        self.done = False
        # Waiting for work: it starts whatever it is handed at its next turn.
        self.idle = False
        # A selection's closed steps as the spool last heard of them (see note_tier).
        self.closed: dict[str, int] = {}
        # A sink that confirms later: what it wrote, resolved once confirmed.
        self.confirms = ConfirmQueue(sink)
        # The session's health snapshot waiting in the inbox, if any (see Writer._health_tick),
        # and the metrics item its sink is writing, until the writer settles it.
        self.health: MetricsItem | None = None
        self.metrics_writing: MetricsItem | None = None

    def idle_check_in(self, clock: Callable[[], float]) -> float | None:
        """How long an idle lane may wait before its selection's idle steps must be closed."""
        selection = self.selection
        if selection is None or not selection.holding or selection.step_timeout is None:
            return None
        return max(0.0, self.next_idle_check - clock())

    def prime(self, state: TierState, name: str) -> None:
        """Before a replay: what this `Selected` sink (`name` in the session) had written of each
        step and which steps it had closed, so its selection keeps at most k a step in all."""
        if self.selection is not None:
            self.selection.prime(state.written.get(name, {}), state.closed.get(name, {}))
            self.closed = self.selection.closed()

    def note_tier(
        self, journal: Journal | None, name: str, records: list[TraceRecord], failed: set[int]
    ) -> None:
        """Tell the spool what a `Selected` sink wrote of each step and which steps it closed."""
        selection = self.selection
        if journal is None or selection is None:
            return
        written: Counter[tuple[str, int]] = Counter(
            (r.split, r.step) for r in records if not r.watched and id(r) not in failed
        )
        closed = selection.closed()
        changed = {split: upto for split, upto in closed.items() if self.closed.get(split) != upto}
        if written or changed:
            self.closed = closed
            journal.tier(name, written, changed)

    async def write_metrics(
        self,
        item: MetricsItem,
        buffer: Buffer,
        retry: RetryPolicy,
        on_retry: Callable[[BaseException | None], None],
    ) -> bool:
        """Write a metrics item to the sink, with retries, and settle it in the buffer; True when
        that freed its room (every sink that took it is done)."""
        unsent: MetricsDropReason | None = "finish_timeout"  # unless the write below returns
        self.metrics_writing = item
        try:
            await self._write_metrics(item, buffer, retry, on_retry)
            unsent = None
        finally:
            # Only finish() cancels the writer: an item whose write it cut short never got
            # there. One that finish() already gave up on (drop_unsent_metrics) is settled.
            freed = False
            if self.metrics_writing is item:
                self.metrics_writing = None
                freed = buffer.metrics_done(self.index, item, unsent)
        return freed

    async def _write_metrics(
        self,
        item: MetricsItem,
        buffer: Buffer,
        retry: RetryPolicy,
        on_retry: Callable[[BaseException | None], None],
    ) -> None:
        if self.dead is not None:
            buffer.note_metrics_failure(self.index, self.dead)
            return
        try:
            await call_with_retry(retry, lambda: self.sink.write_metrics(item.step, item.metrics), on_retry)
        except Exception as exc:
            error = describe(exc)
            buffer.note_metrics_failure(self.index, error)
            logger.warning("asynctrace: sink %r failed to write metrics: %s", self.sink.name, error)

    def drop_unsent_metrics(self, buffer: Buffer) -> None:
        """After the writer stopped: the `log_metrics` items not written (the sink was stuck past
        finish()'s deadline: in the inbox, or in a call finish() gave up on) are counted dropped
        for this sink ("finish_timeout"), and their room freed."""
        unsent = [item for item in self.inbox if isinstance(item, MetricsItem)]
        if self.metrics_writing is not None:
            unsent.append(self.metrics_writing)
            self.metrics_writing = None
        for item in unsent:
            buffer.metrics_done(self.index, item, "finish_timeout")
        # Out of the inbox: a stuck call that returns at last lets the lane go on a moment.
        kept = [item for item in self.inbox if not isinstance(item, MetricsItem)]
        self.inbox.clear()
        self.inbox.extend(kept)
        self.health = None
