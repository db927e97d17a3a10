"""ParquetSink's converters, as its file maker (`_parquet_maker`) drives them: the writer process's
client (`WriterProcess`), or the same work in the maker's own thread (`InThread`).

Both take a file to write and a journal to read (`start`), the journal's bytes as they grow
(`append`), and end the file (`finish`, which says how many rows it holds and how many damaged
journal lines it left out). Only the maker's thread calls them, so a writer process that stops
answering holds up that thread alone, never a write.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import subprocess
import sys
from collections.abc import Sequence
from typing import Any, NamedTuple

import orjson

from ._parquet_file import FileConverter
from ._parquet_rows import pyarrow

__all__ = ["Converter", "InThread", "Made", "WriterGone", "WriterProcess", "new_converter", "worker_env"]

# Seconds a closing sink waits for its writer process to exit before it kills it.
_EXIT_WAIT = 10.0


class Made(NamedTuple):
    """A file ended: the rows it holds and the damaged journal lines left out of it."""

    rows: int
    damaged: int


class WriterGone(RuntimeError):
    """The writer process exited (killed, out of memory): the maker starts another."""


class InThread:
    """Converts in the maker's own thread (``process=False``)."""

    def __init__(self, compression_level: int | None) -> None:
        self._converter = FileConverter(compression_level)

    def start(self, out: int, journal: int, offset: int) -> None:
        self._converter.start(out, journal, offset)

    def append(self, start: int, end: int, layout: dict[str, Any] | None) -> None:
        self._converter.append(end, layout=layout, start=start)

    def finish(self) -> Made:
        rows = self._converter.finish()
        return Made(rows, self._converter.damaged)

    def ready(self) -> None:
        pyarrow()  # imported now rather than at the first row group

    def check(self) -> None:
        pass  # every call finished before it returned

    def reset(self) -> None:
        self._converter.reset()

    def close(self) -> None:
        self._converter.reset()

    def stop(self) -> str:
        # Its work is a thread's of this process: bounded by the journal, waiting on no one.
        return "its thread ends the file it is making"

    def forget(self) -> None:
        pass  # it holds no lock and keeps no other process waiting


def worker_env() -> dict[str, str]:
    """The trainer's environment, with numpy's BLAS on one thread: the writer process does no
    linear algebra, and OpenBLAS's idle threads spin on the cores the trainer uses."""
    env = dict(os.environ)
    for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env.setdefault(name, "1")
    return env


class WriterProcess:
    """The writer process's client. Requests are sent without waiting: the process answers each in
    order, and the client reads the answers when it must know (a file's end) or at the next
    request, where an earlier request's failure fails that one."""

    def __init__(self, compression_level: int | None) -> None:
        ours, theirs = socket.socketpair()
        try:
            self._process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "asynctrace.sinks._parquet_worker",
                    str(theirs.fileno()),
                    "none" if compression_level is None else str(compression_level),
                ],
                stdin=subprocess.DEVNULL,
                pass_fds=[theirs.fileno()],
                env=worker_env(),
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self._socket = ours
        self._received = b""
        self._outstanding = 1  # the process says it is ready
        self._failure: Exception | None = None
        self._last: dict[str, Any] = {}

    def _gone(self) -> WriterGone:
        return WriterGone(f"ParquetSink: its writer process exited (status {self._process.poll()})")

    def _send(self, request: dict[str, Any], fds: Sequence[int] = ()) -> None:
        data = orjson.dumps(request) + b"\n"
        try:
            sent = socket.send_fds(self._socket, [data], list(fds))
            if sent < len(data):  # a large layout, cut short: the descriptors went with its start
                self._socket.sendall(data[sent:])
        except OSError:  # the process is gone, or the socket was closed by `stop`
            raise self._gone() from None
        self._outstanding += 1

    def _drain(self, wait: bool) -> None:
        """Read the answers that are there (all of them, with `wait`)."""
        while self._outstanding:
            try:
                if not wait and not select.select([self._socket], [], [], 0)[0]:
                    return
                data = self._socket.recv(65536)
            except (ConnectionResetError, ValueError, OSError):
                data = b""
            if not data:
                raise self._gone()
            *lines, self._received = (self._received + data).split(b"\n")
            for line in lines:
                self._outstanding -= 1
                reply = orjson.loads(line)
                self._last = reply
                if not reply["ok"] and self._failure is None:
                    error = f"ParquetSink writer process: {reply['error']}"
                    code = reply.get("errno")
                    self._failure = OSError(code, error) if code is not None else RuntimeError(error)

    def ready(self) -> None:
        """Wait until the process has started (pyarrow imported)."""
        self._drain(wait=True)

    def check(self) -> None:
        """Raise the failure the process reported since the last check, if any."""
        self._drain(wait=False)
        failure, self._failure = self._failure, None
        if failure is not None:
            raise failure

    def start(self, out: int, journal: int, offset: int) -> None:
        try:
            self._send({"op": "start", "offset": offset}, [out, journal])
        finally:
            # The process holds its own copies now.
            os.close(out)
            os.close(journal)

    def append(self, start: int, end: int, layout: dict[str, Any] | None) -> None:
        self._send({"op": "append", "start": start, "end": end, "layout": layout})

    def finish(self) -> Made:
        self._send({"op": "finish"})
        self._drain(wait=True)
        self.check()
        return Made(int(self._last["rows"]), int(self._last.get("damaged", 0)))

    def reset(self) -> None:
        self._send({"op": "reset"})
        self._drain(wait=True)
        self._failure = None  # what failed is dropped with the file

    def stop(self) -> str:
        """Kill the process (from any thread): a call waiting on it fails at once."""
        with contextlib.suppress(OSError):
            self._process.kill()
        return "its writer process is killed"

    def forget(self) -> None:
        """In a forked child: close the child's copy of the socket (the parent's stays connected)."""
        self._socket.close()

    def close(self) -> None:
        """End of input: the process exits; killed when it does not in time."""
        with contextlib.suppress(OSError):
            self._socket.shutdown(socket.SHUT_RDWR)
        self._socket.close()
        try:
            self._process.wait(_EXIT_WAIT)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()


Converter = InThread | WriterProcess


def new_converter(process: bool, compression_level: int | None) -> Converter:
    """A writer process's client, or (``process=False``, or no descriptor passing) the same work in-thread."""
    if process and hasattr(socket, "send_fds"):
        return WriterProcess(compression_level)
    return InThread(compression_level)
