"""Trackio writer process (`TrackioSink` starts it; ``python -m asynctrace.sinks._trackio_worker``).

The protocol on stdin is frames of ``>I`` header length, an orjson header, then the concatenated
payloads; each request gets one orjson line on the protocol pipe. Why a process, and how it
finishes the run when its parent dies: docs/concepts.md and docs/reliability.md.
"""

from __future__ import annotations

import io
import os
import queue
import select
import signal
import sys
import threading
import time
from typing import Any, TextIO

import orjson

from .._security import scrub
from ..exceptions import PermanentSinkError
from ._trackio_writer import HEADER, TrackioWriter, WriteItem


class _Scrubbed(io.TextIOBase):
    """A text stream that scrubs credentials (Trackio prints URLs that can carry a write token)."""

    def __init__(self, inner: TextIO) -> None:
        self._inner = inner

    def write(self, text: str) -> int:
        self._inner.write(scrub(text))
        return len(text)

    def flush(self) -> None:
        self._inner.flush()

    def fileno(self) -> int:
        return self._inner.fileno()

    def isatty(self) -> bool:
        return self._inner.isatty()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return self._inner.encoding


def _read_exact(fd: int, n: int) -> bytes | None:
    # Raw reads on the descriptor: a daemon thread blocked in a buffered stdin read would make
    # the interpreter abort at exit while it waits for that buffer's lock.
    chunks = []
    while n:
        chunk = os.read(fd, min(n, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def _handle(
    writer: TrackioWriter | None, header: dict[str, Any], blob: bytes, reply: dict[str, Any]
) -> TrackioWriter | None:
    op = header["op"]
    if op == "open":
        # This process's console is its own (see `main`): the writer may finish and reopen
        # the run after each write on the public path, its prints silenced.
        writer = TrackioWriter(**header["writer"], seal_writes=True)
        writer.open()
        return writer
    if writer is None:
        # Its open failed (and was reported); the parent starts a fresh writer on retry.
        raise RuntimeError("the Trackio writer was not opened")
    if op == "write":
        items = []
        offset = 0
        fields = ("ids", "steps", "keys", "sizes", "replayed", "timestamps")
        columns = zip(*(header[f] for f in fields), strict=True)
        for record_id, step, key, size, replayed, timestamp in columns:
            payload = blob[offset : offset + size]
            items.append(WriteItem(record_id, step, key, payload, bool(replayed), float(timestamp)))
            offset += size
        reply["skipped"] = writer.write(items)
    elif op == "metrics":
        writer.write_metrics(header["step"], header["metrics"])
    elif op == "finish":
        writer.finish()
    else:
        raise PermanentSinkError(f"unknown operation {op!r}")
    return writer


def _read_frames(stdin: int, frames: queue.Queue[tuple[dict[str, Any], bytes] | None]) -> None:
    """Reader thread: drain stdin as frames arrive, so the parent's sends never stall on a pipe
    that is full because a commit is waiting (a locked database, a slow disk)."""
    try:
        while True:
            raw = _read_exact(stdin, HEADER.size)
            if raw is None:
                break
            (size,) = HEADER.unpack(raw)
            head = _read_exact(stdin, size)
            if head is None:
                break
            header = orjson.loads(head)
            blob = _read_exact(stdin, header["blob"]) if header.get("blob") else b""
            if blob is None:
                break
            frames.put((header, blob))
    finally:
        frames.put(None)


_PARENT_POLL = 0.2  # seconds between checks that the parent is still there


def _watch_parent(parent: int, stdin: int, frames: queue.Queue[tuple[dict[str, Any], bytes] | None]) -> None:
    """Watcher thread: once the parent is gone, stop as end of input would, even while another
    process still holds the pipe open."""
    while os.getppid() == parent:
        time.sleep(_PARENT_POLL)
    # What the parent sent before it died is in the pipe: let the reader thread take it first.
    for _ in range(20):
        if not select.select([stdin], [], [], 0)[0]:
            break
        time.sleep(0.05)
    frames.put(None)


def main() -> int:
    parent = os.getppid()
    stdin = sys.stdin.fileno()
    # Trackio prints to stdout; keep the protocol on a private copy of fd 1 and send
    # everything else the process prints to stderr.
    proto = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    sys.stdout = sys.stderr = _Scrubbed(sys.stderr)  # type: ignore[assignment]
    # They reach the whole process group, and the parent's shutdown hooks need this process to
    # finish writing what they flush.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    frames: queue.Queue[tuple[dict[str, Any], bytes] | None] = queue.Queue()
    threading.Thread(target=_read_frames, args=(stdin, frames), daemon=True).start()
    threading.Thread(target=_watch_parent, args=(parent, stdin, frames), daemon=True).start()
    writer: TrackioWriter | None = None
    try:
        while True:
            frame = frames.get()
            if frame is None:
                break
            header, blob = frame
            reply: dict[str, Any] = {"seq": header.get("seq")}
            try:
                writer = _handle(writer, header, blob, reply)
                reply["ok"] = True
                if writer is not None:
                    # How it writes, which its first write may still change (`TrackioWriter.path`).
                    reply["path"], reply["fallback"] = writer.path, writer.fallback
            except PermanentSinkError as exc:
                reply.update(ok=False, permanent=True, error=scrub(str(exc)))
            except Exception as exc:
                reply.update(ok=False, permanent=False, error=scrub(f"{type(exc).__name__}: {exc}"))
            try:
                proto.write(orjson.dumps(reply) + b"\n")
            except BrokenPipeError:
                break  # the parent is gone; finish the run below
            if header["op"] == "finish" and reply["ok"]:
                return 0
    finally:
        # Reached on EOF too: the parent is gone, so finish the run it left open.
        if writer is not None and not writer.finished:
            writer.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
