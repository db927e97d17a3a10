"""Trackio writer process: ``python -m asynctrace.sinks._trackio_worker``.

Trackio's Python-heavy work (building rows, SQLite, its own threads) would compete with the
caller's event loop for the GIL; in a process of its own it cannot. The protocol on stdin is
frames of ``>I`` header length, an orjson header, then the concatenated payloads; each request
gets one orjson line on the protocol pipe. If the parent dies, stdin closes and the run is
finished anyway, so a killed trainer never leaves its Trackio run open.
"""

from __future__ import annotations

import os
import sys
from typing import Any, BinaryIO

import orjson

from ..exceptions import PermanentSinkError
from ._trackio_writer import HEADER, TrackioWriter


def _read_exact(stream: BinaryIO, n: int) -> bytes | None:
    chunks = []
    while n:
        chunk = stream.read(n)
        if not chunk:
            return None
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def _handle(writer: TrackioWriter | None, header: dict[str, Any], blob: bytes) -> TrackioWriter | None:
    op = header["op"]
    if op == "open":
        writer = TrackioWriter(
            header["project"],
            header["run"],
            space_id=header.get("space_id"),
            server_url=header.get("server_url"),
            init_kwargs=header.get("init_kwargs"),
        )
        writer.open()
        return writer
    if writer is None:
        raise PermanentSinkError("the Trackio writer was not opened")
    if op == "write":
        items = []
        offset = 0
        for record_id, step, key, size in header["items"]:
            items.append((record_id, step, key, blob[offset : offset + size]))
            offset += size
        writer.write(items)
    elif op == "metrics":
        writer.write_metrics(header["step"], header["metrics"])
    elif op == "finish":
        writer.finish()
    else:
        raise PermanentSinkError(f"unknown operation {op!r}")
    return writer


def main() -> int:
    stdin = sys.stdin.buffer
    # Trackio prints to stdout; keep the protocol on a private copy of fd 1 and send
    # everything else the process prints to stderr.
    proto = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    writer: TrackioWriter | None = None
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
            blob = _read_exact(stdin, header.get("blob", 0)) if header.get("blob") else b""
            if blob is None:
                break
            reply: dict[str, Any] = {"seq": header.get("seq")}
            try:
                writer = _handle(writer, header, blob)
                reply["ok"] = True
            except PermanentSinkError as exc:
                reply.update(ok=False, permanent=True, error=str(exc))
            except Exception as exc:
                reply.update(ok=False, permanent=False, error=f"{type(exc).__name__}: {exc}")
            proto.write(orjson.dumps(reply) + b"\n")
            if header["op"] == "finish" and reply["ok"]:
                return 0
    finally:
        # Reached on EOF too: the parent is gone, so finish the run it left open.
        if writer is not None and not writer.finished:
            writer.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
