"""ConsoleSink: readable, truncated traces on a text stream."""

from __future__ import annotations

import codecs
import sys
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

import orjson

from .._checks import check_int
from .._records.types import TraceRecord
from .._runtime.abandon import Backlog, run_sync_daemon
from .._security import scrub
from ._base import Sink

__all__ = ["ConsoleSink"]


_RULE, _ELLIPSIS = "──", "…"


def _clip(text: str, limit: int, ellipsis: str = _ELLIPSIS) -> str:
    if len(text) <= limit:
        return text
    return f"{text[:limit]}{ellipsis} [{len(text) - limit} more chars]"


def _encoding(stream: TextIO) -> str | None:
    """The stream's encoding when it is not a UTF one (None: anything can be written)."""
    encoding = getattr(stream, "encoding", None)
    if not isinstance(encoding, str):
        return None
    try:
        name = codecs.lookup(encoding).name
    except LookupError:
        return None
    return None if name.startswith("utf") else name


class ConsoleSink(Sink):
    """Prints each trace as a short block: header with step and metadata, then one line per message."""

    def __init__(self, stream: TextIO | None = None, max_chars: int = 2000) -> None:
        check_int("max_chars", max_chars)
        self.name = "console"
        self.stream = stream
        self.max_chars = max_chars
        self._backlog = Backlog("ConsoleSink")

    def recovery_args(self) -> dict[str, Any] | None:
        return {"max_chars": self.max_chars} if self.stream is None else None

    def _decorations(self, stream: TextIO) -> tuple[str, str]:
        """The rule and clip marks, in ASCII on a stream that cannot encode the usual ones."""
        encoding = _encoding(stream)
        if encoding is not None:
            try:
                (_RULE + _ELLIPSIS).encode(encoding)
            except UnicodeError:
                return "--", "..."
        return _RULE, _ELLIPSIS

    def _format(self, record: TraceRecord, rule: str = _RULE, ellipsis: str = _ELLIPSIS) -> str:
        sample = orjson.loads(record.payload)
        meta: dict[str, Any] = sample.get("metadata", {})
        head = f"{rule} {record.key} step {record.step} ({record.id})"
        if meta:
            head += " " + _clip(orjson.dumps(meta).decode(), self.max_chars // 4, ellipsis)
        lines = [head]
        per_message = max(40, self.max_chars // max(1, len(sample["messages"])))
        for m in sample["messages"]:
            content = m.get("content")
            text = content if isinstance(content, str) else orjson.dumps(content).decode()
            extra = " [tool_calls]" if m.get("tool_calls") else ""
            lines.append(f"  {m.get('role', '?'):>9}: {_clip(text, per_message, ellipsis)}{extra}")
        return "\n".join(lines) + "\n"

    def _emit(self, stream: TextIO, text: str) -> None:
        # A console is often captured into job logs that many people can read.
        text = scrub(text)
        encoding = _encoding(stream)
        if encoding is not None:
            # Characters the stream cannot encode become "?" instead of failing the whole batch.
            text = text.encode(encoding, "replace").decode(encoding)
        stream.write(text)
        stream.flush()

    async def write(self, records: Sequence[TraceRecord]) -> None:
        stream = self.stream or sys.stdout
        rule, ellipsis = self._decorations(stream)
        text = "".join(self._format(r, rule, ellipsis) for r in records)
        await run_sync_daemon(self._emit, stream, text, backlog=self._backlog)

    async def write_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        stream = self.stream or sys.stdout
        rule, _ = self._decorations(stream)
        body = " ".join(f"{k}={v:.4g}" for k, v in metrics.items())
        await run_sync_daemon(
            self._emit, stream, f"{rule} metrics step {step}: {body}\n", backlog=self._backlog
        )
