"""SIGTERM mid-run: the shutdown hook drains the session, then hands the signal on."""

from __future__ import annotations

import signal
import time
import uuid
from pathlib import Path
from typing import Any

import orjson
import pytest

from tests.faults import _harness as h


@pytest.fixture(autouse=True)
def _trackio_dir(trackio_dir: str) -> None:
    """Every process here shares the test run's TRACKIO_DIR (inherited through the environment)."""


def _sigterm_child(args: list[str], ready: bytes, delay: float = 0.0) -> tuple[Any, float, bytes]:
    """Run `python -c *args`, SIGTERM it `delay` s after it prints `ready`; returns the process,
    the seconds from the signal to its end, and its stderr."""
    import subprocess
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-c", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=h.env()
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == ready
        time.sleep(delay)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        return proc, time.monotonic() - sent, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def _trainer(tmp_path: Path) -> tuple[str, Path, Path]:
    project = f"term-{uuid.uuid4().hex[:8]}"
    return project, tmp_path / "acked.txt", tmp_path / "stats.json"


def test_sigterm_flushes_then_runs_the_previous_handler(tmp_path: Path) -> None:
    """With a trainer's own SIGTERM handler: the hook flushes first, the handler runs, the run is finished."""
    project, acked, stats = _trainer(tmp_path)
    marker = tmp_path / "previous.json"
    # Nothing would be written for 60 s on its own: a big batch and a long flush interval.
    proc = h.start_trainer(
        "--project", project, "--run", "r", "--acked", str(acked), "--stats", str(stats),
        "--hooks", "--prev-handler", str(marker), "--batch-size", "100000", "--flush-interval", "60",
        "--durability", "writer", "--spool", str(tmp_path / "spool"),
    )  # fmt: skip
    h.wait_ready(proc)
    h.wait_acked(acked)
    before = len(h.acked_uids(acked))
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err.decode()[-2000:]
    previous = orjson.loads(marker.read_bytes())
    assert previous["signal"] == signal.SIGTERM
    # Everything acknowledged before the signal was written before the trainer's handler ran
    # (on its own the session would not have written anything for a minute).
    assert before > 0 and previous["written_when_called"] >= before
    final = orjson.loads(stats.read_bytes())
    assert final["pending"] == 0 and final["check"] and final["finished"]
    uids = h.trackio_uids(project, "r")
    assert set(h.acked_uids(acked)) == set(uids) and max(uids.values()) == 1
    assert b"Run finished" in err


@pytest.mark.parametrize("form", ["asyncio", "trio", "sync"])
def test_sigterm_with_the_default_handler_finishes_the_session_then_dies(tmp_path: Path, form: str) -> None:
    """With no handler of the trainer's own: the hook finishes the session, then SIGTERM ends the process."""
    project, acked, _ = _trainer(tmp_path)
    proc = h.start_trainer(
        "--project", project, "--run", "r", "--acked", str(acked), "--hooks",
        "--batch-size", "100000", "--flush-interval", "60",
        *(["--sync"] if form == "sync" else ["--backend", form]),
    )  # fmt: skip
    h.wait_ready(proc)
    h.wait_acked(acked)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGTERM, err.decode()[-2000:]
    acknowledged = set(h.acked_uids(acked))
    uids = h.trackio_uids(project, "r")
    assert acknowledged and acknowledged <= set(uids) and max(uids.values()) == 1
    assert b"Run finished" in err


_CTRL_C_CHILD = """
import signal, sys, time
# As in a trainer started from a terminal: a runner that started this process in the background
# may have left SIGINT ignored, and Python then raises no KeyboardInterrupt.
signal.signal(signal.SIGINT, signal.default_int_handler)
import asynctrace as at
sink = at.testing.MemorySink()
try:
    with at.TraceSession("p", run="r", sinks=[sink], shutdown_hooks=True, flush_interval=60,
                         batch_size=10**5) as s:
        print("ready", flush=True)
        step = 0
        while True:
            s.log_samples([{"prompt": "q", "response": "a"}], step=step)
            step += 1
            time.sleep(0.01)
except KeyboardInterrupt:
    print("KeyboardInterrupt", len(sink.records), s.stats().pending, flush=True)
    sys.exit(0)
"""


def test_ctrl_c_finishes_a_sync_session_then_raises_keyboard_interrupt() -> None:
    """Ctrl-C with the hook on a synchronous session: the session is finished, then the trainer
    gets KeyboardInterrupt (its except and finally blocks run), not a kill by SIGINT."""
    import subprocess
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-c", _CTRL_C_CHILD], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err.decode()[-2000:]
    word, written, pending = out.split()
    assert word == b"KeyboardInterrupt" and int(written) > 0 and int(pending) == 0


_CLOSE_MARKER_CHILD = """
import asyncio, os, sys, time
import asynctrace as at

class Sink(at.testing.MemorySink):
    async def close(self):
        with open(sys.argv[1], "w") as f:
            f.write(str(len(self.records)))

sink = Sink(delay=float(sys.argv[3]))
options = dict(run="r", sinks=[sink], shutdown_hooks=True, batch_size=4, flush_interval=60,
               finish_timeout=30)

async def main():
    async with at.TraceSession("p", **options) as s:
        for step in range(20):
            await s.log_samples([{"prompt": "q", "response": "a"}], step=step)
        print("finishing", flush=True)
    await asyncio.sleep(30)

if sys.argv[2] == "async-finish":
    asyncio.run(main())
with at.TraceSession("p", **options) as s:
    for step in range(20):
        s.log_samples([{"prompt": "q", "response": "a"}], step=step)
    if sys.argv[2] == "lock":
        # The signal lands while this thread holds the lock the drain needs.
        with s.session._engine.buffer.lock:
            os.kill(os.getpid(), 15)
            time.sleep(0.1)
    else:
        print("finishing", flush=True)
time.sleep(30)
"""


@pytest.mark.parametrize("moment", ["lock", "finish", "async-finish"])
def test_sigterm_finishes_the_session_wherever_it_lands(tmp_path: Path, moment: str) -> None:
    """SIGTERM while the training thread holds the session's lock, or while finish() is under
    way (a synchronous or an asyncio session): the session is still finished (every record
    written, sinks closed), then the signal ends the process, well within the deadline."""
    import subprocess
    import sys

    marker = tmp_path / "closed"
    delay = "0" if moment == "lock" else "0.2"  # a finish of about a second to land in
    start = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-c", _CLOSE_MARKER_CHILD, str(marker), moment, delay],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    if moment != "lock":
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"finishing"
        time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGTERM, err.decode()[-2000:]
    assert marker.read_text() == "20", err.decode()[-2000:]
    assert time.monotonic() - start < 10


_STUBBORN_SINK_CHILD = """
import sys, time
import anyio
import asynctrace as at

class Stubborn(at.Sink):
    # Breaks the sink contract: its write ignores its cancel for two minutes.
    name = "stubborn"

    async def write(self, records):
        print("writing", flush=True)
        with anyio.CancelScope(shield=True):
            await anyio.sleep(120)

    async def close(self):
        with open(sys.argv[2], "w") as f:
            f.write("closed")

form = sys.argv[1]
options = dict(run="r", sinks=[Stubborn()], batch_size=1, finish_timeout=60)
if form == "sync":
    with at.TraceSession("p", **options) as s:
        at.install_shutdown_hooks(s, timeout=0.5)
        s.log_samples([{"prompt": "q", "response": "a"}], step=0)
        time.sleep(120)
else:
    async def main():
        async with at.TraceSession("p", **options) as s:
            at.install_shutdown_hooks(s, timeout=0.5)
            await s.log_samples([{"prompt": "q", "response": "a"}], step=0)
            await anyio.sleep(120)

    anyio.run(main, backend=form)
"""


@pytest.mark.parametrize("form", ["sync", "asyncio", "trio"])
def test_sigterm_keeps_the_hooks_deadline_when_a_sink_ignores_cancellation(tmp_path: Path, form: str) -> None:
    """SIGTERM with the hook's timeout=0.5 while a sink's write ignores its cancel for two
    minutes: the hook finishes the session, closing the sink, and the signal ends the process
    within the hook's bound (0.5 s drain, 2 s for the write to give in, 0.5 s to close, 1 s
    margin)."""
    from asynctrace._runtime.lifecycle import finish_bound

    proc, took, err = _sigterm_child([_STUBBORN_SINK_CHILD, form, str(tmp_path / "closed")], b"writing")
    assert proc.returncode == -signal.SIGTERM, err.decode()[-2000:]
    assert b"'stubborn' still running" in err
    # Finished, not given up on: the sink was closed before the signal was handed on.
    assert (tmp_path / "closed").exists(), err.decode()[-2000:]
    # Three seconds of slack for a loaded machine: before the fix it took 10 s or more.
    assert took < finish_bound(0.5) + 1.0 + 3.0, f"the process ended {took:.1f}s after SIGTERM"


_LONG_FINISH_CHILD = """
import sys
import anyio
import asynctrace as at

form = sys.argv[1]
# A sink that never answers: finish(60) would wait its whole minute.
options = dict(run="r", sinks=[at.testing.MemorySink(hang=True)], batch_size=1, finish_timeout=60)
if form == "sync":
    with at.TraceSession("p", **options) as s:
        at.install_shutdown_hooks(s, timeout=0.5)
        s.log_samples([{"prompt": "q", "response": "a"}], step=0)
        print("finishing", flush=True)
else:
    async def main():
        async with at.TraceSession("p", **options) as s:
            at.install_shutdown_hooks(s, timeout=0.5)
            await s.log_samples([{"prompt": "q", "response": "a"}], step=0)
            print("finishing", flush=True)

    anyio.run(main, backend=form)
"""


@pytest.mark.parametrize("form", ["sync", "asyncio", "trio"])
def test_sigterm_during_a_longer_finish_keeps_the_hooks_deadline(form: str) -> None:
    """SIGTERM while finish(60) waits on a sink that never answers, with the hook's timeout=0.5:
    that finish is cut short to the hook's deadline and the signal ends the process within the
    hook's bound, not a minute later."""
    from asynctrace._runtime.lifecycle import finish_bound

    # 0.3 s after "finishing": finish(60) is under way.
    proc, took, err = _sigterm_child([_LONG_FINISH_CHILD, form], b"finishing", delay=0.3)
    assert proc.returncode == -signal.SIGTERM, err.decode()[-2000:]
    # Three seconds of slack for a loaded machine, against the minute finish(60) would take.
    assert took < finish_bound(0.5) + 1.0 + 3.0, f"the process ended {took:.1f}s after SIGTERM"


_WAITING_CHILD = """
import os, signal, sys, threading, time
import asynctrace as at

sink = at.testing.MemorySink(delay=0.2)
with at.TraceSession("p", run="r", sinks=[sink], queue_size=4, batch_size=4, shutdown_hooks=True) as s:
    def sigterm_once_waiting():
        # The caller below waits for room once more is pending than the queue holds.
        while s.stats().pending <= s.stats().queue_depth:
            time.sleep(0.01)
        time.sleep(0.2)
        print("waiting", flush=True)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=sigterm_once_waiting, daemon=True).start()
    s.log_samples([{"prompt": "q", "response": "a"} for _ in range(40)], step=0)
    print("returned", flush=True)
"""


def test_sigterm_while_waiting_for_room_counts_the_waiting_samples_closed() -> None:
    """SIGTERM lands while the blocking log_samples waits for room (the hook then finishes the
    session on that very thread): what still waited is counted "closed", not left pending, and
    the log does not claim a deadline was reached when it was not."""
    import re
    import subprocess
    import sys

    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", _WAITING_CHILD], capture_output=True, timeout=60, check=False
    )
    took = time.monotonic() - start
    out, err = proc.stdout.decode(), proc.stderr.decode()
    assert proc.returncode == -signal.SIGTERM, err[-2000:]
    assert out.split() == ["waiting"], (out, err[-2000:])
    summary = re.search(r"submitted=(\d+) written=(\d+) failed=0 pending=(\d+) dropped\[closed=(\d+)\]", err)
    assert summary is not None, err[-2000:]
    submitted, written, pending, closed = map(int, summary.groups())
    assert submitted == 40 and pending == 0 and written + closed == 40 and closed > 0, err[-2000:]
    assert "reached its" not in err, err[-2000:]
    assert took < 10
