"""Statistics snapshots: small frozen dataclasses."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["SessionStats", "SinkStats"]


@dataclass(frozen=True, slots=True)
class SinkStats:
    """What one sink did with the records handed to it."""

    written: int = 0
    failed: int = 0
    retries: int = 0
    metrics_failed: int = 0
    last_error: str | None = None


@dataclass(frozen=True, slots=True)
class SessionStats:
    """A consistent snapshot of a session's accounting.

    Invariant at every moment: ``submitted == written + failed + pending + sum(dropped.values())``.
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

    @property
    def dropped_total(self) -> int:
        """All dropped samples, every reason together."""
        return sum(self.dropped.values())

    def check(self) -> bool:
        """True when the accounting invariant holds."""
        return self.submitted == self.written + self.failed + self.pending + self.dropped_total

    def summary(self) -> str:
        """One human-readable line."""
        drops = ", ".join(f"{k}={v}" for k, v in sorted(self.dropped.items()) if v) or "none"
        return (
            f"submitted={self.submitted} written={self.written} failed={self.failed} "
            f"pending={self.pending} dropped[{drops}] retries={self.retries}"
        )
