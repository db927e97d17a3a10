"""Shutdown hooks: installed from the main thread, chained to the previous handlers, removed again."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator

import pytest

import asynctrace as at


@pytest.fixture
def saved_handlers() -> Iterator[None]:
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield
    for s, h in before.items():
        signal.signal(s, h)


def test_hooks_install_and_restore_the_previous_handlers(saved_handlers: None) -> None:
    """install_shutdown_hooks replaces SIGTERM/SIGINT handlers; the returned function restores them."""

    def mine(signum: int, frame: object) -> None:
        pass

    signal.signal(signal.SIGTERM, mine)
    before_int = signal.getsignal(signal.SIGINT)
    session = at.TraceSession("p", sinks=[at.testing.MemorySink()])
    remove = at.install_shutdown_hooks(session, timeout=2.0)
    assert signal.getsignal(signal.SIGTERM) is not mine
    remove()
    assert signal.getsignal(signal.SIGTERM) is mine and signal.getsignal(signal.SIGINT) == before_int


def test_hooks_need_the_main_thread() -> None:
    """Python runs signal handlers on the main thread only, so installing elsewhere is refused."""
    session = at.TraceSession("p", sinks=[at.testing.MemorySink()])
    errors: list[BaseException] = []

    def other() -> None:
        try:
            at.install_shutdown_hooks(session)
        except ValueError as exc:
            errors.append(exc)

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert errors and "main thread" in str(errors[0])
    with pytest.raises(ValueError, match="timeout"):
        at.install_shutdown_hooks(session, timeout=0)


def test_shutdown_hooks_option_lasts_as_long_as_the_session(saved_handlers: None) -> None:
    """shutdown_hooks=True installs the hooks when a session opens and removes them when it finishes."""
    before = signal.getsignal(signal.SIGTERM)
    with at.TraceSession("p", sinks=[at.testing.MemorySink()], shutdown_hooks=True) as s:
        assert signal.getsignal(signal.SIGTERM) != before
        s.log_samples([{"prompt": "q", "response": "a"}], step=0)
    assert signal.getsignal(signal.SIGTERM) == before
    assert s.stats().written == 1
