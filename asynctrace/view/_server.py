"""`asynctrace view`'s server (uvicorn) over the web app (`_app`): the port taken first, then the
archive's indexing started (`_loading`), then the app and the server imported while it runs."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from ._archive import Archive
from ._guard import host_names
from ._loading import STOP_SECONDS, Loading

__all__ = ["run"]


def run(
    source: str | os.PathLike[str],
    *,
    host: str = "127.0.0.1",
    port: int = 8321,
    watch: Sequence[str] = (),
    cache: str | os.PathLike[str] | None = None,
    ready: Callable[[str], Any] | None = None,
) -> None:
    """Listen on `host`:`port` (0: any free port) and serve until interrupted, indexing the
    archive meanwhile. At its end, however it ends (Ctrl-C included), the indexing is stopped
    before the interpreter's: see `Loading.stop`."""
    _sigint_stops()
    archive = Archive(source, cache=cache)
    sock = _listen(host, port)  # a busy port is said before any indexing starts
    loading: Loading | None = None
    server: Any = None
    announcer: threading.Thread | None = None
    try:
        loading = Loading(archive)
        # Imported while the indexing runs (a first open's summary is most of its start): the
        # pages, numpy, Starlette and uvicorn are about 0.8 s of it.
        import uvicorn

        from ._app import build_app

        bound = sock.getsockname()[1]
        app = build_app(archive, watch=watch, loading=loading, hosts=host_names(host), port=bound)
        # A request still running at exit is given this long before the server stops waiting.
        config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=2)
        server = uvicorn.Server(config)
        if ready is not None:
            where = f"http://{'[' + host + ']' if ':' in host else host}:{bound}/"
            announcer = _announce(server, where, ready)
        server.run(sockets=[sock])
    finally:
        sock.close()
        if server is not None:
            server.should_exit = True  # ends the announcing thread too, which holds the app
        if announcer is not None:
            announcer.join(1)
        with _sigint_ignored():
            stopped = loading is None or loading.stop()
        if not stopped:
            _leave(sys.exc_info()[1])


def _listen(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    return sock


def _announce(server: Any, where: str, ready: Callable[[str], Any]) -> threading.Thread:
    def announce() -> None:
        # uvicorn says it listens by setting `started`; the deadline keeps this thread bounded.
        deadline = time.monotonic() + 30
        while not server.started and not server.should_exit and time.monotonic() < deadline:
            time.sleep(0.01)
        if server.started:
            ready(where)

    thread = threading.Thread(target=announce, name="asynctrace-view-ready", daemon=True)
    thread.start()
    return thread


def _sigint_stops() -> None:
    """SIGINT stops the command with status 130 even when it was started with SIGINT ignored (a
    shell's background job): uvicorn catches SIGINT whatever the disposition and stops, then
    raises it again under the disposition it found, which would end the command with 0, silently."""
    main = threading.current_thread() is threading.main_thread()
    if main and signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@contextlib.contextmanager
def _sigint_ignored() -> Iterator[None]:
    """Ctrl-C pressed again while the indexing stops (a bounded wait) does not cut the stop short."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _leave(error: BaseException | None) -> None:
    """Exit now, skipping the interpreter's ending: a thread still inside DuckDB would abort it."""
    code = 130 if isinstance(error, KeyboardInterrupt) else (1 if error is not None else 0)
    sys.stderr.write(f"asynctrace view: the indexing did not stop within {STOP_SECONDS:.0f} s; leaving\n")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
