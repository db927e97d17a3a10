"""Shutdown hooks: installed from the main thread, chained to the previous handlers, removed again."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import orjson
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


def _exit_output(script: str) -> list[str]:
    """What a fresh interpreter running `script` printed, up to and through its exit hooks."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_exit_phases_run_in_order_ahead_of_earlier_exit_hooks() -> None:
    """The exit registry runs its phases in order, whatever order they were added in, carries on
    past a hook that raises, and runs before an exit hook registered ahead of its newest one (as
    Ray's is, at `import ray`)."""
    out = _exit_output(
        """
        import atexit
        from asynctrace._runtime.exits import Phase, at_exit
        atexit.register(print, "earlier")
        at_exit(Phase.SESSIONS, lambda: print("sessions"), "sessions")
        at_exit(Phase.OWNED, lambda: 1 / 0, "a broken hook")
        at_exit(Phase.REMOTE, lambda: print("remote"), "remote")
        at_exit(Phase.SHIP, lambda: print("ship"), "ship")
        """
    )
    assert out == ["ship", "remote", "sessions", "earlier"]


def test_a_blocking_session_opened_off_the_main_thread_is_finished_at_exit(tmp_path: Path) -> None:
    """A blocking session opened on another thread (no signal handlers there) and never finished
    is drained at exit: the step its sampler held back is written."""
    path = tmp_path / "run.jsonl"
    _exit_output(
        f"""
        import threading
        import asynctrace as at
        opened = []
        def open_one():
            opened.append(at.TraceSession(
                "p", sinks=[at.JsonlSink({str(path)!r})], max_traces_per_step=2, sampler="top_bottom",
                health_metrics=False,
            ).start())
        t = threading.Thread(target=open_one)
        t.start()
        t.join()
        opened[0].log_samples([{{"prompt": str(i), "reward": float(i)}} for i in range(5)], step=0)
        """
    )
    rows = [orjson.loads(line) for line in path.read_text().splitlines()]
    assert sorted(r["sample"]["metadata"]["reward"] for r in rows) == [0.0, 4.0]
