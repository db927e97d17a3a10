"""The session's health as run metrics: drops by reason, failures, retries, the queue, each sink.

Logged through every sink's `write_metrics` under an ``asynctrace/`` prefix, so a drop shows on
the dashboard next to the loss curve: every `interval` seconds while something changed, and once
at finish. They go at the highest step the writer has handed to the sinks so far (samples and
metrics): a step the run has reached, never ahead of what the sinks have seen, and never
decreasing, as trackers that plot by step (and W&B, which refuses a step lower than its last)
need.

A metric is logged from the first point it is non-zero on: counters only grow, and a gauge
(`held`, `degraded`: the ones left out while zero) that was ever logged keeps being logged,
its return to 0 included, so a tracker's last point never shows a value `stats()` no longer has.
"""

from __future__ import annotations

from collections.abc import Iterable

from .._records.types import MetricsItem
from .._stats import SessionStats

__all__ = ["PREFIX", "Health", "health_metrics"]

PREFIX = "asynctrace/"


def _part(name: str) -> str:
    """A sink name as part of a metric name: anything but letters, digits and `_.-` becomes `_`.

    A tracker might read other characters as separators or refuse them in a key; letters and
    digits of any script are kept (Trackio, W&B and MLflow's word characters all take them).
    """
    return "".join(c if c.isalnum() or c in "_.-" else "_" for c in name) or "_"


def health_metrics(stats: SessionStats) -> dict[str, float]:
    """The run metrics for one stats snapshot (see docs/health.md for the list)."""
    m: dict[str, float] = {
        PREFIX + "submitted": stats.submitted,
        PREFIX + "written": stats.written,
        PREFIX + "failed": stats.failed,
        PREFIX + "pending": stats.pending,
        PREFIX + "retries": stats.retries,
        PREFIX + "queue/depth": stats.queue_depth,
        PREFIX + "queue/bytes": stats.queue_bytes,
        PREFIX + "dropped/total": stats.dropped_total,
    }
    if stats.metrics_dropped:
        m[PREFIX + "metrics_dropped"] = stats.metrics_dropped
    for reason, n in sorted(stats.dropped.items()):
        m[f"{PREFIX}dropped/{_part(reason)}"] = n
    for name, sink in stats.sinks.items():
        base = f"{PREFIX}sinks/{_part(name)}/"
        m[base + "written"] = sink.written
        m[base + "failed"] = sink.failed
        m[base + "retries"] = sink.retries
        if sink.held:
            m[base + "held"] = sink.held
        if sink.degraded is not None:
            m[base + "degraded"] = 1
        for reason, n in sorted(sink.skipped.items()):
            m[f"{base}skipped/{_part(reason)}"] = n
        for reason, n in sorted(sink.metrics_dropped.items()):
            m[f"{base}metrics_dropped/{_part(reason)}"] = n
    return {k: float(v) for k, v in m.items()}


class Health:
    """When the writer logs the health metrics, and at which step (event-loop thread only)."""

    def __init__(self, interval: float, clock_now: float) -> None:
        self.interval = interval
        self.step: int | None = None
        self._next = clock_now + interval
        self._last: dict[str, float] | None = None
        # Every metric logged so far: one missing from a later snapshot went back to 0.
        self._logged: set[str] = set()

    def note_steps(self, steps: Iterable[int]) -> None:
        """Steps the writer handed to the sinks (a batch's records, a metrics item)."""
        top = max(steps, default=None)
        if top is not None and (self.step is None or top > self.step):
            self.step = top

    def item(self, stats: SessionStats, now: float, *, final: bool = False) -> MetricsItem | None:
        """The metrics to log now, if it is time and something changed (always when `final`)."""
        if not final and now < self._next:
            return None
        self._next = now + self.interval
        metrics = health_metrics(stats)
        for name in self._logged.difference(metrics):
            metrics[name] = 0.0
        if not final and (self.step is None or metrics == self._last):
            return None
        self._last = metrics
        self._logged.update(metrics)
        return MetricsItem(self.step if self.step is not None else 0, metrics)
