"""`Selected`: a sink that keeps its own per-step selection on top of the session's cap."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from .._checks import check_int
from .._select.base import Sampler
from .._select.samplers import SamplerName, resolve_sampler
from ._base import Sink

if TYPE_CHECKING:
    from .._records.types import TraceRecord

__all__ = ["Selected"]


class Selected(Sink):
    """Write to `sink` only a per-(split, step) selection of what the session passes on.

    At most `max_traces_per_step` records per (split, step), chosen by `sampler` (the session's
    samplers: "first", "top_bottom", "reservoir" or a `Sampler`); what it leaves out is counted in
    this sink's `SinkStats.skipped` (docs/sinks.md, "Tiered capture"). Used outside a session,
    `write` writes everything.
    """

    def __init__(
        self, sink: Sink, *, max_traces_per_step: int, sampler: SamplerName | Sampler = "first"
    ) -> None:
        if not isinstance(sink, Sink):
            raise ValueError(f"Selected wraps an asynctrace.Sink, got {type(sink).__name__}")
        if isinstance(sink, Selected):
            raise ValueError("Selected wraps a sink that is not Selected already: pass one selection")
        check_int("max_traces_per_step", max_traces_per_step)
        self.sink = sink
        self.max_traces_per_step = max_traces_per_step
        self.sampler = resolve_sampler(sampler)
        self.name = getattr(sink, "name", type(sink).__name__) or type(sink).__name__

    def __repr__(self) -> str:
        return (
            f"Selected({self.sink!r}, max_traces_per_step={self.max_traces_per_step}, "
            f"sampler={type(self.sampler).__name__})"
        )

    @property
    def duplicates_skipped(self) -> int:
        """The wrapped sink's count of replayed records it already held, if it keeps one."""
        return int(getattr(self.sink, "duplicates_skipped", 0))

    def bind(self, project: str, run: str) -> None:
        self.sink.bind(project, run)

    async def open(self) -> None:
        await self.sink.open()

    async def write(self, records: Sequence[TraceRecord]) -> None:
        await self.sink.write(records)

    @property
    def confirms_later(self) -> bool:
        return self.sink.confirms_later

    async def confirm(self, records: Sequence[TraceRecord]) -> None:
        await self.sink.confirm(records)

    async def held_back(self, records: Sequence[TraceRecord]) -> bool:
        return await self.sink.held_back(records)

    @property
    def degraded(self) -> str | None:
        return self.sink.degraded

    async def write_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        await self.sink.write_metrics(step, metrics)

    async def close(self) -> None:
        await self.sink.close()
