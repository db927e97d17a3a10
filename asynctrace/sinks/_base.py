"""The sink interface: where batches of trace records go."""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .._records.types import TraceRecord

__all__ = ["Sink"]


class Sink(abc.ABC):
    """Receives batches of records from the session's writer.

    `write` may raise `PermanentSinkError` for a failure retrying cannot fix; any other
    exception is retried per the session's `RetryPolicy`. Blocking work belongs off the
    event loop (for instance in `anyio.to_thread.run_sync`).
    """

    name: str = "sink"

    @property
    def confirms_later(self) -> bool:
        """True when `write` returns once the records are handed over, and `confirm` says when
        they are persisted: the session counts them written only then, and writes on meanwhile."""
        return False

    def bind(self, project: str, run: str) -> None:  # noqa: B027 - optional hook
        """Called by the session before `open` with its project and run name."""

    async def open(self) -> None:  # noqa: B027 - optional hook
        """Prepare the sink (connect, create files); retried like `write`."""

    @abc.abstractmethod
    async def write(self, records: Sequence[TraceRecord]) -> None:
        """Write a batch; records may span several steps and splits."""

    async def write_metrics(self, step: int, metrics: Mapping[str, float]) -> None:  # noqa: B027
        """Write scalar metrics for a step (optional)."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Flush and release resources; called once, from `finish()`."""

    async def confirm(self, records: Sequence[TraceRecord]) -> None:  # noqa: B027 - optional hook
        """With `confirms_later`: return once `records`, handed over by `write`, are persisted;
        raise when they never will be (they count as failed). Cancelled at `finish()`'s deadline."""

    async def held_back(self, records: Sequence[TraceRecord]) -> bool:
        """With `confirms_later`: True while `records` wait on something only the trainer does
        (an attached W&B run's next step), so a flush does not wait for their confirmation.
        Asked on the event loop while a flush waits: a question to the backend goes off it,
        with a deadline (no answer in time: False)."""
        return False

    @property
    def degraded(self) -> str | None:
        """Why the sink runs in a documented fallback that keeps fewer of its promises (say, it
        can no longer confirm what it writes), or None. Read from any thread, under the session's
        lock: return state the sink keeps, at once."""
        return None

    def recovery_args(self) -> dict[str, Any] | None:
        """The keyword arguments that make this sink again, for `asynctrace recover`, or None
        when it cannot be made outside the trainer (the default).

        Called before `bind`. They are stored in the spool directory as JSON: plain values
        only, and never a credential (a URL's user part and credential parameters are left out
        for you; any other token or password must not be returned). `asynctrace recover`
        makes asynctrace's own sinks from them; a sink of yours comes back when its class is
        passed to `asynctrace.recover(..., sinks={name: cls})`, which calls it with them."""
        return None
