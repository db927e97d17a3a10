"""ConsoleSink: readable, truncated traces on a text stream."""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

import anyio
import orjson

from .._checks import check_int
from .._record import TraceRecord
from .._security import scrub
from ._base import Sink

__all__ = ["ConsoleSink"]


def _clip(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… [{len(text) - limit} more chars]"


class ConsoleSink(Sink):
    """Prints each trace as a short block: header with step and metadata, then one line per message."""

    def __init__(self, stream: TextIO | None = None, max_chars: int = 2000) -> None:
        check_int("max_chars", max_chars)
        self.name = "console"
        self.stream = stream
        self.max_chars = max_chars

    def _format(self, record: TraceRecord) -> str:
        sample = orjson.loads(record.payload)
        meta: dict[str, Any] = sample.get("metadata", {})
        head = f"── {record.key} step {record.step} ({record.id})"
        if meta:
            head += " " + _clip(orjson.dumps(meta).decode(), self.max_chars // 4)
        lines = [head]
        per_message = max(40, self.max_chars // max(1, len(sample["messages"])))
        for m in sample["messages"]:
            content = m.get("content")
            text = content if isinstance(content, str) else orjson.dumps(content).decode()
            extra = " [tool_calls]" if m.get("tool_calls") else ""
            lines.append(f"  {m.get('role', '?'):>9}: {_clip(text, per_message)}{extra}")
        return "\n".join(lines) + "\n"

    def _emit(self, text: str) -> None:
        stream = self.stream or sys.stdout
        # A console is often captured into job logs that many people can read.
        stream.write(scrub(text))
        stream.flush()

    async def write(self, records: Sequence[TraceRecord]) -> None:
        text = "".join(self._format(r) for r in records)
        await anyio.to_thread.run_sync(self._emit, text, abandon_on_cancel=True)

    async def write_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        body = " ".join(f"{k}={v:.4g}" for k, v in metrics.items())
        await anyio.to_thread.run_sync(
            self._emit, f"── metrics step {step}: {body}\n", abandon_on_cancel=True
        )
