"""Statistics snapshots: small frozen dataclasses sharing one accounting check."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Literal

__all__ = ["Counts", "DropReason", "MetricsDropReason", "SessionStats", "SinkStats", "SpoolStats"]

# Why a sample was dropped, in the words every `stats().dropped` uses.
DropReason = Literal[
    "queue_full",  # the bound was reached (a drop policy, or a wait for room that gave up)
    "capped",  # the step's cap did not keep it
    "late",  # logged for a step already closed
    "invalid",  # failed validation under on_invalid="skip", or could not be built
    "closed",  # logged after finish() or close() began
    "cancelled",  # its caller was cancelled while it waited for room or was decoded
    "aborted",  # torch.distributed: taken for a reduction that failed, or held at a local finish
    "collector_gone",  # Ray: the collector actor died
    "collector_unavailable",  # Ray: a call failed while Ray restarts the collector
    "collector_error",  # Ray: the collector raised while ingesting a batch
    "ship_error",  # Ray: the call could not even be submitted
    "close_timeout",  # Ray: still buffered when close()'s deadline passed
    "not_closed",  # Ray: still buffered at exit in a process that cannot ship any more
]

# Why one sink did not get a `log_metrics` call that others got (`SinkStats.metrics_dropped`).
MetricsDropReason = Literal[
    "backlog_full",  # its backlog of metrics not yet written held its share of max_queue_bytes
    "finish_timeout",  # not written by it when finish() gave up on its sink at the deadline
]


class Counts:
    """What every accounting snapshot shares: ``submitted`` equals the sum of the fields named
    in `PARTS` and every dropped sample, at every moment."""

    __slots__ = ()
    PARTS: ClassVar[tuple[str, ...]] = ()
    if TYPE_CHECKING:
        submitted: int
        dropped: Mapping[str, int]

    @property
    def dropped_total(self) -> int:
        """All dropped samples, every reason together."""
        return sum(self.dropped.values())

    def check(self) -> bool:
        """True when the accounting invariant holds (and no count is negative)."""
        parts = [getattr(self, name) for name in self.PARTS]
        counts = (*parts, *self.dropped.values())
        return self.submitted == sum(parts) + self.dropped_total and min(counts, default=0) >= 0

    def summary(self) -> str:
        """One human-readable line."""
        drops = ", ".join(f"{k}={v}" for k, v in sorted(self.dropped.items()) if v) or "none"
        parts = " ".join(f"{name}={getattr(self, name)}" for name in ("submitted", *self.PARTS))
        return f"{parts} dropped[{drops}]{self._extra()}"

    def _extra(self) -> str:
        return ""


@dataclass(frozen=True, slots=True)
class SinkStats:
    """What one sink did with the records handed to it.

    A sink with a selection of its own (`asynctrace.sinks.Selected`) also counts what it left
    out, by reason (`skipped`), and what it holds for steps still open (`held`): every record
    handed to a sink is ``written + failed + sum(skipped.values()) + held``. Any sink counts
    replayed records it had dealt with before a kill as ``skipped["earlier"]``.

    `metrics_dropped` counts the `log_metrics` calls this sink alone did not get, by reason
    (`MetricsDropReason`); calls no sink got are the session's `metrics_dropped`.
    """

    written: int = 0
    failed: int = 0
    retries: int = 0
    metrics_failed: int = 0
    last_error: str | None = None
    skipped: Mapping[str, int] = field(default_factory=dict)
    held: int = 0
    metrics_dropped: Mapping[str, int] = field(default_factory=dict)
    #: Why the sink runs in a documented fallback that keeps fewer of its promises (a `WandbSink`
    #: that cannot read its run's `.wandb` log, say), or None.
    degraded: str | None = None


@dataclass(frozen=True, slots=True)
class SpoolStats:
    """What the write-ahead spool holds and did (see docs/reliability.md).

    `unspooled` records could not be written to the spool (a full disk, for instance): they
    were still delivered to the sinks, but were not crash-safe. `duplicates_skipped` are
    replayed records a sink found it already held (the batch in flight at a kill).
    """

    directory: str
    durability: str
    appended: int = 0
    acknowledged: int = 0
    unspooled: int = 0
    dead_letters: int = 0
    duplicates_skipped: int = 0
    segments: int = 0
    bytes: int = 0
    last_error: str | None = None


@dataclass(frozen=True, slots=True)
class SessionStats(Counts):
    """A consistent snapshot of a session's accounting.

    Invariant at every moment: ``submitted == written + failed + pending + sum(dropped.values())``.
    Records replayed from a spool count as submitted; `replayed` says how many of them there were.
    """

    submitted: int = 0
    accepted: int = 0
    written: int = 0
    dropped: Mapping[str, int] = field(default_factory=dict)
    failed: int = 0
    retries: int = 0
    pending: int = 0
    queue_depth: int = 0
    queue_bytes: int = 0
    sinks: Mapping[str, SinkStats] = field(default_factory=dict)
    replayed: int = 0
    spool: SpoolStats | None = None
    # `log_metrics` calls that reached no sink: no room in `max_queue_bytes`, or every sink's
    # backlog was full (calls, not samples: outside the invariant).
    metrics_dropped: int = 0

    PARTS: ClassVar[tuple[str, ...]] = ("written", "failed", "pending")

    def _extra(self) -> str:
        line = f" retries={self.retries}"
        if self.replayed:
            line += f" replayed={self.replayed}"
        if self.metrics_dropped:
            line += f" metrics_dropped={self.metrics_dropped}"
        spool = self.spool
        if spool is not None and (spool.unspooled or spool.dead_letters or spool.duplicates_skipped):
            line += (
                f" spool[unspooled={spool.unspooled} dead_letters={spool.dead_letters} "
                f"duplicates_skipped={spool.duplicates_skipped}]"
            )
        return line
