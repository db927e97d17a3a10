"""JsonlSink: one JSON object per line, optionally rotated every N records."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import orjson

from .._checks import check_bool, check_int
from .._records.types import TraceRecord
from .._runtime.abandon import Backlog, run_sync_daemon
from ._appends import write_all
from ._base import Sink
from ._guard import Guard

__all__ = ["JsonlSink"]


class JsonlSink(Sink):
    """Appends records as JSON lines; with `rotate_every`, starts ``name.00001.jsonl`` etc. every N records.

    Each line holds ``id``, ``step``, ``split``, ``key``, ``timestamp`` and ``sample``; metrics
    lines hold ``{"step": ..., "metrics": {...}}``. The sample bytes encoded at submission are
    written as they are, never re-encoded. ``fsync=True`` syncs each batch to disk.
    """

    def __init__(
        self, path: str | os.PathLike[str], *, rotate_every: int | None = None, fsync: bool = False
    ) -> None:
        check_int("rotate_every", rotate_every, allow_none=True)
        check_bool("fsync", fsync)
        self.name = "jsonl"
        self.path = Path(path)
        self.rotate_every = rotate_every
        self.fsync = fsync
        self.paths: list[Path] = []
        self._file: IO[bytes] | None = None
        self._middles: dict[tuple[str, str], bytes] = {}
        self._in_file = 0
        self._next_index: int | None = None
        # File work runs in daemon threads that a timeout abandons and that never keep the
        # interpreter from exiting; the guard keeps one at a time on the file.
        self._guarded = Guard("JsonlSink", self._close_file, OSError)
        self._backlog = Backlog("JsonlSink")

    def recovery_args(self) -> dict[str, Any]:
        return {"path": str(self.path.absolute()), "rotate_every": self.rotate_every, "fsync": self.fsync}

    def _next_path(self) -> Path:
        if self.rotate_every is None:
            return self.path
        suffix = self.path.suffix or ".jsonl"
        if self._next_index is None:
            # A session reusing the path goes on after the files already there, so that no
            # file ever holds more than `rotate_every` lines.
            pattern = re.compile(rf"{re.escape(self.path.stem)}\.(\d{{5,}}){re.escape(suffix)}")
            found = [
                int(m.group(1))
                for p in (self.path.parent.iterdir() if self.path.parent.is_dir() else ())
                if (m := pattern.fullmatch(p.name))
            ]
            self._next_index = max(found) + 1 if found else 0
        index = self._next_index
        self._next_index += 1
        return self.path.with_name(f"{self.path.stem}.{index:05d}{suffix}")

    def _roll(self) -> IO[bytes]:
        if self._file is not None:
            if self.fsync:
                # Lines of this batch already in the file count as written with the rest.
                self._file.flush()
                os.fsync(self._file.fileno())
            self._file.close()
        path = self._next_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        # Unbuffered: each batch goes down in writev calls from the pieces it is given.
        self._file = open(path, "ab", buffering=0)  # noqa: SIM115 - closed in close()/_roll()
        self.paths.append(path)
        self._in_file = 0
        return self._file

    def _write_lines(self, parts: list[bytes], per_line: int = 1) -> None:
        """Write lines given as `per_line` consecutive pieces each (no joined copy is made)."""
        f = self._file or self._roll()
        if self.rotate_every is None:
            write_all(f.fileno(), parts)
        else:
            lines = len(parts) // per_line
            i = 0
            while i < lines:
                if self._in_file >= self.rotate_every:
                    f = self._roll()
                take = min(self.rotate_every - self._in_file, lines - i)
                write_all(f.fileno(), parts[i * per_line : (i + take) * per_line])
                self._in_file += take
                i += take
        if self.fsync:
            os.fsync(f.fileno())

    def _open_once(self) -> None:
        # A retry after an abandoned attempt that did open the file in the end has nothing to do.
        if self._file is None:
            self._roll()

    def _close_file(self) -> None:
        f, self._file = self._file, None
        if f is not None:
            f.close()

    async def open(self) -> None:
        await run_sync_daemon(self._guarded, self._open_once, backlog=self._backlog)

    async def write(self, records: Sequence[TraceRecord]) -> None:
        await run_sync_daemon(
            self._guarded, self._write_lines, self._lines(records), 3, backlog=self._backlog
        )

    def _lines(self, records: Sequence[TraceRecord]) -> list[bytes]:
        """The batch's lines, three pieces a line."""
        # Three pieces a line: a small header, the sample bytes encoded at submission, and the
        # closing brace. Only the header is made here; the payload is never copied or re-encoded.
        parts: list[bytes] = []
        append = parts.append
        dumps = orjson.dumps
        middles = self._middles
        # Records of one call share step, split, key and timestamp: the header's tail after
        # the id is built once per run of equal ones.
        last: tuple[int, str, str, float] | None = None
        tail = b""
        for r in records:
            fields = (r.step, r.split, r.key, r.timestamp)
            if fields != last:
                last = fields
                middle = middles.get((r.split, r.key))
                if middle is None:
                    middle = middles[(r.split, r.key)] = (
                        b',"split":' + dumps(r.split) + b',"key":' + dumps(r.key) + b',"timestamp":'
                    )
                tail = b',"step":%d%b%b,"sample":' % (r.step, middle, dumps(r.timestamp))
            append(b'{"id":' + dumps(r.id) + tail)
            append(r.payload)
            append(b"}\n")
        # Not joined here (a copy of the whole batch, on the session's loop): the sink's thread
        # hands the pieces to writev, which releases the GIL for the whole of each call.
        return parts

    async def write_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        line = orjson.dumps({"step": step, "metrics": dict(metrics)}) + b"\n"
        await run_sync_daemon(self._guarded, self._write_lines, [line], backlog=self._backlog)

    async def close(self) -> None:
        # Closing flushes, which can block like a write; a write still stuck in a thread (given
        # up on by its timeout) closes the file itself when it returns.
        await run_sync_daemon(self._guarded.close)
