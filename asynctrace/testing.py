"""Helpers for testing code that logs through asynctrace."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import anyio

from ._records.types import Sample, TraceRecord
from .exceptions import PermanentSinkError
from .sinks._base import Sink

__all__ = ["MemorySink"]


class MemorySink(Sink):
    """Keeps every record in memory; can be made slow, flaky, permanently failing or hanging.

    `delay` seconds per write; the first `fail_times` write attempts raise `RuntimeError`
    (retried by the session); `fail_permanently` raises `PermanentSinkError`; `hang` never
    returns from `write`.
    """

    def __init__(
        self,
        name: str = "memory",
        *,
        delay: float = 0.0,
        fail_times: int = 0,
        fail_permanently: bool = False,
        hang: bool = False,
    ) -> None:
        self.name = name
        self.delay = delay
        self.fail_times = fail_times
        self.fail_permanently = fail_permanently
        self.hang = hang
        self.records: list[TraceRecord] = []
        self.metrics: list[tuple[int, dict[str, float]]] = []
        self.attempts = 0
        self.writes = 0
        self.opened = False
        self.closed = False

    async def open(self) -> None:
        self.opened = True

    async def write(self, records: Sequence[TraceRecord]) -> None:
        self.attempts += 1
        if self.hang:
            await anyio.sleep_forever()
        if self.delay:
            await anyio.sleep(self.delay)
        if self.fail_permanently:
            raise PermanentSinkError(f"{self.name}: refusing batch (fail_permanently)")
        if self.attempts <= self.fail_times:
            raise RuntimeError(f"{self.name}: transient failure {self.attempts}/{self.fail_times}")
        self.writes += 1
        self.records.extend(records)

    async def write_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        self.metrics.append((step, dict(metrics)))

    async def close(self) -> None:
        self.closed = True

    @property
    def samples(self) -> list[Sample]:
        """Every written sample, decoded, in write order."""
        return [r.sample for r in self.records]

    def steps(self, split: str | None = None) -> dict[int, list[TraceRecord]]:
        """Written records grouped by step (optionally for one split)."""
        out: dict[int, list[TraceRecord]] = {}
        for r in self.records:
            if split is None or r.split == split:
                out.setdefault(r.step, []).append(r)
        return out
