"""`log_metrics` within the byte bound: behind a hung sink, the others get every call, and what
the hung sink cannot hold is dropped for it and counted."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import asynctrace as at
from asynctrace._runtime.lifecycle import finish_bound
from tests._util import sample
from tests.faults._harness import ROOT, env


def _run(script: str, *args: str) -> dict[str, object]:
    """Run `script` in a Python process of its own; its last line of output, as JSON."""
    cmd = [sys.executable, "-c", script, *args]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env(), cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


# A sink whose write_metrics never returns and ignores cancellation (a tracker stuck in a
# blocking call), beside one that keeps up: the trainer logs a step only once the healthy sink is
# at most 50 calls behind, as a training step that takes longer than a metrics write does.
_HUNG = textwrap.dedent(
    """
    import json, sys, threading, time
    import anyio.to_thread
    import asynctrace as at

    class Hung(at.Sink):
        name = "hung"
        async def write(self, records):
            pass
        async def write_metrics(self, step, metrics):
            await anyio.to_thread.run_sync(threading.Event().wait)  # forever, uncancellable

    class Healthy(at.testing.MemorySink):
        def __init__(self):
            super().__init__("ok")
            self.calls = 0
            self.written = threading.Condition()
        async def write_metrics(self, step, metrics):
            await super().write_metrics(step, metrics)
            if "loss/0" in metrics:
                with self.written:
                    self.calls += 1
                    self.written.notify_all()

    ok = Healthy()
    n, finish_timeout = 5_000, float(sys.argv[1])
    session = at.TraceSession(
        "p", sinks=[Hung(), ok], max_queue_bytes=2 * 2**20, health_interval=0.05,
        finish_timeout=finish_timeout,
    )
    kept_up = True
    with session as s:
        for i in range(n):
            if i % 500 == 0:
                s.log_samples([{"prompt": "q", "response": "a"}], step=i)
            with ok.written:
                kept_up = ok.written.wait_for(lambda: ok.calls >= i - 50, timeout=10)
            if not kept_up:
                break
            s.log_metrics({f"loss/{j}": float(i + j) for j in range(10)}, step=i)
        started = time.monotonic()
    took = time.monotonic() - started
    stats = session.stats()
    health = [m for _, m in ok.metrics if "asynctrace/submitted" in m]
    print(json.dumps({
        "kept_up": kept_up, "ok": ok.calls, "took": took, "check": stats.check(),
        "metrics_dropped": stats.metrics_dropped,
        "hung": dict(stats.sinks["hung"].metrics_dropped), "healthy": dict(stats.sinks["ok"].metrics_dropped),
        "health": health[-1] if health else {},
    }))
    """
)


def test_a_hung_sink_does_not_starve_the_others_of_metrics() -> None:
    """5,000 log_metrics calls beside a sink stuck in write_metrics: the healthy sink gets all of
    them; the stuck one's backlog stays within its share, what it missed is counted for it (and
    logged as health metrics), and finish returns within its bound."""
    result = _run(_HUNG, "1.0")
    assert result["kept_up"] and result["ok"] == 5_000, result
    assert result["metrics_dropped"] == 0 and result["healthy"] == {}, result
    hung = result["hung"]
    assert isinstance(hung, dict) and hung["backlog_full"] > 2_000, result
    # Every call: refused for want of room in its share, or not written when finish() gave up.
    assert hung["backlog_full"] + hung["finish_timeout"] == 5_000, result
    assert result["check"], result
    health = result["health"]
    assert isinstance(health, dict) and health["asynctrace/sinks/hung/metrics_dropped/backlog_full"] > 0
    assert float(result["took"]) <= finish_bound(1.0), result  # type: ignore[arg-type]


# Run in a process of its own: its resident memory is what the test measures. The sink that
# keeps up counts the calls it gets and keeps none.
_FLOOD = textwrap.dedent(
    """
    import gc, json, psutil
    import asynctrace as at

    class Counting(at.Sink):
        name = "other"
        calls = 0
        async def write(self, records):
            pass
        async def write_metrics(self, step, metrics):
            Counting.calls += 1

    proc = psutil.Process()
    hung = at.testing.MemorySink("hung", hang=True)
    with at.TraceSession(
        "p", sinks=[hung, Counting()], max_queue_bytes=2**20, on_full="drop_newest", finish_timeout=1.0,
        health_metrics=False,
    ) as s:
        s.log_samples([{"prompt": "q", "response": "a"}], step=0)  # the hung sink's lane stops on it
        gc.collect()
        before = proc.memory_info().rss
        for i in range(80_000):
            s.log_metrics({f"loss/{j}": float(i + j) for j in range(10)}, step=i)
        gc.collect()
        grown = proc.memory_info().rss - before
        stats = s.stats()
    print(json.dumps({
        "grown": grown, "queue_bytes": stats.queue_bytes, "metrics_dropped": stats.metrics_dropped,
        "hung": stats.sinks["hung"].metrics_dropped.get("backlog_full", 0), "other": Counting.calls,
    }))
    """
)


def test_a_metrics_flood_behind_a_hung_sink_stays_within_the_bound() -> None:
    """80,000 log_metrics calls of 10 keys behind a hung sink, max_queue_bytes=1 MiB: resident
    memory grows by a few MiB, not the ~100 MiB they would take; what did not fit is counted."""
    result = _run(_FLOOD)
    assert result["grown"] < 16 * 2**20, result  # type: ignore[operator]
    assert 0 < result["queue_bytes"] <= 2**20, result  # type: ignore[operator]
    # Each call holds about 1 KiB: the hung sink's share (half the bound) takes a few hundred,
    # and every later call is counted, for it alone or (when the other fell behind) for both.
    assert result["hung"] + result["metrics_dropped"] > 79_000, result  # type: ignore[operator]
    assert result["other"] == 80_000 - result["metrics_dropped"], result  # type: ignore[operator]


def test_metrics_free_their_room_once_every_sink_has_them() -> None:
    """Metrics written by every sink give their bytes back: the queue is empty after a flush,
    and none is dropped under the bound."""
    sink = at.testing.MemorySink()
    with at.TraceSession("p", sinks=[sink], max_queue_bytes=64 * 2**10, health_metrics=False) as s:
        s.log_samples([sample(0)], step=0)
        for i in range(2_000):
            s.log_metrics({"loss": float(i)}, step=i)
            if i % 20 == 0:
                assert s.flush(timeout=10)
        assert s.flush(timeout=10)
        stats = s.stats()
    assert stats.queue_bytes == 0 and stats.metrics_dropped == 0
    assert [m["loss"] for _, m in sink.metrics] == [float(i) for i in range(2_000)]
