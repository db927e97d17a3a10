"""ParquetSink's writer process (``python -m asynctrace.sinks._parquet_worker FD``).

It turns the journal into a Parquet file, a row group at a time, off the trainer's process: the
decoding, Arrow conversion and compression hold no lock the training loop needs. FD is its end of
a Unix socket pair. Each request is one JSON line, with descriptors passed alongside (`start`: the
file to write and the journal to read, both opened by the sink); each gets one JSON line back.
The sink sends requests without waiting; they are answered in order, after a first line saying
the process is ready (pyarrow imported). The process never creates, names or deletes a file:
what it leaves behind when its sink is killed is a temporary the next sink deletes. It exits at
end of input (its sink closed or died); a sink whose close is given up on kills it.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
from typing import Any

import orjson

from ._parquet_file import FileConverter
from ._parquet_rows import pyarrow

_MAX_FDS = 8


def _handle(converter: FileConverter, request: dict[str, Any], fds: list[int]) -> dict[str, Any]:
    op = request["op"]
    if op == "start":
        out, journal = fds.pop(0), fds.pop(0)
        converter.start(out, journal, request["offset"])
        return {"ok": True}
    if op == "append":
        converter.append(request["end"], layout=request.get("layout"), start=request.get("start", 0))
        return {"ok": True}
    if op == "finish":
        rows = converter.finish()
        return {"ok": True, "rows": rows, "damaged": converter.damaged}
    if op == "reset":
        converter.reset()
        return {"ok": True}
    raise ValueError(f"unknown operation {op!r}")


def serve(sock: socket.socket, converter: FileConverter) -> None:
    """Answer requests on `sock`, in order, until it is closed."""
    pending = b""
    fds: list[int] = []  # received with the `start` requests, in their order
    try:
        while True:
            data, received, _, _ = socket.recv_fds(sock, 65536, _MAX_FDS)
            fds += received
            if not data:
                return
            *lines, pending = (pending + data).split(b"\n")
            for line in lines:
                try:
                    reply = _handle(converter, orjson.loads(line), fds)
                except Exception as exc:
                    # The file is dropped; requests for it fail until the next `start`.
                    converter.reset()
                    reply = {
                        "ok": False,
                        "errno": getattr(exc, "errno", None),
                        "error": f"{type(exc).__name__}: {exc}",
                    }
                sock.sendall(orjson.dumps(reply) + b"\n")
    finally:
        for fd in fds:
            os.close(fd)


def main() -> int:
    # They reach the whole process group: the sink decides when this process ends (it closes the
    # socket), and a sink finishing on Ctrl-C still needs it for its last file.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    sock = socket.socket(fileno=int(sys.argv[1]))
    level = sys.argv[2] if len(sys.argv) > 2 else "none"
    pyarrow()  # before saying it is ready: the sink's open waits for this
    converter = FileConverter(None if level == "none" else int(level))
    try:
        sock.sendall(b'{"ok":true}\n')
        serve(sock, converter)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the sink is gone
    finally:
        converter.reset()
    return 0


if __name__ == "__main__":
    code = main()
    # Every file it wrote is closed (and a finished one synced): the interpreter's teardown of
    # pyarrow and numpy (tens of ms that the closing sink waits for) has nothing left to do.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
