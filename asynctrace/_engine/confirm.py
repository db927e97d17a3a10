"""A lane's writes that its sink confirms later (`Sink.confirms_later`), resolved in order.

`write` then only hands the records over and the lane goes on; this queue awaits the sink's
`confirm` for each write in turn and resolves it then, so a resolution never overtakes an
earlier one. A flush waits here too, except for what only the trainer can move on (`held_back`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

from .._records.types import TraceRecord
from .._security import describe
from ..sinks._base import Sink
from .wakeup import Signal

__all__ = ["ConfirmQueue", "Settle"]

# Resolves one write: the ids of the records it lost after all, and why (None when none were).
Settle = Callable[[set[int], str | None], None]


class ConfirmQueue:
    """One lane's writes waiting for its sink's confirmation, oldest first."""

    def __init__(self, sink: Sink) -> None:
        self.sink = sink
        # What the sink wrote, in order, and how to resolve each once confirmed.
        self.confirming: deque[tuple[Sequence[TraceRecord], Settle]] = deque()
        self.confirmed = Signal()
        self.to_confirm = Signal()

    def settle(self, written: Sequence[TraceRecord], settle: Settle) -> None:
        """Resolve what a write did now, or, for a sink that confirms later, once it confirmed
        `written` (in order: a resolution never overtakes an earlier one)."""
        if not self.sink.confirms_later:
            settle(set(), None)
            return
        self.confirming.append((written, settle))
        self.to_confirm.set()

    async def run(self, on_failed: Callable[[int, str], None]) -> None:
        """Confirm and resolve the queued writes as they come (idle for a sink that does not)."""
        while True:
            if not self.confirming:
                await self.to_confirm.wait(None)
                continue
            written, settle = self.confirming[0]
            lost: set[int] = set()
            error: str | None = None
            if written:
                try:
                    await self.sink.confirm(written)
                except Exception as exc:
                    error = describe(exc)
                    lost = {id(r) for r in written}
                    on_failed(len(written), error)
            self.confirming.popleft()
            settle(lost, error)
            self.confirmed.set()

    async def until_confirmed(self) -> None:
        """A flush waits for what a sink that confirms later has handed over, but not for what
        only the trainer can have persisted (an attached W&B run's open step)."""
        while self.confirming:
            # Confirmed in order: when the next is held back, so is everything after it.
            head = self.confirming[0][0]
            if head and await self.sink.held_back(head):
                return
            await self.confirmed.wait(0.2)
