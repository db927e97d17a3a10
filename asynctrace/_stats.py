"""Statistics snapshots: small frozen dataclasses."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["SessionStats", "SinkStats", "SpoolStats"]


@dataclass(frozen=True, slots=True)
class SinkStats:
    """What one sink did with the records handed to it.

    A sink with a selection of its own (`asynctrace.sinks.Selected`) also counts what it left
    out, by reason (`skipped`), and what it holds for steps still open (`held`): every record
    handed to a sink is ``written + failed + sum(skipped.values()) + held``.
    """

    written: int = 0
    failed: int = 0
    retries: int = 0
    metrics_failed: int = 0
    last_error: str | None = None
    skipped: Mapping[str, int] = field(default_factory=dict)
    held: int = 0


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
class SessionStats:
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

    @property
    def dropped_total(self) -> int:
        """All dropped samples, every reason together."""
        return sum(self.dropped.values())

    def check(self) -> bool:
        """True when the accounting invariant holds (and no count is negative)."""
        counts = (self.written, self.failed, self.pending, *self.dropped.values())
        return (
            self.submitted == self.written + self.failed + self.pending + self.dropped_total
            and min(counts, default=0) >= 0
        )

    def summary(self) -> str:
        """One human-readable line."""
        drops = ", ".join(f"{k}={v}" for k, v in sorted(self.dropped.items()) if v) or "none"
        line = (
            f"submitted={self.submitted} written={self.written} failed={self.failed} "
            f"pending={self.pending} dropped[{drops}] retries={self.retries}"
        )
        if self.replayed:
            line += f" replayed={self.replayed}"
        spool = self.spool
        if spool is not None and (spool.unspooled or spool.dead_letters or spool.duplicates_skipped):
            line += (
                f" spool[unspooled={spool.unspooled} dead_letters={spool.dead_letters} "
                f"duplicates_skipped={spool.duplicates_skipped}]"
            )
        return line
