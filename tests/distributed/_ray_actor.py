"""A Ray actor that logs, through a `TraceClient` of its own, the samples a test hands it.

Kept apart from the test modules so a Ray worker importing it imports neither torch nor hypothesis.
"""

from __future__ import annotations

from typing import Any

from asynctrace.ray import ClientStats, TraceClient


class Producer:
    """One rollout actor: `connect` to a collector, `log` a step's calls, `end_step`, `close`."""

    def connect(self, collector: Any, **client_kwargs: Any) -> None:
        self.client = TraceClient(collector, **client_kwargs)

    def log(self, step: int, calls: list[list[Any]], split: str = "train") -> int:
        return sum(self.client.log_samples_nowait(call, step=step, split=split) for call in calls)

    def end_step(self, step: int) -> bool:
        """This actor's step is done: ship its candidates and wait until the collector has them."""
        self.client.end_step(step)
        return self.client.flush(30.0)

    def close(self) -> ClientStats:
        return self.client.close(30.0)
