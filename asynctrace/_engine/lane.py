"""One sink's lane in the writer: its inbox, its own selection, its tier notes to the spool.

A `Selected` sink's lane holds that sink's per-step selection and tells the spool what it wrote
of each step and which steps it closed; every lane owns the queue of writes its sink confirms
later (confirm.py).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from .._records.types import MetricsItem, TraceRecord
from .._select.lane import LaneSelection
from ..sinks._base import Sink
from ..sinks._selected import Selected
from .buffer import Batch, Marker
from .confirm import ConfirmQueue
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
