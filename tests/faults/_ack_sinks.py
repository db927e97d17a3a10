"""A sink for the acknowledgement fault tests: each record's uid appended to a file as it is
written (so what it holds survives a SIGKILL), made again by `asynctrace recover` from its
arguments; optionally it stops for good once it holds `stall_after` records (a sink far behind)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import orjson

import asynctrace as at


class UidFileSink(at.Sink):
    """Appends ``"<uid>\\n"`` per record to `path` before its write returns."""

    def __init__(self, path: str, *, name: str, stall_after: int | None = None) -> None:
        self.path = path
        self.name = name
        self.stall_after = stall_after
        self.count = 0

    def recovery_args(self) -> dict[str, Any]:
        return {"path": self.path, "name": self.name}

    async def write(self, records: Sequence[at.TraceRecord]) -> None:
        if self.stall_after is not None and self.count + len(records) > self.stall_after:
            await anyio.sleep_forever()
        lines = "".join(f"{orjson.loads(r.payload)['metadata']['uid']}\n" for r in records)
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            os.write(fd, lines.encode())
        finally:
            os.close(fd)
        self.count += len(records)


def uids(path: Path) -> list[str]:
    return path.read_text().split() if path.exists() else []
